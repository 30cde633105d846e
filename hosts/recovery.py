"""Worker-side resume: one call restores a DDP job from its shadows, or from disk, exactly.

A restarted training script calls, on every rank, before ``enable_checkmate``::

    point = hosts.resume(ddp_model, optimizer, stateful={"scheduler": sched})
    agent = hosts.enable_checkmate(ddp_model, optimizer, stateful={"scheduler": sched}, resume=point)
    for iteration in range(point.iteration, total): ...

Rank 0 asks, in this order,

1. the shadows' memory (:func:`shadow.restore.fetch_state`; the shadows named by
   ``CHECKMATE_SHADOWS`` / ``CHECKMATE_JOB_FILE``): the latest iteration every
   shadow has applied, merged, every parameter exactly once;
2. when no shadow answers (or none holds state), the newest *complete*
   universal checkpoint in the shadows' snapshot directory (``snapshot_dir`` or
   ``CHECKMATE_SNAPSHOT_DIR``, a directory this rank can read): how many
   iterations that loses, as far as the shadows' status files tell, is logged
   and returned (:attr:`ResumePoint.lost_iterations`);
3. when neither holds a state, nothing: the job starts at iteration 0.

Every rank receives the same state (``broadcast_object_list`` on the default
process group) and loads it: parameters, optimizer state, the param groups'
hyperparameters in force, the model's persistent buffers, each stateful
object (``load_state_dict``). The returned :class:`ResumePoint` says where to
continue: :attr:`~ResumePoint.iteration` (the restored iteration + 1) and the
data position the script set with ``agent.set_data_position`` for it.

Bit-identical resume needs what an uninterrupted run would have had: with 2
ranks every element's all-reduce is one addition, so DDP's bucket order does
not matter; with more ranks call :func:`settle_buckets` at every start (fresh or
resumed), so every iteration sums in the same order. RNG state is not captured:
seed per iteration, or hand a Stateful wrapper of your generator in ``stateful``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checkmate.checkpoint_format import PARAM_STATE, CheckpointError, CheckpointReader
from checkmate.control import ControlProtocolError, JobStart
from checkmate.job_state import JobState, JobStateError, load_stateful, persistent_buffers
from shadow.restore import RestoreError, fetch_shard, fetch_state, merge_shards

logger = logging.getLogger(__name__)

Addr = tuple[str, int]

SOURCE_SHADOW_MEMORY = "shadow-memory"
SOURCE_SNAPSHOT = "snapshot"
SOURCE_NONE = "none"
SNAPSHOT_DIR_ENV = "CHECKMATE_SNAPSHOT_DIR"


class ResumeError(RuntimeError):
    """A certified state could not be fetched or does not fit the job; the message says why."""


@dataclass
class RestoredState:
    """A certified state: everything of the job after ``iteration``."""

    iteration: int
    """The last iteration applied; training resumes at ``iteration + 1``."""
    source: str
    """:data:`SOURCE_SHADOW_MEMORY` or :data:`SOURCE_SNAPSHOT`."""
    parameters: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Parameter name -> its optimizer state (``exp_avg``, ``step``, ...)."""
    optimizer_step: int = 0
    data_position: Any = None
    """Where to resume the data after ``iteration`` (``agent.set_data_position``); None: unknown."""
    detail: str = ""
    """Where exactly it came from (shadow names, snapshot directory)."""
    job_state: JobState | None = None
    """Buffers, stateful objects, param groups after ``iteration`` (None: a version-1 checkpoint)."""
    optimizer_kind: str | None = None
    lost_iterations: int | None = None
    """From disk: iterations the shadows had applied beyond ``iteration`` (None: unknown; 0 from memory)."""

    @property
    def next_iteration(self) -> int:
        return self.iteration + 1


@dataclass(frozen=True)
class ResumePoint:
    """Where a (re)started job continues; pass it to ``enable_checkmate(..., resume=point)``."""

    iteration: int
    """The first iteration to run: the restored iteration + 1, or 0 when nothing was restored."""
    optimizer_step: int = 0
    """Optimizer steps taken before :attr:`iteration`."""
    data_position: Any = None
    """The data position after the restored iteration (what ``agent.set_data_position`` sent)."""
    source: str = SOURCE_NONE
    detail: str = ""
    lost_iterations: int | None = 0
    """Iterations the shadows had applied that the restored state lacks (disk restores; None: unknown)."""

    @property
    def restored(self) -> bool:
        return self.source != SOURCE_NONE

    @property
    def restored_iteration(self) -> int | None:
        return self.iteration - 1 if self.restored else None


