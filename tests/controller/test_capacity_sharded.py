"""The planner for sharded jobs (``checkmate-ctl plan --parallelism``): hand-computed figures.

FSDP2 reduce-scatters once per ``fully_shard`` module; protected, each module's flat input runs
through the ring all-reduce as one bucket, padded to ``dp`` equal shards, and the hop that brings
each shard's owner its fully reduced shard is tagged (docs/protocol.md). What changes against DDP:
the buckets (modules, not 25 MB), the padding, the parameter all-gathers crossing the switch, the
workers' gradient bytes (a tagged ring all-reduce against a plain reduce-scatter). What does not:
every element copied once, the shadows' memory per parameter and apply rate (they hold the full state).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.capacity import PlanError, PlanRequest, plan, shadow_bytes_per_param
from controller.cli import main as ctl_main


def _bench(tmp_path: Path, adamw_rate: float = 1e8) -> Path:
    path = tmp_path / "shadow_bench.json"
    path.write_text(json.dumps([{"kind": "AdamW", "parameters": 1, "parameters_per_second": adamw_rate}]))
    return path


def test_fsdp2_modules_padding_datagrams_and_bytes(tmp_path: Path) -> None:
    r = plan(
        PlanRequest(
            1_000_003,
            "adamw",
            1.0,
            dp=4,
            switch="embedded",
            parallelism="fsdp2",
            fsdp_modules=3,
            shadow_bench=_bench(tmp_path),
        )
    )
    ring = r["rings"]
    # 1,000,003 = 333,335 + 333,334 + 333,334; each padded to a multiple of 4: 3 x 333,336 on the wire
    assert ring["buckets_per_ring"] == 3
    assert ring["padding_elements_per_ring_per_iteration"] == 1 + 2 + 2
    # a shard (ring chunk) of 83,334 fp32 elements is 38 datagrams of <= 2,235: 4 x 38 per module
    assert ring["tagged_datagrams_per_ring_per_iteration"] == 3 * 4 * 38
    # every element on the wire once, plus 74 header bytes (Ethernet, IPv4, UDP, Checkmate) per datagram
    assert ring["copied_bytes_per_ring_per_iteration"] == 1_000_008 * 4 + 456 * 74 == 4_033_776
    # the tagged ring all-reduce sends 2 (N-1)/N of the input, FSDP2's own reduce-scatter (N-1)/N
    assert ring["gradient_bytes_sent_per_worker_per_iteration"] == {
        "tagged": 6_000_048,
        "untagged": 3_000_024,
    }
    assert ring["parameter_all_gathers_per_iteration"] == 2
    shadows = r["shadows"]
    # the shadows hold the logical parameters, not the padding: 56 bytes each for AdamW, fp32
    assert shadows["processes"] == 1 and shadows["parameters_per_shadow"] == 1_000_003
    assert shadows["memory_bytes_per_shadow"] == 1_000_003 * 56
    # frames into the leaf: 4 workers x (2 ring + 2 all-gathers) x 3/4 x 456, plus the 456 copies
    frames = {row["resource"]: row["needed"] for row in r["switch"]["resources"]}
    assert frames["frames per second in (ring traffic + copies)"] == 4 * 4 * 3 // 4 * 456 + 456 == 5_928
    assert r["protection"].startswith("protected: hosts.c10d_fsdp.enable_checkmate_fsdp")


def test_the_same_job_as_ddp_copies_no_padding_and_gathers_nothing(tmp_path: Path) -> None:
    r = plan(PlanRequest(1_000_003, "adamw", 1.0, dp=4, switch="embedded", shadow_bench=_bench(tmp_path)))
    ring = r["rings"]
    assert ring["buckets_per_ring"] == 1 and ring["padding_elements_per_ring_per_iteration"] == 0
    # chunks of 250,000 / 250,001 elements: 112 datagrams each (2,235 x 111 = 248,085)
    assert ring["tagged_datagrams_per_ring_per_iteration"] == 4 * 112
    assert ring["copied_bytes_per_ring_per_iteration"] == 1_000_003 * 4 + 448 * 74
    assert ring["gradient_bytes_sent_per_worker_per_iteration"] == {
        "tagged": 6_000_018,
        "untagged": 6_000_018,
    }
    assert ring["parameter_all_gathers_per_iteration"] == 0
    assert r["shadows"]["memory_bytes_per_shadow"] == 1_000_003 * 56


def test_fsdp2_modules_are_whole_buckets_for_the_shadows(tmp_path: Path) -> None:
    bench = _bench(tmp_path)  # 100 M params/s: 50 M in a shadow's half of a 1 s iteration
    # 1e9 parameters in 40 modules of 25 M: 2 per shadow, 20 shadows (DDP's 25 MB buckets: 22)
    fsdp = plan(
        PlanRequest(1e9, "adamw", 1.0, dp=8, parallelism="fsdp2", fsdp_modules=40, shadow_bench=bench)
    )
    assert fsdp["shadows"]["per_ring"] == 20 and fsdp["shadows"]["parameters_per_shadow"] == 50_000_000
    ddp = plan(PlanRequest(1e9, "adamw", 1.0, dp=8, shadow_bench=bench))
    assert ddp["shadows"]["per_ring"] == 22
    # in 10 modules of 100 M, one module alone takes 1 s to apply: no number of shadows keeps up
    with pytest.raises(PlanError, match=r"shadow CPU: one bucket \(FSDP module\) of 100,000,000 parameters"):
        plan(PlanRequest(1e9, "adamw", 1.0, dp=8, parallelism="fsdp2", fsdp_modules=10, shadow_bench=bench))


def test_zero_is_sized_and_said_unprotected(tmp_path: Path) -> None:
    bench = _bench(tmp_path)
    ddp = plan(PlanRequest(1_000_003, "adamw", 1.0, dp=4, shadow_bench=bench))
    zero1 = plan(PlanRequest(1_000_003, "adamw", 1.0, dp=4, parallelism="zero1", shadow_bench=bench))
    zero2 = plan(PlanRequest(1_000_003, "adamw", 1.0, dp=4, parallelism="zero2", shadow_bench=bench))
    assert zero1["protection"].startswith("not protected: ZeRO-1") and "like DDP's" in zero1["protection"]
    assert zero2["protection"].startswith("not protected: ZeRO-2") and "like FSDP2's" in zero2["protection"]
    for z in (zero1, zero2):
        assert z["shadows"] == ddp["shadows"]
        assert (
            z["rings"]["copied_bytes_per_ring_per_iteration"]
            == ddp["rings"]["copied_bytes_per_ring_per_iteration"]
        )
        assert z["rings"]["parameter_all_gathers_per_iteration"] == 1
    assert zero1["rings"]["gradient_bytes_sent_per_worker_per_iteration"]["untagged"] == 6_000_018
    assert zero2["rings"]["gradient_bytes_sent_per_worker_per_iteration"]["untagged"] == 3_000_009
    fsdp_tp = plan(
        PlanRequest(1e6, "adamw", 1.0, dp=4, tp=2, parallelism="fsdp2", fsdp_modules=2, shadow_bench=bench)
    )
    assert fsdp_tp["protection"].startswith("not protected: FSDP2 with tensor parallelism (--tp 2)")


def test_shadow_memory_per_parameter_is_the_documented_formula() -> None:
    # fp32 weights and state, twice (live and the snapshot being written), 8 iterations of gradients
    assert shadow_bytes_per_param("adamw", "fp32") == (4 + 8) * 2 + 8 * 4 == 56
    assert shadow_bytes_per_param("adamw", "bf16") == (4 + 8) * 2 + 8 * 2 == 40
    assert shadow_bytes_per_param("sgd", "fp32") == 4 * 2 + 8 * 4 == 40


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(parallelism="zero3"), "unknown --parallelism 'zero3'; known: ddp, fsdp2, zero1, zero2"),
        (dict(parallelism="tp"), "tensor parallelism is --tp"),
        (dict(parallelism="fsdp2"), "--parallelism fsdp2 needs --fsdp-modules"),
        (dict(parallelism="fsdp2", fsdp_modules=0), "--fsdp-modules must be an integer >= 1"),
        (dict(parallelism="fsdp2", fsdp_modules=-3), "--fsdp-modules must be an integer >= 1"),
        (dict(parallelism="fsdp2", fsdp_modules=2_000_000), "leave modules without parameters"),
        (dict(fsdp_modules=4), "--fsdp-modules goes with --parallelism fsdp2, not ddp"),
    ],
)
def test_bad_parallelism_requests(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError) as caught:
        plan(PlanRequest(1_000_000, "adamw", 1.0, dp=4, shadow_bench=_bench(tmp_path), **kwargs))  # type: ignore[arg-type]
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["--parallelism", "zero3"], 2, "invalid choice: 'zero3'"),
        (["--parallelism", "fsdp2"], 1, "needs --fsdp-modules"),
        (["--parallelism", "fsdp2", "--fsdp-modules", "4", "--bucket-mb", "25"], 1, "--bucket-mb with"),
        (["--fsdp-modules", "4"], 1, "goes with --parallelism fsdp2"),
        (["--parallelism", "fsdp2", "--fsdp-modules", "-1"], 2, "must be >= 1"),
    ],
)
def test_cli_refuses_bad_parallelism_options(
    argv: list[str], status: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["plan", "--model-params", "1B", "--optimizer", "adamw", "--iteration-time", "1", "--dp", "8"]
    assert ctl_main([*base, *argv]) == status
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_fsdp2_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan", "--model-params", "1B", "--optimizer", "adamw", "--iteration-time", "2", "--dp", "8",
        "--parallelism", "fsdp2", "--fsdp-modules", "80",
    ]  # fmt: skip
    assert ctl_main([*argv, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["request"]["parallelism"] == "fsdp2" and document["rings"]["buckets_per_ring"] == 80
    assert ctl_main(argv) == 0
    text = capsys.readouterr().out
    assert "(fsdp2: dp 8 x tp 1)" in text and "80 FSDP modules" in text
    assert "protection: protected: hosts.c10d_fsdp.enable_checkmate_fsdp" in text
    assert "2 parameter all-gather(s), untagged" in text
