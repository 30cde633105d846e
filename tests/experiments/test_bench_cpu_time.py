"""The benchmark's CPU accounting: /proc read right, shares computed from two samples, shown honestly."""

from __future__ import annotations

import os
import time
from pathlib import Path

from experiments.bench.cpu_time import (
    TICKS_PER_S,
    CpuClock,
    CpuSample,
    CpuTicks,
    cpu_shares,
    cpu_ticks,
    mean_shares,
    process_ticks,
)
from experiments.bench.report import cpu_table, targets_markdown
from experiments.bench.scaling import time_shares


def test_process_ticks_grow_with_work_and_vanish_with_the_process(tmp_path: Path) -> None:
    before = process_ticks(os.getpid())
    assert before is not None
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    after = process_ticks(os.getpid())
    assert after is not None and after - before >= 0.2 * TICKS_PER_S
    assert process_ticks(2**22 + 7) is None  # no such pid
    fake = tmp_path / "123"
    fake.mkdir()
    (fake / "stat").write_text("123 (a) weird) name) S 1 1 1 0 -1 0 0 0 0 0 250 50 0 0 20 0 1 0\n")
    assert process_ticks(123, tmp_path) == 300  # comm with ')' and spaces is skipped


def test_cpu_ticks_read_every_cpu_line(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text(
        "cpu  1 1 1 1 1 1 1 1 0 0\ncpu0 100 0 50 800 10 5 20 0 0 0\ncpu1 10 0 5 900 0 0 1 0 0 0\nintr 12345\n"
    )
    ticks = cpu_ticks(tmp_path)
    assert ticks == {0: CpuTicks(busy=175, softirq=20, total=985), 1: CpuTicks(busy=16, softirq=1, total=916)}
    (tmp_path / "stat").write_text("cpu0 100 0 50 800 10 5 20 7 0 0\n")
    assert cpu_ticks(tmp_path)[0] == CpuTicks(busy=182, softirq=20, total=992, steal=7)
    assert cpu_ticks(tmp_path / "missing") == {}
    assert set(cpu_ticks()) == set(range(len(cpu_ticks())))  # this machine's CPUs, numbered from 0


def _sample(wall: float, iteration: int, shadow: int, switch: int, busy0: int, busy1: int) -> CpuSample:
    return CpuSample(
        wall=wall,
        iteration=iteration,
        processes={"shadows": {10: shadow, 11: shadow}, "switch": {20: switch}, "workers": {30: 0}},
        # 500 idle ticks per second on each CPU
        cpus={
            0: CpuTicks(busy0, 0, int(500 * wall) + busy0),
            1: CpuTicks(busy1, busy1 // 10, int(500 * wall) + busy1),
        },
    )


def test_shares_from_two_samples() -> None:
    hz = TICKS_PER_S
    first = _sample(10.0, 5, shadow=0, switch=0, busy0=0, busy1=0)
    last = _sample(12.0, 25, shadow=hz // 2, switch=hz, busy0=1000, busy1=500)
    last.processes["workers"].clear()  # the worker ended in between: left out, not guessed
    shares = cpu_shares(first, last, {"workers": {0}, "infrastructure": {1}, "absent": {7}})
    assert shares is not None
    assert shares["seconds"] == 2.0 and shares["iterations"] == 20
    assert shares["roles"]["shadows"] == {"processes": 2, "cpu_s_per_s": 0.5, "cpu_ms_per_iteration": 50.0}
    assert shares["roles"]["switch"]["cpu_s_per_s"] == 0.5
    assert shares["roles"]["workers"]["processes"] == 0
    assert shares["cpu_sets"]["workers"] == {"cpus": "0", "busy": 0.5, "softirq": 0.0, "steal": 0.0}
    assert shares["cpu_sets"]["infrastructure"] == {
        "cpus": "1",
        "busy": round(500 / 1500, 3),
        "softirq": 0.033,
        "steal": 0.0,
    }
    assert "absent" not in shares["cpu_sets"]
    assert cpu_shares(first, first, {}) is None  # no time passed: no figure
    assert CpuClock().shares({}) is None  # never started: no figure


def test_clock_samples_this_process() -> None:
    clock = CpuClock(interval_s=0.0)
    clock.start({"bench": [os.getpid()]}, iteration=5)
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    clock.tick(15)
    shares = clock.shares({"all": set(cpu_ticks())})
    assert shares is not None and shares["iterations"] == 10
    # 0.2 s of CPU over 10 iterations, whatever the wall time under load (ticks are 10 ms)
    assert shares["roles"]["bench"]["cpu_ms_per_iteration"] >= 10


def test_rounds_averaged_and_shares_for_the_scaling_rows() -> None:
    one = {"roles": {"switch": {"processes": 1, "cpu_s_per_s": 0.2},
                     "shadows": {"processes": 2, "cpu_s_per_s": 0.4}},
           "cpu_sets": {"workers": {"cpus": "0", "busy": 0.9, "softirq": 0.0},
                        "infrastructure": {"cpus": "1", "busy": 0.8, "softirq": 0.1}}}  # fmt: skip
    two = {"roles": {"switch": {"processes": 1, "cpu_s_per_s": 0.4},
                     "shadows": {"processes": 2, "cpu_s_per_s": 0.6}},
           "cpu_sets": {"workers": {"cpus": "0", "busy": 0.7, "softirq": 0.0},
                        "infrastructure": {"cpus": "1", "busy": 1.0, "softirq": 0.3}}}  # fmt: skip
    merged = mean_shares([one, None, two])
    assert merged is not None and merged["rounds"] == 2
    assert merged["roles"]["switch"]["cpu_s_per_s"] == 0.3
    assert merged["cpu_sets"]["infrastructure"] == {"cpus": "1", "busy": 0.9, "softirq": 0.2}
    assert mean_shares([None]) is None
    assert time_shares(merged) == {"network_share": 0.5, "shadows_share": 0.5, "workers_busy": 0.8}
    assert time_shares(None) == {"network_share": None, "shadows_share": None, "workers_busy": None}
    table = cpu_table({"systems": [{"name": "checkmate", "cpu_time": merged}, {"name": "ideal-gloo"}]})
    assert "| checkmate | 80 % | 90 % (20 %) | 30 % | 50 % |" in table
    assert "| ideal-gloo | — | — | — | — | — |" in table


def test_targets_list_shows_failures_and_the_zero_cost_bound() -> None:
    summary = {
        "runs": [
            {
                "workload": "large-state",
                "placement": "partitioned",
                "targets": {
                    "vs_same_transport_ideal": {"ratio": 0.746, "target": 0.97, "met": False},
                    "vs_every_iteration_systems": {
                        "torch-save-1": {"speedup": 0.739, "target": 1.3, "met": False, "at_zero_cost": 1.11}
                    },
                    "more_often_at_equal_throughput": {
                        "checkfreq": {"times_more_often": None, "at_least": 8, "target": 5.0, "met": True},
                        "torch-save": {"times_more_often": 2, "target": 5.0, "met": False},
                    },
                },
            }
        ]
    }
    text = targets_markdown(summary)
    assert "Checkmate at 0.746x its same-transport ideal (target 0.97): **not met**" in text
    assert (
        "0.739x `torch-save-1` (target 1.3x): **not met**; a Checkmate that cost nothing would be 1.110x"
        in text
    )
    assert ">= 8x more often than `checkfreq`" in text and "**met**" in text
    assert "2x more often than `torch-save` at equal throughput (target 5x): **not met**" in text
