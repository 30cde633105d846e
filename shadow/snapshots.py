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

The directory may be remote storage, ``nfs://SERVER/EXPORT/PATH`` (:mod:`checkmate.checkpoint.remote`:
the same files and guarantees, written over NFS with a timeout). The policy's ``directory`` is
then a local directory of the shadow's own (default under the system's temporary directory,
:func:`local_directory`) for what stays on the shadow's host: its status file, and a step
staged from the export for ``--resume``. A write that fails (storage unreachable, full, or
silent beyond the timeout) is logged with the URL, counted, and said in the status
(``snapshots.failing``, ``disk.failing``); the shadow keeps running and serving its memory, its
writer tries again on the next due snapshot (backing off from 1 s to 30 s), and nothing of the
failed write is under a final name or named by ``latest``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkmate import nfs
from checkmate.checkpoint import storage
from checkmate.checkpoint.format import GLOBAL_FILE, STEP_DIR, CheckpointError, step_dir
from checkmate.checkpoint.remote import RemoteRoot, url_of
from checkmate.job_state import JobState

logger = logging.getLogger(__name__)

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0
"""After a failed write the writer waits this long (doubling from the first, up to the max)."""


def local_directory(url: str) -> Path:
    """A remote snapshot directory's local one on the shadow's host (``TMPDIR/checkmate-snapshots/...``)."""
    location = nfs.NFSURL.parse(url)
    parts = [location.server, *location.export.split("/"), *location.path.split("/")]
    return Path(tempfile.gettempdir(), "checkmate-snapshots", *[p for p in parts if p not in ("", ".", "..")])


@dataclass(frozen=True)
class SnapshotPolicy:
    directory: Path
    """Where snapshots go; given as ``nfs://SERVER/EXPORT/PATH`` it moves to ``remote`` and this becomes
    :func:`local_directory` of it (status file, staged resume)."""
    every_iterations: int = 1
    """Snapshot when this many iterations have passed since the last one (0: never by count)."""
    every_seconds: float = 0.0
    """Snapshot when this much time has passed since the last one (0: never by time)."""
    keep: int = 3
    """Complete steps kept on disk."""
    hold: int = 3
    """Due captures held while the writer is busy (the newest; older ones are superseded)."""
    remote: str | None = None
    """``nfs://SERVER/EXPORT/PATH``: snapshots go there (None: to ``directory``)."""
    timeout: float = nfs.DEFAULT_TIMEOUT_S
    """Remote: an NFS call not answered in this many seconds fails the write."""
    stage_latest: bool = False
    """Remote: at start, copy the newest complete step into ``directory`` (for the node's ``--resume``)."""

    def __post_init__(self) -> None:
        url = url_of(self.directory)
        if url is not None:
            if self.remote is not None and url_of(self.remote) != url:
                raise ValueError(f"two remote snapshot directories: {url} and {self.remote}")
            object.__setattr__(self, "remote", url)
            object.__setattr__(self, "directory", local_directory(url))
        elif not isinstance(self.directory, Path):
            object.__setattr__(self, "directory", Path(self.directory))
        if self.remote is not None:
            remote = url_of(self.remote)
            if remote is None:
                raise ValueError(
                    f"a remote snapshot directory is nfs://SERVER/EXPORT/PATH, not {self.remote!r}"
                )
            nfs.NFSURL.parse(remote)  # names a server and an export, else ValueError
            object.__setattr__(self, "remote", remote)
        if not self.timeout > 0:
            raise ValueError(f"the snapshot storage timeout must be positive, not {self.timeout}")
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
    storage: str = ""
    """Where the snapshots go: the directory, or the ``nfs://`` URL."""
    failing: str | None = None
    """While writes fail: the last failure (storage, step, error); None once a write succeeds."""
    failures_in_a_row: int = 0
    last_failed_at: float | None = None
    """``time.time()`` of the last failed write."""

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


@dataclass
class _RemoteDisk:
    """What the writers to a remote directory last saw there (read by :func:`disk_status` without I/O)."""

    url: str
    newest_complete_step: int | None = None
    seen_complete_at: float | None = None
    failing: str | None = None


_remote_disks: dict[Path, _RemoteDisk] = {}
"""Local directory of a remote snapshot directory -> what its writers saw (one per directory)."""
_remote_lock = threading.Lock()


