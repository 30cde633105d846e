"""A running DeepSpeed engine resumes from our export; DeepSpeed's own universal checkpoint imports into ours.

Each job is its own process (``tests/universal/deepspeed_job.py``, one CPU rank,
gloo): DeepSpeed ZeRO-1 and ZeRO-3 train 4 steps and save their own checkpoint
after step 2; DeepSpeed's converter (``deepspeed.checkpoint.ds_to_universal``)
turns it into a universal checkpoint; ``import deepspeed`` reads that into
ours (every state element for element); ``convert --to deepspeed`` writes ours
back; a fresh engine with ``load_universal`` loads it and trains steps 3-4 with
the reference's losses, bit for bit. The imported checkpoint also resumes
under FSDP2 (torch's Adam, the checkpoint's hyperparameters) with the same
losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkmate.checkpoint import CheckpointReader
from checkmate.checkpoint.cli import main
from tests.listen_ports import listen_port

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]  # about 140 s on 2 shared cores: -m slow
REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> dict[int, float]:
    out = Path(args[1])
    env = {
        **os.environ,
        "MASTER_PORT": str(listen_port()),
        "PYTHONPATH": str(REPO),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }
    result = subprocess.run(
        [sys.executable, "-m", "tests.universal.deepspeed_job", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {int(k): v for k, v in json.loads(out.read_text())["losses"].items()}


def _ds_tensor(path: Path) -> torch.Tensor:
    content = torch.load(path, map_location="cpu", weights_only=False)
    return content["param"] if isinstance(content, dict) else content


@pytest.fixture(scope="module", params=[1, 3], ids=["zero1", "zero3"])
def deepspeed_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    pytest.importorskip("deepspeed")
    stage = request.param
    root = tmp_path_factory.mktemp(f"ds{stage}")
    losses = _run("reference", str(root / "reference.json"), str(stage), str(root / "ds"))
    converted = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(root / "ds" / "step2"),
            "--output_folder",
            str(root / "ds" / "step2_universal"),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
        ],
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert converted.returncode == 0, converted.stderr[-3000:]
    return stage, root, losses


def test_deepspeeds_universal_checkpoint_imports_element_for_element(deepspeed_run: tuple) -> None:
    stage, root, _ = deepspeed_run
    universal = root / "ds" / "step2_universal"
    assert main(["import", "deepspeed", str(universal), "-o", str(root / "ours")]) == 0
    reader = CheckpointReader(root / "ours")
    assert reader.step == 2
    assert main(["verify", str(root / "ours")]) == 0
    assert sorted(reader.parameters) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for name in reader.parameters:
        assert reader.states_of(name) == ["exp_avg", "exp_avg_sq", "param", "step"]
        for state, file in (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            assert torch.equal(
                reader.parameter(name, state), _ds_tensor(universal / "zero" / name / f"{file}.pt")
            )
        assert float(reader.parameter(name, "step")) == 2.0
    group = reader.global_state["optimizer"]["param_groups"][0]
    assert (group["lr"], group["weight_decay"], group["decoupled_weight_decay"]) == (0.01, 0.01, True)


def test_a_running_deepspeed_engine_resumes_from_our_export_with_the_same_losses(
    deepspeed_run: tuple,
) -> None:
    stage, root, losses = deepspeed_run
    if not (root / "ours").exists():
        assert (
            main(["import", "deepspeed", str(root / "ds" / "step2_universal"), "-o", str(root / "ours")]) == 0
        )
    assert main(["convert", str(root / "ours"), "--to", "deepspeed", "-o", str(root / "export")]) == 0
    folder = root / "export" / "global_step2_universal"
    assert (root / "export" / "latest_universal").read_text() == "global_step2_universal"
    step = torch.load(folder / "zero" / "0.weight" / "step.pt", weights_only=True)
    assert isinstance(step, torch.Tensor) and step.dim() == 0  # bare, as DeepSpeed's converter writes it
    resumed = _run(
        "resume-deepspeed", str(root / "resumed.json"), str(stage), str(root / "export"), folder.name
    )
    assert resumed == {3: losses[3], 4: losses[4]}, (resumed, losses)


def test_deepspeeds_universal_checkpoint_resumes_under_fsdp2(deepspeed_run: tuple) -> None:
    stage, root, losses = deepspeed_run
    if stage != 1:
        pytest.skip("one DeepSpeed source is enough for the FSDP2 resume")
    if not (root / "ours").exists():
        assert (
            main(["import", "deepspeed", str(root / "ds" / "step2_universal"), "-o", str(root / "ours")]) == 0
        )
    resumed = _run("resume-fsdp2", str(root / "fsdp2.json"), str(root / "ours"))
    assert resumed == {3: losses[3], 4: losses[4]}, (resumed, losses)
