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

How it is cut (each component a module, owning its state; :class:`CheckmateAgent` here
composes them, and they talk through methods only; docs/architecture.md, "The host agent"):

* :mod:`hosts.ddp_config` - :class:`CheckmateConfig` and the job file; frozen values
  built on the training thread, no lock.
* :mod:`hosts.ddp_gradients` - :class:`~hosts.ddp_gradients.GradientGuard`: the clipping /
  unscaling / scaler-update interceptions (torch patched while any agent lives; the registry
  and the patches under its module lock ``_AGENTS_LOCK``), the gradient multiplications and
  parameters without a gradient until the commit takes them, and the step pre-hook's checks;
  training thread.
* :mod:`hosts.ddp_hook` - :class:`~hosts.ddp_hook.CommHook`: the DDP communication hook; the
  backward pass's thread hands buckets to the ring, whose transport receive thread completes
  them under the ring's lock.
* :mod:`hosts.ddp_commits` - :class:`~hosts.ddp_commits.ShadowMessages`: the iteration count
  and rank 0's messages to the shadows (job start, bucket layout, commits, fingerprints, job
  state, data position); training thread, from the step post-hook, the forward pre-hook and
  the hook's iteration events.
* :mod:`hosts.ddp_links` - :class:`~hosts.ddp_links.ShadowLinks`: the control channel (its
  per-link sender threads send what it queues under the channel's lock), the protection watch
  and the job file followed.
* :mod:`hosts.ddp_tp` - DTensor parameters kept local for DDP (module hooks, training thread).

This module only sets the parts up (rendezvous, transport, ring, the components, hooks) and
tears them down (:meth:`CheckmateAgent.close`, collective).
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
from checkmate.control import Commit, validate_data_position
from checkmate.job_state import JobStateError
from checkmate.job_state import capture as capture_job_state
from checkmate.optimizers import check_replayable, pin_implementation
from checkmate.os_threads import name_os_threads
from hosts.control_channel import ControlChannel
from hosts.ddp_commits import JobContext, ShadowMessages
from hosts.ddp_config import (
    CheckmateConfig,
    CheckmateConfigError,
    _fingerprint_every,  # noqa: F401  (hosts.ddp._fingerprint_every: where tests and scripts found it)
    _replication_mode,
    ask_shadow_data_ports,
    read_job_file,
)
from hosts.ddp_gradients import CheckmateStateError, GradientGuard, clip_grad_norm_
from hosts.ddp_hook import CommHook, comm_hook
from hosts.ddp_links import ShadowLinks
from hosts.metrics import start_agent_metrics
from hosts.random_state import RandomStateError, check_same_on_every_rank
from hosts.ring_allreduce import RingAllReduce
from hosts.ring_config import RingConfig
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
        if config.secret is None:  # the entry point (enable_checkmate) reads it and passes it down
            raise CheckmateConfigError(
                "the configuration carries no job secret: build the agent with hosts.enable_checkmate, "
                "which reads it, or give CheckmateConfig its secret"
            )
        self.model = ddp_model
        self.optimizer = optimizer
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
        try:  # fail fast, on every rank: an object whose state cannot travel is refused here
            initial_state = capture_job_state(module, self.stateful, optimizer)
        except JobStateError as exc:
            raise CheckmateConfigError(str(exc)) from None
        self._group: Any = getattr(ddp_model, "process_group", None) if dist.is_initialized() else None
        """The DDP model's process group: every rank of this ring (with TP x DP: one TP index's DP group)."""
        workers = self._rendezvous(config)
        self.workers = workers
        if _replication_mode(config.replication) == "host" and config.shadow_control:
            # no switch: the owner of each chunk sends the copy to the port the shadow listens on
            ports = ask_shadow_data_ports(
                config.shadow_control, config.job_id, config.shadow_connect_timeout, config.secret
            )
            config = dataclasses.replace(config, shadow_data_ports=ports)
        self.transport = Transport(
            TransportConfig(
                bind=config.bind,
                peer_timeout=config.peer_timeout,
                faults=config.faults,
                datapath=config.datapath,
                secret=config.secret,
            )
        )
        links = self._links = ShadowLinks(config, self.rank)
        self.ring = RingAllReduce(
            self.transport,
            RingConfig(
                job_id=config.job_id,
                rank=config.rank,
                workers=workers,
                shard_key_for_bucket=lambda bucket: links.config.shard_key_for_bucket(bucket),
                timeout=config.timeout,
                keep_iterations=config.keep_iterations,
                host_replica=(
                    (lambda key: links.config.shadow_data_address(key))
                    if _replication_mode(config.replication) == "host"
                    else None
                ),
            ),
        )
        self._gradients = GradientGuard(module, optimizer, self.rank, self._after_scaler_update)
        self._messages = ShadowMessages(
            module,
            optimizer,
            self.stateful,
            JobContext(self.rank, workers, initial_state, initial_position, self.ring.release_through),
            self._gradients,
            links,
        )
        links.open(self._messages.start_messages, self._messages.fingerprint_every)
        self._metrics = (
            start_agent_metrics(self, config.job_id, self.rank, config.metrics_port)
            if self.rank == 0 and config.metrics_port is not None
            else None
        )
        if dist.is_initialized():
            dist.barrier(group=self._group)  # every rank's transport is up before the first gradient moves
        self._check_random_states()
        self._hook = CommHook(
            self.ring,
            self._gradients.names,
            self._messages,
            links,
            CommHook.watches_random_state(self.rank, self.stateful),
        )
        ddp_model.register_comm_hook(self, comm_hook)
        self._step_handle = optimizer.register_step_post_hook(self._messages.after_step)
        self._gradients.attach()
        self._forward_handle = ddp_model.register_forward_pre_hook(self._messages.before_forward)
        atexit.register(self._messages.flush_at_exit)  # a script that never calls close(): its last commit
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

    def _check_random_states(self) -> None:
        """Collective: the ranks' RandomStates agree (RandomState saves rank 0's); else stop what the
        agent started and raise CheckmateConfigError."""
        try:
            check_same_on_every_rank(self.stateful, self._group)
        except RandomStateError as exc:
            self._links.close_now(1.0)  # nothing was registered yet
            self.ring.close()
            self.transport.close()
            if self._metrics is not None:
                self._metrics.close()
            raise CheckmateConfigError(str(exc)) from None

    def _after_scaler_update(self) -> None:
        """A GradScaler's update() (the gradients' interception): a reduced iteration without a step."""
        self._messages.after_scaler_update()

    # ---- what the agent shows ---------------------------------------------------------
    @property
    def config(self) -> CheckmateConfig:
        """The job's configuration now (rank 0 follows a job file change: its job and shadows)."""
        return self._links.config

    @property
    def channel(self) -> ControlChannel | None:
        """Rank 0's control channel to the shadows (None: another rank, or no shadows)."""
        return self._links.channel

    @property
    def names(self) -> Mapping[int, str]:
        """Parameter id -> its name in the model."""
        return self._gradients.names

    @property
    def iteration(self) -> int:
        """The next all-reduce iteration."""
        return self._messages.iteration

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (the resumed job's earlier steps included)."""
        return self._messages.optimizer_steps

    @property
    def commits(self) -> list[Commit]:
        """Commit records made on this rank (rank 0), for inspection."""
        return self._messages.records

    @property
    def protection(self) -> dict[str, Any] | None:
        """Rank 0: whether the shadows protect the job, the lag and why not (hosts.protection); else None."""
        return self._links.protection_status()

    @property
    def divergences(self) -> list[dict[str, Any]]:
        """Rank 0: every divergence a shadow reported (iteration, shadow, tensors that differ)."""
        return self._links.divergences

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """What DDP's registered hook calls per gradient bucket (:class:`hosts.ddp_hook.CommHook`)."""
        return self._hook.on_bucket(bucket)

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
        self._messages.set_data_position(position)

    @property
    def data_position(self) -> Any:
        """The data position after the last committed iteration (None: never set)."""
        return self._messages.data_position

    def wait_certified(self, iteration: int, timeout: float) -> bool:
        """On rank 0: wait (at most ``timeout``) until every shadow has certified ``iteration``.

        Other ranks have no control channel and return True at once. The last step's
        commit is sent now if the next forward pass has not sent it yet, with the LR
        schedulers' and GradScalers' state as it is now: call this after
        ``scheduler.step()`` / ``scaler.update()``.
        """
        return self._messages.wait_certified(iteration, timeout)

    # ---- teardown -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {"transport": self.transport.stats(), "ring": self.ring.stats(), **self._links.stats()}

    def close(self, timeout: float = 5.0) -> None:
        """Flush the control channel, drain the transport, stop the threads, restore clip_grad_norm_.

        Collective: every rank must call it (it ends with a barrier on the default group).
        """
        self._messages.finish()
        atexit.unregister(self._messages.flush_at_exit)
        self._step_handle.remove()
        self._forward_handle.remove()
        self._gradients.detach()
        if self._metrics is not None:
            self._metrics.close()
        self._links.close(self._messages.iteration, timeout, self._messages.state_messages)
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
