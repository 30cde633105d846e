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
   ``CHECKMATE_SNAPSHOT_DIR``, a directory this rank can read). A newest complete
   checkpoint that fails verification (a checksum, a truncated file) raises
   :class:`ResumeError` naming the damaged file: starting over needs ``start_over=True``;
3. when neither holds a state, nothing: the job starts at iteration 0.

:attr:`ResumePoint.lost_iterations` is measured at the restore, from the shadows' live
answers (never from their periodic status files): the newest iteration the shadows saw
the workers finish (its commit record, or the next iteration's gradients) minus the
restored one. The iteration in progress at the failure is redone as well, so a job
killed in iteration ``k`` redoes ``lost_iterations + 1`` iterations. None when no shadow
could say (every shadow lost too: a disk restore's loss is then unknown).

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

from checkmate import checkpoint as fmt
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
from checkmate.control import ShadowStatusError, query_status
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
    """Iterations the workers had finished that the restored state lacks, measured at the restore from
    the shadows' answers (the module docstring says how); None: unknown (no shadow could tell)."""
    workers_finished: int | None = None
    """The newest iteration the shadows saw the workers finish (None: unknown, or nothing restored)."""

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
    shadows: Mapping[str, Addr],
    snapshot_dir: Path | None,
    timeout: float = 20.0,
    job_id: int = 0,
    start_over: bool = False,
) -> RestoredState | None:
    """Shadow memory first, then the snapshot directory; None when neither holds a state.

    ResumeError naming the damaged file when the newest complete checkpoint fails verification
    (unless ``start_over``: then None, with an error logged).
    """
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
                logger.info("no state from the shadows' memory (%s); trying the snapshots on disk", exc)
            elif snapshot_dir is not None and (steps := fmt.complete_steps(snapshot_dir)):
                damaged = (
                    f"the newest complete checkpoint in {snapshot_dir} (step {steps[-1]}) fails "
                    f"verification and no shadow holds a state: {exc}"
                )
                if not start_over:
                    raise ResumeError(
                        f"{damaged}. Nothing was restored. Check it with `checkmate-ckpt verify "
                        f"{snapshot_dir}`, move the damaged step aside to resume from an older one, or pass "
                        "start_over=True to hosts.resume to start from iteration 0"
                    ) from None
                logger.error("%s; starting from iteration 0 as asked (start_over=True)", damaged)
                return None
            continue
        if state.source == SOURCE_SNAPSHOT:
            logger.warning("restored step %d from disk (%s)", state.iteration, state.detail)
        return state
    # A fresh start (the shadows hold nothing yet, no snapshots): nothing to warn about.
    logger.info("no state to restore (%s): starting from iteration 0", "; ".join(reasons))
    return None


def workers_finished(shadows: Mapping[str, Addr], timeout: float, job_id: int = 0) -> int | None:
    """The newest iteration any shadow saw the workers finish, from their live status (None: none said).

    A shadow has seen iteration t finished when it holds t's commit record (sent after t's
    optimizer step) or copies of t + 1's reduced gradients (t + 1's all-reduce starts after
    t's step): ``max(latest_commit, latest_seen_iteration - 1)``.
    """
    seen: list[int] = []
    for name, address in shadows.items():
        try:
            status = query_status(address, timeout, job_id)
        except (ShadowStatusError, OSError) as exc:
            logger.debug("shadow %s: no status (%s)", name, exc)
            continue
        if status.get("job_id") not in (None, job_id) and job_id:
            continue
        commit, latest = status.get("latest_commit"), status.get("latest_seen_iteration")
        values = [v for v in (commit, None if latest is None else latest - 1) if isinstance(v, int)]
        if values and max(values) >= 0:
            seen.append(max(values))
    return max(seen) if seen else None


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
    start_over: bool = False,
) -> ResumePoint:
    """Restore the job's latest certified state into ``model``, ``optimizer`` and ``stateful``.

    Collective when a default process group exists: every rank calls it; rank 0
    fetches (shadow memory, then ``snapshot_dir`` / ``CHECKMATE_SNAPSHOT_DIR``) and
    every rank loads the same state. ``shadows`` and ``job_id`` default to the
    job's configuration (``CheckmateConfig.from_env``; ``job_id`` defaults to 1, as
    there, when ``shadows`` are given without a process group). Returns where to
    continue (iteration 0 and no data position when nothing was restored). Raises
    ResumeError, on every rank, when a state was found but does not fit the job, or
    when the newest complete checkpoint on disk is damaged and no shadow holds a state
    (``start_over=True``: start from iteration 0 then, with an error logged).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    box: list[Any] = [None]
    if rank == 0:
        try:
            box[0] = _fetch(shadows, job_id, snapshot_dir, timeout, start_over)
        except ResumeError as exc:
            box[0] = exc  # every rank raises it, not only rank 0 (the others wait in the broadcast)
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], ResumeError):
        raise ResumeError(str(box[0]))
    if box[0] is None:
        return ResumePoint(iteration=0)
    state: RestoredState = box[0][0]
    finished: int | None = box[0][1]
    load_state(model, optimizer, state, stateful)
    lost = None if finished is None else max(0, finished - state.iteration)
    logger.log(
        logging.WARNING if lost else logging.INFO,
        "resumed after iteration %d from %s (%s): %s",
        state.iteration,
        state.source,
        state.detail,
        "the shadows saw no later iteration finish"
        if lost == 0
        else f"{lost} finished iteration(s) lost (the workers finished {finished})"
        if lost is not None
        else "how many finished iterations are lost is unknown (no shadow could tell)",
    )
    return ResumePoint(
        iteration=state.next_iteration,
        optimizer_step=state.optimizer_step,
        data_position=state.data_position,
        source=state.source,
        detail=state.detail,
        lost_iterations=lost,
        workers_finished=finished,
    )


def _fetch(
    shadows: Mapping[str, Addr] | None,
    job_id: int | None,
    snapshot_dir: str | Path | None,
    timeout: float,
    start_over: bool,
) -> tuple[RestoredState, int | None] | None:
    """Rank 0: the state to load and the newest iteration the shadows saw the workers finish."""
    if shadows is None:
        from hosts.ddp import CheckmateConfig

        config = CheckmateConfig.from_env()
        shadows = dict(config.shadow_control)
        job_id = config.job_id if job_id is None else job_id
    elif job_id is None:
        job_id = _job_id_env()
    directory = snapshot_dir if snapshot_dir is not None else os.environ.get(SNAPSHOT_DIR_ENV) or None
    state = restore_latest(
        shadows, Path(directory) if directory else None, timeout=timeout, job_id=job_id, start_over=start_over
    )
    if state is None:
        return None
    return state, workers_finished(shadows, min(timeout, 5.0), job_id)


def _job_id_env() -> int:
    """``CHECKMATE_JOB_ID`` (default 1, as :meth:`CheckmateConfig.from_env`), without needing a rank."""
    text = os.environ.get("CHECKMATE_JOB_ID") or "1"
    try:
        return int(text)
    except ValueError:
        raise ResumeError(f"CHECKMATE_JOB_ID={text!r} is not an integer") from None


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
