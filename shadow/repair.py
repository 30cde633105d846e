"""Gap repair: ask a worker's repair service for exactly the element ranges a shadow lacks.

Once an iteration's commit has arrived and an owned bucket still has gaps
after a short grace, the shadow sends a REPAIR_REQUEST listing the missing
ranges (docs/protocol.md, "Repairs") to one worker, places the REPAIR_DATA
answers like copies, and re-asks for whatever is still missing after a
timeout. A NACK (the worker no longer holds the bucket) or a timeout moves
the request to the next worker in the ring; when every worker has NACKed, or
the attempts are spent, the bucket is *unrepairable* and the iteration is
never certified. This module keeps only the bookkeeping; the shadow node owns
the socket and the window.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from checkmate.wire import MAX_PAYLOAD_BYTES, CheckmateHeader, DType, MessageType

logger = logging.getLogger(__name__)

_PAIR = struct.Struct("!II")
MAX_RANGES_PER_REQUEST = 1 + MAX_PAYLOAD_BYTES // _PAIR.size
"""One range in the header plus as many (offset, count) pairs as fit in one payload."""


@dataclass(frozen=True)
class RepairPolicy:
    grace: float = 0.02
    """Seconds after an iteration's commit before its gaps are requested (copies may still be on the way)."""
    timeout: float = 0.1
    """Seconds to wait for an answer before asking again (the next worker)."""
    max_attempts: int = 12
    """Requests per (iteration, bucket) before it is declared unrepairable."""
    max_grace: float = 0.5
    """Most seconds the grace grows to when copies keep arriving after their repair was asked
    (late, not lost: a queue on their path); the grace halves back towards ``grace`` after
    ``GRACE_DECAY_S`` without a late copy. Equal to ``grace``: a fixed grace."""


@dataclass
class RepairStats:
    requests: int = 0
    ranges_requested: int = 0
    elements_requested: int = 0
    datagrams_received: int = 0
    elements_repaired: int = 0
    nacks: int = 0
    timeouts: int = 0
    unrepairable: int = 0
    late_copies: int = 0
    """Copies that arrived for an iteration after a repair of it was asked (stale or duplicate)."""
    grace_raised: int = 0
    """Times the grace doubled because an iteration's repair proved premature."""


@dataclass
class _Outstanding:
    request_id: int
    worker: int
    sent: float
    ranges: list[tuple[int, int]]


@dataclass
class BucketRepair:
    """Repair state of one (iteration, bucket)."""

    iteration: int
    bucket_id: int
    attempts: int = 0
    next_worker: int = 0
    nacked: set[int] = field(default_factory=set)
    outstanding: _Outstanding | None = None
    failed: str | None = None
    """Why the bucket cannot be repaired; None while it still can."""


def request_datagram(
    job_id: int,
    iteration: int,
    bucket_id: int,
    ranges: Sequence[tuple[int, int]],
    request_id: int,
    sender_rank: int,
    shard_key: int,
) -> tuple[CheckmateHeader, bytes]:
    """A REPAIR_REQUEST for ``ranges`` ((start, end) pairs, at most MAX_RANGES_PER_REQUEST)."""
    if not ranges or len(ranges) > MAX_RANGES_PER_REQUEST:
        raise ValueError(f"a repair request carries 1..{MAX_RANGES_PER_REQUEST} ranges, got {len(ranges)}")
    (first_start, first_end), rest = ranges[0], ranges[1:]
    header = CheckmateHeader(
        msg_type=MessageType.REPAIR_REQUEST,
        job_id=job_id,
        iteration=iteration,
        bucket_id=bucket_id,
        sender_rank=sender_rank,
        element_offset=first_start,
        element_count=first_end - first_start,
        sequence=request_id,
        dtype=DType.NONE,
        shard_key=shard_key,
    )
    payload = b"".join(_PAIR.pack(start, end - start) for start, end in rest)
    return header, payload


GRACE_DECAY_S = 10.0
"""Seconds without a late copy after which a raised grace halves (towards the policy's)."""

_ASKED_REMEMBERED = 64
"""Iterations whose repair requests are remembered for telling late copies from lost ones."""


