"""The scaling benchmark's option checks, rows and plot, on synthetic figures (no benchmark runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.bench.config import BenchError
from experiments.bench.scaling import build_parser, parse_workers, plan_from, rows_from, write


def test_worker_counts_checked() -> None:
    assert parse_workers("6,2,3") == (2, 3, 6)
    for bad, message in (
        ("1", "out of range"),
        ("7", "out of range"),
        ("x", "not a whole number"),
        ("", "no worker"),
    ):
        with pytest.raises(BenchError, match=message):
            parse_workers(bad)


def test_plan_one_partitioned_run_per_size_and_count() -> None:
    args = build_parser().parse_args(["--workers", "2,6", "--worker-cpus", "0", "--infra-cpus", "1"])
    plan = plan_from(args)
    assert [(c.workload, c.workers) for c in plan] == [
        (w, n) for w in ("tinylm", "medium", "large-state") for n in (2, 6)
    ]
    assert all(c.placement == "partitioned" and c.partition is not None for c in plan)
    assert [c.global_batch for c in plan[:2]] == [32, 96]
    for argv, message in (
        (["--workloads", "huge"], "unknown"),
        (["--worker-cpus", "4096"], "not available"),
        (["--systems", "nope"], "unknown system"),
        (["--rounds", "0"], "--rounds"),
    ):
        with pytest.raises(BenchError, match=message):
            plan_from(build_parser().parse_args(argv))


def _entry(name: str, rate: float, ratio: float) -> dict[str, object]:
    return {
        "name": name,
        "mean_iteration_ms": 1000 / rate,
        "iterations_per_s": rate,
        "ratio_to_ideal": ratio,
        "ratio_to_gloo_ideal": None,
    }


def test_rows_and_files(tmp_path: Path) -> None:
    runs = []
    for workers, ideal, checkmate in ((2, 20.0, 19.0), (4, 10.0, 8.0)):
        runs.append(
            {
                "settings": {"workload": "tinylm", "workers": workers},
                "machine": {"load_average_at_start": [0.1, 0.1, 0.1]},
                "errors": {},
                "systems": [
                    _entry("ideal-cm-transport", ideal, 1.0),
                    _entry("checkmate", checkmate, round(checkmate / ideal, 3)),
                ],
            }
        )
    rows = [row for run in runs for row in rows_from(run)]
    assert [(r["workers"], r["system"], r["ratio_to_ideal"]) for r in rows if r["system"] == "checkmate"] == [
        (2, "checkmate", 0.95),
        (4, "checkmate", 0.8),
    ]
    args = build_parser().parse_args(["--json", str(tmp_path / "s.json"), "--png", str(tmp_path / "s.png")])
    args.given = []
    write(rows, runs, args, 3.0)
    assert json.loads((tmp_path / "s.json").read_text())["rows"] == rows
    assert (tmp_path / "s.png").stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "s.png"]


def test_append_adds_sizes_run_separately_and_replaces_a_repeated_point(tmp_path: Path) -> None:
    def run(workload: str, workers: int, ideal: float, checkmate: float) -> dict[str, object]:
        return {
            "settings": {"workload": workload, "workers": workers},
            "machine": {"load_average_at_start": [0.1, 0.1, 0.1]},
            "errors": {},
            "systems": [
                _entry("ideal-cm-transport", ideal, 1.0),
                _entry("checkmate", checkmate, checkmate / ideal),
            ],
        }

    out = tmp_path / "s.json"
    first = [run("tinylm", 2, 20.0, 19.0), run("tinylm", 4, 10.0, 9.0)]
    args = build_parser().parse_args(["--json", str(out), "--png", str(tmp_path / "s.png")])
    args.given = ["--workloads", "tinylm"]
    write([r for x in first for r in rows_from(x)], first, args, 1.0)
    again = [run("tinylm", 4, 10.0, 9.5), run("large-state", 2, 0.5, 0.45)]
    args = build_parser().parse_args(["--json", str(out), "--png", str(tmp_path / "s.png"), "--append"])
    args.given = ["--workloads", "large-state", "--append"]
    write([r for x in again for r in rows_from(x)], again, args, 2.0)
    document = json.loads(out.read_text())
    points = sorted(
        (r["workload"], r["workers"], r["system"], r["iterations_per_s"]) for r in document["rows"]
    )
    assert points == [
        ("large-state", 2, "checkmate", 0.45),
        ("large-state", 2, "ideal-cm-transport", 0.5),
        ("tinylm", 2, "checkmate", 19.0),
        ("tinylm", 2, "ideal-cm-transport", 20.0),
        ("tinylm", 4, "checkmate", 9.5),  # measured again: replaced
        ("tinylm", 4, "ideal-cm-transport", 10.0),
    ]
    assert len(document["runs"]) == 3 and len(document["commands"]) == 2
    out.write_text("not json")
    with pytest.raises(BenchError, match="cannot read"):
        write([], [], args, 0.0)
