"""Fault injection into real training, soak cases (``make soak``; several seeded trials each).

Same harness and invariant as ``test_faults_quick.py`` (:class:`FaultJob`): after each
fault, every state the shadows certified — each complete snapshot step on disk, each
state the workers restored, the shadows' final memory — equals the workers' state at
that iteration bit for bit, or it was never certified. Faults: copy loss on the shadow
links (0.1%, 1%, 5%, the switch's ``--drop-egress``), worker-to-worker loss (switch and
host transport), duplicated and reordered datagrams, kill -9 of a worker, a shadow,
``checkmate-ctl`` mid-write and the switch process at seeded random iterations, a crash
while a checkpoint is written, and a shadow moved to another host.
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
    Verdict,
    counted,
    summarize,
    worst_recovery,
)
from tests.reliability.record import Recorder

pytestmark = [pytest.mark.root, pytest.mark.soak, pytest.mark.timeout(1800)]

SHADOW_PORTS = (5, 6)
WORKER_PORTS = (1, 2, 3)
SEED = 1009


def _run(config: FaultJobConfig, recorder: Recorder) -> Verdict:
    _, verdict = FaultJob(config).run_and_verify(recorder)
    assert verdict.final_compared or verdict.final_refused, "the shadows' final state was not checked"
    return verdict


@pytest.mark.parametrize(
    ("fraction", "iterations", "trials"), [(0.001, 40, 3), (0.01, 24, 3), (0.05, 24, 3)], ids=str
)
def test_copy_loss_on_shadow_links(
    tmp_path: Path, reliability: Recorder, fraction: float, iterations: int, trials: int
) -> None:
    verdicts = []
    for trial in range(trials):
        drops = [a for p in SHADOW_PORTS for a in ("--drop-egress", f"{p}:{fraction}")]
        config = FaultJobConfig(
            switch=f"fl{trial}",
            work_dir=tmp_path / f"trial{trial}",
            iterations=iterations,
            switch_args=(*drops, "--drop-seed", str(SEED + trial)),
        )
        verdicts.append(_run(config, reliability))
    dropped = sum(sum(v.injected_drops.get(p, 0) for p in SHADOW_PORTS) for v in verdicts)
    if fraction >= 0.01:
        assert dropped > 0, "no copy was dropped: the case exercised nothing"
    reliability.record(
        area="fault",
        case=f"{fraction:.1%} of copies dropped on the shadow links (switch --drop-egress)",
        target="switch -> shadows",
        trials=trials,
        **counted(verdicts),
        held=summarize(verdicts, SHADOW_PORTS),
    )


def test_worker_to_worker_loss_in_the_switch(tmp_path: Path, reliability: Recorder) -> None:
    verdicts = []
    for trial in range(2):
        drops = [a for p in WORKER_PORTS for a in ("--drop-egress", f"{p}:0.01")]
        config = FaultJobConfig(
            switch=f"fw{trial}",
            work_dir=tmp_path / f"trial{trial}",
            iterations=24,
            switch_args=(*drops, "--drop-seed", str(SEED + trial)),
        )
        verdicts.append(_run(config, reliability))
    assert sum(sum(v.injected_drops.values()) for v in verdicts) > 0
    reliability.record(
        area="fault",
        case="1% of worker-to-worker frames dropped (switch --drop-egress on the worker ports)",
        target="switch -> workers",
        trials=2,
        **counted(verdicts),
        held=summarize(verdicts),
    )


def test_worker_send_loss_in_the_host_transport(tmp_path: Path, reliability: Recorder) -> None:
    verdicts = []
    for trial in range(2):
        config = FaultJobConfig(
            switch=f"fh{trial}",
            work_dir=tmp_path / f"trial{trial}",
            iterations=24,
            worker_env={"CHECKMATE_LOSS": "0.02", "CHECKMATE_FAULT_SEED": str(SEED + trial)},
        )
        verdicts.append(_run(config, reliability))
    assert sum(v.transport.get("fault.send_drop", 0) for v in verdicts) > 0
    reliability.record(
        area="fault",
        case="2% of every worker's datagrams dropped at the sender (tagged ones too: copies never made)",
        target="host agents",
        trials=2,
        **counted(verdicts),
        held=summarize(verdicts),
    )


def test_duplicated_and_reordered_datagrams(tmp_path: Path, reliability: Recorder) -> None:
    verdicts = []
    for trial in range(2):
        config = FaultJobConfig(
            switch=f"fd{trial}",
            work_dir=tmp_path / f"trial{trial}",
            iterations=24,
            worker_env={
                "FAULTJOB_DUPLICATE": "0.05",
                "FAULTJOB_REORDER": "0.05",
                "CHECKMATE_FAULT_SEED": str(SEED + trial),
            },
        )
        verdicts.append(_run(config, reliability))
    assert all(v.transport.get("fault.duplicate", 0) > 0 for v in verdicts)
    assert all(v.transport.get("fault.reorder", 0) > 0 for v in verdicts)
    reliability.record(
        area="fault",
        case="5% of datagrams duplicated and 5% reordered by the senders (so are the switch's copies)",
        target="host agents, shadows",
        trials=2,
        **counted(verdicts),
        held=summarize(verdicts),
    )


def test_worker_killed(tmp_path: Path, reliability: Recorder) -> None:
    rng = random.Random(SEED)
    verdicts, what = [], []
    for trial in range(3):
        iteration, rank = rng.randint(2, 15), rng.randint(0, 2)
        config = FaultJobConfig(
            switch=f"fk{trial}",
            work_dir=tmp_path / f"trial{trial}",
            iterations=20,
            kill_worker_at=iteration,
            kill_rank=rank,
        )
        verdict = _run(config, reliability)
        assert verdict.restarts >= 1 and verdict.restores_compared >= 3, verdict
        verdicts.append(verdict)
        what.append(f"rank {rank} at {iteration}")
    reliability.record(
        area="fault",
        case=f"kill -9 of a worker ({', '.join(what)}), all restarted from the shadows",
        target="workers",
        trials=3,
        **counted(verdicts),
        held=summarize(verdicts),
        recovery_s=worst_recovery(verdicts),
    )


def test_shadow_killed(tmp_path: Path, reliability: Recorder) -> None:
    rng = random.Random(SEED + 1)
    verdicts, what = [], []
    for trial in range(3):
        iteration, shadow = rng.randint(2, 10), rng.choice(["sh1", "sh2"])
        config = FaultJobConfig(
            switch=f"fs{trial}",
            work_dir=tmp_path / f"trial{trial}",
            iterations=20,
            actions=(Action(iteration, "kill_shadow", shadow, delay=0.3),),
        )
        verdicts.append(_run(config, reliability))
        what.append(f"{shadow} at {iteration}")
    reliability.record(
        area="fault",
        case=f"kill -9 of a shadow ({', '.join(what)}), restarted with --resume, re-seeded by rank 0",
        target="shadows",
        trials=3,
        **counted(verdicts),
        held=summarize(verdicts),
        recovery_s=worst_recovery(verdicts),
    )


def test_controller_killed_mid_write(tmp_path: Path, reliability: Recorder) -> None:
    rng = random.Random(SEED + 2)
    verdicts, outcomes = [], []
    for trial in range(3):
        iteration, delay = rng.randint(2, 12), round(rng.uniform(0.5, 1.5), 2)
        config = FaultJobConfig(
            switch=f"fc{trial}",
            work_dir=tmp_path / f"trial{trial}",
            iterations=20,
            actions=(Action(iteration, "kill_ctl", "sh1", delay=delay, args=("1",)),),
        )
        verdict = _run(config, reliability)
        (action,) = verdict.actions
        verdicts.append(verdict)
        state = "killed" if action["killed"] else "finished first"
        outcomes.append(f"{delay}s: {state}, shard went to {action['owner_after_kill']}")
    reliability.record(
        area="fault",
        case="kill -9 of checkmate-ctl during `shadow move` (seeded delay), then reconcile and move back",
        target="controller",
        trials=3,
        **counted(verdicts),
        held=summarize(verdicts)
        + "; a second reconcile found nothing to change every time ("
        + "; ".join(outcomes)
        + ")",
        recovery_s=worst_recovery(verdicts),
    )


def test_switch_killed(tmp_path: Path, reliability: Recorder) -> None:
    rng = random.Random(SEED + 3)
    verdicts, what = [], []
    for trial in range(3):
        iteration = rng.randint(2, 15)
        config = FaultJobConfig(
            switch=f"fx{trial}",
            work_dir=tmp_path / f"trial{trial}",
            iterations=20,
            actions=(Action(iteration, "kill_switch"),),
        )
        verdict = _run(config, reliability)
        (action,) = verdict.actions
        assert action["restarted_pid"] != action["pid"]
        verdicts.append(verdict)
        what.append(str(iteration))
    reliability.record(
        area="fault",
        case=f"kill -9 of the switch process (iterations {', '.join(what)}); the supervisor restarts "
        "and reprograms it",
        target="switch",
        trials=3,
        **counted(verdicts),
        held=summarize(verdicts),
        recovery_s=worst_recovery(verdicts),
    )


def test_crash_while_writing_a_checkpoint(tmp_path: Path, reliability: Recorder) -> None:
    rng = random.Random(SEED + 4)
    verdicts, hits, partial_files = [], 0, 0
    for trial in range(3):
        iteration, shadow = rng.randint(2, 12), rng.choice(["sh1", "sh2"])
        config = FaultJobConfig(
            switch=f"fp{trial}",
            work_dir=tmp_path / f"trial{trial}",
            iterations=20,
            actions=(Action(iteration, "kill_shadow_writing", shadow, delay=0.3),),
        )
        verdict = _run(config, reliability)
        (action,) = verdict.actions
        hits += int(bool(action["during_write"]))
        partial_files += len(action["partial_files"])
        verdicts.append(verdict)
    assert hits >= 1, "no kill landed while a snapshot was being written"
    reliability.record(
        area="fault",
        case="kill -9 of a shadow while it writes a snapshot (crash mid-checkpoint)",
        target="shadows, checkpoint files",
        trials=3,
        **counted(verdicts),
        held=f"{hits}/3 kills landed during a write, {partial_files} partial temp files left and ignored; "
        + summarize(verdicts),
        recovery_s=worst_recovery(verdicts),
    )


def test_shadow_moved(tmp_path: Path, reliability: Recorder) -> None:
    rng = random.Random(SEED + 5)
    verdicts = []
    for trial in range(2):
        iteration = rng.randint(2, 8)
        config = FaultJobConfig(
            switch=f"fm{trial}",
            work_dir=tmp_path / f"trial{trial}",
            iterations=18,
            topology=SINGLE_SPARE,
            actions=(Action(iteration, "move_shadow", "sh3", args=("1",)),),
            kill_worker_at=iteration + 4,
        )
        verdict = _run(config, reliability)
        assert verdict.restarts >= 1
        verdicts.append(verdict)
    reliability.record(
        area="fault",
        case="a shadow moved to another host mid-run (checkmate-ctl shadow move), workers restarted later",
        target="controller, shadows",
        trials=2,
        **counted(verdicts),
        held=summarize(verdicts),
        recovery_s=worst_recovery(verdicts),
    )
