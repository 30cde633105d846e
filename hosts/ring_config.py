"""What a ring all-reduce is, apart from the engine that runs it (:mod:`hosts.ring_allreduce`).

:class:`RingConfig` (the job, this rank, the ring, timeouts and limits), :class:`ReduceOp`, the
errors a collective raises, :func:`slot_grid` (how a bucket is cut into chunks and datagram
slots, the same on every rank) and :func:`reference_allreduce` (the exact result the ring
computes, same order and rounding: what the tests and the differential checks compare with).

The algorithm
-------------
A bucket of ``n`` elements is cut into ``N`` chunks (``N`` = world size),
chunk ``c`` = elements ``[c*n//N, (c+1)*n//N)``, and each chunk into datagrams
of at most ``MAX_PAYLOAD_BYTES`` (the *slot grid*, identical on every rank).
Rank ``r`` sends only to ``next = r+1 mod N`` and receives only from
``prev = r-1 mod N``.

* **Reduce-scatter.** Chunk ``c`` starts at rank ``c``, which sends its own
  values; each following rank adds its values to what arrives and forwards
  the sum, until rank ``c-1`` (the chunk's *owner*) holds the full sum.
* **All-gather.** The owner sends the reduced chunk on, each rank stores it
  and forwards it, until rank ``c-2`` has it.

Work is driven per datagram (cut-through), not per step: each received slot
is reduced and forwarded at once, so many steps overlap. Every element's
all-gather copy depends causally on its reduce-scatter copy having passed
this rank, so the first arrival of a slot is its reduce-scatter half and the
second its all-gather half; no phase field is needed on the wire.

Reduction order (deterministic, for reference sums in tests)
------------------------------------------------------------
Element ``e`` of chunk ``c`` ends up as::

    acc = x[c][e]
    for j in 1 .. N-1:  acc = acc + x[(c + j) % N][e]     # IEEE add in the bucket dtype

where ``x[k]`` is rank ``k``'s input, already divided by ``N`` for
``ReduceOp.AVG`` (like DDP's default hook: divide first, then sum, so the
wire carries the final averaged values). With 2 ranks this is ``x0 + x1``,
bit-identical to gloo. Every rank ends with the same bits, because every
rank copies the owner's sum.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hosts.transport import Addr


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    """Divide each input by the world size, then sum (what DDP's default hook does)."""


class CollectiveError(RuntimeError):
    """The all-reduce cannot complete (a peer failed, or this engine was closed)."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """An all-reduce did not complete within its timeout; the message names the peer waited for."""


@dataclass(frozen=True)
class RingConfig:
    job_id: int
    rank: int
    workers: tuple[Addr, ...]
    """Worker data addresses in ring order (index = rank)."""
    shard_key_for_bucket: Callable[[int], int] = lambda bucket: 0
    timeout: float = 60.0
    """Seconds an all-reduce may take before it fails with CollectiveTimeoutError."""
    keep_iterations: int = 4
    """Reduced buckets of this many recent iterations are kept for repairs."""
    future_iterations: int = 4
    """Data more than this many iterations ahead of this rank's latest started one is dropped as
    bogus (acknowledged and lost: keep it above how far a peer can legitimately run ahead, which
    is 1 iteration under DDP)."""
    max_stash_bytes: int = 1 << 30
    """Bound on data buffered for buckets this rank has not started yet."""
    host_replica: Callable[[int], Addr | None] | None = None
    """Host-side replication (no switch): shard key -> the shadow's data address. When set, the
    owner sends its tagged chunks to the peer *without* REPLICATE (the switch copies nothing) and
    once more itself, straight to that shadow, as the switch's copy would look (REPLICATE
    cleared); None: the switch replicates (``CheckmateConfig.replication``)."""

    def __post_init__(self) -> None:
        if len(self.workers) < 2:
            raise ValueError(f"a ring needs at least 2 workers, got {len(self.workers)}")
        if not 0 <= self.rank < len(self.workers):
            raise ValueError(f"rank {self.rank} is outside 0..{len(self.workers) - 1}")

    @property
    def world_size(self) -> int:
        return len(self.workers)


@dataclass(frozen=True)
class SlotGrid:
    """The slot grid of a bucket: identical on every rank for the same (n, N, dtype size)."""

    bounds: tuple[int, ...]
    offsets: tuple[int, ...]
    counts: tuple[int, ...]
    chunk: tuple[int, ...]
    last: tuple[bool, ...]
    chunk_slots: tuple[tuple[int, ...], ...]
    slot_of: dict[int, int]


@functools.lru_cache(maxsize=512)
def slot_grid(n: int, world: int, per_datagram: int) -> SlotGrid:
    """Chunk bounds and datagram slots of an ``n``-element bucket (see the module docstring)."""
    bounds = tuple(c * n // world for c in range(world + 1))
    offsets: list[int] = []
    counts: list[int] = []
    chunk: list[int] = []
    last: list[bool] = []
    chunk_slots: list[tuple[int, ...]] = []
    for c in range(world):
        start, end = bounds[c], bounds[c + 1]
        mine = []
        for o in range(start, end, per_datagram):
            mine.append(len(offsets))
            offsets.append(o)
            counts.append(min(per_datagram, end - o))
            chunk.append(c)
            last.append(o + per_datagram >= end)
        chunk_slots.append(tuple(mine))
    return SlotGrid(
        bounds=bounds,
        offsets=tuple(offsets),
        counts=tuple(counts),
        chunk=tuple(chunk),
        last=tuple(last),
        chunk_slots=tuple(chunk_slots),
        slot_of={o: i for i, o in enumerate(offsets)},
    )


def reference_allreduce(inputs: Sequence[torch.Tensor], op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """The exact result of the ring for these per-rank inputs (same order, same rounding)."""
    world = len(inputs)
    xs = [t.reshape(-1) / world if op is ReduceOp.AVG else t.reshape(-1).clone() for t in inputs]
    n = xs[0].numel()
    out = torch.empty_like(xs[0])
    for c in range(world):
        lo, hi = c * n // world, (c + 1) * n // world
        acc = xs[c][lo:hi].clone()
        for j in range(1, world):
            acc = acc + xs[(c + j) % world][lo:hi]
        out[lo:hi] = acc
    return out
