"""The ring's tag log: the same records as a bounded deque of TagRecord, kept as untracked blocks."""

from __future__ import annotations

import gc
import random
from collections import deque

import pytest

from hosts.tag_log import TagLog, TagRecord


def test_the_log_reads_as_a_bounded_deque_of_records() -> None:
    rng = random.Random(7)
    for maxlen in (1, 5, 64, 1000):
        log, reference = TagLog(maxlen), deque[TagRecord](maxlen=maxlen)
        for step in range(300):
            if rng.random() < 0.3:
                tag = TagRecord(step, rng.randrange(4), rng.randrange(10**6), rng.randrange(1, 2000), 7)
                log.append(tag)
                reference.append(tag)
            else:
                n = rng.randrange(0, 40)
                offsets = tuple(rng.randrange(10**6) for _ in range(n))
                counts = tuple(rng.randrange(1, 2000) for _ in range(n))
                assert log.add_block(step, 1, 3, offsets, counts) == n
                reference.extend(TagRecord(step, 1, o, c, 3) for o, c in zip(offsets, counts, strict=True))
            assert len(log) == len(reference)
        assert list(log) == list(reference)
        assert log[0] == reference[0] and log[-1] == reference[-1] and log[1:3] == list(reference)[1:3]


def test_blocks_are_not_tracked_by_the_garbage_collector() -> None:
    log = TagLog(1 << 20)
    grid_offsets = tuple(range(0, 940 * 2235, 2235))
    grid_counts = (2235,) * 940
    for iteration in range(50):
        log.add_block(iteration, 0, 0, grid_offsets[10:900], grid_counts[10:900])
    gc.collect()
    gc.collect()  # an outer tuple is untracked once its inner tuples are
    assert len(log) == 50 * 890
    assert not any(gc.is_tracked(block) for block in log._blocks)  # ints and tuples of ints only


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        TagLog(0)
    with pytest.raises(ValueError, match="2 offsets but 1 counts"):
        TagLog(4).add_block(0, 0, 0, (1, 2), (3,))
