"""Checkmate for FSDP2 (``fully_shard``) jobs on the ``checkmate`` backend: one added line.

An FSDP2 script whose default process group is ``checkmate`` adds, after ``fully_shard`` and the
optimizer::

    agent = hosts.enable_checkmate_fsdp(model, optimizer)

which (every rank; collective, like ``fully_shard``):

* gives the group's ring to the job (:meth:`~hosts.c10d_sharded.ShardedProtection.protect_reduce_scatters`:
  the job id, shard keys and replication mode of :class:`~hosts.ddp_config.CheckmateConfig`);
* installs on every FSDP module a custom reduce-scatter (FSDP2's ``set_custom_reduce_scatter``)
  that runs the module's gradient reduce-scatter as bucket ``b`` (the module's index among the
  FSDP modules holding parameters, ``model.modules()`` order) of the training iteration through
  :meth:`~hosts.c10d_sharded.ShardedProtection.tagged_reduce_scatter`: the fully reduced shards are
  the tagged datagrams (docs/protocol.md, "Which datagrams are tagged");
* on rank 0 connects to the shadows and sends them the job's *full* state (every rank gathers
  the parameters and optimizer state for it), then after the first iteration the bucket layout —
  each bucket a list of parameter *segments* (:class:`~checkmate.control.ParamSlice` with
  ``param_offset``): rank r's shard of every parameter, in FSDP2's ``chunk_cat`` order — and one
  commit record per optimizer step (learning rates, hyperparameters that changed, the gradient
  multiplications ``clip_grad_norm_`` made, the parameters without a gradient, the gradient tags).

The shadows hold the full (logical) model and apply the same elementwise step on full
parameters, so restoring, the universal checkpoint and re-sharding are a DDP job's. Every K-th
iteration (``CheckmateConfig.fingerprint_every``, default every iteration for CPU parameters)
every rank gathers the full state and rank 0 sends its fingerprint: a shadow that differs
reports it and is not certified. Not covered yet (refused or documented in docs/backend.md): a
reduce-scatter with SUM and a division after it (fp16 reduce dtype, ``force_sum_reduction_for_comms``),
``gradient_divide_factor``, gradient accumulation with a reduce-scatter per micro-batch, HSDP,
``shard_placement_fn`` other than dim 0, re-seeding a shadow that reconnects mid-run, a GradScaler,
the job state (stateful objects, buffers) and the lag bound of :mod:`hosts.protection`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor, distribute_tensor

from checkmate.auth import GradientDigests, secret_from_env
from checkmate.checkpoint.source import RestoredState
from checkmate.control import (
    BucketLayout,
    BucketSpec,
    Commit,
    JobStart,
    ParamSlice,
    ParamSpec,
    dtype_name,
)
from checkmate.fingerprint import FingerprintTurns
from checkmate.fingerprint import fingerprint as state_fingerprint
from checkmate.optimizers import check_replayable, describe, pin_implementation
from checkmate.tensors import tensor_payload
from hosts.c10d_backend import CheckmateProcessGroup
from hosts.control_channel import ControlChannel
from hosts.ddp_commits import _plain, hyperparameter_changes, job_description
from hosts.ddp_config import (
    CheckmateConfig,
    CheckmateConfigError,
    _fingerprint_every,
    _replication_mode,
    ask_shadow_data_ports,
)
from hosts.ddp_gradients import CheckmateStateError, GradientGuard
from hosts.ddp_links import ShadowLinks
from hosts.recovery import ResumeError, ResumePoint, restore_latest
from hosts.ring_config import ReduceOp, RingConfig

__all__ = ["FsdpCheckmateAgent", "enable_checkmate_fsdp", "load_full_state", "resume_fsdp"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Shard:
    """One parameter of an FSDP module's reduce-scatter: its name, numel and padded shard numel."""

    name: str
    numel: int
    shard_numel: int


def bucket_params(shards: Sequence[_Shard], world: int) -> tuple[int, tuple[ParamSlice, ...]]:
    """The reduce-scatter input's size and segments: rank r's shard of each parameter, in order.

    FSDP2's ``chunk_cat`` puts rank r's padded shard of every parameter at ``[r·S, (r+1)·S)``
    (``S`` = the sum of the padded shard sizes), parameter after parameter; the shard holds
    elements ``[r·s, r·s + s)`` of the flattened parameter padded on dim 0 (the padding last).
    """
    per_rank = sum(s.shard_numel for s in shards)
    slices = []
    for rank in range(world):
        offset = rank * per_rank
        for shard in shards:
            first = rank * shard.shard_numel
            count = max(0, min(shard.shard_numel, shard.numel - first))
            if count:
                slices.append(ParamSlice(shard.name, offset, count, first))
            offset += shard.shard_numel
    return per_rank * world, tuple(slices)


