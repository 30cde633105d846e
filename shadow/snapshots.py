"""Asynchronous snapshots of a shadow's state to disk, in the universal format.

The shadow calls :meth:`Snapshotter.offer` after every applied iteration. When a
snapshot is due (every K iterations or T seconds) the caller's ``capture``
clones the state — the only work done on the caller's thread — and a writer
thread persists it with :mod:`checkmate.checkpoint_format` (atomic, fsynced),
moves ``latest`` forward once every shard of the step is on disk, and prunes
old steps. If the previous write is still running the snapshot is skipped and
counted, so packet receipt is never blocked by the disk.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkmate import checkpoint_format as fmt
from checkmate.job_state import JobState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotPolicy:
    directory: Path
    every_iterations: int = 1
    """Snapshot when this many iterations have passed since the last one (0: never by count)."""
    every_seconds: float = 0.0
    """Snapshot when this much time has passed since the last one (0: never by time)."""
    keep: int = 3
    """Complete steps kept on disk."""

    def __post_init__(self) -> None:
        if self.every_iterations < 0 or self.every_seconds < 0:
            raise ValueError("snapshot intervals must not be negative")
        if self.every_iterations == 0 and self.every_seconds == 0:
            raise ValueError("snapshots need an interval: every_iterations or every_seconds")
        if self.keep < 1:
            raise ValueError("keep at least one snapshot")


@dataclass(frozen=True)
class Snapshot:
    """What one shard writes for one step (tensors already cloned)."""

    step: int
    shard: int
    num_shards: int
    states: Mapping[str, Mapping[str, torch.Tensor]]
    parameters: Mapping[str, tuple[list[int], str]]
    optimizer: Mapping[str, Any]
    extra: Mapping[str, Any] = field(default_factory=dict)
    job_state: JobState | None = None
    """Buffers, stateful objects and param groups after ``step`` (every shard writes the same)."""


@dataclass
class SnapshotStats:
    written: int = 0
    skipped_busy: int = 0
    failed: int = 0
    last_step: int | None = None
    last_seconds: float = 0.0


class Snapshotter:
    def __init__(self, policy: SnapshotPolicy) -> None:
        self.policy = policy
        self.stats = SnapshotStats()
        self._queue: queue.Queue[Snapshot | None] = queue.Queue(maxsize=1)
        self._last_iteration: int | None = None
        self._last_time = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="snapshot-writer", daemon=True)
        self._thread.start()

    def due(self, iteration: int) -> bool:
        policy = self.policy
        if self._last_iteration is None:
            return True
        if policy.every_iterations and iteration - self._last_iteration >= policy.every_iterations:
            return True
        return bool(policy.every_seconds) and time.monotonic() - self._last_time >= policy.every_seconds

    def offer(self, iteration: int, capture: Callable[[], Snapshot], force: bool = False) -> bool:
        """Snapshot ``iteration`` if due (or ``force``) and the writer is free; True when one was queued."""
        if not force and not self.due(iteration):
            return False
        if self._queue.full():
            self.stats.skipped_busy += 1
            return False
        snapshot = capture()
        try:
            self._queue.put_nowait(snapshot)
        except queue.Full:
            self.stats.skipped_busy += 1
            return False
        self._last_iteration = iteration
        self._last_time = time.monotonic()
        return True

    def _run(self) -> None:
        while True:
            snapshot = self._queue.get()
            try:
                if snapshot is None:
                    return
                self._write(snapshot)
            except (OSError, ValueError, RuntimeError) as exc:
                self.stats.failed += 1
                logger.error("snapshot of step %s failed: %s", getattr(snapshot, "step", "?"), exc)
            finally:
                self._queue.task_done()

    def _write(self, snapshot: Snapshot) -> None:
        started = time.monotonic()
        root = self.policy.directory
        fmt.write_global(
            root, snapshot.step, snapshot.parameters, snapshot.optimizer, snapshot.extra, snapshot.job_state
        )
        fmt.write_shard(root, snapshot.step, snapshot.shard, snapshot.num_shards, snapshot.states)
        if snapshot.step in fmt.complete_steps(root):
            fmt.update_latest(root, snapshot.step)
            fmt.prune(root, self.policy.keep)
        self.stats.written += 1
        self.stats.last_step = snapshot.step
        self.stats.last_seconds = time.monotonic() - started
        logger.info(
            "snapshot of step %d (shard %d) written in %.3fs",
            snapshot.step,
            snapshot.shard,
            self.stats.last_seconds,
        )

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until queued snapshots are on disk; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            logger.warning("snapshot writer still busy at close")
            return
        self._thread.join(timeout)
