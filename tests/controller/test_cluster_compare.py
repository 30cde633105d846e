"""The cluster-scale comparison (``checkmate-ctl plan --compare``): the model, its sources, its refusals."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from controller import capacity_table
from controller.cli import main as ctl_main
from controller.cluster_bench_check import machine_check
from controller.cluster_inputs import INPUT_FIELDS, CompareError, with_overrides
from controller.cluster_model import MAX_INTERVAL, PEERS, compare, interval_at, overhead
from controller.cluster_render import machine_markdown
from controller.named_clusters import CONFIGS, measured_lag, named


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("system", PEERS)
def test_overhead_never_rises_with_the_interval(name: str, system: str) -> None:
    c = compare(named(name))
    T = c.config.iteration_time_s
    values = [overhead(system, k, c.snapshot_s, c.write_s, T) for k in (1, 2, 3, 4, 8, 16, 64, 1000)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert values[0] > values[-1] > 0


def test_interval_at_five_percent_by_hand() -> None:
    # torch.save: waits 0.5 + 1.5 s per checkpoint of a 1 s iteration: 2 / k <= 0.05 from k = 40
    assert interval_at("torch-save", 0.5, 1.5, 1.0) == 40
    assert overhead("torch-save", 39, 0.5, 1.5, 1.0) > 0.05
    # async: k = 2 still waits for a 3 s persist ((0.1 + 1) / 2 = 55 %); k = 3 pays the snapshot only (3.3 %)
    assert overhead("checkfreq", 2, 0.1, 3.0, 1.0) == pytest.approx(0.55)
    assert interval_at("checkfreq", 0.1, 3.0, 1.0) == 3
    # and a snapshot alone above 5 % of an iteration needs k = ceil(0.2 / 0.05) = 4
    assert interval_at("dcp-async", 0.2, 0.0, 1.0) == 4
    assert interval_at("checkmate", 0.0, 0.0, 1.0, checkmate=0.06) is None
    assert interval_at("checkmate", 0.0, 0.0, 1.0, checkmate=0.01) == 1
    with pytest.raises(ValueError, match="k must be >= 1"):
        overhead("torch-save", 0, 1.0, 1.0, 1.0)


def test_llama3_figures_by_hand() -> None:
    c = compare(named("llama3-405b"))
    state = 405e9 * 12
    T = 6 * 405e9 * 16e6 / (16384 * 400e12)
    write = state / 2000e9
    snapshot = state / 16384 / 25e9
    assert c.state_bytes == pytest.approx(state)
    assert c.write_s == pytest.approx(write)
    assert c.snapshot_s == pytest.approx(snapshot)
    assert c.failures_per_hour == pytest.approx(419 / (54 * 24))
    save = c.system("torch-save")
    k = math.ceil((snapshot + write) / (0.05 * T))
    assert save.interval_at_budget == k
    o = (snapshot + write) / (k * T)
    assert save.overhead_at_interval == pytest.approx(o)
    assert save.repeated_iterations == pytest.approx(k / 2)
    assert save.repeated_s == pytest.approx(k / 2 * T * (1 + o) + 600)
    assert save.repeated_gpu_hours == pytest.approx(save.repeated_s * 16384 / 3600)  # type: ignore[operator]
    # the write is shorter than an iteration: an async save every iteration costs its snapshot only
    assert c.system("checkfreq").overhead_every_iteration == pytest.approx(snapshot / T)
    assert c.throughput_every_iteration["torch-save"] == pytest.approx(1 + (snapshot + write) / T)
    cm = c.system("checkmate")
    lag, _ = measured_lag()
    assert cm.interval_at_budget == 1
    assert cm.repeated_iterations == pytest.approx(0.5 + lag)
    assert c.shadows is not None and c.shadows["processes"] > 0


def test_slower_storage_makes_checkmate_further_ahead() -> None:
    base = compare(named("llama3-405b"))
    slow = compare(with_overrides(named("llama3-405b"), [("storage_write_gbytes_per_s", "100")]))
    for peer in PEERS:
        assert slow.throughput_every_iteration[peer] > base.throughput_every_iteration[peer]
        assert slow.system(peer).interval_at_budget > base.system(peer).interval_at_budget  # type: ignore[operator]
    assert slow.config.sources["storage_write_gbytes_per_s"].kind == "given"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_input_has_a_source_and_nothing_is_attributed_to_the_testbed_paper(name: str) -> None:
    config = named(name)
    assert set(config.sources) == set(INPUT_FIELDS)
    for field_name, source in config.sources.items():
        assert source.kind in ("cited", "derived", "measured", "assumed"), field_name
        assert source.text, field_name
        if source.kind == "cited":
            assert "NSDI" not in source.text, f"{field_name}: no testbed figure is cited from the paper"
    if name == "checkmate-testbed":
        kinds = {config.sources[f].kind for f in ("gpus", "nic_gbps", "model_params", "iteration_time_s")}
        assert kinds == {"assumed"}


def test_a_missing_source_is_refused() -> None:
    config = named("llama3-405b")
    sources = dict(config.sources)
    del sources["nic_gbps"]
    with pytest.raises(CompareError, match="nic_gbps has no source"):
        compare(replace(config, sources=sources))


def test_a_checkmate_that_costs_more_than_five_percent_has_no_interval() -> None:
    c = compare(with_overrides(named("checkmate-testbed"), [("checkmate_overhead", "0.1")]))
    cm = c.system("checkmate")
    assert cm.interval_at_budget is None
    assert "costs 10.0% of every iteration" in cm.note
    assert c.throughput_every_iteration["torch-save"] == pytest.approx(
        (1 + c.system("torch-save").overhead_every_iteration) / 1.1
    )


def test_shadows_that_cannot_keep_up_leave_checkmate_without_an_interval() -> None:
    c = compare(with_overrides(named("llama3-405b"), [("iteration_time_s", "0.001")]))
    cm = c.system("checkmate")
    assert cm.interval_at_budget is None and cm.repeated_s is None
    assert "shadows cannot keep up" in cm.note
    assert c.more_often_at_budget == {p: None for p in PEERS}
    assert MAX_INTERVAL >= 10**9


@pytest.mark.parametrize(
    "argv,message",
    [
        (["nope"], "unknown cluster configuration 'nope'"),
        (["llama3-405b", "--set", "nic_gbps=-5"], "nic_gbps must be positive"),
        (["--set", "storage_write_gbytes_per_s=0"], "storage_write_gbytes_per_s must be positive"),
        (["--set", "snapshot_gbytes_per_s=nan"], "snapshot_gbytes_per_s must be a finite number"),
        (["llama3-405b", "--set", "model_params=1e15"], "model_params 1e+15 x checkpoint_bytes_per_param"),
        (["--set", "gpus=3"], "gpus 3 is not dp"),
        (["--set", "gpus=2.5"], "gpus=2.5: not an integer"),
        (["llama3-405b", "--set", "dp=1", "--set", "model_parallel=16384"], "dp must be >= 2"),
        (["llama3-405b", "--set", "checkpoint_writers=100000"], "checkpoint_writers 100000 exceeds gpus"),
        (["--set", "switch=arista"], "switch 'arista' unknown"),
        (["--set", "checkmate_overhead=1"], "checkmate_overhead must be in [0, 1)"),
        (["--set", "restart_s=-1"], "restart_s must be >= 0"),
        (["--set", "bogus=1"], "--set bogus: no such field"),
        (["--set", "nic_gbps"], "is not FIELD=VALUE"),
        (["--dp", "8"], "not --dp (use --set FIELD=VALUE)"),
    ],
)
def test_bad_configurations_are_refused_naming_the_field(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ctl_main(["plan", "--compare", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""


def test_plan_without_compare_still_needs_its_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl_main(["plan", "--model-params", "7B"]) == 2
    assert "required: --optimizer, --iteration-time, --dp" in capsys.readouterr().err
    assert ctl_main(["plan", "--model-params", "7B", "--set", "gpus=8"]) == 2
    assert "go with --compare" in capsys.readouterr().err


def test_cli_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl_main(["plan", "--compare"]) == 0
    text = capsys.readouterr().out
    for name in CONFIGS:
        assert f"{name}: " in text
    assert "projected by the model" in text
    assert "cited: The Llama 3 Herd of Models" in text
    assert ctl_main(["plan", "--compare", "checkmate-testbed", "--set", "restart_s=60"]) == 0
    assert "restart_s = 60  [given: --set restart_s=60]" in capsys.readouterr().out
    assert ctl_main(["plan", "--compare", "llama3-405b", "--json", "--check-bench"]) == 0
    document = json.loads(capsys.readouterr().out)
    (cluster,) = document["clusters"]
    assert cluster["config"]["name"] == "llama3-405b"
    assert cluster["config"]["sources"]["failures"].startswith("cited: ")
    assert {s["system"] for s in cluster["systems"]} == {"checkmate", *PEERS}
    assert "machine_check" in document


def _bench_files(tmp_path: Path, measured_ratio: float) -> tuple[Path, Path]:
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "systems": [{"name": "checkmate", "shadow_lag_iterations": {"mean": 1.25}}],
                "runs": [
                    {
                        "workload": "big",
                        "placement": "partitioned",
                        "settings": {"model": "a model (~100 MB of parameters + AdamW state)"},
                        "systems": [
                            {"name": "ideal-gloo", "mean_iteration_ms": 1000.0, "checkpoint_every": None},
                            {"name": "torch-save-1", "checkpoint_every": 1, "ratio_to_ideal": measured_ratio},
                        ],
                    }
                ],
            }
        )
    )
    disk = tmp_path / "disk.json"
    disk.write_text(json.dumps({"rows": [{"bytes_written": 10_000_000, "seconds_per_write": 0.1}]}))
    return bench, disk


def test_the_machine_check_predicts_from_the_measured_figures(tmp_path: Path) -> None:
    bench, disk = _bench_files(tmp_path, 0.5)
    (check,) = machine_check(bench, disk)
    # 100 MB at 100 MB/s = 1 s, plus a 20 ms snapshot at 5 GB/s, on a 1 s iteration
    assert check.write_s == pytest.approx(1.0)
    (row,) = check.rows
    assert row.predicted_ratio == pytest.approx(1 / 2.02)
    assert row.error == pytest.approx(1 / 2.02 / 0.5 - 1)
    assert "| yes |" in "\n".join(machine_markdown([check]))
    bench, disk = _bench_files(tmp_path, 0.8)
    (check,) = machine_check(bench, disk)
    text = "\n".join(machine_markdown([check]))
    assert "| **no** |" in text and "0 of 1 within 15 %" in text
    assert measured_lag(bench) == (1.25, measured_lag(bench)[1])
    assert measured_lag(bench)[1].kind == "measured"
    assert measured_lag(tmp_path / "missing.json")[1].kind == "assumed"
    with pytest.raises(CompareError, match="cannot read the measured results"):
        machine_check(tmp_path / "missing.json", disk)


def test_the_machine_check_takes_the_runs_own_storage_measurement(tmp_path: Path) -> None:
    """bench.json's emulation.storage (the peers' directory, checkpoint size) before the disk bench."""
    bench, disk = _bench_files(tmp_path, 0.5)
    document = json.loads(bench.read_text())
    run = document["runs"][0]
    run["emulation"] = {"storage": {"bytes": 100_000_000, "buffered_MBps": 400.0, "durable_MBps": 90.0}}
    bench.write_text(json.dumps(document))
    disk.unlink()  # not needed: the run measured its own storage
    (check,) = machine_check(bench, disk)
    assert check.write_rate_mb_s == pytest.approx(400.0) and check.write_s == pytest.approx(0.25)
    assert "bench.json emulation.storage" in check.write_rate_source
    assert "write 400 MB/s (bench.json emulation.storage" in "\n".join(machine_markdown([check]))
    # measured at another size (more than 2x off): the disk bench's nearest size instead
    run["emulation"]["storage"]["bytes"] = 1_000_000
    bench.write_text(json.dumps(document))
    with pytest.raises(CompareError, match="cannot read the measured results"):
        machine_check(bench, disk)
    disk.write_text(json.dumps({"rows": [{"bytes_written": 10_000_000, "seconds_per_write": 0.1}]}))
    (check,) = machine_check(bench, disk)
    assert check.write_rate_mb_s == pytest.approx(100.0) and "shadow_disk_bench" in check.write_rate_source


def test_the_machine_check_takes_the_remote_storage_the_peers_wrote_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--storage remote: the storage host's durable NFS rate, not the local directory's."""
    bench, disk = _bench_files(tmp_path, 0.5)
    document = json.loads(bench.read_text())
    document["runs"][0]["emulation"] = {
        "storage": {"bytes": 100_000_000, "buffered_MBps": 400.0, "durable_MBps": 90.0},
        "remote_storage": {"bytes": 100_000_000, "written_MBps": 30.0, "durable_MBps": 25.0},
    }
    document["runs"][0]["storage"] = "remote"
    bench.write_text(json.dumps(document))
    (check,) = machine_check(bench, disk)
    assert check.write_rate_mb_s == pytest.approx(25.0) and check.write_s == pytest.approx(4.0)
    assert "emulation.remote_storage" in check.write_rate_source
    assert (
        check.storage == "remote" and "**big** (partitioned, remote storage)" in machine_markdown([check])[0]
    )
    # checkmate-ctl plan --compare --check-bench BENCH_JSON reads that file (default results/bench.json)
    assert ctl_main(["plan", "--compare", "llama3-405b", "--json", "--check-bench", str(bench)]) == 0
    (checked,) = json.loads(capsys.readouterr().out)["machine_check"]
    assert (checked["storage"], checked["write_rate_mb_s"]) == ("remote", pytest.approx(25.0))
    assert ctl_main(["plan", "--compare", "llama3-405b", "--check-bench", str(tmp_path / "none.json")]) == 2
    assert "cannot read the measured results" in capsys.readouterr().err
    # a remote probe at another size falls back to the local measurement of the right size
    document["runs"][0]["emulation"]["remote_storage"]["bytes"] = 1_000_000
    bench.write_text(json.dumps(document))
    (check,) = machine_check(bench, disk)
    assert check.write_rate_mb_s == pytest.approx(400.0)


