"""The repair grace adapts: late copies raise it (once per iteration, capped), quiet time lowers it."""

from __future__ import annotations

import pytest

from shadow.repair import GRACE_DECAY_S, RepairPolicy, RepairTracker


def test_a_premature_repair_doubles_the_grace_up_to_the_cap_and_quiet_time_halves_it() -> None:
    tracker = RepairTracker(RepairPolicy(grace=0.02, max_grace=0.05), num_workers=2)
    assert tracker.current_grace(0.0) == pytest.approx(0.02)
    tracker.note_late_copy(3, 0.0)  # no repair was asked for iteration 3: a plain duplicate
    assert tracker.stats.late_copies == 0 and tracker.grace == pytest.approx(0.02)
    for iteration in (3, 4, 5):
        assert tracker.due(iteration, 0, [(0, 8)], now=0.0) is not None
    tracker.note_late_copy(3, 1.0)
    tracker.note_late_copy(3, 1.0)  # more late copies of the same iteration: raised once
    assert tracker.grace == pytest.approx(0.04) and tracker.stats.grace_raised == 1
    tracker.note_late_copy(4, 2.0)
    tracker.note_late_copy(5, 2.0)  # capped at max_grace
    assert tracker.grace == pytest.approx(0.05) and tracker.stats.late_copies == 4
    assert tracker.current_grace(2.0 + GRACE_DECAY_S / 2) == pytest.approx(0.05)
    assert tracker.current_grace(2.0 + GRACE_DECAY_S) == pytest.approx(0.025)
    assert tracker.current_grace(2.0 + 2 * GRACE_DECAY_S) == pytest.approx(0.02)  # never below the policy's


def test_a_fixed_grace_stays_fixed() -> None:
    tracker = RepairTracker(RepairPolicy(grace=0.02, max_grace=0.02), num_workers=2)
    assert tracker.due(1, 0, [(0, 8)], now=0.0) is not None
    tracker.note_late_copy(1, 0.5)
    assert tracker.grace == pytest.approx(0.02) and tracker.stats.late_copies == 1
    assert tracker.stats.grace_raised == 0
