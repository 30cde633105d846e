"""checkmate-ckpt: every command on a real checkpoint, and clear errors on bad ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkmate import checkpoint as fmt
from checkmate.checkpoint.cli import main


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    states = {
        "a.weight": {
            "param": torch.ones(3, 2),
            "exp_avg": torch.zeros(3, 2),
            "exp_avg_sq": torch.ones(3, 2),
            "step": torch.tensor(2.0),
        },
        "b.bias": {
            "param": torch.arange(4.0),
            "exp_avg": torch.ones(4),
            "exp_avg_sq": torch.zeros(4),
            "step": torch.tensor(2.0),
        },
    }
    fmt.write_global(
        root,
        2,
        {"a.weight": ([3, 2], "torch.float32"), "b.bias": ([4], "torch.float32")},
        {"kind": "Adam", "param_groups": [{"lr": 0.1, "params": ["a.weight", "b.bias"]}]},
        extra={"data_position": {"epoch": 1, "batch": 3}},
    )
    fmt.write_shard(root, 2, 0, 2, {"a.weight": states["a.weight"]})
    fmt.write_shard(root, 2, 1, 2, {"b.bias": states["b.bias"]})
    fmt.update_latest(root, 2)
    return root


def test_inspect_and_verify(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(root), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 2 and summary["parameters"]["b.bias"]["states"] == [
        "exp_avg",
        "exp_avg_sq",
        "param",
        "step",
    ]
    assert summary["data_position"] == {"epoch": 1, "batch": 3}
    assert main(["inspect", str(root)]) == 0
    prefix = "data position after step 2: "
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith(prefix)]
    assert json.loads(line.partition(": ")[2]) == {"epoch": 1, "batch": 3}
    assert main(["verify", str(root)]) == 0
    assert "all checksums match" in capsys.readouterr().out


def test_convert_and_reshard(root: Path, tmp_path: Path) -> None:
    for kind in ("dcp", "safetensors", "deepspeed"):
        assert main(["convert", str(root), "--to", kind, "-o", str(tmp_path / kind)]) == 0
    assert (tmp_path / "safetensors" / "model.safetensors.index.json").is_file()
    assert (tmp_path / "deepspeed" / "latest_universal").is_file()
    assert main(["reshard", str(root), "--shards", "3", "-o", str(tmp_path / "k3")]) == 0
    assert len(fmt.CheckpointReader(tmp_path / "k3").manifests) == 3


def test_bad_checkpoints_get_a_clear_error(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(tmp_path / "nothing")]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err
    data = fmt.step_dir(root, 2) / "shard-001-of-002.safetensors"
    data.write_bytes(data.read_bytes()[:-3] + b"xyz")
    assert main(["verify", str(root)]) == 1
    assert "checksum mismatch" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(root), "--to", "onnx", "-o", str(tmp_path / "x")])
    assert exit_info.value.code == 2
