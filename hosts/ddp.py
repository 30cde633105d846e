"""PyTorch DDP integration: one added line puts a job's gradients on Checkmate's transport.

An ordinary DDP script (``torchrun`` + ``init_process_group("gloo")`` +
``DistributedDataParallel``) adds, after building the model and optimizer::

    hosts.enable_checkmate(ddp_model, optimizer)

which

* reads its configuration (:meth:`CheckmateConfig.from_env`): ``RANK``,
  ``WORLD_SIZE`` from torchrun, plus ``CHECKMATE_*`` variables or a job file;
* uses the default process group only for rendezvous (every rank's data
  address and the job id are exchanged with ``all_gather_object``);
* starts this rank's :class:`~hosts.transport.Transport` and
  :class:`~hosts.ring_allreduce.RingAllReduce` and registers a DDP
  communication hook that all-reduces every gradient bucket over them
  (average, like DDP's default hook), tagging the reduced chunks for the
  shadows. CPU buckets are reduced in place of DDP's; CUDA buckets are
  copied through host memory and the result copied back;
* registers an optimizer step post-hook that, on rank 0, sends the shadows
  the iteration's commit record (learning rates, clipping coefficient, skip
  flag, and the data position the script set with
  :meth:`CheckmateAgent.set_data_position`) over the control channel, after
  the initial state;
* refuses (raising :class:`~checkmate.optimizers.OptimizerReplayError`) an
  optimizer the shadows cannot replay, and pins its implementation (``foreach``
  explicit in every param group) so both sides run the same kernels;
* records every multiplication of the gradients between the all-reduce and the
  step: ``clip_grad_norm_``'s clamped coefficient (however it was imported: the
  recording sits in torch's helper) and ``GradScaler``'s inverse scale, in
  order, plus the parameters whose ``grad`` is None at the step; all go into
  the commit record, and the shadows do the same;
* on rank 0, sends a fingerprint of its state with every K-th commit
  (``CHECKMATE_FINGERPRINT_EVERY``): a shadow that differs reports it
  (:attr:`CheckmateAgent.divergences`, an error in this log) and is re-seeded;
* raises :class:`CheckmateStateError` at ``optimizer.step()`` (before it changes
  anything) for a closure, a param group added or a model parameter replaced
  after enable.

Iterations are numbered by all-reduce rounds from 0: every backward pass that
reduces gradients is one iteration (``no_sync`` micro-batches are not). An
all-reduced iteration not followed by an optimizer step (a GradScaler skip)
is committed with ``skip_step=True`` when the next one starts.
"""

from __future__ import annotations

import atexit
import dataclasses
import ipaddress
import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from checkmate.control import (
    DEFAULT_CONTROL_PORT,
    BucketLayout,
    BucketSpec,
    Commit,
    JobStart,
    Message,
    ParamSlice,
    ParamSpec,
    attach_job_state,
    dtype_name,
    validate_data_position,
)
from checkmate.fingerprint import fingerprint as state_fingerprint
from checkmate.job import JobSpec
from checkmate.job_state import JobState, JobStateError
from checkmate.job_state import capture as capture_job_state
from checkmate.job_state import merge as merge_job_states
from checkmate.metrics import parse_metrics_port
from checkmate.optimizers import check_replayable, describe, non_elementwise_state, pin_implementation
from checkmate.wire import CHECKMATE_UDP_PORT
from hosts.control_channel import ControlChannel, ControlConfig
from hosts.faults import FaultConfig
from hosts.metrics import start_agent_metrics
from hosts.ring_allreduce import ReduceOp, RingAllReduce, RingConfig
from hosts.transport import Addr, Transport, TransportConfig, resolve

logger = logging.getLogger(__name__)


class CheckmateConfigError(ValueError):
    """The environment or job file does not describe a usable Checkmate job."""


