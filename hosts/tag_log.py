"""The ring's record of every tagged (REPLICATE) first transmission, kept at almost no cost.

A native ring completes an op with one callback on the engine's thread; it tags one datagram
per slot this rank owns (about 940 per 16 MiB bucket at 2 ranks). Building a Python object per
tag there, and keeping a million of them where the cyclic garbage collector tracks every one,
was most of the native ring's CPU above gloo's (docs/benchmarks.md, "The native data path").
:class:`TagLog` therefore keeps one *block* per op: a plain tuple of ints and two tuples of
ints (the slots' offsets and counts, slices of the bucket's cached grid), which the collector
does not track, and makes the :class:`TagRecord` objects only when someone reads the log.

To a reader it is what it was, a bounded sequence of :class:`TagRecord` in tagging order:
``len``, iteration, indexing and ``list()`` give the same records as before. Not thread-safe:
the ring appends under its lock; a reader reads a ring that is not tagging (as tests do).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from itertools import repeat
from typing import NamedTuple, overload


class TagRecord(NamedTuple):
    """One tagged (REPLICATE) first transmission."""

    iteration: int
    bucket_id: int
    element_offset: int
    element_count: int
    shard_key: int


_Block = tuple[int, int, int, Sequence[int], Sequence[int]]
"""(iteration, bucket_id, shard_key, element offsets, element counts): consecutive tags of one op."""


class TagLog:
    """The last ``maxlen`` tags, in blocks (see the module docstring)."""

    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError(f"a tag log keeps at least one tag, not {maxlen}")
        self.maxlen = maxlen
        self._blocks: deque[_Block] = deque()
        self._length = 0

    def add_block(
        self, iteration: int, bucket_id: int, shard_key: int, offsets: Sequence[int], counts: Sequence[int]
    ) -> int:
        """Record one tag per (offset, count) pair of one op; returns how many."""
        n = len(offsets)
        if n != len(counts):
            raise ValueError(f"{n} offsets but {len(counts)} counts")
        if n:
            self._blocks.append((iteration, bucket_id, shard_key, offsets, counts))
            self._length += n
            self._trim()
        return n

    def append(self, tag: TagRecord) -> None:
        """Record one tag (the Python data path tags datagram by datagram)."""
        self.add_block(
            tag.iteration, tag.bucket_id, tag.shard_key, (tag.element_offset,), (tag.element_count,)
        )

    def extend(self, tags: Sequence[TagRecord]) -> None:
        for tag in tags:
            self.append(tag)

    def clear(self) -> None:
        self._blocks.clear()
        self._length = 0

    def _trim(self) -> None:
        """Drop the oldest tags beyond ``maxlen`` (the oldest block cut at its front if needed)."""
        excess = self._length - self.maxlen
        while excess > 0:
            iteration, bucket_id, shard_key, offsets, counts = self._blocks[0]
            if len(offsets) <= excess:
                self._blocks.popleft()
                self._length -= len(offsets)
                excess -= len(offsets)
            else:
                self._blocks[0] = (iteration, bucket_id, shard_key, offsets[excess:], counts[excess:])
                self._length -= excess
                excess = 0

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[TagRecord]:
        for iteration, bucket_id, shard_key, offsets, counts in self._blocks:
            yield from map(
                TagRecord._make, zip(repeat(iteration), repeat(bucket_id), offsets, counts, repeat(shard_key))
            )

    @overload
    def __getitem__(self, index: int) -> TagRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[TagRecord]: ...

    def __getitem__(self, index: int | slice) -> TagRecord | list[TagRecord]:
        return list(self)[index]

    def __repr__(self) -> str:
        return f"TagLog({self._length} tags in {len(self._blocks)} blocks, maxlen={self.maxlen})"
