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

Tensor parallelism (TP x DP): the agent's ring is the DDP model's process group. With
``CHECKMATE_TP_DEGREE`` each TP index's DP group is a lane of its own (its job id, ring,
rank 0 and shadows; :class:`~hosts.ddp_config.CheckmateConfig`), and
:func:`hosts.ddp_tp.localize_tensor_parallel` makes a TP model's DTensor parameters
DDP's (docs/checkpoint-format.md, "Checkmate for TP x DP jobs").

How it is cut (each part a module, assembled into :class:`CheckmateAgent` here):

* :mod:`hosts.ddp_config` - :class:`CheckmateConfig` and the job file; frozen values
  built on the training thread, no lock.
* :mod:`hosts.ddp_gradients` - the clipping / unscaling / scaler-update interceptions
  (torch patched while any agent lives; the registry and the patches under its module
  lock ``_AGENTS_LOCK``) and the step pre-hook's checks; training thread.
* :mod:`hosts.ddp_hook` - the DDP communication hook; the backward pass's thread hands
  buckets to the ring, whose transport receive thread completes them under the ring's lock.
* :mod:`hosts.ddp_commits` - rank 0's messages to the shadows (job start, bucket layout,
  commits, fingerprints, job state, job-file changes); training thread, from the step
  post-hook and the forward pre-hook; the control channel's per-link sender threads send
  what it queues under the channel's lock.
* :mod:`hosts.ddp_tp` - DTensor parameters kept local for DDP (module hooks, training thread).

This module only sets the parts up (rendezvous, transport, ring, control channel,
hooks) and tears them down (:meth:`CheckmateAgent.close`, collective).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from checkmate.auth import secret_from_env
from checkmate.control import BucketSpec, Commit, validate_data_position
from checkmate.job_state import JobState, JobStateError
from checkmate.optimizers import check_replayable, pin_implementation
from checkmate.os_threads import name_os_threads
from hosts import ddp_gradients
from hosts.control_channel import ControlChannel, ControlConfig
from hosts.ddp_commits import ShadowMessages
from hosts.ddp_config import (
    CheckmateConfig,
    CheckmateConfigError,
    _file_stamp,
    _fingerprint_every,
    _replication_mode,
    ask_shadow_data_ports,
    read_job_file,
)
from hosts.ddp_gradients import CheckmateStateError, GradientGuard, clip_grad_norm_
from hosts.ddp_hook import CommHook
from hosts.metrics import start_agent_metrics
from hosts.protection import ProtectionWatch, VerdictBoard
from hosts.ring_allreduce import RingAllReduce, RingConfig
from hosts.transport import Addr, Transport, TransportConfig

__all__ = [
    "CheckmateAgent",
    "CheckmateConfig",
    "CheckmateConfigError",
    "CheckmateStateError",
    "clip_grad_norm_",
    "enable_checkmate",
    "read_job_file",
]

logger = logging.getLogger(__name__)


