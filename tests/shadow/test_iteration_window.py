"""The shadow's window: copies placed by (iteration, bucket, offset); junk counted, never written."""

from __future__ import annotations

import torch

from checkmate import wire
from checkmate.tensors import tensor_payload
from checkmate.wire import CheckmateHeader, DType, Flags, MessageType
from shadow.iteration_window import BucketLayout, IterationWindow, ParameterSlot
from shadow.optimizer_apply import StepRecord

LAYOUTS = {
    0: BucketLayout(0, 12, (ParameterSlot("w", 0, 8, (2, 4)), ParameterSlot("b", 8, 4, (4,)))),
    1: BucketLayout(1, 6, (ParameterSlot("other", 0, 6, (6,)),)),
}


def datagram(iteration: int, bucket: int, offset: int, values: torch.Tensor, **overrides: object):  # type: ignore[no-untyped-def]
    fields: dict[str, object] = dict(
        msg_type=MessageType.DATA,
        job_id=9,
        iteration=iteration,
        bucket_id=bucket,
        sender_rank=0,
        element_offset=offset,
        element_count=values.numel(),
        sequence=1,
        dtype=DType.FP32,
        flags=Flags.NONE,
        shard_key=0,
    )
    fields.update(overrides)
    return wire.decode(wire.encode(CheckmateHeader(**fields), tensor_payload(values)))  # type: ignore[arg-type]


def test_iteration_becomes_ready_with_all_elements_and_its_commit() -> None:
    window = IterationWindow(9, LAYOUTS, {0}, first_iteration=5)
    bucket = torch.arange(12, dtype=torch.float32)
    assert window.place(*datagram(5, 0, 4, bucket[4:])) is None
    assert window.ready() is None
    assert window.pending[5].missing() == {0: [(0, 4)]}
    assert window.place(*datagram(5, 0, 0, bucket[:4])) is None
    assert window.ready() is None  # no commit yet
    assert window.commit(StepRecord(5, [0.1])) is None
    pending = window.ready()
    assert pending is not None
    gradients = window.gradients(pending)
    assert torch.equal(gradients["w"], bucket[:8].view(2, 4)) and torch.equal(gradients["b"], bucket[8:])
    window.advance()
    assert window.next_iteration == 6 and window.owned_parameters() == {"w", "b"}


def test_junk_is_dropped_by_reason_and_never_written() -> None:
    window = IterationWindow(9, LAYOUTS, {0}, first_iteration=5, horizon=2)
    values = torch.ones(4)
    reasons = [
        window.place(*datagram(5, 0, 0, values, job_id=8)),
        window.place(*datagram(5, 1, 0, values)),
        window.place(*datagram(4, 0, 0, values)),
        window.place(*datagram(7, 0, 0, values)),
        window.place(*datagram(5, 0, 10, values)),
        window.place(*datagram(5, 0, 0, values.half(), dtype=DType.FP16)),
        window.place(*datagram(5, 0, 0, torch.empty(0), msg_type=MessageType.ACK, dtype=DType.NONE)),
    ]
    assert [r.value if r else None for r in reasons] == [
        "other_job",
        "bucket_not_owned",
        "stale_iteration",
        "iteration_too_far_ahead",
        "offset_past_bucket_end",
        "wrong_dtype",
        "not_data",
    ]
    assert window.stats.placed_packets == 0
    assert all(not p.buckets[0].ranges.starts for p in window.pending.values())
    assert window.place(*datagram(5, 0, 0, values)) is None
    assert window.place(*datagram(5, 0, 0, values * 2)).value == "duplicate"  # type: ignore[union-attr]
    assert torch.equal(window.pending[5].buckets[0].buffer[:4], values)
    assert window.commit(StepRecord(2, [0.1])).value == "stale_iteration"  # type: ignore[union-attr]
