"""Reassembly of copied gradient packets into whole buckets, per iteration.

A shadow receives each reduced element of the buckets it owns once, in any
order, possibly duplicated, possibly not at all. ``BucketAssembly`` places each
payload at its element offset and tracks which ranges are covered, so the
shadow can tell when a bucket is complete and which exact ranges to repair.
``IterationWindow`` holds a bounded number of iterations in flight.
"""

from __future__ import annotations

import bisect
import enum
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from checkmate.tensors import tensor_payload

logger = logging.getLogger(__name__)


class PlaceResult(enum.Enum):
    NEW = "new"
    """At least one element was new; the payload was written."""
    DUPLICATE = "duplicate"
    """Every element was already there; nothing was written."""


class ReassemblyError(ValueError):
    """A payload that cannot belong to the bucket (past its end, wrong dtype)."""


@dataclass
class RangeSet:
    """Disjoint, sorted, half-open integer ranges [start, end)."""

    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    def covered(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends, strict=True))

    def disjoint(self, start: int, end: int) -> bool:
        """Whether no element of [start, end) is covered."""
        i = bisect.bisect_right(self.starts, start) - 1
        if i >= 0 and self.ends[i] > start:
            return False
        return i + 1 >= len(self.starts) or self.starts[i + 1] >= end

    def contains(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self.starts, start) - 1
        return i >= 0 and self.ends[i] >= end

    def add(self, start: int, end: int) -> None:
        """Add [start, end), merging with neighbours it touches or overlaps."""
        if start >= end:
            return
        i = bisect.bisect_left(self.ends, start)
        j = bisect.bisect_right(self.starts, end)
        if i < j:
            start = min(start, self.starts[i])
            end = max(end, self.ends[j - 1])
        self.starts[i:j] = [start]
        self.ends[i:j] = [end]

    def gaps(self, total: int) -> list[tuple[int, int]]:
        """The ranges of [0, total) not covered, as (start, end) pairs."""
        missing = []
        cursor = 0
        for s, e in zip(self.starts, self.ends, strict=True):
            if s > cursor:
                missing.append((cursor, s))
            cursor = max(cursor, e)
        if cursor < total:
            missing.append((cursor, total))
        return missing


class BucketAssembly:
    """One bucket of one iteration, filled by element ranges."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32) -> None:
        self.numel = numel
        self.buffer = torch.empty(numel, dtype=dtype)
        self.ranges = RangeSet()
        self._itemsize = self.buffer.element_size()
        self._bytes = tensor_payload(self.buffer) if numel else memoryview(bytearray())
        """The buffer's memory as bytes: a payload is written with one memcpy, no tensor op."""

    @property
    def complete(self) -> bool:
        return self.ranges.contains(0, self.numel) if self.numel else True

    def place(self, offset: int, values: torch.Tensor) -> PlaceResult:
        """Write ``values`` at element ``offset``; duplicates are ignored, never rewritten."""
        count = values.numel()
        if values.dtype != self.buffer.dtype:
            raise ReassemblyError(f"payload dtype {values.dtype} but the bucket holds {self.buffer.dtype}")
        if offset < 0 or offset + count > self.numel:
            raise ReassemblyError(f"elements [{offset}, {offset + count}) lie past the bucket's {self.numel}")
        if count == 0 or self.ranges.contains(offset, offset + count):
            return PlaceResult.DUPLICATE
        # Write only the uncovered parts: covered elements keep their first value.
        for start, end in self._uncovered(offset, offset + count):
            self.buffer[start:end].copy_(values[start - offset : end - offset])
        self.ranges.add(offset, offset + count)
        return PlaceResult.NEW

    def place_bytes(self, offset: int, count: int, payload: memoryview) -> PlaceResult:
        """:meth:`place` for ``count`` elements as raw bytes of the bucket's dtype (a wire payload)."""
        size = self._itemsize
        if len(payload) != count * size:
            raise ReassemblyError(f"{len(payload)} payload bytes for {count} elements of {size} bytes")
        if offset < 0 or offset + count > self.numel:
            raise ReassemblyError(f"elements [{offset}, {offset + count}) lie past the bucket's {self.numel}")
        end = offset + count
        if count == 0 or self.ranges.contains(offset, end):
            return PlaceResult.DUPLICATE
        if self.ranges.disjoint(offset, end):  # the common case: all new, one copy
            self._bytes[offset * size : end * size] = payload
        else:  # covered elements keep their first value
            for start, stop in self._uncovered(offset, end):
                self._bytes[start * size : stop * size] = payload[
                    (start - offset) * size : (stop - offset) * size
                ]
        self.ranges.add(offset, end)
        return PlaceResult.NEW

    def payload(self, offset: int, count: int) -> bytes:
        """The bytes of ``count`` elements from ``offset`` (a copy)."""
        size = self._itemsize
        return bytes(self._bytes[offset * size : (offset + count) * size])

    def _uncovered(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        for gap_start, gap_end in self.ranges.gaps(self.numel):
            lo, hi = max(gap_start, start), min(gap_end, end)
            if lo < hi:
                yield lo, hi

    def missing(self) -> list[tuple[int, int]]:
        return self.ranges.gaps(self.numel)
