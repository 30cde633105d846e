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

**Tensor parallelism (TP x DP).** With ``CHECKMATE_TP_DEGREE`` = T > 1 (or ``tp_degree=T``)
each TP index t's DP group is a Checkmate *lane* (its own job id, shadows and snapshots,
holding that TP shard). The same call, on every rank, is then lane-aware::

    point = hosts.resume(ddp, optimizer)      # ddp = DDP(model, process_group=<the lane's DP group>)

Each lane's first rank (DP index 0) asks its own lane's sources, in this order: the lane's
shadows' memory (job ``CHECKMATE_JOB_ID + t`` / the lane's job file), the lane's snapshot
directory (``snapshot_dir`` with ``{tp_index}`` in it, e.g. ``snapshots/lane{tp_index}``), and
the merged universal checkpoint (``merged_dir``, written by
:func:`checkmate.universal.shadow_merge.merge_lane_snapshots`; the lane loads its TP slice).
The lanes then agree on one iteration (a TP job cannot continue with its shards at
different iterations): all ranks exchange what their lane found (``all_gather_object`` on
the default group); a lane behind the newest waits for its shadows to reach it; when one
cannot, every lane takes the oldest and a lane ahead reads that step from its snapshots
(or the merged checkpoint). The lane's state is then broadcast in its DP group
(``group``; default: the DDP model's ``process_group``) and loaded. A lane that cannot
provide the agreed iteration raises :class:`ResumeError` on every rank, naming the lane.
:attr:`ResumePoint.lanes` says where each lane's state came from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checkmate import checkpoint as fmt
from checkmate.checkpoint.shadow_memory import ShadowMemory
from checkmate.checkpoint.source import SOURCE_NONE, RestoredState, SnapshotDirectory, SourceError
from checkmate.job_state import persistent_buffers
from checkmate.network import Addr
from hosts.ddp_config import CheckmateConfig, CheckmateConfigError, ResumeConfig
from hosts.recovery_sources import (
    SOURCE_MERGED,
    LaneRestore,
    ResumeError,
    ResumePoint,
    fetch_iteration,
    from_merged,
    from_shadows,
    from_snapshots,
    load_state,
    optimizer_states_by_name,
    restore_latest,
    workers_finished,
)

__all__ = [
    "SOURCE_MERGED",
    "LaneRestore",
    "ResumeError",
    "ResumePoint",
    "fetch_iteration",
    "from_merged",
    "from_shadows",
    "from_snapshots",
    "load_state",
    "optimizer_states_by_name",
    "restore_latest",
    "resume",
    "settle_buckets",
    "workers_finished",
]
"""The parts of resuming live in :mod:`hosts.recovery_sources`; they are importable from here as before."""

logger = logging.getLogger(__name__)


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
    tp_degree: int | None = None,
    group: dist.ProcessGroup | None = None,
    merged_dir: str | Path | None = None,
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

    ``shadows`` maps each shadow's *name* to its control address: the node's hello must
    name itself so, or it is refused and asked nothing (a redirected connection cannot
    answer for another shadow); only ``CHECKMATE_SHADOWS`` entries without ``NAME=`` go
    unchecked.

    Tensor parallelism (the module docstring): ``tp_degree`` (default ``CHECKMATE_TP_DEGREE``, 1)
    > 1 makes the call lane-aware; ``group`` is this rank's lane, the DP group of its TP index
    (default: ``model.process_group`` of a DDP model); ``shadows``, when given, are this rank's
    lane's; ``job_id`` is the first lane's (lane t is job ``job_id + t``, as ``CHECKMATE_JOB_ID``);
    ``snapshot_dir`` names each lane's directory with ``{tp_index}``;
    ``merged_dir`` is the lanes' merged universal checkpoint, the last source asked.
    """
    try:  # the entry point's one read of the environment (arguments given here take precedence)
        settings = ResumeConfig.from_env()
    except CheckmateConfigError as exc:
        raise ResumeError(str(exc)) from None
    tp = settings.tp_degree if tp_degree is None else tp_degree
    if snapshot_dir is None:
        snapshot_dir = settings.snapshot_dir
    if shadows is not None and job_id is None:
        job_id = settings.job_id
    if tp < 1:
        raise ResumeError(f"tp_degree {tp}: a tensor-parallel degree is at least 1")
    if tp > 1:
        return _resume_lane(
            model,
            optimizer,
            _LaneRequest(tp, group, stateful, shadows, job_id, snapshot_dir, merged_dir, timeout, start_over),
        )
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
    unnamed: frozenset[str] = frozenset()
    if shadows is None:
        config = CheckmateConfig.from_env()
        shadows = dict(config.shadow_control)
        unnamed = config.unnamed_shadows
        job_id = config.job_id if job_id is None else job_id
    assert job_id is not None  # resume() filled it (CHECKMATE_JOB_ID) when it was given shadows
    state = restore_latest(
        shadows,
        Path(snapshot_dir) if snapshot_dir else None,
        timeout=timeout,
        job_id=job_id,
        start_over=start_over,
        unnamed=unnamed,
    )
    if state is None:
        return None
    return state, workers_finished(shadows, min(timeout, 5.0), job_id, unnamed)


# ---- tensor parallelism: one lane per TP index ----------------------------------------------
@dataclass
class _LaneRequest:
    """What :func:`resume` was given, for :func:`_resume_lane`."""

    tp: int
    group: dist.ProcessGroup | None
    stateful: Mapping[str, Any] | None
    shadows: Mapping[str, Addr] | None
    job_id: int | None
    snapshot_dir: str | Path | None
    merged_dir: str | Path | None
    timeout: float
    start_over: bool


@dataclass
class _LaneSources:
    """A lane leader's sources: its shadows, its snapshot directory, the merged checkpoint."""

    tp: int
    tp_index: int
    job_id: int
    shadows: dict[str, Addr]
    lane_dir: Path | None
    merged_dir: Path | None
    unnamed: frozenset[str] = frozenset()
    """Names of :attr:`shadows` made up for addresses given without one (not checked)."""

    def latest(self, timeout: float, start_over: bool) -> RestoredState | None:
        """The lane's newest state: memory, then its snapshots, then the merged checkpoint."""
        state = restore_latest(self.shadows, self.lane_dir, timeout, self.job_id, start_over, self.unnamed)
        if state is None and self.merged_dir is not None and fmt.complete_steps(self.merged_dir):
            state = from_merged(self.merged_dir, self.tp, self.tp_index)
            logger.warning(
                "lane %d: restored step %d from the merged checkpoint", self.tp_index, state.iteration
            )
        return state

    def at_from_memory(self, iteration: int, timeout: float) -> RestoredState | None:
        """The state after ``iteration`` from the lane's shadows (waiting up to ``timeout``), or None."""
        if not self.shadows:
            return None
        try:
            return ShadowMemory(self.shadows, self.job_id, self.unnamed).at(iteration, timeout)
        except SourceError as exc:
            logger.info("lane %d: the shadows cannot serve iteration %d: %s", self.tp_index, iteration, exc)
            return None

    def at_from_disk(self, iteration: int) -> RestoredState | None:
        """The state after ``iteration`` from the lane's snapshots, else the merged checkpoint, or None."""
        if self.lane_dir is not None and iteration in fmt.complete_steps(self.lane_dir):
            try:
                return SnapshotDirectory(self.lane_dir, iteration).latest()
            except SourceError as exc:
                logger.warning("lane %d: %s", self.tp_index, exc)
        if self.merged_dir is not None and iteration in fmt.complete_steps(self.merged_dir):
            try:
                return from_merged(self.merged_dir, self.tp, self.tp_index, iteration)
            except ResumeError as exc:
                logger.warning("lane %d: %s", self.tp_index, exc)
        return None


def _lane_note(
    t: int, job_id: int, state: RestoredState | None, finished: int | None = None
) -> dict[str, Any]:
    """What a lane leader tells every rank about its lane (``all_gather_object``; plain data only)."""
    return {
        "tp_index": t,
        "job_id": job_id,
        "iteration": None if state is None else state.iteration,
        "source": SOURCE_NONE if state is None else state.source,
        "detail": "" if state is None else state.detail,
        "finished": finished,
        "error": None,
    }


def _gather_lanes(note: dict[str, Any] | None, tp: int) -> dict[int, dict[str, Any]]:
    """Every lane leader's note, by TP index, on every rank (collective on the default group)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, note)
    lanes = {int(n["tp_index"]): n for n in gathered if isinstance(n, dict)}
    missing = sorted(set(range(tp)) - set(lanes))
    if missing:
        raise ResumeError(f"no answer from lane(s) {missing}: every lane's DP index 0 must call hosts.resume")
    return lanes


def _lane_group(model: nn.Module, request: _LaneRequest) -> tuple[dist.ProcessGroup, int, int]:
    """(this rank's lane group, its TP index, the global rank of the lane's leader); ResumeError if wrong."""
    if not dist.is_initialized():
        raise ResumeError(f"tp_degree {request.tp}: resuming a TP x DP job needs the default process group")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % request.tp:
        raise ResumeError(f"tp_degree {request.tp} does not divide the world size {world}")
    t = rank % request.tp
    group = request.group if request.group is not None else getattr(model, "process_group", None)
    if group is None:
        raise ResumeError(
            f"tp_degree {request.tp}: pass group=<this rank's DP group> or a DDP model built with "
            "process_group=<the DP group> (the lane this rank restores)"
        )
    members = dist.get_process_group_ranks(group)
    expected = list(range(t, world, request.tp))
    if sorted(members) != expected:
        raise ResumeError(
            f"rank {rank} (TP index {t}): its group holds ranks {sorted(members)}, but its lane is the DP "
            f"group of TP index {t}: ranks {expected} (rank = dp_index * {request.tp} + tp_index)"
        )
    return group, t, dist.get_global_rank(group, 0)


def _lane_sources(request: _LaneRequest, t: int) -> _LaneSources:
    """The lane leader's sources, from what :func:`resume` was given or the job's configuration."""
    shadows, job_id = request.shadows, request.job_id
    unnamed: frozenset[str] = frozenset()
    if shadows is None:
        try:
            config = CheckmateConfig.from_env()
        except CheckmateConfigError as exc:
            raise ResumeError(f"lane {t}: {exc}") from None
        shadows = dict(config.shadow_control)
        unnamed = config.unnamed_shadows
        job_id = config.job_id if job_id is None else job_id + t
    else:
        assert job_id is not None  # resume() filled it
        job_id += t
    directory = request.snapshot_dir
    lane_dir = None
    if directory:
        text = str(directory)
        if "{tp_index}" not in text:
            raise ResumeError(
                f"snapshot_dir {text!r}: with tp_degree {request.tp} every lane has its own snapshot "
                "directory; name it with {tp_index} (e.g. snapshots/lane{tp_index})"
            )
        lane_dir = Path(text.replace("{tp_index}", str(t)))
    merged = Path(request.merged_dir) if request.merged_dir is not None else None
    return _LaneSources(request.tp, t, job_id, dict(shadows), lane_dir, merged, unnamed)


def _resume_lane(model: nn.Module, optimizer: torch.optim.Optimizer, request: _LaneRequest) -> ResumePoint:
    """:func:`resume` for a TP x DP job: every lane restores its own shard, all at one iteration."""
    group, t, leader = _lane_group(model, request)
    is_leader = dist.get_rank() == leader
    sources: _LaneSources | None = None
    original: RestoredState | None = None
    note: dict[str, Any] | None = None
    if is_leader:
        try:
            sources = _lane_sources(request, t)
            original = sources.latest(request.timeout, request.start_over)
            finished = (
                None
                if original is None
                else workers_finished(
                    sources.shadows, min(request.timeout, 5.0), sources.job_id, sources.unnamed
                )
            )
            note = _lane_note(t, sources.job_id, original, finished)
        except ResumeError as exc:
            note = {**_lane_note(t, -1, None), "error": str(exc)}
    lanes = _gather_lanes(note, request.tp)
    _raise_lane_errors(lanes)
    held = {u: n["iteration"] for u, n in lanes.items()}
    if all(i is None for i in held.values()):
        logger.info("no lane holds a state: starting from iteration 0")
        return ResumePoint(iteration=0)
    if any(i is None for i in held.values()):
        empty = sorted(u for u, i in held.items() if i is None)
        story = _lane_story(lanes)
        if not request.start_over:
            raise ResumeError(
                f"lane(s) {empty} hold no state while the others do ({story}); the lanes of a TP job "
                "restore together: bring the lanes' shadows or snapshots back, or pass start_over=True"
            )
        logger.error("lane(s) %s hold no state (%s); starting from iteration 0 as asked", empty, story)
        return ResumePoint(iteration=0)
    state = original
    target = max(i for i in held.values() if i is not None)
    low = min(i for i in held.values() if i is not None)
    newest = target
    if low != target:  # the lanes differ: those behind wait for their shadows to reach the newest
        logger.warning("the lanes hold different iterations (%s); agreeing on one", _lane_story(lanes))
        state, lanes = _agree(state, sources, lanes, target, min(request.timeout, 10.0), from_disk=False)
        if any(n["iteration"] != target for n in lanes.values()):  # else the oldest, from disk
            state, lanes = _agree(original, sources, lanes, low, request.timeout, from_disk=True)
            target = low
            if any(n["iteration"] != target for n in lanes.values()):
                raise ResumeError(
                    f"the lanes cannot agree on an iteration ({_lane_story(lanes)}): a lane behind cannot "
                    f"reach iteration {newest} (no shadow has it) and a lane ahead has no "
                    f"snapshot of iteration {low} (pass snapshot_dir with {{tp_index}} or merged_dir)"
                )
    box: list[Any] = [state]
    dist.broadcast_object_list(box, src=leader, group=group)
    mine: RestoredState = box[0]
    load_state(model, optimizer, mine, request.stateful)
    finished_all = [n["finished"] for n in lanes.values() if isinstance(n["finished"], int)]
    finished = max(finished_all) if finished_all else None
    lost = None if finished is None else max(0, finished - target)
    summary = tuple(
        LaneRestore(u, int(n["job_id"]), target, str(n["source"]), str(n["detail"]), n["finished"])
        for u, n in sorted(lanes.items())
    )
    logger.log(
        logging.WARNING if lost else logging.INFO,
        "lane %d resumed after iteration %d, every lane at the same iteration (%s); %s",
        t,
        target,
        _lane_story(lanes),
        "how many finished iterations are lost is unknown"
        if lost is None
        else f"{lost} finished iteration(s) lost",
    )
    return ResumePoint(
        iteration=mine.next_iteration,
        optimizer_step=mine.optimizer_step,
        data_position=mine.data_position,
        source=mine.source,
        detail=mine.detail,
        lost_iterations=lost,
        workers_finished=finished,
        lanes=summary,
    )


def _agree(
    state: RestoredState | None,
    sources: _LaneSources | None,
    lanes: dict[int, dict[str, Any]],
    target: int,
    timeout: float,
    from_disk: bool,
) -> tuple[RestoredState | None, dict[int, dict[str, Any]]]:
    """One round: each leader not at ``target`` fetches it (memory, or disk); all learn how it went."""
    note: dict[str, Any] | None = None
    if sources is not None:  # a lane leader
        t = sources.tp_index
        mine = lanes[t]
        if state is not None and state.iteration != target:
            found = sources.at_from_disk(target) if from_disk else sources.at_from_memory(target, timeout)
            if found is not None:
                state = found
        note = {**_lane_note(t, sources.job_id, state, mine["finished"])}
    return state, _gather_lanes(note, len(lanes))


def _raise_lane_errors(lanes: Mapping[int, Mapping[str, Any]]) -> None:
    errors = [f"lane {u}: {n['error']}" for u, n in sorted(lanes.items()) if n.get("error")]
    if errors:
        raise ResumeError("; ".join(errors))


def _lane_story(lanes: Mapping[int, Mapping[str, Any]]) -> str:
    return ", ".join(
        f"lane {u} (job {n['job_id']}): "
        + ("nothing" if n["iteration"] is None else f"iteration {n['iteration']} from {n['source']}")
        for u, n in sorted(lanes.items())
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