class RepairTracker:
    """Which repairs are outstanding, and what to send next; not thread-safe (the node locks).

    The grace before gaps are asked for adapts: a copy that arrives for an iteration after its
    repair was asked shows that the copies were late, not lost (a switch or host queue longer
    than the grace), and every such repair cost the workers a resend of data that was on its
    way. The grace then doubles, once per iteration, up to ``policy.max_grace``, and halves
    back after ``GRACE_DECAY_S`` without a late copy. Copies that are really lost never arrive,
    so they leave the grace where it is.
    """

    def __init__(self, policy: RepairPolicy, num_workers: int) -> None:
        self.policy = policy
        self.num_workers = num_workers
        self.stats = RepairStats()
        self.buckets: dict[tuple[int, int], BucketRepair] = {}
        self._by_request: dict[int, tuple[int, int]] = {}
        self._next_id = 1
        self.grace = policy.grace
        """Seconds after an iteration's commit before its gaps are asked for, now."""
        self._asked: dict[int, bool] = {}
        """Iteration -> whether a late copy of it already raised the grace (recent requests only)."""
        self._last_late: float | None = None

    def current_grace(self, now: float) -> float:
        """The grace in force at ``now`` (a raised one halves after GRACE_DECAY_S without late copies)."""
        quiet = self._last_late is not None and now - self._last_late >= GRACE_DECAY_S
        if self.grace > self.policy.grace and quiet:
            self.grace = max(self.policy.grace, self.grace / 2)
            self._last_late = now
        return self.grace

    def note_late_copy(self, iteration: int, now: float) -> None:
        """A DATA copy of ``iteration`` arrived stale or duplicate: late if its repair was asked."""
        raised = self._asked.get(iteration)
        if raised is None:
            return  # no repair was asked for it: a plain duplicate (e.g. a retransmission)
        self.stats.late_copies += 1
        self._last_late = now
        if not raised and self.grace < self.policy.max_grace:
            self._asked[iteration] = True
            self.grace = min(self.policy.max_grace, max(self.grace * 2, self.policy.grace))
            self.stats.grace_raised += 1
            logger.info(
                "copies of iteration %d arrived after their repair was asked: repair grace now %.3f s",
                iteration,
                self.grace,
            )

    def forget_before(self, iteration: int) -> None:
        for key in [k for k in self.buckets if k[0] < iteration]:
            repair = self.buckets.pop(key)
            if repair.outstanding is not None:
                self._by_request.pop(repair.outstanding.request_id, None)

    def restart(self, iteration: int, bucket_id: int) -> None:
        """Forget what was asked for ``bucket_id`` of ``iteration``: its whole contents are wanted anew."""
        repair = self.buckets.pop((iteration, bucket_id), None)
        if repair is not None and repair.outstanding is not None:
            self._by_request.pop(repair.outstanding.request_id, None)

    def due(
        self, iteration: int, bucket_id: int, missing: list[tuple[int, int]], now: float
    ) -> tuple[int, int, list[tuple[int, int]]] | None:
        """(worker index, request id, ranges) to send now for this bucket's gaps, or None."""
        key = (iteration, bucket_id)
        repair = self.buckets.get(key)
        if repair is None:
            repair = self.buckets[key] = BucketRepair(
                iteration, bucket_id, next_worker=(iteration + bucket_id) % self.num_workers
            )
        if repair.failed is not None:
            return None
        if repair.outstanding is not None:
            if now - repair.outstanding.sent < self.policy.timeout:
                return None
            self.stats.timeouts += 1
            self._by_request.pop(repair.outstanding.request_id, None)
            repair.outstanding = None
            repair.next_worker = (repair.next_worker + 1) % self.num_workers
        if repair.attempts >= self.policy.max_attempts:
            self._fail(repair, f"no answer after {repair.attempts} repair requests")
            return None
        worker = self._pick_worker(repair)
        if worker is None:
            return None
        ranges = missing[:MAX_RANGES_PER_REQUEST]
        request_id = self._next_id
        self._next_id = self._next_id % 0xFFFFFFFF + 1
        repair.attempts += 1
        repair.outstanding = _Outstanding(request_id, worker, now, ranges)
        if iteration not in self._asked:
            self._asked[iteration] = False
            if len(self._asked) > _ASKED_REMEMBERED:
                del self._asked[next(iter(self._asked))]
        self._by_request[request_id] = key
        self.stats.requests += 1
        self.stats.ranges_requested += len(ranges)
        self.stats.elements_requested += sum(e - s for s, e in ranges)
        return worker, request_id, ranges

    def _pick_worker(self, repair: BucketRepair) -> int | None:
        for step in range(self.num_workers):
            worker = (repair.next_worker + step) % self.num_workers
            if worker not in repair.nacked:
                repair.next_worker = worker
                return worker
        self._fail(repair, f"every worker ({self.num_workers}) answered NACK: none holds it any more")
        return None

    def _fail(self, repair: BucketRepair, why: str) -> None:
        repair.failed = f"iteration {repair.iteration} bucket {repair.bucket_id}: {why}"
        self.stats.unrepairable += 1
        logger.warning("unrepairable: %s", repair.failed)

    def on_answer(self, header: CheckmateHeader) -> None:
        """A REPAIR_DATA datagram for ``header.sequence`` arrived (placement is the node's)."""
        self.stats.datagrams_received += 1
        key = self._by_request.get(header.sequence)
        repair = self.buckets.get(key) if key is not None else None
        if repair is not None and repair.outstanding is not None and header.flags & 0x04:  # LAST
            # The answer is complete as far as the worker is concerned: whatever is still
            # missing is asked again at once (next tick), from the same worker.
            self._by_request.pop(header.sequence, None)
            repair.outstanding = None

    def on_nack(self, header: CheckmateHeader) -> None:
        self.stats.nacks += 1
        key = self._by_request.pop(header.sequence, None)
        if key is None:
            return
        repair = self.buckets.get(key)
        if repair is None or repair.outstanding is None:
            return
        repair.nacked.add(repair.outstanding.worker)
        repair.outstanding = None
        repair.next_worker = (repair.next_worker + 1) % self.num_workers

    def failure(self, iteration: int) -> str | None:
        for (it, _), repair in sorted(self.buckets.items()):
            if it == iteration and repair.failed is not None:
                return repair.failed
        return None
