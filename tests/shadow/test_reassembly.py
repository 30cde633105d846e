"""Bucket reassembly: any order, duplicates, gaps — the bucket ends exactly as sent."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shadow.reassembly import BucketAssembly, PlaceResult, RangeSet, ReassemblyError


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 40)), max_size=30))
def test_range_set_matches_a_plain_set(ranges: list[tuple[int, int]]) -> None:
    ranges_set, model = RangeSet(), set()
    for start, length in ranges:
        ranges_set.add(start, start + length)
        model.update(range(start, start + length))
    assert ranges_set.covered() == len(model)
    gaps = {i for s, e in ranges_set.gaps(250) for i in range(s, e)}
    assert gaps == set(range(250)) - model
    spans = list(zip(ranges_set.starts, ranges_set.ends, strict=True))
    assert all(s < e for s, e in spans)  # no empty ranges
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(spans, spans[1:], strict=False)), spans  # sorted, merged


def test_shuffled_duplicated_chunks_rebuild_the_bucket_and_keep_first_values() -> None:
    bucket = torch.randn(10_000)
    chunks = [(o, bucket[o : o + 700]) for o in range(0, 10_000, 700)]
    rng = random.Random(3)
    arrivals = chunks + rng.sample(chunks, 5)
    rng.shuffle(arrivals)
    assembly = BucketAssembly(10_000)
    results = [assembly.place(offset, values) for offset, values in arrivals]
    assert results.count(PlaceResult.DUPLICATE) == 5
    assert assembly.complete and assembly.missing() == []
    assert torch.equal(assembly.buffer, bucket)
    # An overlapping late copy with other values never overwrites what arrived first.
    assert assembly.place(100, torch.zeros(50)) is PlaceResult.DUPLICATE
    assert torch.equal(assembly.buffer, bucket)


def test_gaps_are_reported_exactly_and_filled_by_repair() -> None:
    bucket = torch.arange(100, dtype=torch.float32)
    assembly = BucketAssembly(100)
    assembly.place(0, bucket[:30])
    assembly.place(50, bucket[50:60])
    assert not assembly.complete
    assert assembly.missing() == [(30, 50), (60, 100)]
    assembly.place(20, bucket[20:55])  # partly new: only [30, 50) is written
    assert assembly.missing() == [(60, 100)]
    assembly.place(60, bucket[60:])
    assert assembly.complete and torch.equal(assembly.buffer, bucket)


def test_payloads_that_cannot_belong_are_refused() -> None:
    assembly = BucketAssembly(10)
    with pytest.raises(ReassemblyError, match="past the bucket"):
        assembly.place(8, torch.zeros(3))
    with pytest.raises(ReassemblyError, match="dtype"):
        assembly.place(0, torch.zeros(2, dtype=torch.float16))
    assert assembly.missing() == [(0, 10)]
