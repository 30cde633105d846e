"""The reliability report: its long-run section shows what the soak measured, a loss included."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tests.reliability import long_runs, report
from tests.reliability.record import Row

SOAK = json.loads((Path(__file__).parents[2] / "results" / long_runs.SOAK_FILE).read_text())


def _write_rows(path: Path) -> None:
    row = Row(
        area="fault",
        target="shadow",
        case="copy loss",
        trials=3,
        lost=0,
        held="every certified step equal",
        command="pytest x",
        test="tests/x.py::test_x",
    )
    path.write_text(json.dumps(dataclasses.asdict(row)) + "\n")


def test_a_soak_that_ended_unequal_is_a_loss(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    rows = tmp_path / "rows.jsonl"
    _write_rows(rows)
    (results / long_runs.SOAK_FILE).write_text(json.dumps(SOAK))
    out = tmp_path / "reliability.md"
    assert report.main([str(rows), "--out", str(out), "--results", str(results)]) == 0
    text = out.read_text()
    assert "## Long runs and a slow shadow" in text
    assert f"{SOAK['steps']} iterations" in text and "bit for bit: **yes**" in text

    (results / long_runs.SOAK_FILE).write_text(json.dumps({**SOAK, "equal_to_workers": False}))
    assert report.main([str(rows), "--out", str(out), "--results", str(results)]) == 1
    assert "bit for bit: **NO**" in out.read_text()


def test_without_long_run_files_the_section_is_left_out(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    _write_rows(rows)
    out = tmp_path / "reliability.md"
    assert report.main([str(rows), "--out", str(out), "--results", str(tmp_path / "none")]) == 0
    assert "Long runs" not in out.read_text()


def test_a_malformed_long_run_file_is_a_clear_error(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    _write_rows(rows)
    (tmp_path / long_runs.SOAK_FILE).write_text("[1, 2]")
    assert report.main([str(rows), "--out", str(tmp_path / "r.md"), "--results", str(tmp_path)]) == 2
    assert not (tmp_path / "r.md").exists()
