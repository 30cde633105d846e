"""A shadow node: copies in, optimizer steps applied in order, certified per-iteration checkpoints out.

One :class:`ShadowNode` serves one job (docs/shadow.md). Its threads:

* **receive** (UDP): decodes copied datagrams and REPAIR_DATA/NACK answers and
  places them into the :class:`~shadow.iteration_window.IterationWindow` under
  a short lock (a copy into the bucket buffer). It never touches the disk or
  the optimizer. Copies of an iteration whose commit has not arrived yet are
  *stashed* raw (bounded in bytes): only the commit tells the shadow for sure
  which bucket layout that iteration used.
* **control** (TCP listener; one handler thread per connection): rank 0's
  control channel (job_start, bucket_layout, commit; the shadow answers
  certified), and on the same port status and restore requests.
* **apply**: takes the next ready iteration (commit here, every owned bucket
  complete), runs :class:`~shadow.optimizer_apply.ShadowOptimizer` on it,
  reports Certified to rank 0, offers a snapshot to the
  :class:`~shadow.snapshots.Snapshotter` (which writes on its own thread) and
  serves restore requests waiting for that iteration.
* **maintenance**: repairs (:mod:`shadow.repair`) and the status file.

Ownership and layout changes: the shadow owns the buckets whose shard key the
job maps to its name, and so the parameters in them. Every bucket layout
arrives right after a job_start carrying the state before the layout's first
iteration; the shadow re-seeds from it, so it never applies an update to a
parameter whose previous state it does not hold. A layout without that state
makes the shadow ask for it (goodbye; rank 0 reconnects and resends).

Data position: the workers' data position after each iteration (any JSON value,
``CheckmateAgent.set_data_position``) arrives in the commit record, or in a
job_start's ``extra`` for the state it seeds; a commit without one keeps the
previous iteration's. The shadow keeps the position with the applied state and
hands it out with it (restore answers, snapshots' ``extra``). A position that is
not strict JSON or is too large is refused (logged, counted as the drop
``bad_data_position``): the iteration is still applied, its position is unknown
(null) until a valid one arrives.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file

from checkmate import checkpoint as fmt
from checkmate.auth import DatagramKeys, secret_from_env
from checkmate.control import (
    BucketLayout as LayoutMessage,
)
from checkmate.control import (
    BucketSpec,
    Certified,
    Commit,
    ControlProtocolError,
    Diverged,
    Goodbye,
    JobStart,
    Message,
    ParamSpec,
    RestoreRefused,
    RestoreRequest,
    StatusReport,
    StatusRequest,
    attach_job_state,
    job_state_of,
    recv_message,
    send_message,
    torch_dtype,
    validate_data_position,
)
from checkmate.control_frame import ControlAuth, bind
from checkmate.fingerprint import fingerprint as state_fingerprint
from checkmate.fingerprint import mismatches as fingerprint_mismatches
from checkmate.job import JobSpec, JobSpecError
from checkmate.job_state import JobState
from checkmate.optimizers import OptimizerReplayError, optimizer_class
from checkmate.wire import (
    CHECKMATE_UDP_PORT,
    HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    CheckmateHeader,
    MessageType,
    WireFormatError,
    decode,
)
from shadow.iteration_window import BucketLayout, DropReason, IterationWindow, ParameterSlot
from shadow.optimizer_apply import (
    GradientScaling,
    OptimizerSpec,
    OptimizerSpecError,
    ShadowOptimizer,
    StepRecord,
)
from shadow.repair import RepairPolicy, RepairTracker, request_datagram
from shadow.snapshots import Snapshot, SnapshotPolicy, Snapshotter, disk_status

logger = logging.getLogger(__name__)

Addr = tuple[str, int]
DEFAULT_CONTROL_BIND: Addr = ("0.0.0.0", 48880)
DEFAULT_DATA_BIND: Addr = ("0.0.0.0", CHECKMATE_UDP_PORT)


@dataclass(frozen=True)
class ShadowConfig:
    name: str
    """This shadow's name in the job's shard map (``JobSpec.shadows``)."""
    control_bind: Addr = DEFAULT_CONTROL_BIND
    data_bind: Addr = DEFAULT_DATA_BIND
    job_id: int | None = None
    """Accept only this job (None: the first job_start's)."""
    shard_keys: tuple[int, ...] | None = None
    """Shard keys this shadow owns; None: those the job's shard map gives its name."""
    snapshots: SnapshotPolicy | None = None
    resume: bool = False
    """Load this shadow's shard of the latest complete snapshot at start (served until rank 0 re-seeds)."""
    status_file: Path | None = None
    """Where to rewrite the status JSON once a second (default: <snapshot dir>/status-<name>.json)."""
    horizon: int = 8
    """Iterations in flight (placed, not yet applied); copies beyond are dropped as too far ahead."""
    stash_bytes: int = 256 << 20
    """Bound on copies held before their iteration's commit (or before the job is known)."""
    repair: RepairPolicy = field(default_factory=RepairPolicy)
    resync_on_unrepairable: bool = True
    """Ask rank 0 for fresh state (goodbye + reconnect) when an iteration cannot be repaired."""
    io_timeout: float = 10.0
    """Timeout of each control-channel read and write."""
    recv_buffer_bytes: int = 16 << 20
    secret: bytes | None = None
    """The job secret (None: this process's, :func:`checkmate.auth.secret_from_env`; none -> error)."""


@dataclass
class _Epoch:
    """A bucket layout in force from ``first_iteration`` on, with the state it started from."""

    generation: int
    first_iteration: int
    layout: dict[int, BucketSpec]
    owned_buckets: set[int]
    window: IterationWindow
    optimizer: ShadowOptimizer
    static: dict[str, torch.Tensor]
    """Owned parameters in no bucket (never updated); kept so a restore covers them."""
    confirmed_through: int
    """The latest iteration whose commit arrived in this epoch (its layout is certain)."""


@dataclass
class _Job:
    job_id: int
    world_size: int
    workers: list[Addr]
    parameters: list[ParamSpec]
    optimizer: dict[str, Any]
    shard_keys: set[int]
    shard_index: int
    num_shards: int
    spec: JobSpec | None
    fingerprint_every: int = 0
    """Rank 0 fingerprints every K-th iteration (and the last one it waits for); 0: never (GPU
    parameters): iterations are then certified on trust."""


class _CommitEntry(NamedTuple):
    """A commit record held until its iteration is applied."""

    record: StepRecord
    arrival: float
    """``time.monotonic()`` when it arrived."""
    optimizer_step: int
    sets_position: bool
    """The commit carried a data position (else the previous iteration's stays)."""
    data_position: Any
    """That position, validated; None if it was refused."""
    job_state: JobState | None = None
    """The job state after the iteration (buffers, stateful objects, ...); None: unchanged."""
    fingerprint: dict[str, dict[str, Any]] | None = None
    """Rank 0's fingerprint of its state after the iteration (None: not checked this iteration)."""


@dataclass
class _Capture:
    iteration: int
    done: threading.Event = field(default_factory=threading.Event)
    result: JobStart | None = None


@dataclass
class NodeStats:
    packets_received: int = 0
    bytes_received: int = 0
    packets_placed: int = 0
    elements_placed: int = 0
    drops: collections.Counter[str] = field(default_factory=collections.Counter)
    applied_iterations: int = 0
    apply_seconds: float = 0.0
    applied_elements: int = 0
    last_apply_seconds: float = 0.0
    last_commit_to_apply_seconds: float = 0.0
    reseeds: int = 0
    resync_requests: int = 0
    certified_sent: int = 0
    divergences: int = 0
    fingerprints_checked: int = 0


def _from_worker(job: _Job, addr: Addr) -> bool:
    """A copy or repair answer may only come from one of the job's worker hosts (docs/security.md)."""
    return not job.workers or any(addr[0] == host for host, _ in job.workers)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


class ShadowNode:
    """One shadow of one job. ``start()``, then ``close()``; everything runs on its own threads."""

    def __init__(self, config: ShadowConfig) -> None:
        self.config = config
        self.name = config.name
        self.stats = NodeStats()
        secret = config.secret if config.secret is not None else secret_from_env()
        self._control_auth = ControlAuth(secret)
        self._datagram_keys = DatagramKeys(secret)
        self._lock = threading.Condition(threading.RLock())
        """Guards job, epoch, stash, commits, repairs; notified on any progress."""
        self._state_lock = threading.Lock()
        """Held while the optimizer state changes or is captured."""
        self._stop = threading.Event()
        self._job: _Job | None = None
        self._epoch: _Epoch | None = None
        self._generation = 0
        self._pending_start: JobStart | None = None
        self._stash: dict[int, list[tuple[bytearray, float, Addr]]] = {}
        self._stash_bytes = 0
        self._commits: dict[int, _CommitEntry] = {}
        self._latest_commit = -1
        self._latest_seen = -1
        self._applied = -1
        self._optimizer_step = 0
        self._data_position: Any = None
        """The workers' data position after ``self._applied`` (None: unknown)."""
        self._job_state: JobState | None = None
        """The job state after ``self._applied`` (buffers, stateful objects; None: none sent)."""
        self._bad_positions = 0
        self._certified = -1
        self._last_verified = -1
        """The last iteration whose state matched rank 0's fingerprint (or was seeded by rank 0)."""
        self._diverged: dict[str, Any] | None = None
        """Set when the state differed from rank 0's fingerprint, until rank 0 re-seeds this shadow."""
        self._last_divergence: dict[str, Any] | None = None
        self._retiring: set[socket.socket] = set()
        """Control connections this shadow said goodbye on: read and discarded until rank 0 closes."""
        self._blocked: str | None = None
        self._captures: dict[int, list[_Capture]] = {}
        self._repairs: RepairTracker | None = None
        self._restored_from: int | None = None
        self._control_conn: socket.socket | None = None
        self._job_conn: socket.socket | None = None
        """The control connection the current job_start came on."""
        self._control_send = threading.Lock()
        self._started = time.time()
        self.snapshotter = Snapshotter(config.snapshots) if config.snapshots is not None else None
        self._last_snapshot_time = time.monotonic()

        self._udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self._udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, config.recv_buffer_bytes)
        except OSError as exc:
            logger.debug("cannot set SO_RCVBUF: %s", exc)
        self._udp.bind(config.data_bind)
        self._udp.settimeout(0.1)
        self.data_address: Addr = self._udp.getsockname()
        self._tcp = socket.create_server(config.control_bind, reuse_port=False)
        self._tcp.settimeout(0.1)
        self.control_address: Addr = self._tcp.getsockname()
        self._threads: list[threading.Thread] = []
        if config.resume and config.snapshots is not None:
            self._resume(config.snapshots.directory)

    # ---- life cycle ---------------------------------------------------------------------
    def start(self) -> ShadowNode:
        for target, name in (
            (self._receive_loop, "rx"),
            (self._accept_loop, "ctl"),
            (self._apply_loop, "apply"),
            (self._maintenance_loop, "maint"),
        ):
            thread = threading.Thread(target=target, name=f"shadow-{self.name}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        logger.info(
            "shadow %s: control %s:%d, copies %s:%d", self.name, *self.control_address, *self.data_address
        )
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
            conn, self._control_conn = self._control_conn, None
        if conn is not None:
            try:
                with self._control_send:
                    send_message(conn, Goodbye(self._job_id(), "shadow closing"), timeout=0.5)
            except OSError:
                pass
            conn.close()
        for thread in self._threads:
            thread.join(timeout)
        if self.snapshotter is not None:
            self.snapshotter.close(timeout)
        self._write_status()
        self._udp.close()
        self._tcp.close()

    def __enter__(self) -> ShadowNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _job_id(self) -> int:
        return self._job.job_id if self._job is not None else (self.config.job_id or 0)

    # ---- state queries ------------------------------------------------------------------
    @property
    def applied_iteration(self) -> int:
        """The last iteration whose state this shadow holds (-1: none)."""
        return self._applied

    def wait_applied(self, iteration: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._applied < iteration:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.1))
            return True

    def parameters(self) -> dict[str, torch.Tensor]:
        """Clones of the owned parameters (bucketed and static)."""
        with self._state_lock:
            epoch = self._epoch
            if epoch is None:
                return {}
            out = {n: p.detach().clone() for n, p in epoch.optimizer.parameters.items()}
            out.update({n: t.clone() for n, t in epoch.static.items()})
            return out

    def optimizer_states(self) -> dict[str, dict[str, torch.Tensor]]:
        with self._state_lock:
            epoch = self._epoch
            if epoch is None:
                return {}
            return {
                n: {k: torch.as_tensor(v).clone() for k, v in epoch.optimizer.optimizer_state(n).items()}
                for n in epoch.optimizer.parameters
            }

    def status(self) -> dict[str, Any]:
        with self._lock:
            job, epoch = self._job, self._epoch
            repairs = self._repairs.stats if self._repairs is not None else None
            stats = self.stats
            if job is None:
                state = "waiting_for_job"
            elif epoch is None:
                state = "waiting_for_layout"
            elif self._diverged is not None:
                state = "diverged"
            elif self._blocked:
                state = "stalled"
            else:
                state = "running"
            apply_rate = stats.applied_elements / stats.apply_seconds if stats.apply_seconds else 0.0
            drops = collections.Counter(stats.drops)
            document: dict[str, Any] = {
                "shadow": self.name,
                "time": time.time(),
                "uptime_seconds": round(time.time() - self._started, 3),
                "job_id": job.job_id if job else None,
                "state": state,
                "blocked": self._blocked,
                "applied_iteration": self._applied,
                "certified_iteration": self._certified,
                "verified_iteration": self._last_verified,
                "divergence": self._diverged,
                "last_divergence": self._last_divergence,
                "divergences": stats.divergences,
                "fingerprints_checked": stats.fingerprints_checked,
                "next_iteration": epoch.window.next_iteration if epoch else None,
                "latest_commit": self._latest_commit,
                "latest_seen_iteration": max(self._latest_seen, self._latest_commit),
                "lag_iterations": max(0, self._latest_commit - self._applied) if job else None,
                "optimizer_step": self._optimizer_step,
                "restored_from_snapshot": self._restored_from,
                "shard": {
                    "keys": sorted(job.shard_keys) if job else [],
                    "index": job.shard_index if job else None,
                    "count": job.num_shards if job else None,
                    "buckets": sorted(epoch.owned_buckets) if epoch else [],
                    "parameters": len(epoch.optimizer.parameters) + len(epoch.static) if epoch else 0,
                    "elements": sum(p.numel() for p in epoch.optimizer.parameters.values()) if epoch else 0,
                },
                "packets_received": stats.packets_received,
                "bytes_received": stats.bytes_received,
                "packets_placed": stats.packets_placed,
                "elements_placed": stats.elements_placed,
                "stash": {
                    "datagrams": sum(len(v) for v in self._stash.values()),
                    "bytes": self._stash_bytes,
                },
                "drops": dict(sorted(drops.items())),
                "repairs": dict(vars(repairs)) if repairs else {},
                "apply": {
                    "iterations": stats.applied_iterations,
                    "seconds": round(stats.apply_seconds, 6),
                    "last_seconds": round(stats.last_apply_seconds, 6),
                    "elements_per_second": round(apply_rate),
                    "last_commit_to_apply_seconds": round(stats.last_commit_to_apply_seconds, 6),
                },
                "reseeds": stats.reseeds,
                "resync_requests": stats.resync_requests,
                "control_connected": self._control_conn is not None,
                "snapshots": dict(vars(self.snapshotter.stats)) if self.snapshotter else None,
                "disk": disk_status(self.snapshotter.policy.directory, self._applied)
                if self.snapshotter
                else None,
            }
        return document

    # ---- receive thread -----------------------------------------------------------------
    def _receive_loop(self) -> None:
        buffer = bytearray(HEADER_BYTES + MAX_PAYLOAD_BYTES + 1024)
        view = memoryview(buffer)
        while not self._stop.is_set():
            try:
                n, addr = self._udp.recvfrom_into(buffer)
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                logger.warning("shadow %s: receive failed: %s", self.name, exc)
                continue
            self.on_datagram(view[:n], addr)

    def on_datagram(self, data: memoryview, addr: Addr) -> DropReason | str | None:
        """Handle one datagram (the receive thread's body; callable directly in tests)."""
        now = time.monotonic()
        with self._lock:
            self.stats.packets_received += 1
            self.stats.bytes_received += len(data)
            opened = self._datagram_keys.open(data)  # NACK, REPAIR_DATA: MAC checked (checkmate.auth)
            if opened is None:
                return self._drop("unauthenticated")
            data = opened
            try:
                header, payload = decode(data)
            except WireFormatError:
                return self._drop("malformed")
            if header.msg_type is MessageType.NACK:
                if self._repairs is not None and self._job is not None and header.job_id == self._job.job_id:
                    self._repairs.on_nack(header)
                    self._lock.notify_all()
                    return None
                return self._drop("unexpected_nack")
            if header.msg_type not in (MessageType.DATA, MessageType.REPAIR_DATA):
                return self._drop(DropReason.NOT_DATA.value)
            job = self._job
            if job is None:
                if self.config.job_id is not None and header.job_id != self.config.job_id:
                    return self._drop(DropReason.OTHER_JOB.value)
                return self._stash_datagram(header, data, now, addr)
            if header.job_id != job.job_id:
                return self._drop(DropReason.OTHER_JOB.value)
            if not _from_worker(job, addr):
                return self._drop("not_from_a_worker")
            if header.msg_type is MessageType.REPAIR_DATA and self._repairs is not None:
                self._repairs.on_answer(header)
            self._latest_seen = max(self._latest_seen, header.iteration)
            epoch = self._epoch
            if (
                epoch is None
                or header.iteration > epoch.confirmed_through
                or header.iteration >= epoch.window.next_iteration + epoch.window.horizon
            ):
                if epoch is not None:
                    refused = epoch.window.admits(header.iteration)
                    if refused is DropReason.STALE:
                        return self._drop(refused.value)
                    if header.iteration >= epoch.window.next_iteration + 2 * self.config.horizon:
                        return self._drop(DropReason.TOO_FAR_AHEAD.value)
                return self._stash_datagram(header, data, now, addr)
            return self._place(epoch, header, payload)

    def _drop(self, reason: str) -> str:
        self.stats.drops[reason] += 1
        return reason

    def _stash_datagram(
        self, header: CheckmateHeader, data: memoryview, now: float, addr: Addr
    ) -> str | None:
        if self._stash_bytes + len(data) > self.config.stash_bytes:
            return self._drop("stash_full")
        self._stash.setdefault(header.iteration, []).append((bytearray(data), now, addr))
        self._stash_bytes += len(data)
        return None

    def _place(self, epoch: _Epoch, header: CheckmateHeader, payload: memoryview) -> DropReason | None:
        if header.bucket_id in epoch.layout and header.bucket_id in epoch.owned_buckets:
            if header.shard_key != epoch.layout[header.bucket_id].shard_key:
                self._drop("wrong_shard_key")
                return DropReason.NOT_OWNED
        reason = epoch.window.place(header, payload)
        if reason is not None:
            self._drop(reason.value)
            return reason
        self.stats.packets_placed += 1
        self.stats.elements_placed += header.element_count
        if header.msg_type is MessageType.REPAIR_DATA and self._repairs is not None:
            self._repairs.stats.elements_repaired += header.element_count
        self._lock.notify_all()
        return None

    def _drain_stash(self) -> None:
        """Place stashed copies of confirmed iterations inside the window (lock held)."""
        epoch = self._epoch
        if epoch is None:
            return
        limit = min(epoch.confirmed_through, epoch.window.next_iteration + epoch.window.horizon - 1)
        for iteration in sorted(self._stash):
            if iteration > limit:
                break
            for data, _, source in self._stash.pop(iteration):
                self._stash_bytes -= len(data)
                header, payload = decode(data)
                if self._job is not None and not _from_worker(self._job, source):
                    self._drop("not_from_a_worker")
                    continue
                if header.job_id != epoch.window.job_id:
                    self._drop(DropReason.OTHER_JOB.value)
                    continue
                if header.iteration < epoch.window.next_iteration:
                    self._drop(DropReason.STALE.value)
                    continue
                self._place(epoch, header, payload)

    # ---- control listener ---------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._tcp.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                logger.warning("shadow %s: accept failed: %s", self.name, exc)
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            bind(conn, self._control_auth, self.config.job_id, server=True)
            threading.Thread(
                target=self._serve, args=(conn, peer), name=f"shadow-{self.name}-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket, peer: Addr) -> None:
        is_control = False
        retired_at: float | None = None
        try:
            while not self._stop.is_set():
                if retired_at is None and conn in self._retiring:
                    retired_at = time.monotonic()
                readable, _, _ = select.select([conn], [], [], 0.2)
                if retired_at is not None:
                    # Said goodbye: what rank 0 sent meanwhile is discarded (unread bytes at close
                    # would reset the connection and could lose the goodbye and a 'diverged').
                    if readable and conn.recv(1 << 16):
                        continue
                    if readable or time.monotonic() - retired_at > self.config.io_timeout:
                        return  # rank 0 closed its side (or never did)
                    continue
                if not readable:
                    if is_control and self._control_conn is not conn:
                        return  # replaced by a newer connection from rank 0
                    continue
                message = recv_message(conn, timeout=self.config.io_timeout)
                if isinstance(message, JobStart):
                    if not is_control:
                        is_control = True
                        self._adopt_control(conn)
                    if not self._on_job_start(message, conn):
                        return
                elif isinstance(message, LayoutMessage):
                    if not self._on_layout(message, conn):
                        return
                elif isinstance(message, Commit):
                    self._on_commit(message)
                elif isinstance(message, StatusRequest):
                    send_message(conn, StatusReport(self._job_id(), self.status()), self.config.io_timeout)
                elif isinstance(message, RestoreRequest):
                    send_message(conn, self._restore(message), self.config.io_timeout)
                elif isinstance(message, Goodbye):
                    logger.info("shadow %s: %s said goodbye: %s", self.name, peer, message.reason)
                    return
                else:
                    self._drop(f"unexpected_control_{message.TYPE}")
        except (OSError, ControlProtocolError) as exc:
            logger.info("shadow %s: connection from %s closed: %s", self.name, peer, exc)
        finally:
            with self._lock:
                if self._control_conn is conn:
                    self._control_conn = None
                self._retiring.discard(conn)
            conn.close()

    def _adopt_control(self, conn: socket.socket) -> None:
        with self._lock:
            old, self._control_conn = self._control_conn, conn
        if old is not None and old is not conn:
            logger.info("shadow %s: rank 0 reconnected; dropping the old control connection", self.name)
            old.close()

    def _send_control(self, message: Message) -> bool:
        conn = self._control_conn
        if conn is None:
            return False
        try:
            with self._control_send:
                send_message(conn, message, timeout=self.config.io_timeout)
            return True
        except OSError as exc:
            logger.info("shadow %s: control write failed: %s", self.name, exc)
            return False

    def _request_state(self, conn: socket.socket, why: str) -> bool:
        """Ask rank 0 for fresh state: goodbye on ``conn``, now retired; rank 0 reconnects and resends it.

        The connection is not closed here: its reader discards what rank 0 sent meanwhile until
        rank 0 closes its side (a close with unread bytes would reset the connection, and rank 0
        could lose this goodbye and a 'diverged' report before it). Returns True (keep reading).
        """
        with self._lock:
            self.stats.resync_requests += 1
            if self._control_conn is conn:
                self._control_conn = None
            self._retiring.add(conn)
        logger.warning("shadow %s: asking rank 0 for fresh state: %s", self.name, why)
        try:
            with self._control_send:
                send_message(conn, Goodbye(self._job_id(), f"resync: {why}"), timeout=1.0)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        return True

    # ---- control messages ---------------------------------------------------------------
    def _on_job_start(self, message: JobStart, conn: socket.socket) -> bool:
        if self.config.job_id is not None and message.job_id != self.config.job_id:
            logger.error("shadow %s: job %d is not the configured job", self.name, message.job_id)
            with self._control_send:
                send_message(
                    conn, Goodbye(message.job_id, f"this shadow serves job {self.config.job_id}"), 1.0
                )
            return False
        try:
            job = self._job_from(message)
        except (JobSpecError, ValueError) as exc:
            logger.error("shadow %s: unusable job_start: %s", self.name, exc)
            return False
        try:  # an optimizer this shadow cannot import or replay: refused at once, rank 0 is told why
            optimizer_class(message.optimizer)
        except (OptimizerReplayError, KeyError, TypeError) as exc:
            logger.error("shadow %s: refusing job %d: %s", self.name, message.job_id, exc)
            with self._control_send:
                send_message(conn, Goodbye(message.job_id, f"refused: {exc}"), timeout=1.0)
            return False
        if message.extra.get("data_position") is not None:
            position = self._checked_position(message.extra["data_position"], message.start_iteration - 1)
            message.extra["data_position"] = position
        try:
            job_state_of(message)
        except ControlProtocolError as exc:
            logger.error("shadow %s: unusable job_start: %s", self.name, exc)
            return False
        with self._lock:
            new_run = conn is not self._job_conn or (
                self._job is not None
                and (self._job.world_size, self._job.workers) != (job.world_size, job.workers)
            )
            self._job = job
            self._job_conn = conn
            self._pending_start = message
            self._epoch = None
            self._blocked = None
            self._repairs = RepairTracker(self.config.repair, len(job.workers))
            # Copies of earlier iterations are stale. A job_start on a new control connection
            # (the job restarted, maybe with another worker count) makes every held copy stale:
            # the failed run's iterations >= start are redone, possibly with other chunks and
            # sums. A layout change within a run keeps copies of later iterations (same run).
            for iteration in [i for i in self._stash if new_run or i < message.start_iteration]:
                for data, *_ in self._stash.pop(iteration):
                    self._stash_bytes -= len(data)
                    self._drop(DropReason.STALE.value)
            # Commit records arrive on the control connection after their job_start, so any
            # held for iterations >= start belong to a previous run or layout: drop them all.
            self._commits.clear()
            if new_run:
                self._latest_commit = min(self._latest_commit, message.start_iteration - 1)
                self._latest_seen = min(self._latest_seen, message.start_iteration - 1)
            self._lock.notify_all()
        logger.info(
            "shadow %s: job %d state before iteration %d received (shard keys %s)",
            self.name,
            job.job_id,
            message.start_iteration,
            sorted(job.shard_keys),
        )
        return True

    def _job_from(self, message: JobStart) -> _Job:
        spec = JobSpec.from_json(message.job) if message.job else None
        if self.config.shard_keys is not None:
            keys = set(self.config.shard_keys)
        elif spec is not None:
            keys = {k for k, s in spec.shard_to_shadow.items() if s == self.name}
            if not keys:
                raise ValueError(f"the job's shard map gives {self.name!r} no shard: {spec.shard_to_shadow}")
        else:
            raise ValueError("the job_start has no job description; start the shadow with --shard-keys")
        owners = sorted(set(spec.shard_to_shadow.values())) if spec is not None else [self.name]
        every = message.extra.get("fingerprint_every", 0)
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"fingerprint_every must be a non-negative integer, not {every!r}")
        return _Job(
            job_id=message.job_id,
            world_size=message.world_size,
            workers=[(str(h), int(p)) for h, p in message.workers],
            parameters=list(message.parameters),
            optimizer=message.optimizer,
            shard_keys=keys,
            shard_index=owners.index(self.name) if self.name in owners else 0,
            num_shards=len(owners),
            spec=spec,
            fingerprint_every=every,
        )

    def _on_layout(self, message: LayoutMessage, conn: socket.socket) -> bool:
        with self._lock:
            start, job = self._pending_start, self._job
            if job is None or message.job_id != job.job_id:
                self._drop("layout_for_unknown_job")
                return True
            if start is None or start.start_iteration != message.first_iteration:
                have = start.start_iteration if start is not None else None
                return self._request_state(
                    conn,
                    f"bucket layout from iteration {message.first_iteration} without the state before it "
                    f"(have state for {have}): parameters may have moved between shadows",
                )
        # Built without the lock: the first optimizer a process builds takes seconds (torch
        # initialises its optimizer machinery), and copies must keep arriving meanwhile
        # (there is no epoch yet, so they are stashed).
        try:
            epoch = self._build_epoch(job, start, message)
        except (OptimizerSpecError, KeyError, ValueError) as exc:
            logger.error("shadow %s: cannot join job %d: %s", self.name, job.job_id, exc)
            with self._lock:
                self._blocked = f"cannot join: {exc}"
            return True
        with self._lock:
            if self._pending_start is not start or self._job is not job:
                logger.info("shadow %s: layout for iteration %d superseded", self.name, start.start_iteration)
                return True
            self._generation += 1
            epoch.generation = self._generation
            with self._state_lock:
                self._epoch = epoch
                self._applied = start.start_iteration - 1
                self._optimizer_step = int(start.extra.get("optimizer_step", self._optimizer_step))
                self._data_position = start.extra.get("data_position")
                self._job_state = job_state_of(start)
            self._pending_start = None
            self._restored_from = None
            # Certificates name the job's iterations: after a re-seed at t (a restart may
            # resume before what an earlier run certified) the next certificate is t - 1's.
            self._certified = min(self._certified, start.start_iteration - 1)
            self._last_verified = start.start_iteration - 1  # rank 0's own state
            self._diverged = None
            self.stats.reseeds += 1
            if self._repairs is not None:
                self._repairs.forget_before(start.start_iteration)
            self._drain_stash()
            self._fulfil_captures_locked()
            self._lock.notify_all()
        if start.start_iteration >= 1:
            self._certify(start.start_iteration - 1, epoch, again=True)
        logger.info(
            "shadow %s: owns buckets %s (%d parameters) from iteration %d",
            self.name,
            sorted(epoch.owned_buckets),
            len(epoch.optimizer.parameters),
            message.first_iteration,
        )
        return True

    def _build_epoch(self, job: _Job, start: JobStart, message: LayoutMessage) -> _Epoch:
        shapes = {p.name: tuple(p.shape) for p in start.parameters}
        layout = {b.bucket_id: b for b in message.buckets}
        owned_buckets = {b.bucket_id for b in message.buckets if b.shard_key in job.shard_keys}
        window_layouts = {}
        for bucket in message.buckets:
            slots = []
            for piece in bucket.params:
                if piece.name not in shapes:
                    raise KeyError(f"bucket {bucket.bucket_id} names unknown parameter {piece.name!r}")
                if piece.offset + piece.numel > bucket.num_elements:
                    raise ValueError(f"parameter {piece.name} lies past bucket {bucket.bucket_id}'s end")
                slots.append(ParameterSlot(piece.name, piece.offset, piece.numel, shapes[piece.name]))
            window_layouts[bucket.bucket_id] = BucketLayout(
                bucket.bucket_id, bucket.num_elements, tuple(slots), torch_dtype(bucket.dtype)
            )
        owned = {s.name for b in owned_buckets for s in window_layouts[b].parameters}
        bucketed = {s.name for layout_ in window_layouts.values() for s in layout_.parameters}
        unbucketed = [p.name for p in start.parameters if p.name not in bucketed]
        static: dict[str, torch.Tensor] = {}
        if unbucketed and job.shard_keys and min(job.shard_keys) == min(b.shard_key for b in message.buckets):
            static = {n: start.tensors[f"param/{n}"].clone() for n in unbucketed}
        optimizer = self._make_optimizer(job.optimizer, start, owned)
        window = IterationWindow(
            job.job_id, window_layouts, owned_buckets, start.start_iteration, horizon=self.config.horizon
        )
        return _Epoch(
            generation=0,  # numbered when it is installed
            first_iteration=start.start_iteration,
            layout=layout,
            owned_buckets=owned_buckets,
            window=window,
            optimizer=optimizer,
            static=static,
            confirmed_through=start.start_iteration - 1,
        )

    @staticmethod
    def _make_optimizer(spec_json: Mapping[str, Any], start: JobStart, owned: set[str]) -> ShadowOptimizer:
        initial = {
            key[len("param/") :]: tensor for key, tensor in start.tensors.items() if key.startswith("param/")
        }
        spec = OptimizerSpec.from_json(spec_json)
        optimizer = ShadowOptimizer(initial, spec, owned)
        for name, parameter in optimizer.parameters.items():
            state: dict[str, Any] = {}
            prefix = f"state/{name}/"
            for key, tensor in start.tensors.items():
                if key.startswith(prefix):
                    state[key[len(prefix) :]] = tensor.clone()
            state.update(start.optimizer_scalars.get(name, {}))
            if state:
                optimizer.optimizer.state[parameter] = state
        return optimizer

    def _checked_position(self, position: Any, iteration: int) -> Any:
        """``position`` validated, or None (logged and counted) if it is refused."""
        try:
            return validate_data_position(position)
        except ValueError as exc:
            with self._lock:
                self._drop("bad_data_position")
                self._bad_positions += 1
                first = self._bad_positions == 1
            (logger.error if first else logger.debug)(
                "shadow %s: data position of iteration %d refused (%d so far; its position is unknown): %s",
                self.name,
                iteration,
                self._bad_positions,
                exc,
            )
            return None

    def _on_commit(self, message: Commit) -> None:
        now = time.monotonic()
        sets_position = message.data_position is not None
        position = self._checked_position(message.data_position, message.iteration) if sets_position else None
        with self._lock:
            job = self._job
            if job is None or message.job_id != job.job_id:
                self._drop("commit_for_unknown_job")
                return
            record = StepRecord(
                iteration=message.iteration,
                learning_rates=list(message.learning_rates),
                clip_coefficient=message.clip_coefficient,
                skip_step=message.skip_step,
                hyperparameters=[
                    {k: tuple(v) if isinstance(v, list) else v for k, v in group.items()}
                    for group in message.hyperparameters
                ],
                no_grad=frozenset(message.no_grad),
                gradient_scaling=tuple(
                    GradientScaling(
                        str(op["by"]),
                        float(op["factor"]),
                        torch_dtype(op.get("dtype", "float32")),
                        frozenset(op["params"]) if op.get("params") is not None else None,
                    )
                    for op in message.gradient_scaling
                ),
            )
            if message.iteration <= self._applied:
                self._drop("stale_commit")
                return
            self._commits[message.iteration] = _CommitEntry(
                record,
                now,
                message.optimizer_step,
                sets_position,
                position,
                job_state=message.job_state,
                fingerprint=message.fingerprint,
            )
            self._latest_commit = max(self._latest_commit, message.iteration)
            epoch = self._epoch
            if epoch is not None:
                epoch.confirmed_through = max(epoch.confirmed_through, message.iteration)
                self._drain_stash()
            self._lock.notify_all()

    # ---- apply thread -------------------------------------------------------------------
    def _apply_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                epoch = self._epoch
                pending = None
                if epoch is not None and self._diverged is None:  # diverged: halted until re-seeded
                    nxt = epoch.window.next_iteration
                    if nxt in self._commits:
                        waiting = epoch.window.pending.get(nxt)
                        if waiting is None or waiting.step is None:
                            epoch.window.commit(self._commits[nxt].record)
                    pending = epoch.window.ready()
                if pending is None:
                    self._lock.wait(0.05)
                    continue
                assert epoch is not None
                entry = self._commits[pending.iteration]
                gradients = epoch.window.gradients(pending)
            assert pending.step is not None
            started = time.perf_counter()
            with self._state_lock:
                if self._epoch is not epoch:
                    continue  # re-seeded meanwhile: this iteration is part of the new state
                epoch.optimizer.apply(pending.step, gradients)
                differs = None
                if entry.fingerprint is not None:
                    mine = state_fingerprint(
                        epoch.optimizer.parameters.items(), epoch.optimizer.optimizer.state
                    )
                    differs = fingerprint_mismatches(entry.fingerprint, mine)
                self._applied = pending.iteration
                self._optimizer_step = entry.optimizer_step
                if entry.sets_position:
                    self._data_position = entry.data_position
                if entry.job_state is not None:
                    self._job_state = entry.job_state
                if not differs:  # a state that differs from rank 0's is never handed out
                    self._fulfil_captures_locked()
            elapsed = time.perf_counter() - started
            with self._lock:
                # Re-seeded meanwhile (rank 0's fresh state replaced this epoch): nothing of this
                # iteration is reported, certified or persisted.
                current = self._epoch is epoch
                if current:
                    epoch.window.advance()
                    self._commits.pop(pending.iteration, None)
                    if self._repairs is not None:
                        self._repairs.forget_before(pending.iteration + 1)
                    self._drain_stash()
                self._blocked = None
                self.stats.applied_iterations += 1
                self.stats.apply_seconds += elapsed
                self.stats.last_apply_seconds = elapsed
                self.stats.applied_elements += sum(p.numel() for p in epoch.optimizer.parameters.values())
                self.stats.last_commit_to_apply_seconds = time.monotonic() - entry.arrival
                report = None
                if current and differs:
                    report = self._diverge_locked(pending.iteration, differs)
                elif current and differs is not None:
                    self.stats.fingerprints_checked += 1
                    self._last_verified = pending.iteration
                self._lock.notify_all()
            if report is not None:
                self._report_divergence(report)
                continue  # neither certified nor persisted: rank 0 re-seeds this shadow
            if current and self._certify(pending.iteration, epoch):
                self._maybe_snapshot(epoch, pending.iteration)

    def _diverge_locked(self, iteration: int, differs: list[str]) -> dict[str, Any]:
        """The state after ``iteration`` differs from rank 0's: withdraw certification (lock held).

        Applying stops until rank 0 re-seeds this shadow (the apply loop takes no iteration while
        diverged), so one divergence is reported once, at the check that found it.
        """
        self.stats.fingerprints_checked += 1
        self.stats.divergences += 1
        report = {
            "iteration": iteration,
            "last_verified": self._last_verified,
            "mismatches": differs[:20],
            "mismatched_tensors": len(differs),
            "time": time.time(),
        }
        self._diverged = report
        self._last_divergence = report
        self._certified = min(self._certified, self._last_verified)
        return report

    def _report_divergence(self, report: dict[str, Any]) -> None:
        """Tell rank 0 (its log, ``agent.divergences``) and ask it for fresh state."""
        iteration, last, differs = report["iteration"], report["last_verified"], report["mismatches"]
        logger.error(
            "shadow %s: DIVERGED: after iteration %d its state differs from rank 0's fingerprint in %d "
            "tensors (%s); certification after iteration %d withdrawn; asking rank 0 for fresh state",
            self.name,
            iteration,
            report["mismatched_tensors"],
            ", ".join(differs[:5]),
            last,
        )
        conn = self._control_conn
        if conn is not None:
            self._send_control(Diverged(self._job_id(), self.name, iteration, last, differs))
            self._request_state(conn, f"state diverged from rank 0's after iteration {iteration}")

    def _certify(self, iteration: int, epoch: _Epoch | None = None, again: bool = False) -> bool:
        """Certify ``iteration`` to rank 0 if its state is known to match the workers'; True if it is.

        Known to match: while rank 0 sends fingerprints (every K-th iteration and the last one
        it waits for) only an iteration up to the last verified one (seeded by rank 0, or its
        fingerprint matched); a certificate covers every earlier iteration, so the iterations
        between two checks are certified by the later check. Without fingerprints (K = 0, GPU
        parameters) on trust, when applied. Once (unless ``again``: the state rank 0 re-seeded);
        never for a replaced ``epoch``.
        """
        with self._lock:
            if self._diverged is not None or (epoch is not None and self._epoch is not epoch):
                return False  # nothing is certified until rank 0 re-seeds this shadow
            job = self._job
            if job is not None and job.fingerprint_every > 0 and iteration > self._last_verified:
                return False  # certified when a check at or after it matches
            if iteration < self._certified or (iteration == self._certified and not again):
                return iteration <= self._certified
            self._certified = iteration
        if self._send_control(Certified(self._job_id(), self.name, iteration)):
            with self._lock:
                self.stats.certified_sent += 1
        return True

    # ---- snapshots ----------------------------------------------------------------------
    def _maybe_snapshot(self, epoch: _Epoch, iteration: int) -> None:
        if self.snapshotter is None or self._job is None or self._diverged is not None:
            return
        policy = self.snapshotter.policy
        by_count = policy.every_iterations > 0 and (iteration + 1) % policy.every_iterations == 0
        since = time.monotonic() - self._last_snapshot_time
        by_time = policy.every_seconds > 0 and since >= policy.every_seconds
        if not (by_count or by_time):
            return
        job = self._job
        if self.snapshotter.offer(iteration, lambda: self._capture_snapshot(job, epoch, iteration)):
            self._last_snapshot_time = time.monotonic()

    def snapshot_now(self, timeout: float = 30.0) -> int | None:
        """Write a snapshot of the current state and wait for it; the step written, or None."""
        if self.snapshotter is None or not self.snapshotter.flush(timeout):
            return None
        with self._state_lock:
            epoch, job, iteration = self._epoch, self._job, self._applied
        if epoch is None or job is None or iteration < 0:
            return None
        if not self.snapshotter.offer(
            iteration, lambda: self._capture_snapshot(job, epoch, iteration), force=True
        ):
            return None
        return iteration if self.snapshotter.flush(timeout) else None

    def _capture_snapshot(self, job: _Job, epoch: _Epoch, iteration: int) -> Snapshot:
        with self._state_lock:
            named = list(epoch.optimizer.parameters.items())
            states = fmt.capture_states(named, epoch.optimizer.optimizer)
            for name, tensor in epoch.static.items():
                states[name] = {fmt.PARAM_STATE: tensor.clone()}
            groups = self._groups_now(job, epoch)
            position = self._data_position
            job_state = self._job_state
        parameters = {p.name: (list(p.shape), str(torch_dtype(p.dtype))) for p in job.parameters}
        return Snapshot(
            step=iteration,
            shard=job.shard_index,
            num_shards=job.num_shards,
            states=states,
            parameters=parameters,
            optimizer={**OptimizerSpec.from_json(job.optimizer).class_fields(), "param_groups": groups},
            extra={
                "job_id": job.job_id,
                "iteration": iteration,
                "optimizer_step": self._optimizer_step,
                "data_position": position,
                "shards": self._shard_owners(job),
                **(job.spec.tp_fields() if job.spec is not None else {}),  # which TP shard (a TP x DP lane)
            },
            job_state=job_state,
        )

    def _shard_owners(self, job: _Job) -> dict[str, str]:
        """Shard file stem -> shadow name, so a restarted shadow finds its own shard."""
        owners = sorted(set(job.spec.shard_to_shadow.values())) if job.spec is not None else [self.name]
        return {fmt.shard_stem(i, len(owners)): name for i, name in enumerate(owners)}

    @staticmethod
    def _groups_now(job: _Job, epoch: _Epoch) -> list[dict[str, Any]]:
        """Param groups with the hyperparameters now in force and every parameter's name."""
        groups = []
        for spec_group, live in zip(
            job.optimizer["param_groups"], epoch.optimizer.optimizer.param_groups, strict=True
        ):
            group = {k: (list(v) if isinstance(v, tuple) else v) for k, v in live.items() if k != "params"}
            group["params"] = list(spec_group["params"])
            groups.append(group)
        return groups

    def _resume(self, root: Path) -> None:
        """Load this shadow's shard of the latest complete snapshot (served until rank 0 re-seeds)."""
        steps = fmt.complete_steps(root)
        for step in reversed(steps):
            directory = fmt.step_dir(root, step)
            global_state = json.loads((directory / "global.json").read_text())
            extra = global_state.get("extra", {})
            for manifest_path in sorted(directory.glob("shard-*-of-*.json")):
                if extra.get("shards", {}).get(manifest_path.stem) != self.name:
                    continue
                manifest = json.loads(manifest_path.read_text())
                tensors = load_file(str(directory / manifest["file"]))
                start = self._job_start_from_snapshot(global_state, manifest, tensors, extra, step)
                try:
                    attach_job_state(start, fmt.read_job_state(directory, global_state))
                except fmt.CheckpointError as exc:
                    logger.error("shadow %s: step %d's job state is unusable: %s", self.name, step, exc)
                self._load_resumed(start, manifest, step)
                return
        logger.info("shadow %s: no snapshot of its own to resume from in %s", self.name, root)

    def _job_start_from_snapshot(
        self,
        global_state: dict[str, Any],
        manifest: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        extra: dict[str, Any],
        step: int,
    ) -> JobStart:
        flat: dict[str, torch.Tensor] = {}
        for entry in manifest["entries"]:
            key = "param" if entry["state"] == fmt.PARAM_STATE else "state"
            shape = global_state["parameters"][entry["name"]]["shape"]
            value = tensors[entry["key"]]
            if key == "param":
                flat[f"param/{entry['name']}"] = value.reshape(shape)
            else:
                flat[f"state/{entry['name']}/{entry['state']}"] = value
        parameters = [
            ParamSpec(n, tuple(m["shape"]), m["dtype"].removeprefix("torch."))
            for n, m in global_state["parameters"].items()
        ]
        return JobStart(
            job_id=int(extra.get("job_id", 0)),
            world_size=0,
            workers=[],
            parameters=parameters,
            optimizer=global_state["optimizer"],
            start_iteration=step + 1,
            tensors=flat,
            extra=dict(extra),
        )

    def _load_resumed(self, start: JobStart, manifest: dict[str, Any], step: int) -> None:
        owned = {k[len("param/") :] for k in start.tensors if k.startswith("param/")}
        optimizer = self._make_optimizer(start.optimizer, start, owned)
        job = _Job(
            job_id=start.job_id,
            world_size=0,
            workers=[],
            parameters=start.parameters,
            optimizer=start.optimizer,
            shard_keys=set(),
            shard_index=manifest["shard"],
            num_shards=manifest["num_shards"],
            spec=None,
        )
        self._generation += 1
        window = IterationWindow(job.job_id, {}, set(), step + 1, horizon=self.config.horizon)
        self._epoch = _Epoch(self._generation, step + 1, {}, set(), window, optimizer, {}, step)
        self._job = job
        self._applied = step
        self._certified = step
        self._last_verified = step  # a snapshot is written of a certified state only
        self._optimizer_step = int(start.extra.get("optimizer_step", 0))
        saved = start.extra.get("data_position")
        self._data_position = None if saved is None else self._checked_position(saved, step)
        self._job_state = job_state_of(start)
        self._restored_from = step
        self._blocked = "resumed from a snapshot: waiting for rank 0's state to rejoin the job"
        logger.info(
            "shadow %s: resumed from its snapshot of step %d (%d parameters)",
            self.name,
            step,
            len(owned),
        )

    # ---- restore service ----------------------------------------------------------------
    def _restore(self, request: RestoreRequest) -> JobStart | RestoreRefused:
        job_id = self._job_id()
        if request.job_id and job_id and request.job_id != job_id:
            why = f"this shadow serves job {job_id}"
            return RestoreRefused(request.job_id, self.name, self._applied, why)
        capture = _Capture(request.iteration if request.iteration is not None else -1)
        with self._state_lock:
            if self._epoch is None:
                return RestoreRefused(job_id, self.name, self._applied, "no state yet")
            if self._diverged is not None:
                at = self._diverged["iteration"]
                why = f"state diverged from the workers' after iteration {at}; waiting to be re-seeded"
                return RestoreRefused(job_id, self.name, self._applied, why)
            target = self._applied if request.iteration is None else request.iteration
            if target == self._applied:
                return self._capture_state()
            if target < self._applied:
                return RestoreRefused(
                    job_id, self.name, self._applied, f"ahead: state after iteration {self._applied}"
                )
            capture.iteration = target
            self._captures.setdefault(target, []).append(capture)
        if capture.done.wait(max(0.0, min(request.wait, 600.0))) and capture.result is not None:
            return capture.result
        with self._state_lock:
            waiting = self._captures.get(target, [])
            if capture in waiting:
                waiting.remove(capture)
        if capture.result is not None:
            return capture.result
        return RestoreRefused(
            job_id, self.name, self._applied, f"did not reach iteration {target} within {request.wait}s"
        )

    def _fulfil_captures_locked(self) -> None:
        """Serve restore requests waiting for the state just reached (state lock held)."""
        for target in [t for t in self._captures if t <= self._applied]:
            waiting = self._captures.pop(target)
            same = target == self._applied and self._diverged is None
            result = self._capture_state() if same else None
            for capture in waiting:
                capture.result = result
                capture.done.set()

    def _capture_state(self) -> JobStart:
        """This shard's state after ``self._applied`` (state lock held)."""
        epoch, job = self._epoch, self._job
        assert epoch is not None and job is not None
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for name, parameter in epoch.optimizer.parameters.items():
            tensors[f"param/{name}"] = parameter.detach().clone()
            for key, value in epoch.optimizer.optimizer_state(name).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"state/{name}/{key}"] = value.detach().clone()
                else:
                    scalars.setdefault(name, {})[key] = value
        for name, tensor in epoch.static.items():
            tensors[f"param/{name}"] = tensor.clone()
        answer = JobStart(
            job_id=job.job_id,
            world_size=job.world_size,
            workers=list(job.workers),
            parameters=list(job.parameters),
            optimizer={
                **OptimizerSpec.from_json(job.optimizer).class_fields(),
                "param_groups": self._groups_now(job, epoch),
            },
            start_iteration=self._applied + 1,
            tensors=tensors,
            optimizer_scalars=scalars,
            job=job.spec.to_json() if job.spec is not None else None,
            extra={
                "shadow": self.name,
                "iteration": self._applied,
                "optimizer_step": self._optimizer_step,
                "data_position": self._data_position,
                "shard_keys": sorted(job.shard_keys),
            },
        )
        return attach_job_state(answer, self._job_state)

    # ---- maintenance: repairs and the status file ---------------------------------------
    def _maintenance_loop(self) -> None:
        next_status = time.monotonic()
        while not self._stop.wait(0.005):
            now = time.monotonic()
            sends: list[tuple[Addr, CheckmateHeader, bytes]] = []
            resync: str | None = None
            with self._lock:
                resync = self._plan_repairs(now, sends)
            for addr, header, payload in sends:
                try:
                    datagram = header.pack() + payload
                    tag = self._datagram_keys.for_job(header.job_id).tag((datagram,))
                    self._udp.sendto(datagram + tag, addr)
                except OSError as exc:
                    logger.debug("repair request to %s failed: %s", addr, exc)
            if resync is not None and self.config.resync_on_unrepairable:
                conn = self._control_conn
                if conn is not None:
                    self._request_state(conn, resync)
            if now >= next_status:
                next_status = now + 1.0
                self._write_status()

    def _plan_repairs(self, now: float, sends: list[tuple[Addr, CheckmateHeader, bytes]]) -> str | None:
        epoch, job, repairs = self._epoch, self._job, self._repairs
        if epoch is None or job is None or repairs is None or not job.workers or self._diverged is not None:
            return None  # diverged: nothing is applied until rank 0 re-seeds, so nothing to repair
        window = epoch.window
        nxt = window.next_iteration
        for iteration in range(nxt, min(epoch.confirmed_through, nxt + window.horizon - 1) + 1):
            entry = self._commits.get(iteration)
            if entry is None or now - entry.arrival < self.config.repair.grace:
                continue
            pending = window.pending.get(iteration)
            if pending is None:
                window.commit(entry.record)
                pending = window.pending[iteration]
            for bucket_id, gaps in pending.missing().items():
                plan = repairs.due(iteration, bucket_id, gaps, now)
                if plan is None:
                    continue
                worker, request_id, ranges = plan
                header, payload = request_datagram(
                    job.job_id,
                    iteration,
                    bucket_id,
                    ranges,
                    request_id,
                    sender_rank=min(job.shard_index, 0xFFFF),
                    shard_key=epoch.layout[bucket_id].shard_key,
                )
                sends.append((job.workers[worker], header, payload))
        failure = repairs.failure(nxt)
        if failure is not None:
            blocked = f"not certified: {failure}"
            if self._blocked != blocked:
                self._blocked = blocked
                return failure
            return None
        if nxt in self._commits:
            waited = now - self._commits[nxt].arrival
            if waited > 1.0 and window.pending.get(nxt) is not None and not window.pending[nxt].complete:
                self._blocked = f"iteration {nxt}: owned buckets incomplete {waited:.1f}s after its commit"
        elif self._stash.get(nxt):
            waited = now - self._stash[nxt][0][1]
            if waited > 1.0:
                self._blocked = f"iteration {nxt}: no commit record {waited:.1f}s after its first copy"
        return None

    def _write_status(self) -> None:
        path = self.config.status_file
        if path is None and self.config.snapshots is not None:
            path = self.config.snapshots.directory / f"status-{self.name}.json"
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write_text(path, json.dumps(self.status(), indent=1, sort_keys=True) + "\n")
        except OSError as exc:
            logger.warning("shadow %s: cannot write status file %s: %s", self.name, path, exc)


def serve(config: ShadowConfig, until: Callable[[], bool] | None = None) -> None:
    """Run a shadow until ``until()`` is true (default: forever, i.e. until interrupted)."""
    node = ShadowNode(config).start()
    try:
        while until is None or not until():
            time.sleep(0.5)
    finally:
        node.close()
