"""Worker-side resume: one call restores a DDP job from its shadows, or from disk, exactly.

A restarted training script calls, on every rank, before ``enable_checkmate``::

    point = hosts.resume(ddp_model, optimizer, stateful={"scheduler": sched})
    agent = hosts.enable_checkmate(ddp_model, optimizer, stateful={"scheduler": sched}, resume=point)
    for iteration in range(point.iteration, total): ...

Rank 0 asks, in this order,

1. the shadows' memory (:class:`checkmate.checkpoint.shadow_memory.ShadowMemory`; the shadows named by
   ``CHECKMATE_SHADOWS`` / ``CHECKMATE_JOB_FILE``): the latest iteration every
   shadow has applied, merged, every parameter exactly once;
2. when no shadow answers (or none holds state), the newest *complete*
   universal checkpoint in the shadows' snapshot directory
   (:class:`checkmate.checkpoint.source.SnapshotDirectory`; ``snapshot_dir`` or
   ``CHECKMATE_SNAPSHOT_DIR``, a directory this rank can read): how many
   iterations that loses, as far as the shadows' status files tell, is logged
   and returned (:attr:`ResumePoint.lost_iterations`);
3. when neither holds a state, nothing: the job starts at iteration 0.

Both are state sources (:class:`checkmate.checkpoint.source.StateSource`), asked
in that order; the state is loaded by the checkpoint package's one loader
(:func:`checkmate.checkpoint.load.load_state`), so the checks are the same
whichever source answered.

Every rank receives the same state (``broadcast_object_list`` on the default
process group) and loads it: parameters, optimizer state, the param groups'
hyperparameters in force, the model's persistent buffers, each stateful
object (``load_state_dict``). The returned :class:`ResumePoint` says where to
continue: :attr:`~ResumePoint.iteration` (the restored iteration + 1) and the
data position the script set with ``agent.set_data_position`` for it.

Bit-identical resume needs what an uninterrupted run would have had: with 2
ranks every element's all-reduce is one addition, so DDP's bucket order does
not matter; with more ranks call :func:`settle_buckets` at every start (fresh or
resumed), so every iteration sums in the same order. Random numbers (dropout)
resume exactly when the job passes :class:`hosts.RandomState` in ``stateful``
to both ``enable_checkmate`` and :func:`resume` (every rank seeded identically).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checkmate.checkpoint import load as checkpoint_load
from checkmate.checkpoint.format import CheckpointError
from checkmate.checkpoint.shadow_memory import ShadowMemory
from checkmate.checkpoint.source import (
    SOURCE_NONE,
    SOURCE_SHADOW_MEMORY,
    SOURCE_SNAPSHOT,
    RestoredState,
    SnapshotDirectory,
    SourceError,
    StateSource,
)
from checkmate.job_state import persistent_buffers
from checkmate.network import Addr

logger = logging.getLogger(__name__)

SNAPSHOT_DIR_ENV = "CHECKMATE_SNAPSHOT_DIR"


class ResumeError(RuntimeError):
    """A certified state could not be fetched or does not fit the job; the message says why."""


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


def optimizer_states_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer's per-parameter state keyed by the parameter's fully-qualified name."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: dict(s) for p, s in optimizer.state.items() if id(p) in names}


# ---- fetching -----------------------------------------------------------------------------
def from_shadows(shadows: Mapping[str, Addr], timeout: float, job_id: int = 0) -> RestoredState:
    """The latest state every shadow can serve, from their memory; ResumeError if there is none."""
    try:
        return ShadowMemory(shadows, job_id).latest(timeout)
    except SourceError as exc:
        raise ResumeError(str(exc)) from None


def from_snapshots(directory: Path) -> RestoredState:
    """The newest complete checkpoint in the shadows' snapshot directory; ResumeError if none.

    ``lost_iterations``: how far the shadows' memory was ahead of it, from their
    status files in the same directory (rewritten once a second, so a lower bound);
    None when there are none.
    """
    try:
        return SnapshotDirectory(directory).latest()
    except SourceError as exc:
        raise ResumeError(str(exc)) from None


def restore_latest(
    shadows: Mapping[str, Addr], snapshot_dir: Path | None, timeout: float = 20.0, job_id: int = 0
) -> RestoredState | None:
    """Shadow memory first, then the snapshot directory; None when neither holds a state."""
    sources: list[StateSource] = [ShadowMemory(shadows, job_id)]
    if snapshot_dir is not None:
        sources.append(SnapshotDirectory(snapshot_dir))
    reasons = []
    for source in sources:
        try:
            state = source.latest(timeout)
        except SourceError as exc:
            reasons.append(str(exc))
            if source.kind == SOURCE_SHADOW_MEMORY:
                logger.warning("restore from shadow memory failed (%s); trying the snapshots on disk", exc)
            continue
        if state.source == SOURCE_SNAPSHOT:
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
    try:
        return ShadowMemory(shadows, job_id).at(iteration, timeout)
    except SourceError as exc:
        raise ResumeError(str(exc)) from None


# ---- applying -----------------------------------------------------------------------------
def load_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: RestoredState,
    stateful: Mapping[str, Any] | None = None,
) -> None:
    """Copy ``state`` into the model (parameters, persistent buffers), optimizer and stateful objects.

    Strict about names, shapes, the optimizer's kind and param groups
    (:func:`checkmate.checkpoint.load.load_state`); ResumeError saying what does not fit.
    """
    try:
        checkpoint_load.load_state(model, optimizer, state, stateful)
    except CheckpointError as exc:
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
