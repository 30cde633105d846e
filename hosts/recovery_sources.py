"""Where a resumed job's state comes from, and how it is loaded: the parts :mod:`hosts.recovery` uses.

:func:`restore_latest` asks the shadows' memory, then the snapshot directory
(:mod:`checkmate.checkpoint.source`); :func:`from_merged` reads one TP lane's slice of the
lanes' merged universal checkpoint; :func:`load_state` copies a state into a model, its
optimizer and the job's stateful objects. :class:`ResumePoint` is what :func:`hosts.resume`
returns. Everything here runs on the calling thread and starts no thread.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
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
from checkmate.network import Addr

logger = logging.getLogger(__name__)


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
    lanes: tuple[LaneRestore, ...] = ()
    """TP x DP: where each lane's state came from, in TP index order (empty without tensor parallelism)."""

    @property
    def restored(self) -> bool:
        return self.source != SOURCE_NONE

    @property
    def restored_iteration(self) -> int | None:
        return self.iteration - 1 if self.restored else None


@dataclass(frozen=True)
class LaneRestore:
    """What one lane (TP index) of a TP x DP job restored."""

    tp_index: int
    job_id: int
    iteration: int
    """The iteration restored (the same in every lane)."""
    source: str
    detail: str
    workers_finished: int | None = None
    """The newest iteration this lane's shadows saw its workers finish (None: unknown)."""


def optimizer_states_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer's per-parameter state keyed by the parameter's fully-qualified name."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: dict(s) for p, s in optimizer.state.items() if id(p) in names}


# ---- fetching -----------------------------------------------------------------------------
def from_shadows(
    shadows: Mapping[str, Addr], timeout: float, job_id: int = 0, unnamed: Collection[str] = ()
) -> RestoredState:
    """The latest state every shadow can serve, from their memory; ResumeError if there is none.

    Each shadow is asked by name: a node whose hello names another is refused (``unnamed``:
    names made up for addresses given without one, not checked; :class:`ShadowMemory`).
    """
    try:
        return ShadowMemory(shadows, job_id, unnamed).latest(timeout)
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
    unnamed: Collection[str] = (),
) -> RestoredState | None:
    """Shadow memory first, then the snapshot directory; None when neither holds a state.

    ResumeError naming the damaged file when the newest complete checkpoint fails verification
    (unless ``start_over``: then None, with an error logged).
    """
    sources: list[StateSource] = [ShadowMemory(shadows, job_id, unnamed)]
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


def workers_finished(
    shadows: Mapping[str, Addr], timeout: float, job_id: int = 0, unnamed: Collection[str] = ()
) -> int | None:
    """The newest iteration any shadow saw the workers finish, from their live status (None: none said).

    A shadow has seen iteration t finished when it holds t's commit record (sent after t's
    optimizer step) or copies of t + 1's reduced gradients (t + 1's all-reduce starts after
    t's step): ``max(latest_commit, latest_seen_iteration - 1)``.
    """
    seen: list[int] = []
    for name, address in shadows.items():
        try:
            status = query_status(address, timeout, job_id, name=None if name in unnamed else name)
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
    shadows: Mapping[str, Addr],
    iteration: int,
    timeout: float = 30.0,
    job_id: int = 0,
    unnamed: Collection[str] = (),
) -> RestoredState:
    """Every shadow's shard of exactly the state after ``iteration`` (waiting up to ``timeout``), merged."""
    try:
        return ShadowMemory(shadows, job_id, unnamed).at(iteration, timeout)
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


def from_merged(
    directory: str | Path, tp_degree: int, tp_index: int, step: int | None = None
) -> RestoredState:
    """TP index ``tp_index``'s slice of a merged universal checkpoint (newest complete step, or ``step``).

    The checkpoint :func:`checkmate.universal.shadow_merge.merge_lane_snapshots` writes from the
    lanes' snapshots (layout-free, whole tensors); the slice is what that lane's ranks hold under
    ``Layout(tp=tp_degree)``, by the checkpoint's own reshape rules. ResumeError if unusable.
    """
    from checkmate.universal.layout import Layout
    from checkmate.universal.load import load_rank
    from checkmate.universal.spec import LayoutError

    try:
        reader = fmt.CheckpointReader(Path(directory), step)
        held = load_rank(reader, Layout(tp=tp_degree), tp_index)
    except (CheckpointError, LayoutError, OSError, KeyError) as exc:
        raise ResumeError(f"no usable merged checkpoint in {directory}: {exc}") from None
    if held.param_flat is not None:
        raise ResumeError(f"{directory} step {reader.step}: a flat-partitioned layout cannot be a TP lane")
    optimizer = reader.global_state.get("optimizer")
    optimizer = dict(optimizer) if isinstance(optimizer, dict) else {}
    extra = reader.global_state.get("extra")
    extra = extra if isinstance(extra, dict) else {}
    return RestoredState(
        iteration=reader.step,
        source=SOURCE_MERGED,
        parameters=dict(held.params),
        optimizer_state={
            name: {**held.states.get(name, {}), **held.scalars.get(name, {})} for name in held.params
        },
        optimizer_step=int(extra.get("optimizer_step", 0) or 0),
        data_position=extra.get("data_position"),
        detail=f"{reader.directory} (TP index {tp_index} of {tp_degree})",
        job_state=reader.job_state(),
        optimizer_kind=optimizer.get("kind"),
        optimizer=optimizer,
    )


SOURCE_MERGED = "merged-snapshot"
"""A :class:`RestoredState` read from the lanes' merged universal checkpoint (:func:`from_merged`)."""
