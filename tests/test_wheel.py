"""``pip install .`` (not editable), then every console script runs from another directory.

The project is copied out of the checkout (what a source distribution holds: no .venv,
build/ or results/) and installed with pip into a target folder, without dependencies
(this environment's torch and the rest serve) and without build isolation. Then, from an
empty working directory and with only that folder on the path: every console script of
pyproject.toml answers ``--help``; ``checkmate-switch`` preloads the committed P4Info,
found as package data inside the install; ``checkmate-ctl plan`` reads the packaged
measurements. The wheel carries no ``examples`` or ``experiments`` package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import read_configuration

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(read_configuration(REPO / "pyproject.toml")["project"]["scripts"])
NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "results",
    "tests",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
    "*.so",
)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The folder ``pip install --target`` filled from a copy of the sources."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE, symlinks=True)
    site = root / "site"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
        + ["--target", str(site), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    yield site
    shutil.rmtree(root, ignore_errors=True)


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(site)
    env["PATH"] = os.pathsep.join([str(site / "bin"), env.get("PATH", "")])
    return env


def _run(site: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(site / "bin" / argv[0]), *argv[1:]],
        cwd=cwd,
        env=_env(site),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_what_the_wheel_ships(installed: Path) -> None:
    shipped = {p.name for p in installed.iterdir() if (p / "__init__.py").is_file()}
    assert shipped == {"checkmate", "controller", "embedded_switch", "hosts", "shadow", "topologies"}
    p4src = installed / "checkmate" / "p4" / "p4src"
    assert (p4src / "checkmate.p4info.txtpb").is_file()
    assert (p4src / "v1model" / "checkmate.p4").is_file() and (p4src / "shared" / "defines.p4").is_file()
    assert (p4src / "tna" / "checkmate.tofino.p4info.txtpb").is_file()
    assert (installed / "controller" / "measured" / "shadow_bench.json").is_file()
    assert (installed / "checkmate" / "wireshark" / "checkmate.lua").is_file()
    assert set(SCRIPTS) <= {p.name for p in (installed / "bin").iterdir()}


def test_every_console_script_runs_from_another_directory(installed: Path, tmp_path: Path) -> None:
    runs = {  # side by side: each imports torch or grpc
        script: subprocess.Popen(
            [str(installed / "bin" / script), "--help"],
            cwd=tmp_path,
            env=_env(installed),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for script in SCRIPTS
    }
    for script, process in runs.items():
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0 and "usage:" in out, f"{script}: {err[-2000:]}"
    where = subprocess.run(
        [sys.executable, "-c", "import checkmate, controller as c; print(checkmate.__file__, c.__file__)"],
        cwd=tmp_path,
        env=_env(installed),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(Path(w).is_relative_to(installed) for w in where), where


def test_the_planner_reads_the_packaged_measurements(installed: Path, tmp_path: Path) -> None:
    argv = ["plan", "--model-params", "7B", "--optimizer", "adam", "--iteration-time", "1", "--dp", "64"]
    result = _run(installed, tmp_path, "checkmate-ctl", *argv)
    assert result.returncode == 0, result.stderr
    assert "controller/measured/shadow_bench.json" in result.stdout


def test_the_switch_preloads_the_packaged_p4info(installed: Path, tmp_path: Path) -> None:
    config = tmp_path / "program.json"  # a BMv2 JSON is checked, not interpreted: the P4Info is the program
    config.write_text("{}")
    process = subprocess.Popen(
        [str(installed / "bin" / "checkmate-switch"), "--grpc-server-addr", "127.0.0.1:0", str(config)],
        cwd=tmp_path,
        env=_env(installed),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            if any("pipeline /" in line for line in list(lines)):
                break
            time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(30)
        reader.join(30)
    started = [line for line in lines if "pipeline /" in line]
    assert started, "".join(lines)
    p4info = Path(started[0].rsplit("pipeline ", 1)[1].strip())
    assert p4info == installed / "checkmate" / "p4" / "p4src" / "checkmate.p4info.txtpb"