@dataclass(frozen=True)
class CheckmateConfig:
    """What one rank needs; :meth:`from_env` builds it from torchrun's and CHECKMATE_* variables."""

    job_id: int
    rank: int
    world_size: int
    bind: Addr
    """This rank's data address (UDP)."""
    workers: tuple[Addr, ...] | None = None
    """Data addresses in ring order; None: gathered from every rank's ``bind``, in rank order."""
    job: JobSpec | None = None
    shadow_control: Mapping[str, Addr] = field(default_factory=dict)
    """Shadow name -> control-channel TCP address (used by rank 0 only)."""
    timeout: float = 300.0
    peer_timeout: float = 30.0
    keep_iterations: int = 4
    shadow_connect_timeout: float = 2.0
    faults: FaultConfig = field(default_factory=FaultConfig)
    replication: str = "switch"
    """Who copies the reduced chunks to the shadows (``CHECKMATE_REPLICATION``): ``"switch"``
    (the tagged packets, REPLICATE set) or ``"host"`` (no switch: the chunk's owner sends an
    untagged copy to the shadow itself, :meth:`shadow_data_address`; for comparison)."""
    start_iteration: int = 0
    """The job's number for the first all-reduce of this process: 0 for a new job, ``t`` for a
    job resumed from a checkpoint of iteration ``t - 1`` (the shadows' snapshots and certificates
    are named by the job's iteration numbers, so a restart must keep them)."""
    optimizer_step: int = 0
    """Optimizer steps taken before ``start_iteration`` (the restored state's step count)."""
    job_file: str | None = None
    """The ``CHECKMATE_JOB_FILE`` this came from. Rank 0 re-reads it when it changes and follows a
    new shard map (``checkmate-ctl shadow move``): links to shadows that left close, links to new
    ones open and get the current state. A change of job id or workers needs a restart."""
    compress: str | None = None
    """All-reduce fp32 buckets in ``"bf16"`` or ``"fp16"`` (``CHECKMATE_COMPRESS``), like DDP's
    ``bf16_compress_hook``/``fp16_compress_hook`` (which cannot be combined with Checkmate's hook:
    it is the all-reduce). The shadows get the compressed result and widen it exactly as the
    workers do. None: buckets travel in their own dtype."""
    fingerprint_every: int | None = None
    """Rank 0 sends a fingerprint of its state (:mod:`checkmate.fingerprint`) with every K-th
    commit (``CHECKMATE_FINGERPRINT_EVERY``; 0: never); a shadow whose state differs says so
    within K iterations, withdraws its certification and is re-seeded. None: 1 when every
    parameter is on the CPU, 0 otherwise (CPU replay is not bit-identical to GPU kernels)."""
    metrics_port: int | None = None
    """Rank 0 serves Prometheus metrics on this TCP port (``CHECKMATE_METRICS_PORT``;
    hosts/metrics.py, docs/metrics.md). A port in use is logged; training goes on without."""

    def __post_init__(self) -> None:
        if self.compress not in COMPRESSION:
            raise CheckmateConfigError(f"compress={self.compress!r}: expected 'bf16', 'fp16' or None")
        if self.fingerprint_every is not None and self.fingerprint_every < 0:
            raise CheckmateConfigError(f"fingerprint_every ({self.fingerprint_every}) must not be negative")
        if self.start_iteration < 0 or self.optimizer_step < 0:
            raise CheckmateConfigError(
                f"start_iteration ({self.start_iteration}) and optimizer_step ({self.optimizer_step}) "
                "must not be negative"
            )

    def shard_key_for_bucket(self, bucket_id: int) -> int:
        if self.job is not None:
            return self.job.shard_key_for_bucket(bucket_id)
        return bucket_id % max(1, len(self.shadow_control))

    def shadow_data_address(self, shard_key: int) -> Addr | None:
        """Where the shadow owning ``shard_key`` receives copies: its host, the job's shadow port."""
        if self.job is not None:
            name = self.job.shard_to_shadow.get(shard_key)
            port = self.job.shadow_port
        else:
            names = list(self.shadow_control)
            name = names[shard_key] if 0 <= shard_key < len(names) else None
            port = CHECKMATE_UDP_PORT
        control = self.shadow_control.get(name) if name is not None else None
        return (control[0], port) if control is not None else None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CheckmateConfig:
        """Read the configuration.

        ``RANK``/``WORLD_SIZE`` (torchrun; else the default process group),
        ``CHECKMATE_JOB_FILE`` (JSON: ``{"job": <JobSpec>, "worker_addresses":
        ["ip[:port]", ...] in ring order, "shadow_control": {"name":
        "ip[:port]"}}``), or: ``CHECKMATE_JOB_ID`` (default 1),
        ``CHECKMATE_BIND`` (``ip[:port]``; default ``127.0.0.(10+RANK)`` when
        ``MASTER_ADDR`` is a loopback address), ``CHECKMATE_SHADOWS``
        (``name=ip:port,...`` or ``ip:port,...``), ``CHECKMATE_TIMEOUT``,
        ``CHECKMATE_PEER_TIMEOUT``, ``CHECKMATE_START_ITERATION`` and
        ``CHECKMATE_OPTIMIZER_STEP`` (a resumed job; see :func:`enable_checkmate`),
        and for tests ``CHECKMATE_LOSS`` (a send drop fraction) with ``CHECKMATE_FAULT_SEED``.
        """
        env = os.environ if environ is None else environ
        try:
            rank = int(env["RANK"]) if "RANK" in env else dist.get_rank()
            world = int(env["WORLD_SIZE"]) if "WORLD_SIZE" in env else dist.get_world_size()
        except (ValueError, RuntimeError) as exc:
            raise CheckmateConfigError(f"cannot tell this process's rank: {exc}") from None
        job: JobSpec | None = None
        workers: tuple[Addr, ...] | None = None
        shadows: dict[str, Addr] = {}
        job_id = int(env.get("CHECKMATE_JOB_ID", "1"))
        job_file = env.get("CHECKMATE_JOB_FILE")
        if job_file is not None:
            job, workers, shadows = read_job_file(job_file)
            job_id = job.job_id
            if len(workers) != world:
                raise CheckmateConfigError(
                    f"{job_file} lists {len(workers)} workers but WORLD_SIZE is {world}"
                )
        for i, item in enumerate(filter(None, env.get("CHECKMATE_SHADOWS", "").split(","))):
            name, _, address = item.rpartition("=")
            shadows[name or f"shadow{i}"] = resolve(address, DEFAULT_CONTROL_PORT)
        if "CHECKMATE_BIND" in env:
            bind = resolve(env["CHECKMATE_BIND"])
        elif workers is not None:
            bind = workers[rank]
        else:
            master = env.get("MASTER_ADDR", "127.0.0.1")
            try:
                loopback = ipaddress.ip_address(resolve(master)[0]).is_loopback
            except (OSError, ValueError):
                loopback = False
            if not loopback:
                raise CheckmateConfigError(
                    "set CHECKMATE_BIND (this rank's data address) or CHECKMATE_JOB_FILE: "
                    f"MASTER_ADDR {master} is not a loopback address, so 127.0.0.(10+rank) will not do"
                )
            bind = (f"127.0.0.{10 + rank}", CHECKMATE_UDP_PORT)
        faults = FaultConfig(
            seed=int(env.get("CHECKMATE_FAULT_SEED", "0")) * 1000 + rank,
            send_drop=float(env.get("CHECKMATE_LOSS", "0")),
        )
        return cls(
            job_id=job_id,
            rank=rank,
            world_size=world,
            bind=bind,
            workers=workers,
            job=job,
            shadow_control=shadows,
            timeout=float(env.get("CHECKMATE_TIMEOUT", "300")),
            peer_timeout=float(env.get("CHECKMATE_PEER_TIMEOUT", "30")),
            faults=faults,
            replication=_replication_mode(env.get("CHECKMATE_REPLICATION", "switch")),
            start_iteration=_int_env(env, "CHECKMATE_START_ITERATION", 0),
            optimizer_step=_int_env(env, "CHECKMATE_OPTIMIZER_STEP", 0),
            job_file=job_file,
            fingerprint_every=(
                _int_env(env, "CHECKMATE_FINGERPRINT_EVERY", 0)
                if env.get("CHECKMATE_FINGERPRINT_EVERY")
                else None
            ),
            compress=env.get("CHECKMATE_COMPRESS") or None,
            metrics_port=_metrics_port_env(env),
        )


def _metrics_port_env(env: Mapping[str, str]) -> int | None:
    try:
        return parse_metrics_port(env.get("CHECKMATE_METRICS_PORT"), "CHECKMATE_METRICS_PORT")
    except ValueError as exc:
        raise CheckmateConfigError(str(exc)) from None


