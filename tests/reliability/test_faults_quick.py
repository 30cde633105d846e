"""Fault injection into real training, quick cases (part of ``make test``).

Each test runs a small TinyLM job in the emulated network (:class:`FaultJob`: the
``single`` topology on the embedded switch, 3 workers, 2 shadows), injects a fault,
and checks that every state the shadows certified — each complete snapshot step on
disk, each state the workers restored, the shadows' final memory — equals the
workers' state at that iteration bit for bit, or was never certified. The soak
cases (``test_faults_soak.py``, ``make soak``) cover every fault with several
seeded trials.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.reliability.faultjob import (
    SINGLE_SPARE,
    Action,
    FaultJob,
    FaultJobConfig,
    counted,
    summarize,
    worst_recovery,
)
from tests.reliability.record import Recorder

pytestmark = pytest.mark.root

SHADOW_PORTS = (5, 6)
SEED = 20261201


def test_copy_loss_duplicates_and_reordering(tmp_path: Path, reliability: Recorder) -> None:
    drops = ("--drop-egress", "5:0.01", "--drop-egress", "6:0.01", "--drop-seed", "11")
    config = FaultJobConfig(
        switch="fq1",
        work_dir=tmp_path / "job",
        iterations=20,
        switch_args=drops,
        worker_env={"FAULTJOB_DUPLICATE": "0.02", "FAULTJOB_REORDER": "0.02", "CHECKMATE_FAULT_SEED": "3"},
    )
    _, verdict = FaultJob(config).run_and_verify(reliability)
    assert verdict.final_compared
    assert verdict.snapshots_compared >= 1
    assert sum(verdict.injected_drops.get(p, 0) for p in SHADOW_PORTS) > 0, verdict.injected_drops
    assert verdict.transport.get("fault.duplicate", 0) > 0 and verdict.transport.get("fault.reorder", 0) > 0
    held = summarize([verdict], SHADOW_PORTS)
    reliability.record(
        area="fault",
        case="1% of copies dropped on the shadow links, with 2% of datagrams duplicated and 2% reordered",
        target="job (switch, shadows, host agents)",
        trials=1,
        **counted([verdict]),
        held=held,
    )


def test_shadow_killed_and_restarted(tmp_path: Path, reliability: Recorder) -> None:
    rng = random.Random(SEED)
    iteration, shadow = rng.randint(4, 12), rng.choice(["sh1", "sh2"])
    config = FaultJobConfig(
        switch="fq2",
        work_dir=tmp_path / "job",
        iterations=20,
        actions=(Action(iteration, "kill_shadow", shadow, delay=0.3),),
    )
    job = FaultJob(config)
    _, verdict = job.run_and_verify(reliability)
    (action,) = verdict.actions
    assert action["exit"] == -9, action
    assert verdict.final_compared  # the restarted shadow rejoined and holds the workers' final state
    reliability.record(
        area="fault",
        case=f"kill -9 of a shadow ({shadow}, iteration {iteration}), restarted with --resume",
        target="shadow",
        trials=1,
        **counted([verdict]),
        held=summarize([verdict]),
        recovery_s=worst_recovery([verdict]),
    )


def test_shadow_moved_to_another_host(tmp_path: Path, reliability: Recorder) -> None:
    config = FaultJobConfig(
        switch="fq3",
        work_dir=tmp_path / "job",
        iterations=16,
        topology=SINGLE_SPARE,
        actions=(Action(4, "move_shadow", "sh3", args=("1",)),),
        kill_worker_at=9,
    )
    _, verdict = FaultJob(config).run_and_verify(reliability)
    (action,) = verdict.actions
    assert action["from"] == "sh2" and action["shadows_now"] == ["sh1", "sh3"], action
    assert verdict.restarts == 1 and verdict.restores_compared == 3
    assert verdict.final_compared  # sh1 + sh3 hold the final state
    reliability.record(
        area="fault",
        case="a shadow moved to another host mid-run (checkmate-ctl shadow move sh2 -> sh3)",
        target="controller, shadows",
        trials=1,
        **counted([verdict]),
        held=summarize([verdict])
        + "; rank 0 followed the rewritten job file: the new shadow re-seeded live, the old one left",
        recovery_s=worst_recovery([verdict]),
    )
