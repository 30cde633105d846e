"""The launcher's restart logic, without a network: hosts are faked by a local exec.

``checkmate-net exec --run-dir DIR HOST -- CMD`` is replaced by a command that
runs ``CMD`` here; the workers are :mod:`tests.experiments.fake_worker`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from experiments.launcher import KillPlan, LaunchConfig, Launcher, LaunchError

FAKE_EXEC = (
    sys.executable,
    "-c",
    "import os, sys; a = sys.argv[1:]; c = a[a.index('--') + 1:]; os.execvp(c[0], c)",
)
WORKER = Path(__file__).with_name("fake_worker.py")


def _logged_iterations(log_dir: Path, ranks: int) -> list[set[int]]:
    """Per incarnation (a ``start`` event opens one), the iterations any rank logged as finished."""
    runs: dict[int, set[int]] = {}
    for rank in range(ranks):
        incarnation = -1
        for line in (log_dir / f"rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "start":
                incarnation += 1
            elif "iteration" in record:
                runs.setdefault(incarnation, set()).add(int(record["iteration"]))
    return [runs.get(i, set()) for i in range(max(runs, default=-1) + 1)]


def _config(tmp_path: Path, mode: str = "ok", iterations: int = 12, **overrides: object) -> LaunchConfig:
    values: dict[str, object] = dict(
        run_dir=tmp_path,
        workers=("h1", "h2", "h3"),
        master_addr="127.0.0.1",
        command=(sys.executable, str(WORKER), str(tmp_path), str(iterations), mode),
        log_dir=tmp_path,
        net_command=FAKE_EXEC,
        start_timeout=20.0,
        stall_timeout=20.0,
        total_timeout=60.0,
        stop_grace=2.0,
    )
    values.update(overrides)
    return LaunchConfig(**values)  # type: ignore[arg-type]


def test_runs_to_the_end_without_failures(tmp_path: Path) -> None:
    records: list[tuple[int, int, dict[str, object]]] = []
    result = Launcher(_config(tmp_path), on_record=lambda n, r, rec: records.append((n, r, rec))).run()
    assert result.restarts == 0 and sorted(result.done) == [0, 1, 2]
    assert result.incarnations[0].completed_through == 11
    assert result.incarnations[0].exit_codes == {0: 0, 1: 0, 2: 0}
    assert sum(1 for _, r, rec in records if r == 0 and "loss" in rec) == 12


def test_a_killed_worker_restarts_all_from_the_certified_iteration(tmp_path: Path) -> None:
    events: list[str] = []
    config = _config(tmp_path, kills=(KillPlan(rank=1, iteration=5),))
    result = Launcher(config, on_event=lambda kind, details: events.append(kind)).run()
    first, second = result.incarnations
    assert first.killed is not None and first.killed["rank"] == 1 and first.killed["iteration"] == 5
    assert first.exit_codes[1] == -9 and first.failed_rank == 1 and "SIGKILL" in (first.failure or "")
    assert second.start_iteration == second.restored_from + 1  # type: ignore[operator]
    assert second.start_iteration is not None and 1 <= second.start_iteration <= first.completed_through + 1
    # Lost work: the iterations the workers' logs show finished before the failure and done again.
    runs = _logged_iterations(tmp_path, ranks=3)
    assert len(runs) == 2
    redone = sorted(runs[0] & runs[1])
    assert redone and redone == list(range(second.start_iteration, max(runs[0]) + 1))
    assert result.lost_iterations() == [len(redone)]
    assert sorted(result.done) == [0, 1, 2]
    assert events == ["start", "kill", "failure", "restart", "start", "done"]


def test_gives_up_after_max_restarts(tmp_path: Path) -> None:
    launcher = Launcher(_config(tmp_path, mode="fail-at-3", max_restarts=2))
    with pytest.raises(LaunchError, match="failed 3 times.*exited with status 3"):
        launcher.run()
    assert len(launcher.incarnations) == 3
    assert all(i.failed_rank == 1 for i in launcher.incarnations)


def test_a_worker_that_stops_making_progress_counts_as_failed(tmp_path: Path) -> None:
    launcher = Launcher(_config(tmp_path, mode="hang-at-2", stall_timeout=1.0, max_restarts=0))
    with pytest.raises(LaunchError, match="no progress for 1 s"):
        launcher.run()
    assert launcher.incarnations[0].exit_codes[1] == -15  # stopped with SIGTERM


def test_a_worker_that_never_starts_counts_as_failed(tmp_path: Path) -> None:
    sleeper = (sys.executable, "-c", "import time; time.sleep(60)")
    config = _config(tmp_path, command=sleeper, start_timeout=1.0, max_restarts=0)
    with pytest.raises(LaunchError, match=r"did not start within 1 s"):
        Launcher(config).run()


def test_kill_plans_need_an_iteration_to_interrupt() -> None:
    with pytest.raises(ValueError, match="iteration 1 or later"):
        KillPlan(rank=0, iteration=0)
