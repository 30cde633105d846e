"""Snapshots land on disk asynchronously, atomically, on schedule, and never block the caller."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from checkmate import checkpoint_format as fmt
from checkmate.checkpoint_format import CheckpointReader
from shadow.snapshots import Snapshot, SnapshotPolicy, Snapshotter


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


def test_a_busy_writer_skips_instead_of_blocking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    original = fmt.write_shard

    def slow_write(*args, **kwargs):  # type: ignore[no-untyped-def]
        release.wait(10)
        return original(*args, **kwargs)

    monkeypatch.setattr(fmt, "write_shard", slow_write)
    writer = Snapshotter(SnapshotPolicy(tmp_path, every_iterations=1))
    try:
        assert writer.offer(0, lambda: snapshot(0))
        for iteration in range(1, 4):  # the writer is stuck on step 0 (one queued, rest skipped)
            writer.offer(iteration, lambda it=iteration: snapshot(it))
        assert writer.stats.skipped_busy >= 2
        release.set()
        assert writer.flush(10)
    finally:
        release.set()
        writer.close()
    assert fmt.read_latest(tmp_path) is not None


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="need an interval"):
        SnapshotPolicy(Path("x"), every_iterations=0)
    with pytest.raises(ValueError, match="keep at least one"):
        SnapshotPolicy(Path("x"), keep=0)