# ---- digests ------------------------------------------------------------------------------
def parameters_digest(parameters: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over every parameter's name, shape, dtype and bytes, in name order."""
    items = dict(parameters.items() if isinstance(parameters, Mapping) else parameters)
    digest = hashlib.sha256()
    for name in sorted(items):
        tensor = items[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def optimizer_digest(states: Mapping[str, Mapping[str, Any]]) -> str:
    """SHA-256 over every parameter's optimizer state (name, key, value bytes), in name order."""
    digest = hashlib.sha256()
    for name in sorted(states):
        for key in sorted(states[name]):
            value = torch.as_tensor(states[name][key]).detach().to("cpu").contiguous()
            digest.update(f"{name}/{key}:{tuple(value.shape)}:{value.dtype};".encode())
            digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def optimizer_states_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer's per-parameter state keyed by the parameter's fully-qualified name."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: dict(s) for p, s in optimizer.state.items() if id(p) in names}


# ---- fetching -----------------------------------------------------------------------------
def _from_merged(state: dict[str, Any], detail: str) -> RestoredState:
    return RestoredState(
        iteration=int(state["iteration"]),
        source=SOURCE_SHADOW_MEMORY,
        parameters=dict(state["parameters"]),
        optimizer_state={n: dict(s) for n, s in state["optimizer_state"].items()},
        optimizer_step=int(state.get("optimizer_step") or 0),
        data_position=state.get("data_position"),
        detail=detail,
        job_state=state.get("job_state"),
        optimizer_kind=(state.get("optimizer") or {}).get("kind"),
        lost_iterations=0,
    )


def from_shadows(shadows: Mapping[str, Addr], timeout: float, job_id: int = 0) -> RestoredState:
    """The latest state every shadow can serve, from their memory; ResumeError if there is none."""
    if not shadows:
        raise ResumeError("no shadow addresses")
    try:
        state = fetch_state(list(shadows.values()), timeout=timeout, job_id=job_id)
    except (RestoreError, OSError, ControlProtocolError) as exc:
        raise ResumeError(f"the shadows cannot serve a state: {exc}") from None
    return _from_merged(state, ", ".join(f"{name}@{it}" for name, it in sorted(state["shadows"].items())))


def shadows_reached(directory: Path) -> int | None:
    """The latest iteration any shadow reported applied in its status file in ``directory`` (None: none)."""
    reached = None
    for path in Path(directory).glob("status-*.json"):
        try:
            applied = json.loads(path.read_text(encoding="utf-8")).get("applied_iteration")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(applied, int) and (reached is None or applied > reached):
            reached = applied
    return reached


def from_snapshots(directory: Path) -> RestoredState:
    """The newest complete checkpoint in the shadows' snapshot directory; ResumeError if none.

    ``lost_iterations``: how far the shadows' memory was ahead of it, from their
    status files in the same directory (rewritten once a second, so a lower bound);
    None when there are none.
    """
    try:
        reader = CheckpointReader(Path(directory))
        parameters = {name: reader.parameter(name) for name in reader.parameters}
        states = {
            name: {s: reader.parameter(name, s) for s in reader.states_of(name) if s != PARAM_STATE}
            for name in reader.parameters
        }
        job_state = reader.job_state()
    except (CheckpointError, OSError, KeyError) as exc:
        raise ResumeError(f"no usable checkpoint in {directory}: {exc}") from None
    extra = reader.global_state.get("extra", {})
    reached = shadows_reached(Path(directory))
    lost = None if reached is None else max(0, reached - reader.step)
    return RestoredState(
        iteration=reader.step,
        source=SOURCE_SNAPSHOT,
        parameters=parameters,
        optimizer_state=states,
        optimizer_step=int(extra.get("optimizer_step", 0) or 0),
        data_position=extra.get("data_position"),
        detail=str(reader.directory),
        job_state=job_state,
        optimizer_kind=(reader.global_state.get("optimizer") or {}).get("kind"),
        lost_iterations=lost,
    )


def restore_latest(
    shadows: Mapping[str, Addr], snapshot_dir: Path | None, timeout: float = 20.0, job_id: int = 0
) -> RestoredState | None:
    """Shadow memory first, then the snapshot directory; None when neither holds a state."""
    reasons = []
    try:
        return from_shadows(shadows, timeout, job_id)
    except ResumeError as exc:
        reasons.append(str(exc))
        logger.warning("restore from shadow memory failed (%s); trying the snapshots on disk", exc)
    if snapshot_dir is not None:
        try:
            state = from_snapshots(snapshot_dir)
        except ResumeError as exc:
            reasons.append(str(exc))
        else:
            logger.warning(
                "restored step %d from disk (%s): %s iterations the shadows had applied are lost",
                state.iteration,
                state.detail,
                "an unknown number of" if state.lost_iterations is None else state.lost_iterations,
            )
            return state
    logger.warning("no certified state anywhere (%s): starting from iteration 0", "; ".join(reasons))
    return None


def fetch_iteration(
    shadows: Mapping[str, Addr], iteration: int, timeout: float = 30.0, job_id: int = 0
) -> RestoredState:
    """Every shadow's shard of exactly the state after ``iteration`` (waiting up to ``timeout``), merged."""
    if not shadows:
        raise ResumeError("no shadow addresses")
    names = list(shadows)
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        try:
            replies = list(
                pool.map(lambda n: fetch_shard(shadows[n], iteration, timeout, timeout, job_id), names)
            )
        except (RestoreError, OSError, ControlProtocolError) as exc:
            raise ResumeError(f"cannot fetch iteration {iteration} from the shadows: {exc}") from None
    refused = [f"{n}: {r.reason}" for n, r in zip(names, replies, strict=True) if not isinstance(r, JobStart)]
    if refused:
        raise ResumeError(f"shadows refused iteration {iteration}: {'; '.join(refused)}")
    try:
        state = merge_shards([r for r in replies if isinstance(r, JobStart)])
    except RestoreError as exc:
        raise ResumeError(str(exc)) from None
    return _from_merged(state, ", ".join(names))


# ---- applying -----------------------------------------------------------------------------
def _unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(model, nn.parallel.DistributedDataParallel) and inner is not None else model


def load_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: RestoredState,
    stateful: Mapping[str, Any] | None = None,
) -> None:
    """Copy ``state`` into the model (parameters, persistent buffers), optimizer and stateful objects.

    Strict about names and shapes; ResumeError saying what does not fit.
    """
    module = _unwrap(model)
    named = dict(module.named_parameters())
    missing = sorted(set(named) - set(state.parameters))
    extra = sorted(set(state.parameters) - set(named))
    if missing or extra:
        raise ResumeError(f"the state does not fit this model: missing {missing[:5]}, unknown {extra[:5]}")
    if state.optimizer_kind and state.optimizer_kind != type(optimizer).__name__:
        raise ResumeError(
            f"the state holds {state.optimizer_kind} state, the optimizer is {type(optimizer).__name__}"
        )
    with torch.no_grad():
        for name, parameter in named.items():
            value = state.parameters[name]
            if tuple(value.shape) != tuple(parameter.shape):
                raise ResumeError(f"{name}: state shape {tuple(value.shape)}, model {tuple(parameter.shape)}")
            parameter.copy_(value.to(parameter.dtype))
    names = {id(p): n for n, p in named.items()}
    saved = optimizer.state_dict()
    per_index: dict[int, dict[str, Any]] = {}
    index = 0
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            entry = state.optimizer_state.get(names[id(parameter)])
            if entry:
                per_index[index] = {
                    k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()
                }
            index += 1
    optimizer.load_state_dict({"state": per_index, "param_groups": saved["param_groups"]})
    _load_job_state(module, optimizer, state.job_state, dict(stateful or {}))


def _load_job_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, job_state: JobState | None, stateful: dict[str, Any]
) -> None:
    buffers = persistent_buffers(module)
    if job_state is None:
        if stateful:
            raise ResumeError(
                f"the restored state holds no job state (a version-1 checkpoint or an older agent): "
                f"cannot restore stateful object(s) {sorted(stateful)}"
            )
        if buffers:
            logger.warning(
                "the restored state holds no buffers: %s keep their current values", sorted(buffers)
            )
        return
    try:
        saved_buffers = job_state.buffers
        if set(saved_buffers) != set(buffers):
            raise ResumeError(
                f"the state's buffers {sorted(saved_buffers)[:5]} do not fit the model's "
                f"{sorted(buffers)[:5]}"
            )
        with torch.no_grad():
            for name, buffer in buffers.items():
                value = saved_buffers[name]
                if tuple(value.shape) != tuple(buffer.shape) or value.dtype != buffer.dtype:
                    raise ResumeError(
                        f"buffer {name}: state {tuple(value.shape)} {value.dtype}, "
                        f"model {tuple(buffer.shape)} {buffer.dtype}"
                    )
                buffer.copy_(value)
        groups = job_state.param_groups
        if groups:
            if len(groups) != len(optimizer.param_groups):
                raise ResumeError(
                    f"the state has {len(groups)} param groups, the optimizer {len(optimizer.param_groups)}"
                )
            for live, hyper in zip(optimizer.param_groups, groups, strict=True):
                for key, value in hyper.items():
                    live[key] = value.clone() if isinstance(value, torch.Tensor) else value
        load_stateful(stateful, job_state)
    except JobStateError as exc:
        raise ResumeError(str(exc)) from None


