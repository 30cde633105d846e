"""make bench: the k-sweep arithmetic, the option checks, the combined results file (no benchmark runs)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from experiments.bench import cli as bench
from experiments.bench.cli import build_parser, plan_from
from experiments.bench.config import DEFAULT_SYSTEMS, BenchConfig, BenchError
from experiments.bench.figures import LogFigures, frequency_targets
from experiments.bench.partition import CpuPartition
from experiments.bench.report import TABLE_BEGIN, TABLE_END, BenchResult, atomic_write_text, write_suite
from experiments.bench.run import TOPOLOGY, scaled_topology
from experiments.bench.sweep import (
    Point,
    SweepError,
    analyse,
    analyse_peer,
    markdown,
    parse_k_list,
    smallest_k_from,
)
from experiments.commands import REPO


# ---- the arithmetic -------------------------------------------------------------------------
def test_smallest_k_that_stays_above_the_threshold() -> None:
    points = [
        Point(1, 5.0, 0.5),
        Point(2, 8.0, 1.0),
        Point(4, 9.6, 2.0),
        Point(8, 9.4, 4.0),
        Point(16, 9.9, 8.0),
    ]
    assert smallest_k_from(points, 9.5) == 16  # 4 reaches it but 8 falls back below: not 'stays'
    assert smallest_k_from(points, 9.0) == 4
    assert smallest_k_from(points, 4.0) == 1
    assert smallest_k_from(points, 10.0) is None


def test_peer_within_5pct_and_matching_checkmate() -> None:
    points = [
        Point(1, 5.0, 0.5),
        Point(2, 7.0, 1.0),
        Point(4, 9.0, 2.1),
        Point(8, 9.6, 4.2),
        Point(16, 9.9, 8.0),
    ]
    # ideal 10 -> threshold 9.5: k = 8; Checkmate at 8.9/s (every iteration) -> k = 4
    result = analyse_peer(points, ideal_rate=10.0, checkmate_rate=8.9)
    assert result["within_5pct_of_ideal"] == {"k": 8, "reached": True, "times_more_often": 8.0}
    assert result["repeated_at_k_within_5pct"] == 4.2
    assert result["matching_checkmate"] == {"k": 4, "reached": True, "times_more_often": 4.0}
    assert result["repeated_at_k_matching_checkmate"] == 2.1
    assert [p["ratio_to_ideal"] for p in result["points"]] == [0.5, 0.7, 0.9, 0.96, 0.99]
    # a peer that never gets there: no made-up k, only a lower bound
    slow = analyse_peer([Point(1, 2.0, 0.5), Point(4, 3.0, 2.0)], ideal_rate=10.0, checkmate_rate=9.0)
    assert slow["within_5pct_of_ideal"] == {"k": None, "reached": False, "at_least": 4.0}
    assert slow["repeated_at_k_within_5pct"] is None
    with pytest.raises(SweepError):
        analyse_peer([], 10.0, None)
    with pytest.raises(SweepError):
        analyse_peer(points, 0.0, None)


def _entry(
    name: str, rate: float, every: int | None, ideal: str, repeated: float | None = None
) -> dict[str, Any]:
    return {
        "name": name,
        "iterations_per_s": rate,
        "checkpoint_every": every,
        "ideal": ideal,
        "expected_repeated_iterations_per_failure": repeated,
        "ratio_to_ideal": None,
    }


def test_analyse_groups_the_entries_by_peer_and_renders() -> None:
    entries = [
        _entry("ideal-gloo", 10.0, None, "ideal-gloo"),
        _entry("ideal-cm-transport", 9.0, None, "ideal-cm-transport"),
        {**_entry("checkmate", 9.2, 1, "ideal-cm-transport", 1.2), "ratio_to_ideal": 1.02},
        _entry("torch-save-1", 4.0, 1, "ideal-gloo", 0.5),
        _entry("torch-save-8", 9.3, 8, "ideal-gloo", 4.0),
        _entry("torch-save-32", 9.8, 32, "ideal-gloo", 16.0),
        _entry("checkfreq-1", 6.0, 1, "ideal-gloo", 0.9),
        _entry("checkfreq-8", 9.7, 8, "ideal-gloo", 4.5),
        _entry("dcp-async-1", 3.0, 1, "ideal-gloo", 2.0),  # not swept: left out
    ]
    sweep = analyse(entries)
    assert set(sweep) == {"torch-save", "checkfreq", "checkmate"}
    assert sweep["torch-save"]["within_5pct_of_ideal"]["k"] == 32
    assert sweep["torch-save"]["matching_checkmate"]["k"] == 8
    assert sweep["checkfreq"]["within_5pct_of_ideal"]["times_more_often"] == 8.0
    assert sweep["checkmate"]["within_5pct_of_ideal"] is True
    table = markdown(sweep)
    assert "| torch-save | 32 | 32x | 16.00 | 8 | 8x | 4.00 |" in table
    assert table.count("\n") == 4


def test_more_often_at_5pct_is_not_claimed_when_checkmate_itself_costs_more() -> None:
    entries = [
        _entry("ideal-gloo", 10.0, None, "ideal-gloo"),
        _entry("ideal-cm-transport", 10.0, None, "ideal-cm-transport"),
        {**_entry("checkmate", 9.0, 1, "ideal-cm-transport", 1.5), "ratio_to_ideal": 0.9},
        _entry("torch-save-1", 8.0, 1, "ideal-gloo", 0.5),
        _entry("torch-save-8", 9.1, 8, "ideal-gloo", 4.0),
    ]
    sweep = analyse(entries)
    assert sweep["checkmate"]["within_5pct_of_ideal"] is False
    table = markdown(sweep)
    assert (
        "| torch-save | > 8 (not reached) | n/a: Checkmate at 0.9x its ideal | — | 8 | 8x | 4.00 |" in table
    )


def test_frequency_targets_never_guess() -> None:
    sweep = {
        "a": {"matching_checkmate": {"k": 8, "reached": True, "times_more_often": 8.0}},
        "b": {"matching_checkmate": {"k": None, "reached": False, "at_least": 16.0}},
        "c": {"matching_checkmate": {"k": None, "reached": False, "at_least": 4.0}},
        "d": {"matching_checkmate": {"k": 2, "reached": True, "times_more_often": 2.0}},
        "checkmate": {"iterations_per_s": 9.0},
    }
    got = {peer: r["met"] for peer, r in frequency_targets(sweep).items()}
    assert got == {"a": True, "b": True, "c": None, "d": False}


def test_k_lists() -> None:
    assert parse_k_list("8, 1,2") == (1, 2, 8)
    assert parse_k_list("") == ()
    for bad, message in (
        ("0", "out of range"),
        ("1,x", "not a whole number"),
        ("2,2", "repeated"),
        ("5000", "range"),
    ):
        with pytest.raises(SweepError, match=message):
            parse_k_list(bad)


# ---- options refused before anything starts -------------------------------------------------
def _plan(*argv: str) -> list[BenchConfig]:
    return plan_from(build_parser().parse_args(list(argv)), "python -m experiments.bench")


def test_plan_runs_each_workload_in_each_placement() -> None:
    plan = _plan(
        "--worker-cpus", "0", "--infra-cpus", "1", "--sweep-k", "1,4", "--placement", "partitioned,colocated",
        "--storage", "local",  # large-state's remote column: test_storage_host
    )  # fmt: skip
    assert [(c.workload, c.placement) for c in plan] == [
        ("tinylm", "partitioned"),
        ("tinylm", "colocated"),
        ("large-state", "partitioned"),
        ("large-state", "colocated"),
    ]
    first, colocated, large = plan[0], plan[1], plan[2]
    assert first.partition == CpuPartition(frozenset({0}), frozenset({1})) and colocated.partition is None
    assert first.sweep_ks == (1, 4) and colocated.sweep_ks == ()  # the sweep runs in the first placement
    names = [s.name for s in first.selected()]
    assert {"checkfreq-4", "dcp-process-4", "torch-save-4", "checkfreq-1", "host-replication"} <= set(names)
    assert "checkfreq-4" not in [s.name for s in colocated.selected()]
    assert first.iterations == 150 and large.iterations == 30
    assert large.global_batch == 3 and "--width" in large.model_args  # 1 sample per worker
    chosen = _plan("--workloads", "tinylm", "--systems", "checkmate,torch-save-4", "--sweep-k", "4")
    assert [[s.name for s in c.selected()] for c in chosen] == [["checkmate", "torch-save-4"], ["checkmate"]]
    only_swept = _plan("--workloads", "tinylm", "--systems", "checkfreq-4", "--sweep-k", "4")
    assert [c.placement for c in only_swept] == ["partitioned"]
    five = _plan("--workers", "5", "--placement", "colocated", "--workloads", "tinylm")
    assert five[0].global_batch == 80 and five[0].workers == 5


def test_default_plan_uses_each_workloads_own_rounds_sweep_and_placements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("experiments.bench.storage_host.ganesha_missing", lambda: None)  # only planned
    monkeypatch.setattr("checkmate.nfs.available", lambda: None)
    plan = _plan("--worker-cpus", "0", "--infra-cpus", "1")
    assert [(c.workload, c.placement, c.rounds, c.sweep_ks, c.storage) for c in plan] == [
        ("tinylm", "partitioned", 2, (1, 2, 4, 8, 16), "local"),
        ("tinylm", "colocated", 2, (), "local"),
        ("large-state", "partitioned", 1, (1, 2, 4, 8), "local"),
        ("large-state", "partitioned", 1, (1, 2, 4, 8), "remote"),  # the sweep on both storages
    ]
    first, colocated, large, large_remote = (list(c.systems) for c in plan)
    assert large == large_remote
    assert first[: len(DEFAULT_SYSTEMS)] == list(DEFAULT_SYSTEMS) and colocated == list(DEFAULT_SYSTEMS)
    assert "torch-save-10" not in first and {"torch-save-16", "dcp-process-2", "checkfreq-8"} <= set(first)
    assert len(first) == len(set(first)) == len(DEFAULT_SYSTEMS) + 3 * 4  # k = 1 runs once
    assert "checkfreq-16" not in large and "checkfreq-8" in large
    given = _plan("--rounds", "3", "--sweep-k", "", "--placement", "colocated", "--storage", "local")
    assert [(c.workload, c.rounds, c.sweep_ks) for c in given] == [("tinylm", 3, ()), ("large-state", 3, ())]
    everything = _plan("--systems", "all", "--workloads", "tinylm", "--placement", "colocated", "--k", "10")
    assert "torch-save-10" in [s.name for s in everything[0].selected()]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workers", "1"], "--workers must be 2 to 6"),
        (["--workers", "7"], "--workers must be 2 to 6"),
        (["--sweep-k", "0,2"], "out of range"),
        (["--sweep-k", "1,a"], "not a whole number"),
        (["--k", "0"], "--k must be"),
        (["--worker-cpus", "4096"], "not available here"),
        (["--worker-cpus", "0", "--infra-cpus", "0"], "overlap"),
        (["--worker-cpus", "x"], "not a CPU list"),
        (["--placement", "colocated", "--worker-cpus", "0"], "need --placement partitioned"),
        (["--placement", "elsewhere"], "--placement: unknown"),
        (["--workloads", "huge"], "--workloads: unknown"),
        (["--workloads", ""], "nothing given"),
        (["--iterations", "4"], "must exceed --warmup"),
        (["--systems", "checkfreq-3"], "unknown system"),
    ],
)
def test_bad_options_are_refused_with_a_message(argv: list[str], message: str) -> None:
    with pytest.raises(BenchError, match=message):
        _plan(*argv)


def test_bad_options_exit_2_before_the_root_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--workers", "9"]) == 2
    assert "--workers must be 2 to 6" in capsys.readouterr().out


def test_scaled_topology_adds_workers_on_new_ports() -> None:
    base = json.loads((TOPOLOGY).read_text())
    data = scaled_topology(base, 6)
    assert [h for h in data["hosts"] if data["hosts"][h]["role"] == "worker"] == [
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
    ]
    ports = [end for link in data["links"] for end in link[:2] if "-p" in end]
    assert len(ports) == len(set(ports)) == 8
    assert (
        len({h["ip"] for h in data["hosts"].values()}) == len({h["mac"] for h in data["hosts"].values()}) == 8
    )
    assert scaled_topology(base, 3) == base  # single.json already has them


# ---- results files ---------------------------------------------------------------------------
def test_atomic_write_leaves_the_old_file_when_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "bench.json"
    target.write_text('{"old": true}\n')

    def interrupted(self: Path, text: str) -> int:
        Path.write_bytes(self, text[:10].encode())
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_text(target, '{"new": "a long document"}\n')
    monkeypatch.undo()
    assert target.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # no half-written temporary


def _figs(rate: float, delay: float | None = None) -> LogFigures:
    return LogFigures(rate, 10.0, int(rate * 10), 1 / rate, 1 / rate, delay, 5 if delay is not None else 0)


def _summary(config: BenchConfig, rates: Mapping[str, float | None]) -> dict[str, Any]:
    result = BenchResult(config, machine={"cores": 2, "load_average_at_start": [0.1, 0.1, 0.1]})
    result.runs = {
        name: [_figs(rate, None if name.startswith("ideal") else 0.0)]
        for name, rate in rates.items()
        if rate is not None
    }
    return result.summary()


def test_write_suite_combines_placements_and_fills_the_docs(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# B\n\n{TABLE_BEGIN}\nold\n{TABLE_END}\n\nrest\n")
    base = BenchConfig(
        json_out=tmp_path / "bench.json", png_out=tmp_path / "bench.png", docs=docs, sweep_ks=(1, 4)
    )
    partitioned = BenchConfig(
        **{
            **base.__dict__,
            "placement": "partitioned",
            "partition": CpuPartition(frozenset({0}), frozenset({1})),
        }
    )
    colocated = BenchConfig(**{**base.__dict__, "sweep_ks": ()})
    rates = {
        "ideal-gloo": 10.0,
        "ideal-cm-transport": 9.0,
        "checkmate": 9.0,
        "torch-save-1": 5.0,
        "torch-save-4": 9.6,
    }
    summaries = [
        _summary(partitioned, rates),
        _summary(colocated, {**rates, "checkmate": 6.0, "torch-save-4": None}),
    ]
    summary = write_suite(summaries, base, 12.0)
    on_disk = json.loads((tmp_path / "bench.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert [(r["workload"], r["placement"]) for r in on_disk["runs"]] == [
        ("tinylm", "partitioned"),
        ("tinylm", "colocated"),
    ]
    assert on_disk["cpu_placement"]["partition"] == {"workers": "0", "infrastructure": "1"}
    assert on_disk["sweep"]["torch-save"]["within_5pct_of_ideal"]["k"] == 4
    # torch-save matches Checkmate's 9.0/s at k = 4: 4x more often, short of the 5x target
    frequency = on_disk["targets"]["more_often_at_equal_throughput"]["torch-save"]
    assert frequency["times_more_often"] == 4.0 and frequency["met"] is False
    assert on_disk["targets"]["vs_same_transport_ideal"] == {
        "ideal": "ideal-cm-transport", "ratio": 1.0, "target": 0.97, "met": True,
    }  # fmt: skip
    text = docs.read_text()
    assert "old" not in text and text.endswith("rest\n")
    assert "| checkmate | 1 | 9.00 | 1.000 | 0.900 | 6.00 | 0.667 | 0.600 |" in text
    assert "| torch-save | 4 | 4x |" in text and text.count("Checkpoint interval sweep") == 1
    assert on_disk["runs"][1]["sweep"] == {}  # no sweep co-located
    assert "| torch-save-4 | 4 | 9.60 | 0.960 | 0.960 | — | — | — |" in text  # not run co-located
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.root
def test_interrupted_benchmark_leaves_nothing_behind(tmp_path: Path) -> None:
    """SIGTERM while a system trains: exit 130, network down, no process left, no results file."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from topologies.runstate import RunState, RunStateError

    work = tmp_path / "work"
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "experiments.bench", "--workloads", "tinylm", "--placement", "partitioned"]
    argv += ["--systems", "checkmate", "--iterations", "400", "--rounds", "1", "--sweep-k", "", "--no-docs"]
    argv += ["--work-dir", str(work), "--json", str(out / "bench.json"), "--png", str(out / "bench.png")]
    argv += ["--switch-name", "bi1"]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        deadline = time.monotonic() + 180
        log = work / "logs" / "round1-checkmate" / "rank0.jsonl"
        while not (log.exists() and '"loss"' in log.read_text()):
            assert process.poll() is None, "the benchmark ended before it trained"
            assert time.monotonic() < deadline, "no training within 180 s"
            time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=180) == 130
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
            subprocess.run(
                [sys.executable, "-m", "topologies.cli", "down", "--run-dir", str(work / "network")],
                timeout=120,
                check=False,
            )
    with pytest.raises(RunStateError):
        RunState.load(work / "network")  # taken down
    marker = str(work).encode()
    left = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    left.append(entry.name)
            except OSError:
                continue
    assert left == []
    assert not out.exists() or list(out.iterdir()) == []
    assert not any("bi1" in name for name in os.listdir("/sys/class/net"))
