"""Iterations in flight at a shadow: placement of copies, commits, and readiness.

The shadow owns some buckets of the model (by shard key). For every iteration
between the last applied one and a bounded horizon it keeps one
:class:`~shadow.reassembly.BucketAssembly` per owned bucket and, once it
arrives, the iteration's commit record. Iteration t is *ready* when t - 1 has
been applied, its commit is here and every owned bucket is complete; missing
ranges of an iteration whose commit is here are what the shadow repairs.
Anything that cannot belong (another job, a bucket it does not own, elements
past a bucket's end, a wrong dtype, an iteration outside the window) is
dropped and counted by reason, never written.
"""

from __future__ import annotations

import collections
import enum
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from checkmate.tensors import torch_dtype
from checkmate.wire import CheckmateHeader, DType, MessageType
from shadow.optimizer_apply import StepRecord
from shadow.reassembly import BucketAssembly, PlaceResult, ReassemblyError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParameterSlot:
    """Where one parameter's gradient lies in its bucket."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    param_offset: int = 0
    """The slot holds elements ``[param_offset, param_offset + numel)`` of the flattened parameter
    (a segment of a sharded job's reduce-scatter); a whole parameter: 0 and all its elements."""

    @property
    def whole(self) -> bool:
        return self.param_offset == 0 and self.numel == math.prod(self.shape)


def check_segments(bucket_id: int, slots: tuple[ParameterSlot, ...] | list[ParameterSlot]) -> None:
    """Raise ValueError unless each parameter's slots in a bucket are it whole or tile it exactly."""
    by_name: dict[str, list[ParameterSlot]] = {}
    for slot in slots:
        by_name.setdefault(slot.name, []).append(slot)
    for name, pieces in by_name.items():
        if len(pieces) == 1 and pieces[0].whole:
            continue
        covered = 0
        for piece in sorted(pieces, key=lambda p: p.param_offset):
            if piece.param_offset != covered or piece.numel < 0:
                raise ValueError(
                    f"bucket {bucket_id}: the segments of parameter {name} do not tile it "
                    f"(elements {covered}.. expected, a segment starts at {piece.param_offset})"
                )
            covered += piece.numel
        if covered != math.prod(pieces[0].shape):
            raise ValueError(
                f"bucket {bucket_id}: the segments of parameter {name} cover {covered} of its "
                f"{math.prod(pieces[0].shape)} elements"
            )


@dataclass(frozen=True)
class BucketLayout:
    bucket_id: int
    numel: int
    parameters: tuple[ParameterSlot, ...]
    dtype: torch.dtype = torch.float32
    """The bucket's element type (the gradients' dtype: fp32, or bf16/fp16 for such a model)."""


class DropReason(enum.Enum):
    OTHER_JOB = "other_job"
    NOT_DATA = "not_data"
    NOT_OWNED = "bucket_not_owned"
    STALE = "stale_iteration"
    TOO_FAR_AHEAD = "iteration_too_far_ahead"
    OUT_OF_RANGE = "offset_past_bucket_end"
    WRONG_DTYPE = "wrong_dtype"
    DUPLICATE = "duplicate"
    REFUSED_BUCKET = "copy_of_refused_bucket"
    """A DATA copy of a bucket whose copies failed rank 0's gradient tag: only repairs fill it."""


@dataclass
class PendingIteration:
    iteration: int
    buckets: dict[int, BucketAssembly]
    step: StepRecord | None = None

    @property
    def complete(self) -> bool:
        return all(bucket.complete for bucket in self.buckets.values())

    def missing(self) -> dict[int, list[tuple[int, int]]]:
        return {b: gaps for b, a in self.buckets.items() if (gaps := a.missing())}


@dataclass
class WindowStats:
    placed_packets: int = 0
    placed_elements: int = 0
    drops: collections.Counter[str] = field(default_factory=collections.Counter)


class IterationWindow:
    """Placement and readiness of the iterations a shadow has not applied yet."""

    def __init__(
        self,
        job_id: int,
        layouts: Mapping[int, BucketLayout],
        owned_buckets: set[int],
        first_iteration: int,
        horizon: int = 4,
    ) -> None:
        unknown = sorted(owned_buckets - set(layouts))
        if unknown:
            raise ValueError(f"owned buckets {unknown} have no layout")
        self.job_id = job_id
        self.layouts = dict(layouts)
        self.owned = set(owned_buckets)
        self.next_iteration = first_iteration
        """The next iteration to apply; everything before it is done."""
        self.horizon = horizon
        self.pending: dict[int, PendingIteration] = {}
        self.stats = WindowStats()
        self.repair_only: set[tuple[int, int]] = set()
        """(iteration, bucket) whose copies were refused (:meth:`refuse_copies`): from then on only
        REPAIR_DATA, which carries the job's MAC, fills them."""

    def _iteration(self, iteration: int) -> PendingIteration:
        pending = self.pending.get(iteration)
        if pending is None:
            buckets = {
                b: BucketAssembly(self.layouts[b].numel, self.layouts[b].dtype) for b in sorted(self.owned)
            }
            pending = self.pending[iteration] = PendingIteration(iteration, buckets)
        return pending

    def _drop(self, reason: DropReason) -> DropReason:
        self.stats.drops[reason.value] += 1
        return reason

    def admits(self, iteration: int) -> DropReason | None:
        if iteration < self.next_iteration:
            return DropReason.STALE
        if iteration >= self.next_iteration + self.horizon:
            return DropReason.TOO_FAR_AHEAD
        return None

    def place(self, header: CheckmateHeader, payload: memoryview) -> DropReason | None:
        """Place one copied (or repaired) datagram; returns why it was dropped, or None."""
        if header.job_id != self.job_id:
            return self._drop(DropReason.OTHER_JOB)
        if header.msg_type not in (MessageType.DATA, MessageType.REPAIR_DATA):
            return self._drop(DropReason.NOT_DATA)
        if header.bucket_id not in self.owned:
            return self._drop(DropReason.NOT_OWNED)
        if header.dtype is DType.NONE or torch_dtype(header.dtype) != self.layouts[header.bucket_id].dtype:
            return self._drop(DropReason.WRONG_DTYPE)
        refused = self.admits(header.iteration)
        if refused is not None:
            return self._drop(refused)
        if (
            self.repair_only
            and header.msg_type is MessageType.DATA
            and (header.iteration, header.bucket_id) in self.repair_only
        ):
            return self._drop(DropReason.REFUSED_BUCKET)
        assembly = self._iteration(header.iteration).buckets[header.bucket_id]
        try:
            result = assembly.place_bytes(header.element_offset, header.element_count, payload)
        except ReassemblyError:
            return self._drop(DropReason.OUT_OF_RANGE)
        if result is PlaceResult.DUPLICATE:
            return self._drop(DropReason.DUPLICATE)
        self.stats.placed_packets += 1
        self.stats.placed_elements += header.element_count
        return None

    def refuse_copies(self, iteration: int, bucket_id: int) -> bool:
        """Empty owned ``bucket_id`` of ``iteration`` and take only REPAIR_DATA for it from now on.

        For a bucket whose assembled copies do not match rank 0's gradient tag (forged copies
        placed before the genuine ones): the shadow then repairs it from the workers, whose
        answers are authenticated, instead of asking rank 0 for its whole state. False (nothing
        changed) if the bucket was refused before: its repaired contents failed the tag too.
        """
        key = (iteration, bucket_id)
        if key in self.repair_only:
            return False
        layout = self.layouts[bucket_id]
        self._iteration(iteration).buckets[bucket_id] = BucketAssembly(layout.numel, layout.dtype)
        self.repair_only.add(key)
        return True

    def assembly(self, iteration: int, bucket_id: int) -> BucketAssembly:
        """The owned bucket ``bucket_id`` of ``iteration`` (a window iteration), made on first use."""
        return self._iteration(iteration).buckets[bucket_id]

    def bucket_complete(self, iteration: int, bucket_id: int) -> bool:
        """Whether ``bucket_id`` of ``iteration`` holds every element (False if not started)."""
        pending = self.pending.get(iteration)
        assembly = pending.buckets.get(bucket_id) if pending is not None else None
        return assembly is not None and assembly.complete

    def commit(self, step: StepRecord) -> DropReason | None:
        """Record an iteration's commit (what is not in the gradients)."""
        refused = self.admits(step.iteration)
        if refused is not None:
            return self._drop(refused)
        self._iteration(step.iteration).step = step
        return None

    def ready(self) -> PendingIteration | None:
        """The next iteration, if its commit is here and all its owned buckets are complete."""
        pending = self.pending.get(self.next_iteration)
        if pending is None or pending.step is None or not pending.complete:
            return None
        return pending

    def gradients(self, pending: PendingIteration) -> dict[str, torch.Tensor]:
        """Per-parameter gradient views into the iteration's completed buckets."""
        gradients = {}
        for bucket_id, assembly in pending.buckets.items():
            for slot in self.layouts[bucket_id].parameters:
                piece = assembly.buffer[slot.offset : slot.offset + slot.numel]
                if slot.whole:
                    gradients[slot.name] = piece.view(slot.shape)
                    continue
                # a segment: the parameter's full gradient is assembled from its segments (they tile it)
                full = gradients.get(slot.name)
                if full is None:
                    full = gradients[slot.name] = torch.empty(slot.shape, dtype=piece.dtype)
                full.view(-1)[slot.param_offset : slot.param_offset + slot.numel].copy_(piece)
        return gradients

    def advance(self) -> None:
        """Forget the applied iteration and move the window on."""
        self.pending.pop(self.next_iteration, None)
        self.next_iteration += 1
        if self.repair_only:
            self.repair_only = {key for key in self.repair_only if key[0] >= self.next_iteration}

    def owned_parameters(self) -> set[str]:
        return {slot.name for b in self.owned for slot in self.layouts[b].parameters}