class _TaggedReduceScatter(ReduceScatter):
    """An FSDP module's reduce-scatter (FSDP2's ``ReduceScatter`` interface) on the tagged ring."""

    def __init__(self, agent: FsdpCheckmateAgent, bucket: int, shards: tuple[_Shard, ...]) -> None:
        self.agent = agent
        self.bucket = bucket
        self.shards = shards
        self.numel, self.slices = bucket_params(shards, agent.world)

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        work = self.agent.reduce_scatter(self, output_tensor, input_tensor, op)
        if async_op:
            return work
        work.wait()
        return None


class FsdpCheckmateAgent:
    """One rank's Checkmate agent for an FSDP2 model; made by :func:`enable_checkmate_fsdp`.

    Composes the gradients' records and step checks (:class:`~hosts.ddp_gradients.GradientGuard`),
    the group's ring (its tagged reduce-scatters, :mod:`hosts.c10d_sharded`) and, on rank 0, the
    control channel to the shadows; it owns the iteration, the bucket layout and the commits.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: CheckmateConfig
    ) -> None:
        group = dist.distributed_c10d._get_default_group()
        if not isinstance(group, CheckmateProcessGroup):
            raise CheckmateConfigError(
                "enable_checkmate_fsdp needs the checkmate backend: init_process_group(backend='checkmate') "
                f"(the default group's backend is {dist.get_backend()!r})"
            )
        if (group.size(), group.rank()) != (config.world_size, config.rank):
            raise CheckmateConfigError(
                f"the process group has {group.size()} ranks, this one rank {group.rank()}, but the "
                f"configuration says rank {config.rank} of {config.world_size}"
            )
        check_replayable(optimizer)
        pin_implementation(optimizer)
        self.fsdp_model, self.optimizer, self.group = model, optimizer, group
        self.rank, self.world = config.rank, config.world_size
        self._gradients = GradientGuard(model, optimizer, config.rank, self._after_scaler_update)
        self.comms = self._install_comms(model)
        if _replication_mode(config.replication) == "host" and config.shadow_control:
            ports = ask_shadow_data_ports(
                config.shadow_control, config.job_id, config.shadow_connect_timeout, config.secret
            )
            config = dataclasses.replace(config, shadow_data_ports=ports)
        self.config = config
        host = _replication_mode(config.replication) == "host"
        self.ring = group.protect_reduce_scatters(
            RingConfig(
                job_id=config.job_id,
                rank=config.rank,
                workers=group.peers,
                shard_key_for_bucket=config.shard_key_for_bucket,
                timeout=config.timeout,
                keep_iterations=config.keep_iterations,
                host_replica=(lambda key: self.config.shadow_data_address(key)) if host else None,
            )
        )
        self.iteration = config.start_iteration
        self.optimizer_steps = config.optimizer_step
        self._started: set[int] = set()
        """Buckets reduce-scattered in this iteration."""
        self._layout: dict[int, BucketSpec] = {}
        self._layout_sent = False
        self._last_hyper: list[dict[str, Any]] = []
        self._fingerprint_every = _fingerprint_every(config.fingerprint_every, model)
        self._turns: FingerprintTurns | None = None
        self.commits: list[Commit] = []
        self._links = ShadowLinks(config, self.rank)
        self._digests: GradientDigests | None = None
        start = self._job_start(config.start_iteration)  # collective: every rank gathers
        if self.rank == 0 and config.shadow_control:
            if config.secret is None:
                raise CheckmateConfigError(
                    "the configuration carries no job secret: build the agent with "
                    "hosts.enable_checkmate_fsdp, which reads it, or give CheckmateConfig its secret"
                )
            self._digests = GradientDigests(config.secret, config.job_id)
            assert start is not None
            # no protection watch: the lag bound is not covered for FSDP2 yet (docs/backend.md)
            self._links.open(lambda: [start], self._fingerprint_every, protect=False)
        self._gradients.attach(refuse_add_param_group=False)  # the step's check finds an added group
        self._step_handle = optimizer.register_step_post_hook(self._after_step)
        logger.info(
            "checkmate: FSDP2 job %d rank %d/%d, %d buckets (FSDP modules), ring %s",
            config.job_id,
            self.rank,
            self.world,
            len(self.comms),
            [f"{h}:{p}" for h, p in group.peers],
        )

    @property
    def channel(self) -> ControlChannel | None:
        """Rank 0's control channel to the shadows (None: another rank, or no shadows)."""
        return self._links.channel

    @property
    def names(self) -> Mapping[int, str]:
        """Parameter id -> its name in the model."""
        return self._gradients.names

    # ---- set-up ---------------------------------------------------------------------------
    def _install_comms(self, model: torch.nn.Module) -> list[_TaggedReduceScatter]:
        comms: list[_TaggedReduceScatter] = []
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            groups = module._get_fsdp_state()._fsdp_param_groups
            if not groups:
                continue
            if len(groups) > 1:
                raise CheckmateConfigError("an FSDP module with several param groups (shard_placement_fn)")
            shards = []
            for fsdp_param in groups[0].fsdp_params:
                placement = fsdp_param.fsdp_placement
                if getattr(placement, "dim", 0) != 0:
                    raise CheckmateConfigError(
                        f"parameter {self.names[id(fsdp_param.sharded_param)]} is sharded on dim "
                        f"{placement.dim}: Checkmate's layout covers FSDP2's default dim-0 sharding only"
                    )
                name = self.names[id(fsdp_param.sharded_param)]
                shards.append(
                    _Shard(
                        name, math.prod(fsdp_param._orig_size), fsdp_param.padded_sharded_param_size.numel()
                    )
                )
            comm = _TaggedReduceScatter(self, len(comms), tuple(shards))
            module.set_custom_reduce_scatter(comm)
            comms.append(comm)
        if not comms:
            raise CheckmateConfigError(
                "the model has no FSDP2 module with parameters (call fully_shard first)"
            )
        return comms

    def _full_state(
        self, names: frozenset[str] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
        """Every parameter (of ``names``; None: all) and its optimizer state in full, by name
        (collective: all-gathers)."""
        params: dict[str, torch.Tensor] = {}
        states: dict[str, dict[str, Any]] = {}
        for name, p in self.fsdp_model.named_parameters():
            if names is not None and name not in names:
                continue
            params[name] = _full(p)
            state = self.optimizer.state.get(p, {})
            states[name] = {k: _full(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        return params, states

    def _job_start(self, start_iteration: int) -> JobStart | None:
        params, states = self._full_state()
        if self.rank != 0:
            return None
        tensors = {f"param/{n}": t for n, t in params.items()}
        scalars: dict[str, dict[str, Any]] = {}
        for name, state in states.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"state/{name}/{key}"] = value
                else:
                    scalars.setdefault(name, {})[key] = value
        groups = []
        for group in self.optimizer.param_groups:
            hyper = {k: _plain(v) for k, v in group.items() if k != "params"}
            hyper["params"] = [self.names[id(p)] for p in group["params"]]
            groups.append(hyper)
        self._last_hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        return JobStart(
            job_id=self.config.job_id,
            world_size=self.world,
            workers=list(self.group.peers),
            parameters=[ParamSpec(n, tuple(t.shape), dtype_name(t.dtype)) for n, t in params.items()],
            optimizer={**describe(self.optimizer), "param_groups": groups},
            start_iteration=start_iteration,
            tensors=tensors,
            optimizer_scalars=scalars,
            job=job_description(self.config, self.group.peers),
            extra={"fingerprint_every": self._fingerprint_every} if self._fingerprint_every > 0 else {},
        )

    # ---- the reduce-scatters (backward pass) ------------------------------------------------
    def reduce_scatter(
        self, comm: _TaggedReduceScatter, output: torch.Tensor, input: torch.Tensor, op: Any
    ) -> dist.Work:
        ring_op = self.group.ring_op("FSDP2's reduce_scatter_tensor", op)
        if ring_op is ReduceOp.SUM:
            raise CheckmateStateError(
                "checkmate: FSDP2 reduces these gradients with SUM and divides them afterwards (an fp16 "
                "reduce dtype, force_sum_reduction_for_comms or a gradient_divide_factor): the shadows do "
                "not replay that division yet; reduce in float32 or bfloat16 "
                "(MixedPrecisionPolicy.reduce_dtype)"
            )
        if input.numel() != comm.numel:
            raise CheckmateStateError(
                f"checkmate: FSDP module {comm.bucket}'s reduce-scatter has {input.numel()} elements, its "
                f"parameters {comm.numel}: a parameter without a gradient in a sharded module is not "
                "supported"
            )
        if comm.bucket in self._started:
            raise CheckmateStateError(
                f"checkmate: FSDP module {comm.bucket} reduce-scattered twice in iteration {self.iteration} "
                "without an optimizer step: for gradient accumulation call "
                "model.set_requires_gradient_sync(False) on all micro-batches but the last"
            )
        spec = BucketSpec(
            comm.bucket,
            dtype_name(input.dtype),
            comm.numel,
            self.config.shard_key_for_bucket(comm.bucket),
            comm.slices,
        )
        known = self._layout.get(comm.bucket)
        if known is not None and known != spec:
            raise CheckmateStateError(f"checkmate: FSDP module {comm.bucket}'s gradients changed dtype")
        self._layout[comm.bucket] = spec
        self._started.add(comm.bucket)
        iteration, digests = self.iteration, self._digests

        def tag(reduced: torch.Tensor) -> None:
            if digests is not None:  # what the shadows' copies must add up to (docs/security.md)
                digests.record(iteration, comm.bucket, tensor_payload(reduced.contiguous()))

        return self.group.tagged_reduce_scatter(output, input.detach(), ring_op, iteration, comm.bucket, tag)

    # ---- the step: commit -------------------------------------------------------------------
    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizer_steps += 1
        if self._started:  # a step without gradients reduced has nothing to commit
            self._commit(skipped=False)

    def _after_scaler_update(self) -> None:
        """A GradScaler's update(): gradients reduced but no optimizer step (inf/NaN) is a skipped step."""
        if self._started:
            self._commit(skipped=True)

    def _commit(self, skipped: bool) -> None:
        """End the iteration: rank 0 sends its commit (after the layout, the first time)."""
        iteration = self.iteration
        coefficient, scaling = self._gradients.take_scaling()
        no_grad = self._gradients.take_no_grad()
        every = self._fingerprint_every
        fingerprint = None
        if every > 0 and (iteration + 1) % every == 0:
            # this turn's parameters (the whole state for a model within fingerprint_bytes); the
            # turns are cut from the logical sizes, the same on every rank
            turns = self._turns = self._turns or FingerprintTurns.of(
                self.fsdp_model.named_parameters(), self.config.fingerprint_bytes
            )
            params, states = self._full_state(turns.names(iteration // every))  # collective
            if self.rank == 0:
                by_tensor = {params[n]: s for n, s in states.items()}
                fingerprint = state_fingerprint(params.items(), by_tensor)
        self._started = set()
        self.iteration += 1
        self.ring.release_through(iteration - self.config.keep_iterations)
        if self.rank != 0:
            return
        changed = hyperparameter_changes(self.optimizer, self._last_hyper)
        commit = Commit(
            job_id=self.config.job_id,
            iteration=iteration,
            learning_rates=[float(_plain(g["lr"])) for g in self.optimizer.param_groups],
            clip_coefficient=None if skipped else coefficient,
            skip_step=skipped,
            hyperparameters=changed if any(changed) else [],
            optimizer_step=self.optimizer_steps,
            no_grad=[] if skipped else no_grad,
            gradient_scaling=[] if skipped else scaling,
            fingerprint=fingerprint,
            gradient_digests=self._digests.take(iteration) if self._digests is not None else None,
        )
        self.commits.append(commit)
        if not self._links.active:
            return
        if not self._layout_sent:  # job_start(t), then bucket_layout(t): nothing between them
            layout = [self._layout[b] for b in sorted(self._layout)]
            self._links.post(BucketLayout(self.config.job_id, self.config.start_iteration, layout))
            self._layout_sent = True
        self._links.post(commit)

    # ---- rank 0's view ----------------------------------------------------------------------
    @property
    def divergences(self) -> list[dict[str, Any]]:
        return self._links.divergences

    def wait_certified(self, iteration: int, timeout: float) -> bool:
        """Rank 0: wait until every shadow has certified ``iteration`` (other ranks: True at once)."""
        channel = self._links.channel
        return True if channel is None else channel.wait_certified(iteration, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Flush the shadows' messages and stop protecting (collective: every rank calls it)."""
        self._step_handle.remove()
        self._gradients.detach()
        self._links.flush(timeout)
        self._links.close_now(timeout)
        if not self.group.transport or not self.group.transport.wait_idle(timeout):
            logger.warning("checkmate: unacknowledged datagrams at close")
        self.group.barrier().wait()


def _full(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (an all-gather), or a plain tensor's copy, on the CPU."""
    full = value.full_tensor() if isinstance(value, DTensor) else value
    return full.detach().to("cpu", copy=True)


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: RestoredState) -> None:
    """Shard a full (logical) state into an FSDP2 model and its optimizer, on this rank's mesh.

    Any world size: each DTensor parameter takes its own part of the full tensor (``distribute_tensor``
    without communication: every rank holds the same full state), and so does each optimizer state
    tensor of the parameter's shape; scalars (``step``) are copied. ResumeError names what does not fit.
    """
    named = dict(model.named_parameters())
    if set(named) != set(state.parameters):
        missing, extra = (
            sorted(set(named) - set(state.parameters)),
            sorted(set(state.parameters) - set(named)),
        )
        raise ResumeError(f"the restored state does not fit the model: missing {missing}, unknown {extra}")
    with torch.no_grad():
        for name, param in named.items():
            full = state.parameters[name]
            if tuple(full.shape) != tuple(param.shape) or full.dtype != param.dtype:
                raise ResumeError(
                    f"parameter {name}: restored {full.dtype}{list(full.shape)}, the model has "
                    f"{param.dtype}{list(param.shape)}"
                )
            _local(param).copy_(_local(_like(full, param)))
            saved = state.optimizer_state.get(name)
            if saved:
                optimizer.state[param] = {
                    key: _like(value, param)
                    if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape)
                    else value.clone()
                    if isinstance(value, torch.Tensor)
                    else value
                    for key, value in saved.items()
                }


def _like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` placed as ``param`` is (a DTensor's shard of it on this rank), or a copy."""
    if isinstance(param, DTensor):
        return distribute_tensor(
            full.detach().clone(), param.device_mesh, param.placements, src_data_rank=None
        )
    return full.detach().clone()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def resume_fsdp(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    timeout: float = 20.0,
    snapshot_dir: str | None = None,
    config: CheckmateConfig | None = None,
) -> ResumePoint:
    """:func:`hosts.resume` for an FSDP2 model: the latest certified state, at this job's world size.

    Collective. Rank 0 fetches (the shadows' memory, then ``snapshot_dir``) what every Checkmate
    job's shadows hold, the full (logical) state, and broadcasts it; every rank loads its shards
    (:func:`load_full_state`), so the world size may differ from the failed run's. Returns where to
    continue (pass it to :func:`enable_checkmate_fsdp` as ``resume``).
    """
    config = config or CheckmateConfig.from_env()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = restore_latest(
                dict(config.shadow_control),
                Path(snapshot_dir) if snapshot_dir else None,
                timeout=timeout,
                job_id=config.job_id,
                unnamed=config.unnamed_shadows,
            )
        except ResumeError as exc:
            box[0] = exc
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], ResumeError):
        raise ResumeError(str(box[0]))
    if box[0] is None:
        return ResumePoint(iteration=0)
    state: RestoredState = box[0]
    load_full_state(model, optimizer, state)
    logger.info(
        "resumed an FSDP2 job after iteration %d from %s (%s)", state.iteration, state.source, state.detail
    )
    return ResumePoint(
        iteration=state.next_iteration,
        optimizer_step=state.optimizer_step,
        data_position=state.data_position,
        source=state.source,
        detail=state.detail,
    )


def enable_checkmate_fsdp(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: CheckmateConfig | None = None,
    *,
    start_iteration: int | None = None,
    optimizer_step: int | None = None,
    resume: Any = None,
) -> FsdpCheckmateAgent:
    """The one line for an FSDP2 script on ``checkmate`` (after ``fully_shard`` and the optimizer).

    Collective: every rank calls it. ``resume`` is what :func:`hosts.resume` returned (the job
    continues at its iteration and optimizer step); ``start_iteration`` / ``optimizer_step``
    override it.
    """
    if resume is not None:
        start_iteration = resume.iteration if start_iteration is None else start_iteration
        optimizer_step = resume.optimizer_step if optimizer_step is None else optimizer_step
    config = config or CheckmateConfig.from_env()
    if config.secret is None:  # the entry point reads the secret once; the agent passes it down
        config = dataclasses.replace(config, secret=secret_from_env())
    config = dataclasses.replace(
        config,
        start_iteration=config.start_iteration if start_iteration is None else start_iteration,
        optimizer_step=config.optimizer_step if optimizer_step is None else optimizer_step,
    )
    return FsdpCheckmateAgent(model, optimizer, config)