class Snapshotter:
    def __init__(self, policy: SnapshotPolicy) -> None:
        self.policy = policy
        policy.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(policy.directory, 0o700)  # also when it existed: the snapshots hold the model
        self.stats = SnapshotStats(storage=policy.remote or str(policy.directory))
        self.remote: RemoteRoot | None = None
        self._disk: _RemoteDisk | None = None
        if policy.remote is not None:
            self.remote = RemoteRoot(policy.remote, policy.timeout)
            with _remote_lock:
                self._disk = _remote_disks.setdefault(policy.directory, _RemoteDisk(policy.remote))
            if policy.stage_latest:
                self._stage_latest()
        self._retry_at = 0.0
        self._retry_s = RETRY_FIRST_S
        self._held: dict[int, Snapshot] = {}
        """Due captures not yet written, by step (the newest ``policy.hold``)."""
        self._writing = False
        self._closing = False
        self._status: tuple[str, bytes] | None = None
        """Remote: the node's newest status document (file name, bytes) not yet on the export."""
        self._status_failing: str | None = None
        """Remote: why the last status upload failed (None: it worked, or none was tried)."""
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

    def publish_status(self, name: str, document: bytes) -> None:
        """Remote: put the node's status document on the export as ``name`` (``status-<shadow>.json``).

        Returns at once; the writer thread uploads the newest document given when no snapshot is
        waiting (and after each snapshot it writes), so a restore from the URL can say how far the
        shadows' memory was ahead of the step it read (``lost_iterations``). Nothing for a local
        directory: the node writes its status file there itself.
        """
        if self.remote is None:
            return
        with self._cond:
            self._status = (name, bytes(document))
            self._cond.notify_all()

    def _ready(self) -> bool:
        """Something to do now (condition held): a held capture or a status, past any back-off."""
        return (bool(self._held) or self._status is not None) and time.monotonic() >= self._retry_at

    def _upload_status(self) -> None:
        """Write the pending status document to the export (writer thread, no lock held)."""
        with self._cond:
            pending, self._status = self._status, None
        if pending is None or self.remote is None:
            return
        name, document = pending
        try:
            self.remote.write_file(name, document)
        except OSError as exc:
            repeated = self._status_failing == str(exc)
            self._status_failing = str(exc)
            (logger.debug if repeated else logger.warning)(
                "cannot put the status file %s on %s: %s", name, self.remote.url, exc
            )
            with self._cond:  # not before the back-off (which grows), and not over a newer document
                self._retry_at = max(self._retry_at, time.monotonic() + self._retry_s)
                self._retry_s = min(RETRY_MAX_S, 2 * self._retry_s)
                if self._status is None and not self._closing:
                    self._status = pending
            return
        if self._status_failing is not None:
            logger.info("the status file %s reaches %s again", name, self.remote.url)
            self._status_failing = None
            if not self.stats.failures_in_a_row:
                self._retry_s = RETRY_FIRST_S

    def _stage_latest(self) -> None:
        """Copy the export's newest complete step into the local directory (replacing staged ones)."""
        assert self.remote is not None
        local = self.policy.directory
        for entry in local.iterdir():
            if STEP_DIR.match(entry.name) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
        try:
            step = self.remote.stage(local)
        except CheckpointError as exc:
            logger.info("nothing to resume from in %s: %s", self.remote.url, exc)
            return
        except OSError as exc:
            logger.error("cannot read the snapshots in %s to resume from: %s", self.remote.url, exc)
            return
        make_private(local, step)

    def _started(self, steps: list[int]) -> list[int]:
        """Of ``steps``, those another shard has started (their global.json is there); no lock held.

        OSError when the remote storage cannot be listed (the write of the newest is then counted failed).
        """
        if self.remote is None:
            return [s for s in steps if (step_dir(self.policy.directory, s) / GLOBAL_FILE).is_file()]
        if len(steps) < 2:
            return []  # one candidate: no choice to make, no call to the server
        present = set(self.remote.steps_present())
        return [s for s in steps if s in present and self.remote.has_global(s)]

    def _choose(self, started: list[int]) -> Snapshot:
        """The held snapshot to write next (condition held): a step another shard started, else the newest."""
        steps = sorted(self._held)
        began = [s for s in steps if s in started]
        step = began[-1] if began else steps[-1]
        chosen = self._held.pop(step)
        for older in [s for s in self._held if s < step]:
            del self._held[older]
            self.stats.superseded += 1
        return chosen

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self._ready():
                    pending = self._held or self._status is not None
                    self._cond.wait(self._retry_at - time.monotonic() if pending else None)
                if self._closing and self._held and self.stats.failures_in_a_row:
                    logger.error(
                        "closing with %d snapshot(s) not written to %s (%s)",
                        len(self._held),
                        self.stats.storage,
                        self.stats.failing,
                    )
                    self._held.clear()
                if self._closing and (self.stats.failures_in_a_row or self._status_failing):
                    self._status = None  # the storage is failing: closing does not wait on it again
                held = bool(self._held)
                steps = sorted(self._held)
            if not held:
                self._upload_status()  # the newest status, when no snapshot waits (closing: the last one)
                with self._cond:
                    if self._closing and not self._held:
                        return
                continue
            unreachable: OSError | None = None
            try:
                started = self._started(steps)  # may ask the server: not under the condition
            except OSError as exc:
                started, unreachable = [], exc
            with self._cond:
                if not self._held:
                    continue
                snapshot = self._choose(started)
                self._writing = True
            try:
                if unreachable is not None:
                    raise unreachable
                self._write(snapshot)
            except OSError as exc:
                self._failed(snapshot, exc)
                with self._cond:  # tried again after the back-off, unless a newer capture came meanwhile
                    if self._held and max(self._held) > snapshot.step:
                        self.stats.superseded += 1
                    else:
                        self._held[snapshot.step] = snapshot
            except (ValueError, RuntimeError) as exc:
                self._failed(snapshot, exc)
            else:
                self._retry_at, self._retry_s = 0.0, RETRY_FIRST_S
                self._upload_status()  # with each step written, how far memory was ahead of it
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _failed(self, snapshot: Snapshot, exc: BaseException) -> None:
        """Count and say a failed write; the next waits (backing off) so a dead server is not hammered."""
        stats = self.stats
        where = self.policy.remote or str(self.policy.directory)
        message = f"snapshot of step {snapshot.step} (shard {snapshot.shard}) to {where} failed: {exc}"
        repeated = stats.failing is not None and stats.failing.split(" failed: ", 1)[-1] == str(exc)
        stats.failed += 1
        stats.failures_in_a_row += 1
        stats.failing = message
        stats.last_failed_at = time.time()
        if self._disk is not None:
            self._disk.failing = message
        self._retry_at = time.monotonic() + self._retry_s
        if repeated:
            logger.warning("%s (%d in a row)", message, stats.failures_in_a_row)
        else:
            logger.error(
                "%s; the shadow keeps its state in memory and tries again in %.0f s", message, self._retry_s
            )
        self._retry_s = min(RETRY_MAX_S, 2 * self._retry_s)

    def _write(self, snapshot: Snapshot) -> None:
        started = time.monotonic()
        if self.remote is not None:
            self._write_remote(self.remote, snapshot)
        else:
            root = self.policy.directory
            storage.write_global(
                root,
                snapshot.step,
                snapshot.parameters,
                snapshot.optimizer,
                snapshot.extra,
                snapshot.job_state,
            )
            storage.write_shard(root, snapshot.step, snapshot.shard, snapshot.num_shards, snapshot.states)
            if snapshot.step in storage.complete_steps(root):
                storage.update_latest(root, snapshot.step)
                storage.prune(root, self.policy.keep)
            make_private(root, snapshot.step)
        if self.stats.failing is not None:
            logger.info("snapshots to %s work again (step %d)", self.stats.storage, snapshot.step)
        self.stats.failing, self.stats.failures_in_a_row = None, 0
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

    def _write_remote(self, remote: RemoteRoot, snapshot: Snapshot) -> None:
        """The local write's steps on the export: global, shard (data, then manifest), latest, prune."""
        remote.write_global(
            snapshot.step, snapshot.parameters, snapshot.optimizer, snapshot.extra, snapshot.job_state
        )
        remote.write_shard(snapshot.step, snapshot.shard, snapshot.num_shards, snapshot.states)
        complete = remote.complete_steps()
        if snapshot.step in complete:
            remote.update_latest(snapshot.step)
            remote.prune(self.policy.keep)
        if self._disk is not None:
            if complete and complete[-1] != self._disk.newest_complete_step:
                self._disk.newest_complete_step, self._disk.seen_complete_at = complete[-1], time.time()
            self._disk.failing = None

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until held snapshots are on disk; False on timeout, or at once when the last write failed
        and the writer waits out its back-off (the storage is failing: waiting would not help)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._held or self._writing:
                left = deadline - time.monotonic()
                if left <= 0 or (not self._writing and self.stats.failures_in_a_row):
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
        if self.remote is not None and not self._thread.is_alive():
            self.remote.close()


def disk_status(directory: Path, applied_iteration: int) -> dict[str, Any]:
    """How old the newest complete step in ``directory`` is, next to the state in memory.

    ``newest_complete_step`` (None: none), ``age_iterations`` (``applied_iteration``
    minus it; None without a step), ``age_seconds`` (since its ``global.json`` was
    written).

    For a remote snapshot directory (``directory`` its :func:`local_directory`), what its
    writers last saw there, without asking the server (this runs under the node's lock):
    ``age_seconds`` counts from when a writer saw the step complete; ``storage`` names the URL,
    ``failing`` the last failure while writes fail.
    """
    with _remote_lock:
        remote = _remote_disks.get(Path(directory))
    if remote is not None:
        newest = remote.newest_complete_step
        seen = remote.seen_complete_at
        return {
            "newest_complete_step": newest,
            "age_iterations": max(0, applied_iteration - newest)
            if newest is not None and applied_iteration >= 0
            else None,
            "age_seconds": None if seen is None else round(max(0.0, time.time() - seen), 3),
            "storage": remote.url,
            "failing": remote.failing,
        }
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