def read_job_file(path: str) -> tuple[JobSpec, tuple[Addr, ...], dict[str, Addr]]:
    """``CHECKMATE_JOB_FILE``: (job, worker data addresses in ring order, shadow control addresses).

    Raises CheckmateConfigError naming the file and the problem.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        job = JobSpec.from_json(data["job"])
        workers = tuple(resolve(a) for a in data.get("worker_addresses", list(job.workers)))
        shadows = {
            str(name): resolve(a, DEFAULT_CONTROL_PORT) for name, a in data.get("shadow_control", {}).items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckmateConfigError(f"cannot read CHECKMATE_JOB_FILE {path}: {exc}") from None
    return job, workers, shadows


REPLICATION_MODES = ("switch", "host")
COMPRESSION: dict[str | None, torch.dtype | None] = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def _fingerprint_every(configured: int | None, module: torch.nn.Module) -> int:
    """K: ``configured``, else 1 with every parameter on the CPU and 0 (off) otherwise.

    The shadows replay on CPU: bit for bit what CPU workers compute, not what GPU kernels
    do, so with GPU parameters every check would find a (last-bit) divergence.
    """
    if configured is not None:
        return configured
    devices = sorted({p.device.type for p in module.parameters()} - {"cpu"})
    if devices:
        logger.warning(
            "checkmate: parameters on %s: the shadows replay the step on CPU, which is not bit-identical "
            "to %s kernels, so the divergence check is off (set CHECKMATE_FINGERPRINT_EVERY to turn it on)",
            ", ".join(devices),
            ", ".join(devices),
        )
        return 0
    return 1


def _file_stamp(path: str | None) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of ``path``, or None: cheap enough to look at once per iteration."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _replication_mode(mode: str) -> str:
    if mode not in REPLICATION_MODES:
        raise CheckmateConfigError(f"CHECKMATE_REPLICATION={mode!r}: expected one of {REPLICATION_MODES}")
    return mode


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise CheckmateConfigError(f"{name}={text!r} is not an integer") from None


# ---- gradient transformations: clipping and GradScaler's unscaling -----------------------
# torch's clip_grad_norm_ looks its helper _clip_grads_with_norm_ up in its module's globals at
# each call, so replacing that helper sees every clip_grad_norm_ call however the script
# imported the function (``from torch.nn.utils import clip_grad_norm_`` before enable included).
# GradScaler.unscale_ (and step's implicit unscale) multiply the gradients through the class's
# _unscale_grads_, replaced at class level for every scaler instance. Both record the factor they
# multiplied by for the commit; the shadows repeat the multiplications in the same order.
_ORIGINAL_CLIP = torch.nn.utils.clip_grad.clip_grad_norm_
_ORIGINAL_CLIP_WITH_NORM = torch.nn.utils.clip_grad._clip_grads_with_norm_
_ORIGINAL_UNSCALE = torch.amp.grad_scaler.GradScaler._unscale_grads_
_AGENTS: list[CheckmateAgent] = []
_AGENTS_LOCK = threading.Lock()


def _live_agents() -> list[CheckmateAgent]:
    with _AGENTS_LOCK:
        return list(_AGENTS)


@torch.no_grad()
def _recording_clip_grads_with_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    """torch's ``_clip_grads_with_norm_``, recording the clamped coefficient it multiplied by."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    _ORIGINAL_CLIP_WITH_NORM(params, max_norm, total_norm, foreach)
    if any(p.grad is not None for p in params):
        coefficient = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)  # as torch computes it
        ids = frozenset(id(p) for p in params if p.grad is not None)
        for agent in _live_agents():
            agent._record_scaling("clip", coefficient, ids)


def _recording_unscale_grads_(
    scaler: torch.amp.GradScaler,
    optimizer: torch.optim.Optimizer,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    allow_fp16: bool,
) -> dict[torch.device, torch.Tensor]:
    """GradScaler's ``_unscale_grads_``, recording the inverse scale it multiplied the gradients by."""
    result = _ORIGINAL_UNSCALE(scaler, optimizer, inv_scale, found_inf, allow_fp16)
    if float(inv_scale) != 1.0:  # 1.0: the inf check without unscaling (x * 1 == x)
        for agent in _live_agents():
            if agent.optimizer is optimizer:
                agent._record_scaling("unscale", inv_scale, None)
    return result


def _install_patches() -> None:
    """Route clipping and unscaling through the recorders (lock held by the caller)."""
    torch.nn.utils.clip_grad._clip_grads_with_norm_ = _recording_clip_grads_with_norm_
    torch.nn.utils.clip_grads_with_norm_ = _recording_clip_grads_with_norm_
    torch.amp.grad_scaler.GradScaler._unscale_grads_ = _recording_unscale_grads_  # type: ignore[method-assign,assignment]


def _remove_patches() -> None:
    torch.nn.utils.clip_grad._clip_grads_with_norm_ = _ORIGINAL_CLIP_WITH_NORM
    torch.nn.utils.clip_grads_with_norm_ = _ORIGINAL_CLIP_WITH_NORM
    torch.amp.grad_scaler.GradScaler._unscale_grads_ = _ORIGINAL_UNSCALE  # type: ignore[method-assign]


