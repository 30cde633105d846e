"""The demo's protection figures: rank 0's per-iteration verdict (hosts.protection) counted and shown."""

from __future__ import annotations

from experiments.progress import _protection
from experiments.results import RunSeries


def test_unprotected_iterations_are_counted_from_rank0s_records_and_shown_with_the_reason() -> None:
    series = RunSeries("main")
    for iteration in range(4):
        record = {"iteration": iteration, "loss": 1.0, "time": float(iteration), "certified": iteration - 1}
        if iteration >= 2:
            record["unprotected"] = "shadow sh1 refused: cannot import module 'mine'"
        series.add(0, 0, record)
        series.add(0, 1, {**record, "unprotected": "rank 1 never says"})  # only rank 0's verdict counts
    assert series.unprotected == {
        0: {2: "shadow sh1 refused: cannot import module 'mine'", 3: series.unprotected[0][3]}
    }
    shown = _protection({"unprotected_iterations": 2, "unprotected_reason": series.unprotected[0][2]})
    assert shown == "[red]UNPROTECTED at 2 iteration(s): shadow sh1 refused: cannot import module 'mine'"
    assert _protection({"unprotected_iterations": 0}).startswith("[green]every iteration")
    assert _protection({}) == "[dim]not recorded"
