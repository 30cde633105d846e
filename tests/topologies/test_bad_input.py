"""Bad input to ``checkmate-net``: one clear error, before anything is created (no root needed)."""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.topologies.harness import REPO, root_interfaces
from topologies.hosts import HostConfig

SINGLE = json.loads((REPO / "topologies" / "single.json").read_text())


def _up(tmp_path: Path, description: object, *extra: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "net.json"
    path.write_text(json.dumps(description))
    return subprocess.run(
        [sys.executable, "-m", "topologies.cli", "up", str(path), "--run-dir", str(tmp_path / "run"), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )


def _variant(**changes: object) -> dict[str, object]:
    data = json.loads(json.dumps(SINGLE))
    for key, value in changes.items():
        data[key] = value
    return data


def _host(name: str, **fields: object) -> dict[str, object]:
    return {**SINGLE["hosts"], name: {**SINGLE["hosts"][name], **fields}}


CASES = {
    "unknown top-level field": (_variant(controller="s1"), "unknown field(s) ['controller']"),
    "unknown host field": (_variant(hosts=_host("h1", gateway="10.0.0.1")), "unknown field(s) ['gateway']"),
    "duplicate IP": (_variant(hosts=_host("h2", ip="10.0.1.1/8")), "10.0.1.1 is also used by host h1"),
    "duplicate MAC": (_variant(hosts=_host("h2", mac="08:00:00:00:01:01")), "is also used by host h1"),
    "dangling link to a host": (
        _variant(links=[*SINGLE["links"], ["h9", "s1-p9"]]),
        "'h9' names no host and no switch port",
    ),
    "dangling link to a switch": (
        _variant(links=[*SINGLE["links"][:-1], ["sh2", "s7-p1"]]),
        "unknown switch 's7'",
    ),
    "unlinked host": (_variant(links=SINGLE["links"][:-1]), "not linked to any switch"),
    "port used twice": (
        _variant(links=[*SINGLE["links"][:-1], ["sh2", "s1-p1"]]),
        "s1-p1 is used by two links",
    ),
    "delay without netem": (
        _variant(links=[*SINGLE["links"][:-1], ["sh2", "s1-p6", {"delay": "5ms"}]]),
        "need the netem qdisc",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_description_is_refused_before_anything_is_created(tmp_path: Path, case: str) -> None:
    description, message = CASES[case]
    if case == "delay without netem" and Path("/sys/module/sch_netem").exists():
        pytest.skip("this kernel has netem")
    before = root_interfaces()
    result = _up(tmp_path, description)
    assert result.returncode == 1, result.stdout + result.stderr
    assert message in result.stderr, result.stderr
    assert result.stderr.startswith("checkmate-net: error:"), result.stderr
    assert not (tmp_path / "run").exists()
    assert root_interfaces() == before


def test_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "net.json"
    path.write_text("{ hosts: ")
    result = subprocess.run(
        [sys.executable, "-m", "topologies.cli", "up", str(path), "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 1 and "is not valid JSON" in result.stderr


def test_missing_bmv2_is_a_clear_error(tmp_path: Path) -> None:
    if shutil.which("simple_switch_grpc"):
        pytest.skip("simple_switch_grpc is installed")
    result = _up(tmp_path, SINGLE, "--target", "bmv2")
    assert result.returncode == 1
    assert "simple_switch_grpc is not on PATH" in result.stderr and "--target embedded" in result.stderr
    assert not (tmp_path / "run").exists()


def test_missing_switch_binary_is_named() -> None:
    from checkmate.p4.program import Target
    from topologies.targets import TargetError, find_binary

    with pytest.raises(TargetError, match="simple_switch_grpc"):
        find_binary(Target.BMV2, search_path="/nonexistent")


def test_down_status_and_exec_without_a_network(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "topologies.cli", *args, "--run-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            check=False,
        )

    down = cli("down")
    assert down.returncode == 0 and "nothing to do" in down.stdout
    status = cli("status")
    assert status.returncode == 1 and "no network is recorded" in status.stderr
    run = subprocess.run(
        [sys.executable, "-m", "topologies.cli", "exec", "--run-dir", str(tmp_path), "h1", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert run.returncode == 1 and "no network is recorded" in run.stderr


def test_mininet_imports_from_the_venv_without_the_system_dist_packages() -> None:
    probe = (
        "import sys, logging; from topologies.mininet_import import import_mininet; m = import_mininet(); "
        "import mininet.net; "
        "assert not any(p.rstrip('/').endswith('dist-packages') for p in sys.path), sys.path; "
        "assert type(logging.getLogger('x.y')) is logging.Logger; print(m.__name__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    if "Mininet is not installed" in result.stderr:
        pytest.skip("Mininet is not installed (make setup installs it)")
    assert result.returncode == 0, result.stderr


def test_host_config_routes_hosts_outside_the_subnet() -> None:
    config = HostConfig(
        name="h1",
        address=ipaddress.IPv4Interface("10.0.1.1/24"),
        neighbours={"10.0.1.2": "02:00:00:01:00:01", "10.0.2.1": "02:00:00:01:00:01"},
    )
    batch = config.ip_batch().splitlines()
    assert "route replace 10.0.2.1/32 dev eth0 scope link" in batch
    assert not any(line.startswith("route") and "10.0.1.2" in line for line in batch)
    assert "neigh replace 10.0.1.2 lladdr 02:00:00:01:00:01 dev eth0 nud permanent" in batch


def _up_as_non_root(path: Path, run_dir: Path) -> subprocess.CompletedProcess[str]:
    """``checkmate-net up`` in a process that believes it is not root (this suite often runs as root)."""
    probe = (
        "import os, sys; os.geteuid = lambda: 1000; from topologies.cli import main; "
        f"sys.exit(main(['up', {str(path)!r}, '--run-dir', {str(run_dir)!r}]))"
    )
    return subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO, check=False
    )


def test_without_root_bad_input_is_reported_first_then_root_is_asked_for(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_variant(hosts=_host("h2", ip="10.0.1.1/8"))))
    result = _up_as_non_root(bad, tmp_path / "run")
    assert result.returncode == 1 and "also used by host h1" in result.stderr, result.stderr
    good = _up_as_non_root(REPO / "topologies" / "single.json", tmp_path / "run")
    assert good.returncode == 1 and "checkmate-net up needs root" in good.stderr, good.stderr
    assert not (tmp_path / "run").exists()
