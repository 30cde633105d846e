"""Issue 8's "Done when", end to end: kill a worker, resume from the shadows, lose at most one
iteration, finish bit-identical to a run that never failed.

Each test runs :class:`experiments.job.JobRun` (what ``make demo`` runs) with a
small TinyLM and few iterations: ``single`` on the embedded target (its switch
renamed so the test can run next to another network), a job with workers
h1-h3 and shadows sh1, sh2, ``checkmate-shadow`` in both shadows,
``examples/train_lm.py`` in the workers under
:class:`experiments.launcher.Launcher`, which SIGKILLs rank 1 during an
iteration and restarts all three. Afterwards the same job runs without the
failure, as the reference. Everything is torn down, also on failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from experiments.job import JobConfig, JobRun
from tests.topologies.harness import root_interfaces

pytestmark = pytest.mark.root

SMALL_MODEL = ("--width", "32", "--layers", "1", "--heads", "2", "--context", "32")
ITERATIONS = 14
KILL_DURING = 6


def _run(tmp_path: Path, shadows_fail_too: bool, elastic: bool = False) -> tuple[dict[str, Any], JobRun]:
    before = root_interfaces()
    config = JobConfig(
        iterations=ITERATIONS,
        kill_iteration=KILL_DURING,
        kill_rank=1,
        shadows_fail_too=shadows_fail_too,
        elastic=elastic,
        reference=True,
        global_batch=12,
        model_args=SMALL_MODEL,
        work_dir=tmp_path / "demo",
        results_dir=None,
        rename_switches=(("s1", "rc1"),),
        train_timeout=240.0,
    )
    demo = JobRun(config)
    result = demo.run()
    assert not {i for i in root_interfaces() - before if i.startswith("rc1-")}, "interfaces left behind"
    return result.summary(), demo


def test_killed_worker_resumes_from_shadow_memory_and_ends_bit_identical(tmp_path: Path) -> None:
    summary, _ = _run(tmp_path, shadows_fail_too=False)
    assert summary["restarts"] == 1, summary["incarnations"]
    failed = summary["failure_iteration"]  # the iteration in progress when the job failed
    assert failed >= KILL_DURING
    first, second = summary["incarnations"]
    assert first["killed"]["rank"] == 1 and first["exit_codes"]["1"] == -9, first
    # Resumed from the last iteration every shadow had applied, from their memory.
    assert summary["restore_source"] == "shadow-memory"
    assert second["restored_from"] == second["start_iteration"] - 1
    # The shadows lag at most one iteration behind: at most one finished iteration is redone.
    assert summary["resumed_from_iteration"] >= failed - 1
    assert summary["lost_iterations"] <= 1
    assert summary["certified_iterations"] == ITERATIONS
    # Same worker count: the recovered job is the job that never failed, bit for bit, and the
    # shadows hold exactly the workers' final state (parameters and AdamW state).
    assert summary["workers_agree"]
    assert summary["recovered_equals_uninterrupted"] is True
    assert summary["shadow_equals_workers"] is True


def test_restores_from_the_snapshots_when_the_shadows_are_gone(tmp_path: Path) -> None:
    summary, demo = _run(tmp_path, shadows_fail_too=True)
    assert summary["restarts"] == 1, summary["incarnations"]
    # The shadows died with the worker: the state comes from their snapshot directory (a complete
    # universal checkpoint, written every iteration but skipped when busy, so it may be older).
    assert summary["restore_source"] == "snapshot"
    restored = summary["restored_checkpoint_iteration"]
    assert restored is not None and 0 <= restored < summary["failure_iteration"]
    assert summary["resumed_from_iteration"] == restored + 1
    assert summary["shadow_equals_workers"] is None  # nothing left to compare with
    assert summary["recovered_equals_uninterrupted"] is True
    assert any(demo.snapshot_dir.glob("step-*")), "no snapshot was written"


def test_restart_with_fewer_workers_continues_from_the_certified_state(tmp_path: Path) -> None:
    summary, demo = _run(tmp_path, shadows_fail_too=False, elastic=True)
    assert summary["restarts"] == 1, summary["incarnations"]
    first, second = summary["incarnations"]
    assert first["workers"] == ["h1", "h2", "h3"] and first["killed"]["host"] == "h2"
    assert second["workers"] == ["h1", "h3"]  # h2 is left out: two workers continue
    assert summary["restore_source"] == "shadow-memory"
    assert summary["lost_iterations"] <= 1
    elastic = summary["elastic"]
    assert elastic["workers_per_incarnation"] == [3, 2]
    # The state two workers restored is the three-worker job's state after that iteration, bit
    # for bit (the uninterrupted reference logged its digest every iteration).
    assert elastic["restored_state_equals_reference"] is True
    # The loss goes on where it was: same global batch, only the summation order differs.
    assert elastic["compared_iterations"] == ITERATIONS - summary["resumed_from_iteration"]
    assert elastic["loss_max_relative_deviation_after_restart"] < 0.01, elastic
    # The shadows followed the smaller job: they hold exactly the two workers' final state, and
    # every iteration was certified across the restart.
    assert summary["workers_agree"] and summary["shadow_equals_workers"] is True
    assert summary["certified_iterations"] == ITERATIONS
    assert summary["recovered_equals_uninterrupted"] is None  # not expected with another count
    job_files = sorted(p.name for p in demo.work.glob("job-file-*.json"))
    assert "job-file-1.json" in job_files
