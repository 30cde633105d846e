"""The shadow node's configuration, its records (job, epoch, commit, capture), counters and shared state."""

from __future__ import annotations

import collections
import logging
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from checkmate.admission import ControlLimits
from checkmate.auth import DatagramKeys
from checkmate.control import BucketSpec, JobStart, Message, ParamSpec, RestoreRefused, RestoreRequest
from checkmate.control_frame import ControlAuth
from checkmate.job import JobSpec
from checkmate.job_state import JobState
from checkmate.network import Addr
from checkmate.wire import CHECKMATE_UDP_PORT
from shadow.adam_apply import default_threads
from shadow.gradient_check import GradientCheck
from shadow.iteration_window import IterationWindow
from shadow.optimizer_apply import ShadowOptimizer, StepRecord
from shadow.repair import RepairPolicy, RepairTracker
from shadow.snapshots import SnapshotPolicy, Snapshotter

logger = logging.getLogger(__name__)


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
    control_limits: ControlLimits = field(default_factory=ControlLimits)
    """Control connections: authentication deadline, caps per source and in all (checkmate.admission)."""
    recv_buffer_bytes: int = 64 << 20
    secret: bytes | None = None
    """The job secret (None: this process's, :func:`checkmate.auth.secret_from_env`; none -> error)."""
    apply_threads: int | None = None
    """Threads that step Adam/AdamW shards of at least 2M parameters (:mod:`shadow.adam_apply`, bit
    for bit as one thread); None: as many as this process's cores (``os.sched_getaffinity``), 1: off."""

    def threads(self) -> int:
        """:attr:`apply_threads`, or this process's cores."""
        return self.apply_threads if self.apply_threads is not None else default_threads()


@dataclass
class Epoch:
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
    unconfirmed: dict[int, list[Unconfirmed]] = field(default_factory=dict)
    """Copies placed before their iteration's commit confirmed this layout, per iteration: a
    layout change turns them back into stashed datagrams (:meth:`~shadow.node_receive.Receiver.
    _restash_unconfirmed`), so they are placed again under the layout that holds."""


class Unconfirmed(NamedTuple):
    """A copy placed ahead of its commit: enough to rebuild the datagram from the bucket."""

    head: bytes
    """Its header as it arrived (the wire's 32 bytes)."""
    bucket_id: int
    element_offset: int
    element_count: int
    arrival: float
    source: Addr


@dataclass
class Job:
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
    worker_hosts: frozenset[str] = field(init=False)
    """The workers' host addresses (copies and repair answers come only from them)."""

    def __post_init__(self) -> None:
        self.worker_hosts = frozenset(host for host, _ in self.workers)


class CommitEntry(NamedTuple):
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
    gradient_digests: dict[str, Any] | None = None
    """Rank 0's tags of the reduced buckets (shadow.gradient_check; None: an older rank 0)."""


@dataclass
class Capture:
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


class NodeState:
    """What every part of a :class:`~shadow.node.ShadowNode` shares: set up in its ``__init__``.

    Each part (receive, control, apply, state service, maintenance) is a class over this
    state; :class:`~shadow.node.ShadowNode` assembles them. Methods one part calls on
    another are declared here for the type checker only.
    """

    config: ShadowConfig
    name: str
    stats: NodeStats
    snapshotter: Snapshotter | None
    data_address: Addr
    control_address: Addr
    _control_auth: ControlAuth
    _datagram_keys: DatagramKeys
    _gradient_check: GradientCheck
    _lock: threading.Condition
    """Guards job, epoch, stash, commits, repairs, certification; notified on any progress."""
    _state_lock: threading.Lock
    """Held while the optimizer state changes or is captured (taken after ``_lock`` if both)."""
    _control_send: threading.Lock
    """Held while writing one message on a control connection."""
    _stop: threading.Event
    _wake: threading.Event
    """Wakes the maintenance thread (a commit arrived, or the node closes)."""
    _job: Job | None
    _epoch: Epoch | None
    _generation: int
    _pending_start: JobStart | None
    _stash: dict[int, list[tuple[bytearray, float, Addr]]]
    _stash_bytes: int
    _commits: dict[int, CommitEntry]
    _latest_commit: int
    _latest_seen: int
    _applied: int
    _optimizer_step: int
    _data_position: Any
    """The workers' data position after ``_applied`` (None: unknown)."""
    _job_state: JobState | None
    """The job state after ``_applied`` (buffers, stateful objects; None: none sent)."""
    _bad_positions: int
    _certified: int
    _last_verified: int
    """The last iteration whose state matched rank 0's fingerprint (or was seeded by rank 0)."""
    _diverged: dict[str, Any] | None
    """Set when the state differed from rank 0's fingerprint, until rank 0 re-seeds this shadow."""
    _last_divergence: dict[str, Any] | None
    _retiring: set[socket.socket]
    """Control connections this shadow said goodbye on: read and discarded until rank 0 closes."""
    _blocked: str | None
    _captures: dict[int, list[Capture]]
    _repairs: RepairTracker | None
    _restored_from: int | None
    _control_conn: socket.socket | None
    _job_conn: socket.socket | None
    """The control connection the current job_start came on."""
    _started: float
    _last_snapshot_time: float
    _udp: socket.socket
    _tcp: socket.socket

    def _job_id(self) -> int:
        return self._job.job_id if self._job is not None else (self.config.job_id or 0)

    def _drop(self, reason: str) -> str:
        self.stats.drops[reason] += 1
        return reason

    if TYPE_CHECKING:  # implemented by the parts (shadow.node_*), called across them

        def status(self) -> dict[str, Any]: ...
        def _drain_stash(self) -> None: ...
        def _restash_unconfirmed(self) -> None: ...
        def _forget_unconfirmed(self, epoch: Epoch) -> None: ...
        def _send_control(self, message: Message) -> bool: ...
        def _request_state(self, conn: socket.socket, why: str) -> bool: ...
        def _checked_position(self, position: Any, iteration: int) -> Any: ...
        @staticmethod
        def _make_optimizer(
            spec_json: Mapping[str, Any], start: JobStart, owned: set[str], threads: int = 1
        ) -> ShadowOptimizer: ...
        def _certify(self, iteration: int, epoch: Epoch | None = None, again: bool = False) -> bool: ...
        @staticmethod
        def _groups_now(job: Job, epoch: Epoch) -> list[dict[str, Any]]: ...
        def _resume(self, root: Path) -> None: ...
        def _restore(self, request: RestoreRequest) -> JobStart | RestoreRefused: ...
        def _fulfil_captures_locked(self) -> None: ...
        def _write_status(self) -> None: ...
