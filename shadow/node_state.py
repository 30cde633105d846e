"""The shadow node's configuration, the records its components hand each other, and two helpers.

Records: :class:`Job` (what rank 0's job_start said), :class:`Epoch` (a bucket layout and
the optimizer seeded for it: the control server builds it, the receiver fills its window,
the state service steps its optimizer), :class:`CommitEntry`, :class:`Capture`.
:class:`Drops` counts what any component throws away (its own lock).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from checkmate.admission import ControlLimits
from checkmate.control import BucketSpec, JobStart, ParamSpec, validate_data_position
from checkmate.job import JobSpec
from checkmate.job_state import JobState
from checkmate.network import Addr
from checkmate.wire import CHECKMATE_UDP_PORT
from shadow.adam_apply import default_threads
from shadow.iteration_window import IterationWindow
from shadow.optimizer_apply import OptimizerSpec, ShadowOptimizer, StepRecord
from shadow.repair import RepairPolicy
from shadow.snapshots import SnapshotPolicy

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
    begin_job`), so they are placed again under the layout that holds."""


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


class Drops:
    """What a shadow threw away, by reason: counted by every component (its own lock, taken last)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def add(self, reason: str) -> str:
        """Count one drop of ``reason``; returns ``reason`` (so a handler can return it)."""
        with self._lock:
            self._counts[reason] += 1
        return reason

    def count(self, reason: str) -> int:
        with self._lock:
            return self._counts[reason]

    def snapshot(self) -> dict[str, int]:
        """Every reason counted so far, sorted by name."""
        with self._lock:
            return dict(sorted(self._counts.items()))


def checked_position(name: str, drops: Drops, position: Any, iteration: int) -> Any:
    """``position`` validated, or None (logged, counted as the drop ``bad_data_position``) if refused."""
    try:
        return validate_data_position(position)
    except ValueError as exc:
        drops.add("bad_data_position")
        refused = drops.count("bad_data_position")
        (logger.error if refused == 1 else logger.debug)(
            "shadow %s: data position of iteration %d refused (%d so far; its position is unknown): %s",
            name,
            iteration,
            refused,
            exc,
        )
        return None


def make_optimizer(
    spec_json: Mapping[str, Any], start: JobStart, owned: set[str], threads: int = 1
) -> ShadowOptimizer:
    """The optimizer of the ``owned`` parameters, seeded with ``start``'s tensors and optimizer state."""
    initial = {
        key[len("param/") :]: tensor for key, tensor in start.tensors.items() if key.startswith("param/")
    }
    spec = OptimizerSpec.from_json(spec_json)
    optimizer = ShadowOptimizer(initial, spec, owned, threads)
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


class ComponentThread:
    """A component's one daemon thread, named ``shadow-<name>-<role>``: started once, joined at close."""

    def __init__(self, shadow: str, role: str, target: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=target, name=f"shadow-{shadow}-{role}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for it to end (nothing to wait for if it never started)."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