def resume(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    stateful: Mapping[str, Any] | None = None,
    snapshot_dir: str | Path | None = None,
    timeout: float = 20.0,
    shadows: Mapping[str, Addr] | None = None,
    job_id: int | None = None,
) -> ResumePoint:
    """Restore the job's latest certified state into ``model``, ``optimizer`` and ``stateful``.

    Collective when a default process group exists: every rank calls it; rank 0
    fetches (shadow memory, then ``snapshot_dir`` / ``CHECKMATE_SNAPSHOT_DIR``) and
    every rank loads the same state. ``shadows`` and ``job_id`` default to the
    job's configuration (``CheckmateConfig.from_env``). Returns where to continue
    (iteration 0 and no data position when nothing was restored). Raises
    ResumeError when a state was found but does not fit the job.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    box: list[Any] = [None]
    if rank == 0:
        if shadows is None or job_id is None:
            from hosts.ddp import CheckmateConfig

            config = CheckmateConfig.from_env()
            shadows = dict(config.shadow_control) if shadows is None else shadows
            job_id = config.job_id if job_id is None else job_id
        directory = snapshot_dir if snapshot_dir is not None else os.environ.get(SNAPSHOT_DIR_ENV) or None
        box[0] = restore_latest(
            shadows, Path(directory) if directory else None, timeout=timeout, job_id=job_id
        )
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    state: RestoredState | None = box[0]
    if state is None:
        return ResumePoint(iteration=0)
    load_state(model, optimizer, state, stateful)
    logger.info(
        "resumed after iteration %d from %s (%s)%s",
        state.iteration,
        state.source,
        state.detail,
        f"; {state.lost_iterations} iterations lost" if state.lost_iterations else "",
    )
    return ResumePoint(
        iteration=state.next_iteration,
        optimizer_step=state.optimizer_step,
        data_position=state.data_position,
        source=state.source,
        detail=state.detail,
        lost_iterations=state.lost_iterations,
    )


def settle_buckets(ddp_model: nn.parallel.DistributedDataParallel, loss: Callable[[], torch.Tensor]) -> None:
    """One forward and backward pass without an optimizer step, so DDP's gradient buckets are final.

    DDP starts with buckets in reverse parameter order and rebuilds them once, in the
    order gradients became ready, at the next forward pass. With more than 2 ranks
    the ring sums an element in an order that depends on where it sits in its bucket,
    so a job resumed at iteration t would reduce t with other buckets (and other
    rounding) than a job that never stopped. Call this at every start (fresh or
    resumed, before ``enable_checkmate``) with a closure computing a loss on any
    batch; the gradients are dropped and the persistent buffers the pass changed
    (BatchNorm statistics) are put back.
    """
    module = ddp_model.module
    saved = {name: buffer.detach().clone() for name, buffer in persistent_buffers(module).items()}
    loss().backward()
    module.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, buffer in persistent_buffers(module).items():
            buffer.copy_(saved[name])
