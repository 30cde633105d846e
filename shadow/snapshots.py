"""Asynchronous snapshots of a shadow's state to disk, in the universal format.

The shadow calls :meth:`Snapshotter.offer` after every applied iteration. When a
snapshot is due (every K iterations or T seconds) the caller's ``capture``
clones the state — the only work done on the caller's thread — and a writer
thread persists it with :mod:`checkmate.checkpoint.storage` (atomic, fsynced),
moves ``latest`` forward once every shard of the step is on disk, and prunes
old steps. Only the shadow-process policy lives here (when to capture, which
held capture to write, how far the disk lags); the format and every write are
the checkpoint package's. Packet receipt is never blocked by the disk.

The disk keeps up by coalescing: while the writer is busy, due captures are
held (the newest ``policy.hold``); when it frees up it writes the newest one —
preferring a held step another shard has already started in the shared
directory, so the shadows' shards meet on the same steps and those steps
complete — and drops the older ones (counted as ``superseded``). So the newest
complete step on disk lags memory by about one write, never more than the
cadence plus the write time; :func:`disk_status` says by how much.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkmate.checkpoint import storage
from checkmate.checkpoint.format import GLOBAL_FILE, step_dir
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
    hold: int = 3
    """Due captures held while the writer is busy (the newest; older ones are superseded)."""

    def __post_init__(self) -> None:
        if self.every_iterations < 0 or self.every_seconds < 0:
            raise ValueError("snapshot intervals must not be negative")
        if self.every_iterations == 0 and self.every_seconds == 0:
            raise ValueError("snapshots need an interval: every_iterations or every_seconds")
        if self.keep < 1:
            raise ValueError("keep at least one snapshot")
        if self.hold < 1:
            raise ValueError("hold at least one capture")


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
    superseded: int = 0
    """Captures dropped for a newer one while the writer was busy (the disk coalesces)."""
    failed: int = 0
    last_step: int | None = None
    last_seconds: float = 0.0
    last_written_at: float | None = None
    """``time.time()`` when ``last_step`` was on disk."""

    @property
    def skipped_busy(self) -> int:
        """Former name of :attr:`superseded`."""
        return self.superseded


def make_private(root: Path, step: int) -> None:
    """What a snapshot of ``step`` wrote under ``root``: files 0600, directories 0700 (the model)."""
    targets = [root, *root.iterdir()]
    step_directory = step_dir(root, step)
    if step_directory.is_dir():
        targets += list(step_directory.rglob("*"))
    for path in targets:
        try:
            if path.is_symlink():
                continue
            os.chmod(path, 0o700 if path.is_dir() else 0o600)
        except FileNotFoundError:
            pass  # pruned meanwhile


class Snapshotter:
    def __init__(self, policy: SnapshotPolicy) -> None:
        self.policy = policy
        policy.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(policy.directory, 0o700)  # also when it existed: the snapshots hold the model
        self.stats = SnapshotStats()
        self._held: dict[int, Snapshot] = {}
        """Due captures not yet written, by step (the newest ``policy.hold``)."""
        self._writing = False
        self._closing = False
        self._cond = threading.Condition()
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

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._writing or bool(self._held)

    def offer(self, iteration: int, capture: Callable[[], Snapshot], force: bool = False) -> bool:
        """Capture ``iteration`` if due (or ``force``) for the writer; True when it was captured."""
        if not force and not self.due(iteration):
            return False
        snapshot = capture()
        with self._cond:
            if self._closing:
                return False
            self._held[snapshot.step] = snapshot
            for step in sorted(self._held)[: -self.policy.hold]:
                del self._held[step]
                self.stats.superseded += 1
            self._cond.notify_all()
        self._last_iteration = iteration
        self._last_time = time.monotonic()
        return True

    def _choose(self) -> Snapshot:
        """The held snapshot to write next (condition held): a step another shard started, else the newest."""
        steps = sorted(self._held)
        started = [s for s in steps if (step_dir(self.policy.directory, s) / GLOBAL_FILE).is_file()]
        step = started[-1] if started else steps[-1]
        chosen = self._held.pop(step)
        for older in [s for s in self._held if s < step]:
            del self._held[older]
            self.stats.superseded += 1
        return chosen

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._held and not self._closing:
                    self._cond.wait()
                if not self._held:
                    return
                snapshot = self._choose()
                self._writing = True
            try:
                self._write(snapshot)
            except (OSError, ValueError, RuntimeError) as exc:
                self.stats.failed += 1
                logger.error("snapshot of step %s failed: %s", snapshot.step, exc)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _write(self, snapshot: Snapshot) -> None:
        started = time.monotonic()
        root = self.policy.directory
        storage.write_global(
            root, snapshot.step, snapshot.parameters, snapshot.optimizer, snapshot.extra, snapshot.job_state
        )
        storage.write_shard(root, snapshot.step, snapshot.shard, snapshot.num_shards, snapshot.states)
        if snapshot.step in storage.complete_steps(root):
            storage.update_latest(root, snapshot.step)
            storage.prune(root, self.policy.keep)
        make_private(root, snapshot.step)
        self.stats.written += 1
        self.stats.last_step = snapshot.step
        self.stats.last_seconds = time.monotonic() - started
        self.stats.last_written_at = time.time()
        logger.info(
            "snapshot of step %d (shard %d) written in %.3fs",
            snapshot.step,
            snapshot.shard,
            self.stats.last_seconds,
        )

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until held snapshots are on disk; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._held or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def close(self, timeout: float = 30.0) -> None:
        if not self.flush(timeout):
            logger.warning("snapshot writer still busy at close")
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)


def disk_status(directory: Path, applied_iteration: int) -> dict[str, Any]:
    """How old the newest complete step in ``directory`` is, next to the state in memory.

    ``newest_complete_step`` (None: none), ``age_iterations`` (``applied_iteration``
    minus it; None without a step), ``age_seconds`` (since its ``global.json`` was
    written).
    """
    steps = storage.complete_steps(directory)
    if not steps:
        return {"newest_complete_step": None, "age_iterations": None, "age_seconds": None}
    newest = steps[-1]
    try:
        written = (step_dir(directory, newest) / GLOBAL_FILE).stat().st_mtime
        age_seconds: float | None = round(max(0.0, time.time() - written), 3)
    except OSError:
        age_seconds = None
    return {
        "newest_complete_step": newest,
        "age_iterations": max(0, applied_iteration - newest) if applied_iteration >= 0 else None,
        "age_seconds": age_seconds,
    }