def test_a_background_persist_pays_its_measured_cpu_and_dcp_in_a_process_writes_from_every_rank(
    tmp_path: Path,
) -> None:
    """On this machine the writer shares the workers' CPU: CheckFreq and DCP hide the wait for the
    storage, not the client's CPU (the probe's, per write); DCP without collectives writes the whole
    state from every rank. torch.save pays the CPU inside its measured write already."""
    bench, disk = _bench_files(tmp_path, 0.5)
    document = json.loads(bench.read_text())
    run = document["runs"][0]
    run["storage"] = "remote"
    run["settings"]["workers"] = 3
    run["emulation"] = {
        "remote_storage": {"bytes": 100_000_000, "durable_MBps": 50.0, "cpu_s_per_write": 0.25},
        "storage": {"bytes": 100_000_000, "buffered_MBps": 1000.0, "buffered_s": [0.1, 0.12, 0.11]},
    }
    run["systems"] += [
        {"name": "checkfreq-4", "checkpoint_every": 4, "ratio_to_ideal": 0.5},
        {"name": "dcp-process-4", "checkpoint_every": 4, "ratio_to_ideal": 0.5},
    ]
    bench.write_text(json.dumps(document))
    (check,) = machine_check(bench, disk)
    assert check.persist_cpu_s == pytest.approx(0.25) and "cpu_s_per_write" in check.persist_cpu_source
    rows = {r.system: r for r in check.rows}
    # 100 MB at 50 MB/s = 2 s, snapshot 20 ms, iteration 1 s
    assert rows["torch-save-1"].predicted_ratio == pytest.approx(1 / (1 + 2.02))
    assert rows["checkfreq-4"].predicted_ratio == pytest.approx(1 / (1 + (0.02 + 0.0 + 0.25) / 4))
    assert rows["dcp-process-4"].writers == 3
    assert rows["dcp-process-4"].predicted_ratio == pytest.approx(1 / (1 + (0.02 + (6.0 - 4.0) + 0.75) / 4))
    assert "3 ranks each writing the whole state" in "\n".join(machine_markdown([check]))
    # local storage: the buffered write's median time is the CPU; an older file without it: 0, said
    run["storage"] = "local"
    bench.write_text(json.dumps(document))
    (check,) = machine_check(bench, disk)
    assert check.persist_cpu_s == pytest.approx(0.11) and "buffered_s" in check.persist_cpu_source
    del run["emulation"]
    bench.write_text(json.dumps(document))
    (check,) = machine_check(bench, disk)
    assert check.persist_cpu_s == 0.0 and "not measured" in check.persist_cpu_source
    # the clusters' projection never adds it (training runs on the GPUs there)
    assert overhead("checkfreq", 4, 0.02, 1.0, 1.0) == pytest.approx(0.02 / 4)


def test_docs_comparison_is_up_to_date(tmp_path: Path) -> None:
    doc = capacity_table.DOC.read_text()
    block = capacity_table.render_compare()
    assert block in doc, "run python -m controller.capacity_table"
    stale = tmp_path / "capacity.md"
    stale.write_text(doc.replace(block.splitlines()[4], block.splitlines()[4] + " stale"))
    assert capacity_table.main(["--check", "--doc", str(stale)]) == 1
