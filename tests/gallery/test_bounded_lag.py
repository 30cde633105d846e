"""Bounded lag under load: a job killed at full speed redoes at most max_lag + 1 iterations.

A real 2-rank job (tests/gallery/scripts/paced.py) runs as fast as it can while the CPUs
are loaded (one busy process per core) and shadow s1 is slower than the job (it sleeps
before every optimizer step, a stand-in for a shadow starved of CPU). The job is killed
(SIGKILL, both ranks) at an arbitrary iteration. With the default policy
(``CHECKMATE_ON_LAG=wait``) rank 0 held the job within ``max_lag`` of the slowest
shadow, so the restore finds a state at most ``max_lag + 1`` iterations before the one
the job was in; the restarted job resumes there and the shadows' answer measures the
loss. With ``CHECKMATE_ON_LAG=continue`` the same run falls far behind: the bound is
the policy's doing.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hosts.recovery import restore_latest, workers_finished
from shadow.node import ShadowNode
from shadow.optimizer_apply import ShadowOptimizer
from tests.gallery.test_gallery import JOB_ID, Job, _dumps, _shadows

logger = logging.getLogger(__name__)

MAX_LAG = 2
SLOW_APPLY_S = 0.08
KILL_AFTER = 40
"""Iterations the job runs before it is killed (well past the shadows' start-up)."""


def _burn(stop: Any) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _killed_run(nodes: list[ShadowNode], out: Path, env: dict[str, str]) -> int:
    """Run paced.py until it has started KILL_AFTER iterations, kill it; the iteration it was in."""
    job = Job("paced.py", ["--iterations", "100000", "--out", str(out)], nodes, env)
    progress = out / "progress"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            text = progress.read_text() if progress.exists() else ""
            if text and int(text) >= KILL_AFTER:
                break
            assert all(p.is_alive() for p in job.procs), "the job ended before it was killed"
            time.sleep(0.01)
    finally:
        job.kill()
    return int(progress.read_text())


def _run(on_lag: str) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"bounded-lag-{on_lag}-"))
    original = ShadowOptimizer.apply

    def slow_apply(self: ShadowOptimizer, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "shadow-s1-apply":
            time.sleep(SLOW_APPLY_S)
        return original(self, *args, **kwargs)

    ctx = mp.get_context("fork")
    stop = ctx.Event()
    burners = [ctx.Process(target=_burn, args=(stop,), daemon=True) for _ in range(2)]
    env = {"CHECKMATE_MAX_LAG": str(MAX_LAG), "CHECKMATE_ON_LAG": on_lag}
    if on_lag == "continue":
        env["CHECKMATE_UNPROTECTED"] = "log"
    nodes = _shadows(tmp)
    ShadowOptimizer.apply = slow_apply  # type: ignore[method-assign]
    try:
        for b in burners:
            b.start()
        killed_in = _killed_run(nodes, tmp / "out", env)
        stop.set()
        addresses = {n.name: n.control_address for n in nodes}
        # what a restarted job's hosts.resume finds: the shadows' memory, else their newest snapshot
        state = restore_latest(addresses, tmp / "ckpt", timeout=30.0, job_id=JOB_ID)
        assert state is not None
        finished = workers_finished(addresses, 10.0, JOB_ID)
        figures = {
            "killed_in": killed_in,
            "restored": state.iteration,
            "source": state.source,
            "workers_finished": finished,
        }
        logger.info("%s: %s", on_lag, figures)
        if on_lag == "wait":  # the job resumes where the restore says, on the same shadows
            ShadowOptimizer.apply = original  # type: ignore[method-assign]
            argv = ["--iterations", str(killed_in + 3), "--out", str(tmp / "again")]
            assert Job("paced.py", argv, nodes, env).wait(180) == [0, 0]
            resumed, _ = _dumps(tmp / "again")
            figures["resumed_at"] = resumed["start_iteration"]
            figures["certified"] = resumed["certified"]
    finally:
        ShadowOptimizer.apply = original  # type: ignore[method-assign]
        stop.set()
        for b in burners:
            b.join(5)
        for n in nodes:
            n.close()
    return figures


@pytest.mark.slow
def test_with_backpressure_a_kill_under_load_redoes_at_most_max_lag_plus_one_iterations() -> None:
    figures = _run("wait")
    redone = figures["killed_in"] - figures["restored"]
    assert figures["source"] == "shadow-memory" and 1 <= redone <= MAX_LAG + 1, figures
    assert figures["resumed_at"] == figures["restored"] + 1 and figures["certified"], figures
    # the loss the restore reports is the shadows' measurement, within the bound too
    assert figures["workers_finished"] is not None
    assert 0 <= figures["workers_finished"] - figures["restored"] <= MAX_LAG, figures


@pytest.mark.slow
def test_without_backpressure_the_same_kill_redoes_more() -> None:
    figures = _run("continue")
    assert figures["killed_in"] - figures["restored"] > MAX_LAG + 1, figures