class CheckmateAgent(GradientGuard, CommHook, ShadowMessages):
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
        if config.secret is None:  # the entry point (enable_checkmate) reads it and passes it down
            raise CheckmateConfigError(
                "the configuration carries no job secret: build the agent with hosts.enable_checkmate, "
                "which reads it, or give CheckmateConfig its secret"
            )
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
        self._group: Any = getattr(ddp_model, "process_group", None) if dist.is_initialized() else None
        """The DDP model's process group: every rank of this ring (with TP x DP: one TP index's DP group)."""
        workers = self._rendezvous(config)
        self.workers = workers
        if _replication_mode(config.replication) == "host" and config.shadow_control:
            # no switch: the owner of each chunk sends the copy to the port the shadow listens on
            ports = ask_shadow_data_ports(
                config.shadow_control, config.job_id, config.shadow_connect_timeout, config.secret
            )
            config = self.config = dataclasses.replace(config, shadow_data_ports=ports)
        self.transport = Transport(
            TransportConfig(
                bind=config.bind,
                peer_timeout=config.peer_timeout,
                faults=config.faults,
                datapath=config.datapath,
                secret=config.secret,
            )
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
                secret=config.secret,
                unnamed=config.unnamed_shadows,
            )
            up = self.channel.wait_connected(config.shadow_connect_timeout)
            logger.info("%d of %d shadows reachable at start", up, len(config.shadow_control))
            self.channel.post_state(lambda: [self._job_start(config.start_iteration)])
        # Never silently unprotected: rank 0 judges the shadows' certificates, every rank raises a verdict.
        self._protection: ProtectionWatch | None = None
        self._posted_through: int | None = None
        if config.shadow_control:
            policy = config.protection
            board = VerdictBoard.default(config.job_id) if policy.unprotected == "raise" else None
            self._protection = ProtectionWatch(
                policy,
                self.rank,
                config.start_iteration,
                board,
                certificate_every=self._fingerprint_every,
                world_size=config.world_size,
            )
        self._metrics = (
            start_agent_metrics(self, config.job_id, self.rank, config.metrics_port)
            if self.rank == 0 and config.metrics_port is not None
            else None
        )
        if dist.is_initialized():
            dist.barrier(group=self._group)  # every rank's transport is up before the first gradient moves
        self.register(ddp_model)
        self._step_handle = optimizer.register_step_post_hook(self._after_step)
        self._structure = self._structure_now()
        self._pre_step_handle = optimizer.register_step_pre_hook(self._before_step)
        self._guard_add_param_group()
        self._forward_handle = ddp_model.register_forward_pre_hook(self._before_forward)
        atexit.register(self._flush_at_exit)  # a script that never calls close() still sends its last commit
        ddp_gradients.install(self)
        name_os_threads()  # top -H, ps -L and the benchmark's per-thread account see cm-rx, cm-ctl, ...
        logger.info(
            "checkmate: job %d rank %d/%d%s on %s:%d, ring %s",
            config.job_id,
            config.rank,
            config.world_size,
            f" (TP index {config.tp_index} of {config.tp_degree})" if config.tp_degree > 1 else "",
            *config.bind,
            [f"{h}:{p}" for h, p in workers],
        )

    # ---- set-up ---------------------------------------------------------------------
    def _rendezvous(self, config: CheckmateConfig) -> tuple[Addr, ...]:
        mine = (config.job_id, config.bind)
        if dist.is_initialized():
            size, rank = dist.get_world_size(self._group), dist.get_rank(self._group)
            if (size, rank) != (config.world_size, config.rank):
                raise CheckmateConfigError(
                    f"the DDP model's process group has {size} ranks, this one rank {rank}, but the "
                    f"configuration says rank {config.rank} of {config.world_size}: with tensor parallelism "
                    "set CHECKMATE_TP_DEGREE and give DDP the DP group (process_group=mesh['dp'].get_group())"
                )
            gathered: list[Any] = [None] * config.world_size
            dist.all_gather_object(gathered, mine, group=self._group)
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

    @property
    def protection(self) -> dict[str, Any] | None:
        """Rank 0: whether the shadows protect the job, the lag and why not (hosts.protection); else None."""
        return self._protection.status() if self._protection is not None and self.rank == 0 else None

    # ---- teardown -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"transport": self.transport.stats(), "ring": self.ring.stats()}
        if self.channel is not None:
            out["control"] = self.channel.stats()
        if self._protection is not None and self.rank == 0:
            out["protection"] = self._protection.status()
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Flush the control channel, drain the transport, stop the threads, restore clip_grad_norm_.

        Collective: every rank must call it (it ends with a barrier on the default group).
        """
        if self._uncommitted is not None:
            self._commit(self._uncommitted, skipped=True, capture=False)
        self._flush_commit(final=True)
        atexit.unregister(self._flush_at_exit)
        self._step_handle.remove()
        self._pre_step_handle.remove()
        vars(self.optimizer).pop("add_param_group", None)  # the class's method again
        self._forward_handle.remove()
        ddp_gradients.uninstall(self)
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
            dist.barrier(group=self._group)
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
    if config.secret is None:  # the entry point reads the secret once; the agent passes it down
        config = dataclasses.replace(config, secret=secret_from_env())
    if start_iteration is not None or optimizer_step is not None:
        config = dataclasses.replace(
            config,
            start_iteration=config.start_iteration if start_iteration is None else start_iteration,
            optimizer_step=config.optimizer_step if optimizer_step is None else optimizer_step,
        )
    return CheckmateAgent(ddp_model, optimizer, config, data_position=data_position, stateful=stateful)
