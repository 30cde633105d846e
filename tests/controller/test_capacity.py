"""The capacity planner: its figures, its sources, and what it refuses (``checkmate-ctl plan``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from controller import capacity, capacity_inputs
from controller.capacity import PlanError, PlanInfeasible, PlanRequest, plan
from controller.capacity_table import main as table_main
from controller.cli import main as ctl_main

REPO = Path(__file__).resolve().parents[2]


def _bench(tmp_path: Path, adamw_rate: float) -> Path:
    path = tmp_path / "shadow_bench.json"
    path.write_text(json.dumps([{"kind": "AdamW", "parameters": 1, "parameters_per_second": adamw_rate}]))
    return path


def test_table_sizes_and_horizon_match_the_program_and_the_shadow() -> None:
    defines = (REPO / "p4src" / "shared" / "defines.p4").read_text()
    sizes = dict(re.findall(r"#define (\w+_TABLE_SIZE) (\d+)", defines))
    assert int(sizes["REPLICATION_TABLE_SIZE"]) == capacity_inputs.REPLICATION_TABLE_SIZE
    assert int(sizes["SHADOW_DESTINATION_TABLE_SIZE"]) == capacity_inputs.SHADOW_DESTINATION_TABLE_SIZE
    assert int(sizes["JOB_TABLE_SIZE"]) == capacity_inputs.JOB_TABLE_SIZE
    from shadow.node import ShadowConfig

    assert ShadowConfig.__dataclass_fields__["horizon"].default == capacity_inputs.SHADOW_HORIZON_ITERATIONS


@pytest.mark.parametrize(
    "elements,dp", [(1, 2), (2235, 2), (2236, 3), (26214, 3), (100_003, 7), (6_553_600, 64)]
)
def test_datagram_count_is_the_ring_slot_grid(elements: int, dp: int) -> None:
    from checkmate.wire import MAX_PAYLOAD_BYTES
    from hosts.ring_config import slot_grid

    per = MAX_PAYLOAD_BYTES // 4
    assert capacity._datagrams(elements, dp, per) == len(slot_grid(elements, dp, per).offsets)


def test_apply_rate_comes_from_the_benchmark_file(tmp_path: Path) -> None:
    request = PlanRequest(1e9, "adamw", 1.0, dp=8, shadow_bench=_bench(tmp_path, 100e6))
    slow = plan(request)
    assert slow["shadows"]["apply_rate_params_per_s_per_core"] == 100e6
    (tmp_path / "fast").mkdir()
    fast = plan(PlanRequest(1e9, "adamw", 1.0, dp=8, shadow_bench=_bench(tmp_path / "fast", 400e6)))
    # 153 buckets of 6,553,600 parameters; a shadow applies 50M (200M) parameters in its 0.5 s:
    # 7 (30) whole buckets, so ceil(153 / 7) = 22 and ceil(153 / 30) = 6 shadows
    assert slow["shadows"]["processes"] == 22
    assert fast["shadows"]["processes"] == 6
    assert "shadow_bench.json" in slow["sources"]["apply_rate"]


def test_no_rate_for_the_optimizer_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"no apply rate for Adam .*experiments.bench.shadow --kinds Adam"):
        plan(PlanRequest(1e9, "adam", 1.0, dp=8, shadow_bench=_bench(tmp_path, 1e8)))


def test_bytes_per_iteration_and_switch_entries(tmp_path: Path) -> None:
    r = plan(
        PlanRequest(
            1e9,
            "adamw",
            1.0,
            dp=64,
            tp=2,
            switch="tofino",
            workers_per_switch=16,
            shadow_bench=_bench(tmp_path, 2e8),
        )
    )
    ring = r["rings"]
    assert ring["parameters_per_ring"] == 500_000_000
    # every reduced element once, plus 74 header bytes per datagram
    assert ring["copied_bytes_per_ring_per_iteration"] == 500_000_000 * 4 + ring[
        "tagged_datagrams_per_ring_per_iteration"
    ] * (14 + 20 + 8 + 32)
    k = r["shadows"]["per_ring"]
    needed = {row["resource"]: row["needed"] for row in r["switch"]["resources"]}
    assert needed["multicast groups"] == 16 * k
    assert needed["replicate_to_shadow entries"] == 16 * k
    assert needed["rewrite_shadow_copy entries (rids)"] == 2 * k
    assert r["switch"]["leaves"] == 8


def test_more_groups_than_the_switch_has_is_refused_with_the_plan(tmp_path: Path) -> None:
    request = PlanRequest(
        70e9, "adamw", 2.0, dp=512, switch="bmv2", workers_per_switch=256, shadow_bench=_bench(tmp_path, 2e8)
    )
    with pytest.raises(
        PlanInfeasible, match=r"multicast groups: the busiest leaf needs [\d,]+, the target has 4,096"
    ):
        plan(request)


def test_shadows_that_cannot_keep_up_at_any_count(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"shadow CPU: one bucket .* no number of shadows keeps up"):
        plan(PlanRequest(1e9, "adamw", 0.01, dp=8, shadow_bench=_bench(tmp_path, 2e8)))
    with pytest.raises(PlanError, match=r"shadow link: one bucket .* 0.1 Gb/s"):
        plan(PlanRequest(1e9, "adamw", 1.0, dp=8, link_gbps=0.1, shadow_bench=_bench(tmp_path, 2e8)))
    with pytest.raises(PlanError, match=r"shadow memory: one bucket needs"):
        plan(PlanRequest(1e9, "adamw", 1.0, dp=8, shadow_memory_gib=0.01, shadow_bench=_bench(tmp_path, 2e8)))


@pytest.mark.parametrize(
    "argv,status,message",
    [
        (["--model-params", "-5"], 2, "must be a positive number"),
        (["--model-params", "seven"], 2, "is not a number"),
        (["--dp", "1"], 1, "--dp 1 has no all-reduce"),
        (["--iteration-time", "0.001"], 1, "shadow CPU: one bucket"),
        (["--shadow-bench", "/nonexistent/bench.json"], 1, "cannot read the shadow benchmark"),
        (["--switch", "bmv2", "--workers-per-switch", "512", "--dp", "1024"], 1, "cannot fit: switch bmv2"),
        (["--shadows-per-ring", "100000"], 1, "a shadow owns whole buckets"),
    ],
)
def test_cli_errors_are_one_line_without_traceback(
    argv: list[str], status: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = {"--model-params": "1B", "--optimizer": "adamw", "--iteration-time": "1", "--dp": "8"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        base[flag] = value
    args = [x for pair in base.items() for x in pair]
    assert ctl_main(["plan", *args]) == status
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_cli_json_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model-params", "7B", "--optimizer", "adam", "--iteration-time", "1", "--dp", "64"]
    assert ctl_main([*argv, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["gpus"] == 64
    assert document["switch"]["fits"] is True
    assert ctl_main(argv) == 0
    text = capsys.readouterr().out
    assert f"shadows: {document['shadows']['processes']} processes" in text
    assert "controller/measured/shadow_bench.json" in text  # the packaged figures (results/ is output)


def test_docs_table_is_up_to_date() -> None:
    assert table_main(["--check"]) == 0, "run python -m controller.capacity_table"


def test_small_end_agrees_with_make_bench() -> None:
    """The planner's copies per iteration x iterations == the switch counter of the last make bench run."""
    bench = json.loads((REPO / "results" / "bench.json").read_text())
    checkmate = next(s for s in bench["systems"] if s["name"] == "checkmate")
    r = plan(
        PlanRequest(
            136960,
            "adamw",
            checkmate["mean_iteration_ms"] / 1e3,
            dp=bench["settings"]["workers"],
            switch="embedded",
            bucket_mb=0.1,
            link_gbps=1,
            shadows_per_ring=bench["settings"]["shadows"],
        )
    )
    per_iteration = r["rings"]["tagged_datagrams_per_ring_per_iteration"]
    assert (
        per_iteration * bench["settings"]["iterations_per_run"] == checkmate["switch_shadow_copies_packets"]
    )
    assert r["switch"]["fits"]
