"""Snapshots land on disk asynchronously, atomically, on schedule, and never block the caller."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from checkmate import checkpoint as fmt
from checkmate.checkpoint import CheckpointReader
from shadow.snapshots import Snapshot, SnapshotPolicy, Snapshotter, disk_status


def snapshot(step: int, shard: int = 0, num_shards: int = 1) -> Snapshot:
    weight = torch.full((4, 4), float(step))
    return Snapshot(
        step,
        shard,
        num_shards,
        {f"w{shard}": {"param": weight}},
        {f"w{s}": ([4, 4], "torch.float32") for s in range(num_shards)},
        {"kind": "SGD"},
    )


def test_every_k_iterations_keeping_the_last_m(tmp_path: Path) -> None:
    writer = Snapshotter(SnapshotPolicy(tmp_path, every_iterations=2, keep=2))
    try:
        for iteration in range(9):
            writer.offer(iteration, lambda it=iteration: snapshot(it))
            assert writer.flush(10)
    finally:
        writer.close()
    assert fmt.complete_steps(tmp_path) == [6, 8]
    assert fmt.read_latest(tmp_path) == 8
    assert torch.equal(CheckpointReader(tmp_path).parameter("w0"), torch.full((4, 4), 8.0))
    assert writer.stats.written == 5 and writer.stats.failed == 0


def test_every_t_seconds_by_the_clock_not_the_iteration_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [100.0]
    monkeypatch.setattr("shadow.snapshots.time.monotonic", lambda: clock[0])
    writer = Snapshotter(SnapshotPolicy(tmp_path, every_iterations=0, every_seconds=5.0, keep=10))
    queued = []
    try:
        for iteration in range(10):
            clock[0] = 100.0 + 2.0 * iteration  # one iteration every 2 s
            if writer.offer(iteration, lambda it=iteration: snapshot(it)):
                queued.append(iteration)
            assert writer.flush(10)
    finally:
        writer.close()
    assert queued == [0, 3, 6, 9]  # the first, then whenever 5 s have passed since the last
    assert fmt.complete_steps(tmp_path) == [0, 3, 6, 9]


def test_latest_moves_only_when_every_shard_is_written(tmp_path: Path) -> None:
    shards = [Snapshotter(SnapshotPolicy(tmp_path, every_iterations=1)) for _ in range(2)]
    try:
        shards[0].offer(3, lambda: snapshot(3, 0, 2))
        shards[0].flush(10)
        assert fmt.read_latest(tmp_path) is None and fmt.complete_steps(tmp_path) == []
        shards[1].offer(3, lambda: snapshot(3, 1, 2))
        shards[1].flush(10)
        assert fmt.read_latest(tmp_path) == 3
    finally:
        for shard in shards:
            shard.close()


def test_a_busy_writer_never_blocks_and_then_writes_the_newest_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    original = fmt.write_shard

    def slow_write(*args, **kwargs):  # type: ignore[no-untyped-def]
        release.wait(10)
        return original(*args, **kwargs)

    monkeypatch.setattr(fmt, "write_shard", slow_write)
    writer = Snapshotter(SnapshotPolicy(tmp_path, every_iterations=1, hold=2))
    try:
        assert writer.offer(0, lambda: snapshot(0))
        deadline = time.monotonic() + 10
        while not writer._writing and time.monotonic() < deadline:  # the writer took step 0
            time.sleep(0.001)
        # The writer is stuck on step 0 until release is set below: an offer that waited for it
        # would never return (no wall-clock bound needed). These are held, the newest two kept.
        for iteration in range(1, 5):
            assert writer.offer(iteration, lambda it=iteration: snapshot(it))
        assert writer.busy
        release.set()
        assert writer.flush(10)
    finally:
        release.set()
        writer.close()
    # the writer caught up: the newest offered state is on disk; 1, 2 (hold) and 3 (older) superseded
    assert fmt.read_latest(tmp_path) == 4
    assert fmt.complete_steps(tmp_path)[-1] == 4
    assert writer.stats.written == 2 and writer.stats.superseded == 3, writer.stats


def test_shards_meet_on_a_step_another_shard_started(tmp_path: Path) -> None:
    """A writer that frees up prefers a held step another shard has begun: that step completes."""
    other = Snapshotter(SnapshotPolicy(tmp_path, every_iterations=1))
    mine = Snapshotter(SnapshotPolicy(tmp_path, every_iterations=1, hold=3))
    try:
        other.offer(5, lambda: snapshot(5, 1, 2))  # shard 1 wrote step 5 only
        assert other.flush(10)
        with mine._cond:  # shard 0 holds 5, 6, 7 (it was busy); its writer must pick 5
            mine._held = {s: snapshot(s, 0, 2) for s in (5, 6, 7)}
            mine._cond.notify_all()
        assert mine.flush(10)
    finally:
        other.close()
        mine.close()
    assert fmt.complete_steps(tmp_path) == [5]  # then the newest held (7; 6 superseded) on its own
    assert mine.stats.written == 2 and mine.stats.superseded == 1 and mine.stats.last_step == 7


def test_disk_status_says_how_old_the_newest_complete_step_is(tmp_path: Path) -> None:
    assert disk_status(tmp_path, 9)["newest_complete_step"] is None
    writer = Snapshotter(SnapshotPolicy(tmp_path, every_iterations=1))
    try:
        writer.offer(6, lambda: snapshot(6))
        assert writer.flush(10)
    finally:
        writer.close()
    status = disk_status(tmp_path, 9)
    assert status["newest_complete_step"] == 6 and status["age_iterations"] == 3
    assert 0 <= status["age_seconds"] < 60


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="need an interval"):
        SnapshotPolicy(Path("x"), every_iterations=0)
    with pytest.raises(ValueError, match="keep at least one"):
        SnapshotPolicy(Path("x"), keep=0)
