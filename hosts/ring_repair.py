"""What a worker's ring answers to a shadow's REPAIR_REQUEST (docs/protocol.md, "Repairs").

The request names element ranges of one (iteration, bucket): the header's range plus
``(offset, count)`` pairs in its payload. A range the worker no longer holds (or that lies
outside the bucket) is answered with one NACK; otherwise the ranges are cut into untagged
REPAIR_DATA datagrams with room for the job's MAC. :class:`hosts.ring_allreduce.RingAllReduce`
sends what these functions describe.
"""

from __future__ import annotations

import struct

from checkmate.wire import CheckmateHeader, DType, MessageType

_PAIR = struct.Struct("!II")


def requested_ranges(header: CheckmateHeader, payload: memoryview) -> list[tuple[int, int]] | None:
    """The ``(offset, count)`` ranges a REPAIR_REQUEST asks for; None when its payload is malformed."""
    if len(payload) % _PAIR.size:
        return None
    ranges = [(header.element_offset, header.element_count)]
    ranges += [_PAIR.unpack_from(payload, i) for i in range(0, len(payload), _PAIR.size)]
    return ranges


def answerable(ranges: list[tuple[int, int]], numel: int) -> bool:
    """Whether every range is non-empty and inside a bucket of ``numel`` elements."""
    return all(k > 0 and o + k <= numel for o, k in ranges)


def nack_for(header: CheckmateHeader, job_id: int, rank: int) -> CheckmateHeader:
    """The NACK that tells the shadow this worker cannot repair the request ``header``."""
    return CheckmateHeader(
        msg_type=MessageType.NACK,
        job_id=job_id,
        iteration=header.iteration,
        bucket_id=header.bucket_id,
        sender_rank=rank,
        element_offset=header.element_offset,
        element_count=header.element_count,
        sequence=header.sequence,
        dtype=DType.NONE,
    )


def pieces(ranges: list[tuple[int, int]], per_datagram: int) -> list[tuple[int, int]]:
    """The ranges cut into ``(start, count)`` pieces of at most ``per_datagram`` elements, in order."""
    out: list[tuple[int, int]] = []
    for offset, count in ranges:
        for start in range(offset, offset + count, per_datagram):
            out.append((start, min(per_datagram, offset + count - start)))
    return out
