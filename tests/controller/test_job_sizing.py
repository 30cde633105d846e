"""``checkmate-ctl job add`` with sizing fields: a job whose shadows cannot hold its state is refused.

The shadows hold the full state (56 bytes per parameter for AdamW with fp32 gradients, 40 for
SGD: docs/capacity.md), split over the shard keys; every figure below is computed by hand. A
refusal names the field and the numbers, exits 1 and leaves the registry as it was.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from controller.cli import main
from tests.controller.conftest import Fabric, cli_session


def test_sized_jobs_added_or_refused_per_shadow(
    fabric: Callable[..., Fabric], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ctl = cli_session(fabric("single"), tmp_path, capsys)
    ctl("pipeline", "push")
    job = ["job", "add", "--workers", "h1,h2,h3,h4", "--shadows", "sh1,sh2"]
    fsdp = ["--parallelism", "fsdp2", "--model-params", "1B", "--optimizer", "adamw"]
    # 1e9 parameters over 2 shard keys: 500,000,000 x 56 B = 28.0e9 B = 26.1 GiB per shadow
    out = ctl(*job, "--job-id", "7", *fsdp, "--shadow-memory-gib", "32")
    assert "job 7 added" in out
    assert "  shadow sh1: 500,000,000 parameters, 26.1 of 32.0 GiB (fsdp2)" in out
    assert "  shadow sh2: 500,000,000 parameters, 26.1 of 32.0 GiB (fsdp2)" in out
    listing = ctl("job", "list", "--json")
    stored = json.loads(listing)["jobs"][0]["job"]
    assert stored["parallelism"] == "fsdp2" and stored["model_params"] == 1_000_000_000
    text = ctl("job", "list")
    assert "  sized: fsdp2, 1,000,000,000 parameters, adamw, fp32 gradients, 32 GiB per shadow" in text
    shown = ctl("job", "show", "7", "--no-shadows")  # job show says it too
    assert "\n  sized: fsdp2, 1,000,000,000 parameters, adamw, fp32 gradients, 32 GiB per shadow\n" in shown

    def refused(*argv: str, message: str, status: int = 1) -> str:
        err = ctl(*argv, status=status)
        assert message in err and "Traceback" not in err, err
        assert ctl("job", "list", "--json") == listing  # the registry is unchanged
        return err

    err = refused(
        *job, "--job-id", "8", *fsdp, "--shadow-memory-gib", "16",
        message="job 8: shadow sh1 holds 1 of 2 shard key(s): 500,000,000 parameters x 56 bytes (adamw, fp32 "
        "gradients; docs/capacity.md) = 26.1 GiB of state, more than shadow_memory_gib 16 GiB",
    )  # fmt: skip
    assert (
        "its fsdp2 workers each hold 1/4 of it, the shadows hold it whole (2 of 2 shadow(s) too small" in err
    )
    # sh1 owns 2 of 3 keys: 666,666,667 x 56 B = 34.8 GiB > 32 (sh2's 333,333,334 would fit)
    refused(
        *job, "--job-id", "8", *fsdp, "--shadow-memory-gib", "32",
        "--shard", "0=sh1", "--shard", "1=sh1", "--shard", "2=sh2",
        message="shadow sh1 holds 2 of 3 shard key(s): 666,666,667 parameters x 56 bytes",
    )  # fmt: skip
    # bf16 gradients: 40 B per parameter, 500,000,000 x 40 = 18.6 GiB fits 20; fp32 (26.1) would not
    out = ctl(*job, "--job-id", "8", *fsdp, "--grad-dtype", "bf16", "--shadow-memory-gib", "20")
    assert "shadow sh2: 500,000,000 parameters, 18.6 of 20.0 GiB (fsdp2)" in out
    listing = ctl("job", "list", "--json")
    ctl("job", "remove", "8")
    listing = ctl("job", "list", "--json")

    # a TP job: each lane's shadow holds 1/2 of 2e9 parameters, 1e9 x 40 B (SGD) = 37.3 GiB
    tp = ["job", "add", "--job-id", "20", "--workers", "h1,h2,h3,h4", "--shadows", "sh1,sh2"]
    sgd = ["--model-params", "2B", "--optimizer", "sgd", "--tp-degree", "2"]
    refused(
        *tp, *sgd, "--shadow-memory-gib", "20",
        message="job 20 (lane 0 of tp_degree 2): shadow sh1 holds 1 of 1 shard key(s): 1,000,000,000 "
        "parameters x 40 bytes",
    )  # fmt: skip
    out = ctl(*tp, *sgd, "--shadow-memory-gib", "40")
    assert (
        "job 20 (lane 0 of TP=2) added" in out and "shadow sh1: 1,000,000,000 parameters, 37.3 of 40.0" in out
    )
    assert (
        "job 21 (lane 1 of TP=2) added" in out and "shadow sh2: 1,000,000,000 parameters, 37.3 of 40.0" in out
    )
    lanes = {j["job"]["job_id"]: j["job"] for j in json.loads(ctl("job", "list", "--json"))["jobs"]}
    assert lanes[21]["model_params"] == 2_000_000_000 and lanes[21]["tp_degree"] == 2
    listing = ctl("job", "list", "--json")

    # a spec file carries the same fields
    spec = tmp_path / "job9.json"
    spec.write_text(
        json.dumps(
            {
                "job_id": 9, "workers": ["h1", "h3"], "shadows": ["sh2"], "parallelism": "fsdp2",
                "model_params": 1e9, "optimizer": "adamw", "shadow_memory_gib": 50,
            }
        )
    )  # fmt: skip
    refused("job", "add", "--spec", str(spec), message="1,000,000,000 parameters x 56 bytes")


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["--parallelism", "zero1"], 1, "parallelism 'zero1': ZeRO-1"),
        (["--parallelism", "fsdp"], 1, "unknown parallelism 'fsdp'; known: ddp, fsdp2"),
        (["--parallelism", "fsdp2", "--tp-degree", "2"], 1, "parallelism 'fsdp2' with tp_degree 2"),
        (["--model-params", "-5"], 2, "'-5' must be a positive number"),
        (["--model-params", "2e16"], 2, "is not a model size"),
        (["--model-params", "7B"], 1, "model_params given without optimizer, shadow_memory_gib"),
        (["--shadow-memory-gib", "8"], 1, "shadow_memory_gib given without model_params, optimizer"),
        (
            ["--model-params", "7B", "--optimizer", "adamw", "--shadow-memory-gib", "-1"],
            1,
            "shadow_memory_gib -1 must be positive",
        ),
        (
            ["--model-params", "7B", "--optimizer", "adamx", "--shadow-memory-gib", "64"],
            1,
            "unknown optimizer 'adamx'; known: sgd",
        ),
        (
            [
                "--model-params",
                "7B",
                "--optimizer",
                "adamw",
                "--shadow-memory-gib",
                "64",
                "--grad-dtype",
                "fp8",
            ],
            1,
            "unknown grad_dtype 'fp8'; known: fp32, bf16, fp16",
        ),
        (["--shadow-memory-gib", "lots"], 2, "invalid float value: 'lots'"),
    ],
)
def test_bad_sizing_options_exit_non_zero_and_register_nothing(
    argv: list[str], status: int, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    net = tmp_path / "net.json"
    net.write_text((Path(__file__).parents[2] / "topologies" / "single.json").read_text())
    state = tmp_path / "state"
    job = ["job", "add", "--job-id", "7", "--workers", "h1,h2,h3,h4", "--shadows", "sh1,sh2"]
    # refused before any switch is contacted: the network's switch is never started here
    assert main(["--network", str(net), "--state-dir", str(state), *job, *argv]) == status
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert main(["--state-dir", str(state), "job", "list"]) == 0
    assert "no jobs registered" in capsys.readouterr().out


def test_spec_with_sizing_options_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    net = tmp_path / "net.json"
    net.write_text((Path(__file__).parents[2] / "topologies" / "single.json").read_text())
    argv = ["--network", str(net), "--state-dir", str(tmp_path), "job", "add", "--spec", "x.json"]
    assert main([*argv, "--model-params", "7B"]) == 2
    assert "with --spec, give the sizing fields" in capsys.readouterr().err
