"""``make bench``'s pure parts: figures from worker logs, the repeated-work formula, the JSON schema.

The last test runs the harness itself (root; about a minute): a few iterations of three systems.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from experiments.bench.cli import build_parser, config_from
from experiments.bench.config import BenchConfig, BenchError, systems_for
from experiments.bench.figures import (
    LogFigures,
    certification_delays,
    expected_repeated_iterations,
    figures,
    iteration_rate,
    steady_times,
)
from experiments.bench.report import (
    TABLE_BEGIN,
    TABLE_END,
    BenchResult,
    markdown_table,
    update_docs_table,
    write_outputs,
)
from experiments.bench.run import BenchRun

SYSTEMS = systems_for(10)


def _log(step: float, n: int, certified_lag: int | None = None, t0: float = 1000.0) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = [{"event": "start", "rank": 0, "start_iteration": 0, "time": t0 - 5}]
    for i in range(n):
        certified = None if certified_lag is None else (i - certified_lag if i >= certified_lag else None)
        records.append(
            {"iteration": i, "loss": 5.0, "lr": 1e-3, "time": t0 + i * step, "certified": certified}
        )
    return records


def test_expected_repeated_work_formula() -> None:
    assert expected_repeated_iterations(None, None) is None
    assert expected_repeated_iterations(1, 0.0) == 0.5  # only the interrupted iteration, on average
    assert expected_repeated_iterations(10, 0.0) == 5.0  # (10 - 1) / 2 finished + 1/2 in progress
    assert expected_repeated_iterations(10, 0.4) == pytest.approx(5.4)
    assert expected_repeated_iterations(1, -0.2) == 0.5  # a delay is never negative


def test_rate_from_steady_iterations_only() -> None:
    records = _log(0.1, 50)
    records[1]["time"] -= 30.0  # a slow first iteration (warm-up) must not count
    times = steady_times(records, warmup=5)
    assert min(times) == 5 and max(times) == 49
    rate, seconds, intervals = iteration_rate(times)
    assert rate == pytest.approx(10.0)
    assert seconds == pytest.approx(4.4)
    assert intervals == 44
    # a restarted job's second start is not measured
    more = records + [
        {"event": "start", "rank": 0, "time": 9999.0},
        {"iteration": 50, "loss": 1, "time": 1e5},
    ]
    assert max(steady_times(more, 5)) == 49
    with pytest.raises(ValueError):
        iteration_rate({3: 1.0})


def test_checkpoint_delays_sync_and_async() -> None:
    step = 0.1
    sync = _log(step, 40)
    for i in range(9, 40, 10):  # durable before the iteration is logged: synchronous
        sync.append(
            {
                "event": "checkpoint",
                "iteration": i,
                "started": 1000 + i * step - 0.05,
                "durable": 1000 + i * step - 0.01,
            }
        )
    fig = figures(sync, SYSTEMS["torch-save-10"], warmup=5)
    assert fig.durable_delay_iterations == 0.0 and fig.checkpoints == 4
    async_ = _log(step, 40)
    for i in range(5, 40):  # complete 1.5 iterations after the iteration was logged
        async_.append(
            {
                "event": "checkpoint",
                "iteration": i,
                "started": 1000 + i * step,
                "durable": 1000 + (i + 1.5) * step,
            }
        )
    fig = figures(async_, SYSTEMS["dcp-async-1"], warmup=5)
    assert fig.durable_delay_iterations == pytest.approx(1.5)
    assert fig.iterations_per_s == pytest.approx(10.0)


def test_checkmate_delay_from_certified() -> None:
    records = _log(0.1, 30, certified_lag=1)  # right after step i the shadows had certified i - 1
    times = steady_times(records, 5)
    delays, lags = certification_delays(records, times, 0.1)
    assert set(lags) == {1}
    assert delays and all(d == pytest.approx(1.0) for d in delays)
    fig = figures(records, SYSTEMS["checkmate"], warmup=5)
    assert fig.durable_delay_iterations == pytest.approx(1.0)
    assert fig.shadow_lag is not None and fig.shadow_lag["mean"] == 1
    assert fig.shadow_lag["certified_share"] < 1  # the last iteration was not seen certified


def _figs(rate: float, delay: float | None = None) -> LogFigures:
    return LogFigures(rate, 10.0, int(rate * 10), 1 / rate, 1 / rate, delay, 5 if delay is not None else 0)


def _result(tmp_path: Path) -> BenchResult:
    config = BenchConfig(
        json_out=tmp_path / "bench.json", png_out=tmp_path / "bench.png", docs=tmp_path / "benchmarks.md"
    )
    result = BenchResult(config, machine={"cores": 2, "load_average_at_start": [0.1, 0.1, 0.1]})
    result.runs = {
        "ideal-gloo": [_figs(10.0), _figs(12.0)],
        "ideal-cm-transport": [_figs(8.0)],
        "checkmate": [_figs(7.8, 1.0)],
        "checkmate-disk-1": [_figs(7.0, 1.0)],
        "checkmate-fingerprint-8": [_figs(7.9, 1.0)],
        "host-replication": [_figs(6.5, 1.0)],
        "torch-save-1": [_figs(5.0, 0.0)],
        "torch-save-10": [_figs(10.5, 0.0)],
        "dcp-async-1": [_figs(4.0, 2.0)],
        "dcp-async-10": [_figs(10.8, 0.5)],
    }
    return result


def test_summary_schema_ratios_and_targets(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# Benchmarks\n\n{TABLE_BEGIN}\nold table\n{TABLE_END}\n\nreading\n")
    summary = write_outputs(_result(tmp_path))
    on_disk = json.loads((tmp_path / "bench.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    by_name = {e["name"]: e for e in summary["systems"]}
    assert set(by_name) == set(SYSTEMS)
    assert summary["emulation"] is None  # not measured: said so, no figure made up
    required = {
        "name", "transport", "iterations_per_s", "checkpoint_every",
        "expected_repeated_iterations_per_failure", "ratio_to_ideal", "ratio_to_gloo_ideal",
        "ratio_to_cm_transport_ideal", "seconds", "iterations_measured",
    }  # fmt: skip
    for entry in summary["systems"]:
        assert required <= set(entry)
    assert by_name["ideal-gloo"]["iterations_per_s"] == 11.0  # rounds averaged
    checkmate = by_name["checkmate"]
    assert checkmate["ratio_to_ideal"] == pytest.approx(7.8 / 8.0, abs=1e-3)  # same transport
    assert checkmate["ratio_to_gloo_ideal"] == pytest.approx(7.8 / 11.0, abs=1e-3)
    assert checkmate["expected_repeated_iterations_per_failure"] == 1.5
    assert by_name["torch-save-10"]["expected_repeated_iterations_per_failure"] == 5.0
    assert by_name["torch-save-1"]["ratio_to_ideal"] == pytest.approx(5.0 / 11.0, abs=1e-3)  # gloo
    assert by_name["ideal-gloo"]["expected_repeated_iterations_per_failure"] is None
    targets = summary["targets"]
    assert targets["vs_same_transport_ideal"]["met"] is True  # 0.975
    assert targets["vs_gloo_ideal"]["met"] is False  # 0.71
    every = targets["vs_every_iteration_systems"]
    assert set(every) == {"host-replication", "torch-save-1", "dcp-async-1"}
    assert every["torch-save-1"]["met"] is True and every["host-replication"]["met"] is False
    assert every["torch-save-1"]["at_zero_cost"] == pytest.approx(8.0 / 5.0, abs=1e-3)  # its ideal / the peer
    text = docs.read_text()
    assert "old table" not in text and "| checkmate | checkmate-udp |" in text and text.endswith("reading\n")
    assert summary["settings"]["k"] == 10 and summary["command"] == "make bench"


def test_markdown_table_and_docs_without_markers(tmp_path: Path) -> None:
    summary = _result(tmp_path).summary()
    table = markdown_table(summary["systems"])
    assert table.count("\n") == 2 + len(SYSTEMS)
    assert "whole run" in table
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    assert update_docs_table(plain, table, "header") is False
    assert plain.read_text() == "no markers\n"


def test_command_line() -> None:
    args = build_parser().parse_args(
        ["--systems", "checkmate,torch-save-K", "--k", "5", "--iterations", "40"]
    )
    config = config_from(args, "python -m experiments.bench")
    assert [s.name for s in config.selected()] == ["checkmate", "torch-save-5"]
    assert config.selected()[1].every == 5
    with pytest.raises(BenchError, match="unknown"):
        config_from(build_parser().parse_args(["--systems", "nope"]), "x").selected()
    with pytest.raises(BenchError):
        config_from(build_parser().parse_args(["--iterations", "6"]), "x")


@pytest.mark.root
def test_bench_harness_smoke(tmp_path: Path) -> None:
    """A few iterations of three systems through the real harness (network, shadows, baselines)."""
    config = BenchConfig(
        iterations=12,
        warmup=2,
        k=3,
        rounds=1,
        systems=("ideal-gloo", "checkmate", "torch-save-3"),
        work_dir=tmp_path / "work",
        json_out=tmp_path / "bench.json",
        png_out=tmp_path / "bench.png",
        docs=None,
        rename_switches=(("s1", "bt1"),),
        train_timeout=240,
    )
    result = BenchRun(config).run_all()
    summary = write_outputs(result)
    assert summary["errors"] == {}
    by_name = {e["name"]: e for e in summary["systems"]}
    assert set(by_name) == {"ideal-gloo", "checkmate", "torch-save-3"}
    assert by_name["checkmate"]["switch_shadow_copies_packets"] > 0
    assert by_name["checkmate"]["shadow_lag_iterations"]["max"] <= 2
    cpu = by_name["checkmate"]["cpu_time"]  # where the CPU time went, read from /proc while it trained
    assert cpu["roles"]["shadows"]["processes"] == 2 and cpu["roles"]["shadows"]["cpu_s_per_s"] > 0
    assert cpu["roles"]["switch"]["cpu_s_per_s"] > 0 and cpu["roles"]["workers"]["processes"] >= 3
    assert by_name["ideal-gloo"]["cpu_time"]["roles"]["shadows"]["processes"] == 0
    assert by_name["torch-save-3"]["checkpoints_measured"] >= 2
    assert (config.work_dir / "checkpoints" / "torch-save-3" / "checkpoint.pt").exists()