class CheckmateStateError(RuntimeError):
    """The model or optimizer changed in a way the shadows cannot follow (raised where it happens)."""


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` itself (kept for scripts written against earlier versions).

    Since clipping is recorded inside torch's helper, ``torch.nn.utils.clip_grad_norm_``
    is recorded however it was imported; this name only calls it.
    """
    return _ORIGINAL_CLIP(parameters, max_norm, norm_type, error_if_nonfinite, foreach)


# ---- the job state's late part -----------------------------------------------------------
LATE_STATEFUL = (
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
    torch.amp.GradScaler,
)
"""Stateful objects a loop steps after ``optimizer.step()``: their state is taken at the next forward."""
_ORIGINAL_SCALER_UPDATE = torch.amp.grad_scaler.GradScaler.update


def _update_and_commit_skips(scaler: torch.amp.GradScaler, new_scale: Any = None) -> None:
    """GradScaler.update, then: an iteration all-reduced without an optimizer step was skipped."""
    _ORIGINAL_SCALER_UPDATE(scaler, new_scale)
    with _AGENTS_LOCK:
        agents = list(_AGENTS)
    for agent in agents:
        agent._after_scaler_update()


# ---- the agent --------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _hook(agent: CheckmateAgent, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return agent.on_bucket(bucket)


# DDP checks the hook's annotations against the real classes (not the postponed strings).
_hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


class CheckmateAgent:
    """One rank's host agent for a DDP model; made by :func:`enable_checkmate`."""

    def __init__(
        self,
        ddp_model: torch.nn.parallel.DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        config: CheckmateConfig,
        *,
        data_position: Any = None,
        stateful: Mapping[str, Any] | None = None,
    ) -> None:
        initial_position = None if data_position is None else validate_data_position(data_position)
        self.model = ddp_model
        self.optimizer = optimizer
        self.config = config
        self.rank = config.rank
        module = ddp_model.module
        # Fail fast, on every rank alike: what the shadows cannot replay is refused here.
        hooks = getattr(ddp_model, "_comm_hooks", None)
        if hooks:
            hook = getattr(hooks[0][0], "__name__", hooks[0][0])
            raise CheckmateConfigError(
                f"the DDP model already has a communication hook ({hook}): "
                "Checkmate's hook is the all-reduce, so it cannot be combined with another; for DDP's "
                "bf16/fp16 compression set CHECKMATE_COMPRESS=bf16 or fp16 (CheckmateConfig.compress) instead"
            )
        check_replayable(optimizer)
        pin_implementation(optimizer)
        self.stateful: dict[str, Any] = dict(stateful or {})
        """The job's Stateful objects by name; their state travels with every commit."""
        self._job_state: tuple[int, JobState] | None = None
        """(i, the job state before iteration i), captured at i's first forward pass."""
        try:  # fail fast, on every rank: an object whose state cannot travel is refused here
            self._job_state = (config.start_iteration, self._capture_job_state())
        except JobStateError as exc:
            raise CheckmateConfigError(str(exc)) from None
        self._pending_commit: Commit | None = None
        self._early: tuple[int, JobState] | None = None
        """(t, iteration t's early job state: buffers, stateful objects stepped before the step)."""
        self._sent_job_state: JobState | None = None
        """The job state last sent in a commit or job_start (a commit whose state equals it omits it)."""
        """Rank 0: the last step's commit, sent at the next forward pass (when the job state is final)."""
        self.names: dict[int, str] = {id(p): n for n, p in module.named_parameters()}
        self._param_ids = set(self.names)
        workers = self._rendezvous(config)
        self.workers = workers
        self.transport = Transport(
            TransportConfig(bind=config.bind, peer_timeout=config.peer_timeout, faults=config.faults)
        )
        self.ring = RingAllReduce(
            self.transport,
            RingConfig(
                job_id=config.job_id,
                rank=config.rank,
                workers=workers,
                shard_key_for_bucket=lambda bucket: self.config.shard_key_for_bucket(bucket),
                timeout=config.timeout,
                keep_iterations=config.keep_iterations,
                host_replica=(
                    (lambda key: self.config.shadow_data_address(key))
                    if _replication_mode(config.replication) == "host"
                    else None
                ),
            ),
        )
        self.iteration = config.start_iteration
        """The next all-reduce iteration."""
        self._bucket_layout: dict[int, BucketSpec] = {}
        self._layout_sent: list[BucketSpec] | None = None
        self._uncommitted: int | None = None
        self._scaling: list[tuple[str, float, torch.dtype, frozenset[int] | None]] = []
        """Gradient multiplications (unscale, clip) since the last commit, in order."""
        self._no_grad: list[str] = []
        """Rank 0: the optimizer's parameters without a gradient at this iteration's step."""
        self._state_checked = False
        self._fingerprint_every = _fingerprint_every(config.fingerprint_every, ddp_model.module)
        self._last_hyper: list[dict[str, Any]] = []
        self.optimizer_steps = config.optimizer_step
        self._data_position: Any = None
        """Set by :meth:`set_data_position` since the last commit (None: not set)."""
        self._committed_position: Any = initial_position
        """The data position after the last committed iteration (None: unknown)."""
        self.commits: list[Commit] = []
        """Commit records made on this rank (rank 0), for inspection."""
        self._job_file_stamp = _file_stamp(config.job_file)
        self.channel: ControlChannel | None = None
        if self.rank == 0 and config.shadow_control:
            self.channel = ControlChannel(
                config.job_id,
                config.shadow_control,
                ControlConfig(connect_timeout=config.shadow_connect_timeout),
            )
            up = self.channel.wait_connected(config.shadow_connect_timeout)
            logger.info("%d of %d shadows reachable at start", up, len(config.shadow_control))
            self.channel.post_state(lambda: [self._job_start(config.start_iteration)])
        self._metrics = (
            start_agent_metrics(self, config.job_id, self.rank, config.metrics_port)
            if self.rank == 0 and config.metrics_port is not None
            else None
        )
        if dist.is_initialized():
            dist.barrier()  # every rank's transport is up before the first gradient moves
        ddp_model.register_comm_hook(self, _hook)
        self._step_handle = optimizer.register_step_post_hook(self._after_step)
        self._structure = self._structure_now()
        self._pre_step_handle = optimizer.register_step_pre_hook(self._before_step)
        self._guard_add_param_group()
        self._forward_handle = ddp_model.register_forward_pre_hook(self._before_forward)
        atexit.register(self._flush_at_exit)  # a script that never calls close() still sends its last commit
        with _AGENTS_LOCK:
            _AGENTS.append(self)
            _install_patches()
            torch.amp.grad_scaler.GradScaler.update = _update_and_commit_skips  # type: ignore[method-assign,assignment]
        logger.info(
            "checkmate: job %d rank %d/%d on %s:%d, ring %s",
            config.job_id,
            config.rank,
            config.world_size,
            *config.bind,
            [f"{h}:{p}" for h, p in workers],
        )

    # ---- set-up ---------------------------------------------------------------------
    def _rendezvous(self, config: CheckmateConfig) -> tuple[Addr, ...]:
        mine = (config.job_id, config.bind)
        if dist.is_initialized():
            gathered: list[Any] = [None] * config.world_size
            dist.all_gather_object(gathered, mine)
        elif config.workers is not None:
            gathered = [(config.job_id, w) for w in config.workers]
        else:
            raise CheckmateConfigError("no process group to exchange addresses and no worker list")
        jobs = {g[0] for g in gathered}
        if len(jobs) != 1:
            raise CheckmateConfigError(f"ranks disagree on the job id: {sorted(jobs)}")
        if config.workers is not None:
            listed = [tuple(w) for w in config.workers]
            actual = [tuple(g[1]) for g in gathered]
            if listed != actual:
                raise CheckmateConfigError(f"ranks bind {actual} but the job lists {listed} in ring order")
            return tuple(config.workers)
        return tuple((str(g[1][0]), int(g[1][1])) for g in gathered)

    def _job_start(self, start_iteration: int) -> JobStart:
        module = self.model.module
        tensors: dict[str, torch.Tensor] = {}
        params = []
        for name, p in module.named_parameters():
            params.append(ParamSpec(name, tuple(p.shape), dtype_name(p.dtype)))
            tensors[f"param/{name}"] = p.detach().to("cpu", copy=True)
        state = self.optimizer.state_dict()
        index_to_name: dict[int, str] = {}
        groups = []
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            for p, index in zip(group["params"], saved["params"], strict=True):
                index_to_name[index] = self.names[id(p)]
            hyper = {k: _plain(v) for k, v in group.items() if k != "params"}
            hyper["params"] = [self.names[id(p)] for p in group["params"]]
            groups.append(hyper)
        scalars: dict[str, dict[str, Any]] = {}
        for index, per_param in state["state"].items():
            name = index_to_name[index]
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"state/{name}/{key}"] = value.detach().to("cpu", copy=True)
                else:
                    scalars.setdefault(name, {})[key] = value
        self._last_hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        start = JobStart(
            job_id=self.config.job_id,
            world_size=self.config.world_size,
            workers=list(self.workers),
            parameters=params,
            optimizer={**describe(self.optimizer), "param_groups": groups},
            start_iteration=start_iteration,
            tensors=tensors,
            optimizer_scalars=scalars,
            job=self._job_description(),
            extra={} if self._committed_position is None else {"data_position": self._committed_position},
        )
        self._sent_job_state = self._job_state_before(start_iteration)
        return attach_job_state(start, self._sent_job_state)

    # ---- the job state: buffers, stateful objects, param groups -----------------------
    # Two moments: at the optimizer step (or a GradScaler's skip) the iteration's *early* part
    # is final: persistent buffers (the forward passes are done) and the stateful objects a loop
    # advances before the step (data loaders, samplers, cursors, RNG wrappers). The *late* part -
    # LR schedulers and GradScalers, which step after the optimizer, and the param groups they
    # change - is final at the next forward pass (or wait_certified/close): the commit goes then.
    def _late(self, name: str) -> bool:
        return isinstance(self.stateful[name], LATE_STATEFUL)

    def _capture_job_state(self) -> JobState:
        return capture_job_state(self.model.module, self.stateful, self.optimizer)

    def _capture_early(self) -> JobState:
        early = {n: obj for n, obj in self.stateful.items() if not self._late(n)}
        return capture_job_state(self.model.module, early)

    def _job_state_before(self, iteration: int) -> JobState:
        """The job state before ``iteration``: iteration - 1's early part with the late part now."""
        if self._job_state is None or self._job_state[0] != iteration:
            early = self._early[1] if self._early is not None and self._early[0] == iteration - 1 else None
            late = {n: obj for n, obj in self.stateful.items() if self._late(n)}
            if early is None:
                state = self._capture_job_state()
            else:
                state = merge_job_states(early, capture_job_state(None, late, self.optimizer), self.stateful)
            self._job_state = (iteration, state)
        return self._job_state[1]

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: the previous iteration is over; send its commit with its job state.

        Only forward passes with gradients enabled count (not evaluation under
        ``torch.no_grad()``). An all-reduced iteration still waiting for its step has its
        early part taken here (a step skipped without a GradScaler is found only at the
        next all-reduce, when this forward pass has changed the buffers). Raises
        JobStateError naming a stateful object whose state cannot travel; nothing is
        sent then, and the shadows keep the last certified state.
        """
        if self.channel is None or not torch.is_grad_enabled():
            return
        if self._uncommitted is not None and (self._early is None or self._early[0] != self._uncommitted):
            self._early = (self._uncommitted, self._capture_early())
        self._flush_commit()
        self._seed_new_shadows()

    def _flush_at_exit(self) -> None:
        """At interpreter exit without :meth:`close`: send the last step's commit (best effort, 5 s)."""
        if self.channel is None or self._pending_commit is None:
            return
        try:
            self._flush_commit()
            self.channel.flush(5.0)
        except Exception as exc:  # noqa: BLE001 - exiting anyway; say why the last commit may be missing
            logger.warning("checkmate: could not send the last commit at exit: %s", exc)

    def _after_scaler_update(self) -> None:
        """A GradScaler's update(): an all-reduced iteration without an optimizer step was skipped."""
        if self._uncommitted is not None:
            self._commit(self._uncommitted, skipped=True)

    def _flush_commit(self) -> None:
        """Send the pending commit with the job state after its iteration, then state for new shadows."""
        commit, self._pending_commit = self._pending_commit, None
        if commit is None or self.channel is None:
            return
        state = self._job_state_before(commit.iteration + 1)
        if not state.equals(self._sent_job_state):  # unchanged: absent on the wire
            commit.job_state = self._sent_job_state = state
        self.channel.post(commit)
        self._seed_new_shadows()

    def _seed_new_shadows(self) -> None:
        """Links that need state (new or reconnected shadows) get the state before :attr:`iteration`."""
        if self.channel is not None and self.channel.needs_state():
            self.channel.post_state(lambda: self._state_messages(self.iteration))

    def _job_description(self) -> dict[str, Any] | None:
        """The JobSpec, or without one the implicit shard map: shard key k -> k-th shadow listed."""
        if self.config.job is not None:
            return self.config.job.to_json()
        if not self.config.shadow_control:
            return None
        names = list(self.config.shadow_control)
        return {
            "job_id": self.config.job_id,
            "workers": [f"{h}:{p}" for h, p in self.workers],
            "shadows": names,
            "shard_to_shadow": {str(k): name for k, name in enumerate(names)},
        }

    # ---- the communication hook -----------------------------------------------------
    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        index = bucket.index()
        wire = COMPRESSION[self.config.compress]
        reduced = buffer.to(wire) if wire is not None and buffer.dtype is torch.float32 else buffer
        if not self._bucket_layout and self._uncommitted is not None:
            self._commit(self._uncommitted, skipped=True, capture=False)
        offset = 0
        slices = []
        for p in bucket.parameters():
            slices.append(ParamSlice(self.names.get(id(p), f"<unnamed:{id(p)}>"), offset, p.numel()))
            offset += p.numel()
        self._bucket_layout[index] = BucketSpec(
            bucket_id=index,
            dtype=dtype_name(reduced.dtype),
            num_elements=buffer.numel(),
            shard_key=self.config.shard_key_for_bucket(index),
            params=tuple(slices),
        )
        future = self.ring.allreduce_async(self.iteration, index, reduced, ReduceOp.AVG)
        if bucket.is_last():
            self._end_of_iteration()
        # Always hand DDP a chained future: a failed all-reduce stores its exception as the
        # Python future's value, which DDP's C++ side would report as "Unable to cast ... to
        # Tensor"; raised inside a then() callback it becomes a proper error with our message.
        device = buffer.device

        def result(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            value = fut.value()  # raises the CollectiveError / PeerTimeoutError of a failed ring
            if reduced is not buffer:  # compressed: widened exactly as the shadows widen it
                return buffer.copy_(value.to(device))
            return value if device.type == "cpu" else value.to(device)  # CUDA: back from host memory

        return future.then(result)

    def _end_of_iteration(self) -> None:
        layout = [self._bucket_layout[i] for i in sorted(self._bucket_layout)]
        if layout != self._layout_sent:
            rebuilt = self._layout_sent is not None
            self._layout_sent = layout
            if self.channel is not None:
                if rebuilt:
                    # Buckets (and with them parameters) may move between shadows: re-seed every
                    # shadow with the state before this iteration's step, then the new layout
                    # (docs/protocol.md, "Bucket layout changes"). The parameters are untouched
                    # until this iteration's optimizer step, so this is exactly that state.
                    self.channel.post(self._job_start(self.iteration))
                self.channel.post(BucketLayout(self.config.job_id, self.iteration, layout))
        self._bucket_layout = {}
        self._uncommitted = self.iteration
        self.iteration += 1

    # ---- the optimizer step hooks ----------------------------------------------------
    def _record_scaling(self, by: str, factor: torch.Tensor, parameter_ids: frozenset[int] | None) -> None:
        """A multiplication of (some of) this job's gradients since the last commit, in order."""
        if parameter_ids is not None:
            parameter_ids = parameter_ids & self._param_ids
            if not parameter_ids:
                return
            if parameter_ids >= self._param_ids:
                parameter_ids = None
        self._scaling.append((by, float(factor.detach().to("cpu")), factor.dtype, parameter_ids))

    def _structure_now(self) -> tuple[Any, ...]:
        """What the shadows were told at enable: param groups' members, the model's parameters."""
        groups = tuple(tuple(id(p) for p in g["params"]) for g in self.optimizer.param_groups)
        params = tuple((n, id(p), tuple(p.shape), p.dtype) for n, p in self.model.module.named_parameters())
        return groups, params

    def _structure_error(self) -> str | None:
        groups, params = self._structure_now()
        old_groups, old_params = self._structure
        kind = type(self.optimizer).__name__
        if len(groups) != len(old_groups):
            return (
                f"{kind} now has {len(groups)} param groups, {len(old_groups)} when checkmate was enabled "
                "(add_param_group after enable_checkmate)"
            )
        for index, (now, before) in enumerate(zip(groups, old_groups, strict=True)):
            if now != before:
                return f"{kind} param group {index} holds other parameters than when checkmate was enabled"
        if params != old_params:
            before_map = {n: (i, s, d) for n, i, s, d in old_params}
            after_map = {n: (i, s, d) for n, i, s, d in params}
            for name in sorted(set(before_map) | set(after_map)):
                if name not in after_map:
                    return f"model parameter {name!r} is gone"
                if name not in before_map:
                    return f"model parameter {name!r} is new"
                if before_map[name] != after_map[name]:
                    (_, s0, d0), (_, s1, d1) = before_map[name], after_map[name]
                    return f"model parameter {name!r} was replaced ({list(s0)} {d0} -> {list(s1)} {d1})"
        return None

    def _guard_add_param_group(self) -> None:
        optimizer = self.optimizer

        def add_param_group(param_group: dict[str, Any]) -> None:
            raise CheckmateStateError(
                f"checkmate: {type(optimizer).__name__}.add_param_group after enable_checkmate: the shadows "
                "replay the param groups they were given at enable; add every group before enabling "
                "(the last certified checkpoint is intact)"
            )

        optimizer.add_param_group = add_param_group  # type: ignore[method-assign]

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step pre-hook: refuse what the shadows cannot follow; note parameters without a gradient."""
        # torch passes step's positional arguments with the optimizer itself first
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:
            raise CheckmateStateError(
                f"checkmate: {type(optimizer).__name__}.step was given a closure: the shadows cannot "
                "re-evaluate the loss; call step() without one (the last certified checkpoint is intact)"
            )
        problem = self._structure_error()
        if problem is not None:
            raise CheckmateStateError(
                f"checkmate: {problem}; the shadows cannot follow a changed model or optimizer mid-run: "
                "restart the job from its last certified checkpoint (which is intact)"
            )
        if self.rank == 0:
            self._no_grad = [
                self.names[id(p)]
                for g in optimizer.param_groups
                for p in g["params"]
                if p.grad is None and id(p) in self.names
            ]

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizer_steps += 1
        if not self._state_checked:  # the optimizer's state exists from its first step on
            self._state_checked = True
            problem = non_elementwise_state(optimizer)
            if problem is not None:
                raise CheckmateStateError(
                    f"checkmate: {problem}: Checkmate's checkpoint stores optimizer state element by "
                    "element, so this optimizer's state could not be restored; nothing after the initial "
                    "state is certified"
                )
        if self._uncommitted is None:
            return
        iteration = self._uncommitted
        self._commit(iteration, skipped=False)
        if self.rank == 0:
            self._follow_job_file()
        self.ring.release_through(iteration - self.config.keep_iterations)

    def _follow_job_file(self) -> None:
        """Rank 0, after each step: if the job file changed, follow its shadows (a live shadow move)."""
        path = self.config.job_file
        stamp = _file_stamp(path)
        if path is None or stamp is None or stamp == self._job_file_stamp:
            return
        self._job_file_stamp = stamp
        try:
            job, workers, shadows = read_job_file(path)
        except CheckmateConfigError as exc:
            logger.warning("checkmate: %s; keeping the current shadows", exc)
            return
        if job.job_id != self.config.job_id or workers != self.workers:
            logger.warning(
                "checkmate: %s now names job %d with workers %s; a new job or other workers need a "
                "restart: keeping job %d's shadows",
                path,
                job.job_id,
                [f"{h}:{p}" for h, p in workers],
                self.config.job_id,
            )
            return
        if job == self.config.job and shadows == dict(self.config.shadow_control):
            return
        self.config = dataclasses.replace(self.config, job=job, shadow_control=shadows)
        if self.channel is None:
            if shadows:
                self.channel = ControlChannel(
                    self.config.job_id,
                    shadows,
                    ControlConfig(connect_timeout=self.config.shadow_connect_timeout),
                )
                self.channel.wait_connected(self.config.shadow_connect_timeout)
        else:
            # The shadows leaving get the last step's commit now (its schedulers' state as it is);
            # the new ones get the state before the next iteration at its forward pass.
            pending, self._pending_commit = self._pending_commit, None
            if pending is not None:
                pending.job_state = self._job_state_before(pending.iteration + 1)
                self._sent_job_state = pending.job_state
                self._job_state = None  # taken early: the new shadows' state is taken again
                self.channel.post(pending)
            added, removed = self.channel.set_shadows(shadows)
            # Like at start: give new shadows a moment to connect, so they get this step's state.
            self.channel.wait_connected(self.config.shadow_connect_timeout, names=added)
            logger.info(
                "checkmate: %s changed: shadows now %s (new: %s, left: %s); new ones get the state "
                "after the next step",
                path,
                sorted(shadows),
                added or "none",
                removed or "none",
            )

    def _final_state_to_rejoining_shadows(self, channel: ControlChannel, timeout: float) -> None:
        """At close: a shadow whose link is down or waiting for state (it restarted) gets the final state.

        During training a restarted shadow is re-seeded after the next optimizer step;
        one that comes back during the last steps would otherwise end without the
        job's final state. Waits at most ``timeout`` for such a link to connect.
        """
        if all(link.connected and not link.needs_state for link in channel.links):
            return
        channel.wait_connected(timeout)
        if channel.post_state(lambda: self._state_messages(self.iteration)):
            logger.info(
                "checkmate: gave the final state (after iteration %d) to a rejoining shadow",
                self.iteration - 1,
            )
        missing = [link.name for link in channel.links if not link.connected]
        if missing:
            logger.warning(
                "checkmate: shadows %s unreachable at close: they do not hold the state after iteration %d",
                ", ".join(missing),
                self.iteration - 1,
            )

    def _state_messages(self, start_iteration: int) -> list[Message]:
        messages: list[Message] = [self._job_start(start_iteration)]
        if self._layout_sent is not None:
            messages.append(BucketLayout(self.config.job_id, start_iteration, self._layout_sent))
        return messages

    def _gradient_scaling(self) -> tuple[float | None, list[dict[str, Any]]]:
        """This iteration's gradient multiplications as (legacy clip_coefficient, gradient_scaling)."""
        records, self._scaling = self._scaling, []
        if not records:
            return None, []
        if (
            len(records) == 1
            and records[0][0] == "clip"
            and records[0][2] is torch.float32
            and records[0][3] is None
        ):
            return records[0][1], []  # the common case reads as before
        out = []
        for by, factor, dtype, ids in records:
            entry: dict[str, Any] = {"by": by, "factor": factor, "dtype": dtype_name(dtype)}
            if ids is not None:
                entry["params"] = sorted(self.names[i] for i in ids)
            out.append(entry)
        return None, out

    def _commit(self, iteration: int, skipped: bool, capture: bool = True) -> None:
        """Commit ``iteration``; ``capture``: its early job state is final now (else taken earlier)."""
        self._flush_commit()
        self._uncommitted = None
        if self.rank == 0 and self.channel is not None:
            if capture or self._early is None or self._early[0] != iteration:
                self._early = (iteration, self._capture_early())
        coefficient, scaling = self._gradient_scaling()
        no_grad, self._no_grad = self._no_grad, []
        position, self._data_position = self._data_position, None
        if position is not None:
            self._committed_position = position
        if self.rank != 0:
            return
        changed: list[dict[str, Any]] = []
        for i, group in enumerate(self.optimizer.param_groups):
            now = {k: _plain(v) for k, v in group.items() if k not in ("params", "lr")}
            before = self._last_hyper[i] if i < len(self._last_hyper) else {}
            changed.append({k: v for k, v in now.items() if before.get(k) != v})
            if i < len(self._last_hyper):
                self._last_hyper[i].update(now)
        commit = Commit(
            job_id=self.config.job_id,
            iteration=iteration,
            learning_rates=[float(_plain(g["lr"])) for g in self.optimizer.param_groups],
            clip_coefficient=None if skipped else coefficient,
            skip_step=skipped,
            hyperparameters=changed if any(changed) else [],
            optimizer_step=self.optimizer_steps,
            data_position=position,
            no_grad=[] if skipped else no_grad,
            gradient_scaling=[] if skipped else scaling,
            fingerprint=self._fingerprint(iteration),
        )
        self.commits.append(commit)
        if self.channel is not None:
            # Sent with the job state after the iteration at the next forward pass, wait_certified
            # or close, when the schedulers and scalers have stepped.
            self._pending_commit = commit

    def _fingerprint(self, iteration: int) -> dict[str, dict[str, Any]] | None:
        """Rank 0's state after ``iteration`` (every K-th iteration), for the shadows to compare."""
        every = self._fingerprint_every
        if self.channel is None or every <= 0 or (iteration + 1) % every:
            return None
        named = self.model.module.named_parameters()
        return state_fingerprint(named, self.optimizer.state)

    @property
    def divergences(self) -> list[dict[str, Any]]:
        """Rank 0: every divergence a shadow reported (iteration, shadow, tensors that differ)."""
        return list(self.channel.divergences) if self.channel is not None else []

    def set_data_position(self, position: Any) -> None:
        """Record where to resume reading data if iteration t is the last one restored.

        Call it in iteration t *before* ``optimizer.step()`` (a call after the step
        belongs to iteration t + 1) with the position after t: the data iteration
        t + 1 starts with, e.g. ``{"epoch": 2, "batch": 118}`` or a sampler's state
        dict. Rank 0 sends it with iteration t's commit record; the shadows keep it
        with the state after t, and a restore of that state returns it as
        ``data_position`` (also stored in their snapshots' ``extra``). For a step
        that was skipped (a loss-scaler skip) the value set when the next
        iteration's gradients start to be reduced (or at :meth:`close`) is sent.
        An iteration without a call keeps the previous iteration's position. Only
        rank 0's value travels; other ranks may call it too (it is validated and
        otherwise ignored).

        ``position`` is any JSON value but None, at most 64 KiB as compact JSON
        (:data:`checkmate.control.MAX_DATA_POSITION_BYTES`), no NaN or infinities; it
        is copied at once (later changes to the object do not travel), and comes
        back as JSON gives it back (tuples as lists, dictionary keys as strings).
        Raises ValueError naming the problem otherwise.
        """
        self._data_position = validate_data_position(position)

    @property
    def data_position(self) -> Any:
        """The data position after the last committed iteration (None: never set)."""
        return self._committed_position

    def wait_certified(self, iteration: int, timeout: float) -> bool:
        """On rank 0: wait (at most ``timeout``) until every shadow has certified ``iteration``.

        Other ranks have no control channel and return True at once. The last step's
        commit is sent now if the next forward pass has not sent it yet, with the LR
        schedulers' and GradScalers' state as it is now: call this after
        ``scheduler.step()`` / ``scaler.update()``.
        """
        if self.channel is None:
            return True
        self._flush_commit()
        return self.channel.wait_certified(iteration, timeout)

    # ---- teardown -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"transport": self.transport.stats(), "ring": self.ring.stats()}
        if self.channel is not None:
            out["control"] = self.channel.stats()
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Flush the control channel, drain the transport, stop the threads, restore clip_grad_norm_.

        Collective: every rank must call it (it ends with a barrier on the default group).
        """
        if self._uncommitted is not None:
            self._commit(self._uncommitted, skipped=True, capture=False)
        self._flush_commit()
        atexit.unregister(self._flush_at_exit)
        self._step_handle.remove()
        self._pre_step_handle.remove()
        vars(self.optimizer).pop("add_param_group", None)  # the class's method again
        self._forward_handle.remove()
        with _AGENTS_LOCK:
            if self in _AGENTS:
                _AGENTS.remove(self)
            if not _AGENTS:
                _remove_patches()
                torch.amp.grad_scaler.GradScaler.update = _ORIGINAL_SCALER_UPDATE  # type: ignore[method-assign]
        if self._metrics is not None:
            self._metrics.close()
        if self.channel is not None:
            self._final_state_to_rejoining_shadows(self.channel, timeout)
            self.channel.flush(timeout)
            # The last iteration's lost copies are repaired from the workers: the other ranks wait in
            # the barrier below (their rings still answer) until the shadows certified it, or timeout.
            if self.iteration > self.config.start_iteration and all(
                link.connected and not link.needs_state for link in self.channel.links
            ):
                self.channel.wait_certified(self.iteration - 1, timeout)
            self.channel.close(timeout)
        # Drain while every peer still listens (its last ACKs may need a retransmission), then
        # wait for all ranks before closing sockets. close() is collective, like DDP itself.
        if not self.transport.wait_idle(timeout):
            logger.warning("checkmate: unacknowledged datagrams left at close: %s", self.transport.stats())
        if dist.is_initialized():
            dist.barrier()
        self.ring.close()
        self.transport.close()


def enable_checkmate(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    config: CheckmateConfig | None = None,
    *,
    start_iteration: int | None = None,
    optimizer_step: int | None = None,
    data_position: Any = None,
    stateful: Mapping[str, Any] | None = None,
    resume: Any = None,
) -> CheckmateAgent:
    """The one line to add to a DDP script (after ``init_process_group`` and the optimizer).

    A job resumed from a checkpoint passes the iteration it continues with (and the
    optimizer steps already taken), so iterations keep the job's numbers; this overrides
    ``CHECKMATE_START_ITERATION`` / ``CHECKMATE_OPTIMIZER_STEP``. ``data_position`` is
    where the data of iteration ``start_iteration`` begins (the position of the state
    the shadows are first given; see :meth:`CheckmateAgent.set_data_position`).

    ``stateful`` names the job's objects with ``state_dict()``/``load_state_dict()``
    (``torch.distributed.checkpoint.stateful.Stateful``: LR schedulers, a GradScaler,
    a sampler, ...); with the model's persistent buffers and the param groups'
    hyperparameters their state after every iteration travels with its commit and
    is in every checkpoint (captured at the next forward pass, so after
    ``scheduler.step()``). One whose state cannot travel raises CheckmateConfigError
    here, naming it. ``resume`` is what :func:`hosts.resume` returned: the job
    continues at its iteration, optimizer step and data position.
    """
    if resume is not None:
        start_iteration = resume.iteration if start_iteration is None else start_iteration
        optimizer_step = resume.optimizer_step if optimizer_step is None else optimizer_step
        if data_position is None:
            data_position = resume.data_position
    config = config or CheckmateConfig.from_env()
    if start_iteration is not None or optimizer_step is not None:
        config = dataclasses.replace(
            config,
            start_iteration=config.start_iteration if start_iteration is None else start_iteration,
            optimizer_step=config.optimizer_step if optimizer_step is None else optimizer_step,
        )
    return CheckmateAgent(ddp_model, optimizer, config, data_position=data_position, stateful=stateful)
