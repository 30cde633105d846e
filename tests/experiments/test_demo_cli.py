"""Issue 9's bad input for ``make demo``: a demo killed outright leaves its network up; the next
demo takes that down and says so; Ctrl-C stops everything and takes the network down.

Runs ``python -m experiments.demo`` itself (what ``make demo`` runs) in a private
work directory with the default ``single`` topology (switch ``s1``, so it must not
run next to another network with that switch name; the test suite is sequential).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.topologies.harness import ENV, REPO, root_interfaces
from topologies.cleanup import cleanup, pid_alive

pytestmark = pytest.mark.root

START_TIMEOUT_S = 150.0


def _start_demo(work: Path, out: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "experiments.demo", "--iterations", "60", "--no-reference"]
    argv += ["--work-dir", str(work), "--results", str(work / "results")]
    with out.open("ab") as sink:
        # Ctrl-C must reach the demo even when this test runs where SIGINT is ignored (a background
        # job of a shell without job control, e.g. `nohup make test &`), which a child would inherit.
        return subprocess.Popen(
            argv, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env=ENV, preexec_fn=_default_sigint
        )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_training(work: Path, process: subprocess.Popen[bytes], out: Path) -> None:
    """Until rank 0 has logged an iteration (the network, job and shadows are up by then)."""
    log = work / "logs" / "rank0.jsonl"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the demo exited early:\n{out.read_text(errors='replace')[-3000:]}"
        lines = log.read_text().splitlines() if log.exists() else []
        if any("loss" in json.loads(line) for line in lines if line.endswith("}")):
            return
        time.sleep(0.2)
    raise AssertionError(
        f"no training within {START_TIMEOUT_S:.0f} s:\n{out.read_text(errors='replace')[-3000:]}"
    )


def test_a_leftover_network_is_taken_down_and_ctrl_c_cleans_up(tmp_path: Path) -> None:
    work = tmp_path / "demo"
    before = root_interfaces()
    first_out, second_out = tmp_path / "first.out", tmp_path / "second.out"
    first = _start_demo(work, first_out)
    second: subprocess.Popen[bytes] | None = None
    try:
        _wait_training(work, first, first_out)
        first.kill()  # no chance to clean up: network, switch, shadows and workers stay behind
        first.wait(timeout=10)
        assert {i for i in root_interfaces() - before if i.startswith("s1-")}, "nothing was left up"
        # The next demo reuses the work dir (and clears its logs): wait for its own training.
        (work / "logs" / "rank0.jsonl").unlink()

        second = _start_demo(work, second_out)
        _wait_training(work, second, second_out)
        second.send_signal(signal.SIGINT)  # Ctrl-C
        code = second.wait(timeout=120)
        text = second_out.read_text(errors="replace")
        assert "took down a network an earlier demo left" in text, text[-3000:]
        assert code == 130, text[-3000:]
        assert "interrupted" in text and "network taken down" in text, text[-3000:]
        assert not {i for i in root_interfaces() - before if i.startswith("s1-")}, "interfaces left behind"
        assert not (work / "results" / "demo.json").exists()  # an interrupted demo reports nothing
        state = work / "network"
        leftover = [p for p in _processes_mentioning(str(state)) if pid_alive(p)]
        assert not leftover, f"processes of the demo's network still run: {leftover}"
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        cleanup(work / "network")


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = (
                Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry))
    return found
