"""The universal checkpoint format: any writer layout in, any reader layout out, bad files refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkmate import checkpoint as fmt
from checkmate.checkpoint import CheckpointError, CheckpointReader


def model_state() -> dict[str, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    shapes = {"embed.weight": (50, 8), "block.0.weight": (8, 8), "block.0.bias": (8,), "head.weight": (3, 8)}
    return {
        name: {
            "param": torch.randn(shape, generator=generator),
            "exp_avg": torch.randn(shape, generator=generator),
            "step": torch.tensor(7.0),
        }
        for name, shape in shapes.items()
    }


def write(
    root: Path, state: dict[str, dict[str, torch.Tensor]], shards: list[list[str]], step: int = 7
) -> None:
    fmt.write_global(
        root,
        step,
        {n: (list(s["param"].shape), "torch.float32") for n, s in state.items()},
        {"kind": "Adam", "param_groups": [{"lr": 0.1, "params": sorted(state)}]},
    )
    for index, names in enumerate(shards):
        fmt.write_shard(root, step, index, len(shards), {n: state[n] for n in names})
    fmt.update_latest(root, step)


@pytest.mark.parametrize(
    "layout",
    [
        [["embed.weight", "block.0.weight", "block.0.bias", "head.weight"]],
        [["embed.weight"], ["block.0.weight", "block.0.bias", "head.weight"]],
        [["embed.weight"], [], ["block.0.bias"], ["head.weight", "block.0.weight"]],
    ],
)
def test_any_shard_layout_reads_back_bit_exact(tmp_path: Path, layout: list[list[str]]) -> None:
    state = model_state()
    write(tmp_path, state, layout)
    reader = CheckpointReader(tmp_path)
    assert reader.step == 7 == fmt.read_latest(tmp_path)
    for name, states in state.items():
        assert reader.states_of(name) == sorted(states)
        for key, tensor in states.items():
            assert torch.equal(reader.parameter(name, key), tensor), (name, key)
    reader.verify_files()


def test_zero_style_slices_and_partial_reads(tmp_path: Path) -> None:
    state = model_state()
    embed = state["embed.weight"]["param"].reshape(-1)
    fmt.write_global(tmp_path, 3, {"embed.weight": ([50, 8], "torch.float32")}, {"kind": "SGD"})
    fmt.write_shard(
        tmp_path, 3, 0, 2, {"embed.weight": {"param": embed[:150]}}, ranges={"embed.weight": (0, 150)}
    )
    fmt.write_shard(
        tmp_path, 3, 1, 2, {"embed.weight": {"param": embed[150:]}}, ranges={"embed.weight": (150, 400)}
    )
    reader = CheckpointReader(tmp_path, 3)
    assert torch.equal(reader.read("embed.weight", start=100, end=200), embed[100:200])
    assert torch.equal(reader.parameter("embed.weight"), state["embed.weight"]["param"])


def test_gaps_overlaps_and_foreign_names_are_refused(tmp_path: Path) -> None:
    state = model_state()
    embed = state["embed.weight"]["param"].reshape(-1)
    params = {"embed.weight": ([50, 8], "torch.float32")}
    fmt.write_global(tmp_path, 1, params, {})
    fmt.write_shard(
        tmp_path, 1, 0, 2, {"embed.weight": {"param": embed[:100]}}, ranges={"embed.weight": (0, 100)}
    )
    fmt.write_shard(
        tmp_path, 1, 1, 2, {"embed.weight": {"param": embed[150:]}}, ranges={"embed.weight": (150, 400)}
    )
    with pytest.raises(CheckpointError, match="gap at element 100"):
        CheckpointReader(tmp_path, 1)
    fmt.write_global(tmp_path, 2, params, {})
    fmt.write_shard(
        tmp_path, 2, 0, 2, {"embed.weight": {"param": embed[:200]}}, ranges={"embed.weight": (0, 200)}
    )
    fmt.write_shard(
        tmp_path, 2, 1, 2, {"embed.weight": {"param": embed[150:]}}, ranges={"embed.weight": (150, 400)}
    )
    with pytest.raises(CheckpointError, match="overlap"):
        CheckpointReader(tmp_path, 2)
    fmt.write_global(tmp_path, 4, params, {})
    fmt.write_shard(
        tmp_path, 4, 0, 1, {"embed.weight": state["embed.weight"], "other.bias": state["head.weight"]}
    )
    with pytest.raises(CheckpointError, match="'other.bias' is not in the model"):
        CheckpointReader(tmp_path, 4)
    fmt.write_global(tmp_path, 5, {**params, "head.weight": ([3, 8], "torch.float32")}, {})
    fmt.write_shard(tmp_path, 5, 0, 1, {"embed.weight": state["embed.weight"]})
    with pytest.raises(CheckpointError, match="'head.weight' is in no shard"):
        CheckpointReader(tmp_path, 5)


def test_corruption_truncation_and_newer_versions_are_refused(tmp_path: Path) -> None:
    state = model_state()
    write(tmp_path, state, [list(state)])
    data = fmt.step_dir(tmp_path, 7) / "shard-000-of-001.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    reader = CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="file checksum mismatch"):
        reader.verify_files()
    with pytest.raises(CheckpointError, match="fails its checksum"):
        [reader.parameter(n, s) for n in state for s in state[n]]
    data.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(CheckpointError, match="cannot be read.*truncated or corrupted"):
        CheckpointReader(tmp_path).parameter("head.weight")
    manifest = fmt.step_dir(tmp_path, 7) / "global.json"
    document = json.loads(manifest.read_text())
    document["format_version"] = 99
    manifest.write_text(json.dumps(document))
    with pytest.raises(CheckpointError, match="format version 99.*newer"):
        CheckpointReader(tmp_path)


def test_partial_steps_are_ignored_and_latest_only_moves_forward(tmp_path: Path) -> None:
    state = model_state()
    write(tmp_path, state, [["embed.weight", "block.0.weight"], ["block.0.bias", "head.weight"]], step=5)
    # Step 6: only one of two shards made it before a crash.
    fmt.write_global(
        tmp_path, 6, {n: (list(s["param"].shape), "torch.float32") for n, s in state.items()}, {}
    )
    fmt.write_shard(tmp_path, 6, 0, 2, {n: state[n] for n in ["embed.weight", "block.0.weight"]})
    (fmt.step_dir(tmp_path, 6) / ".shard-001-of-002.safetensors.tmp-1").write_bytes(b"partial")
    assert fmt.complete_steps(tmp_path) == [5]
    assert CheckpointReader(tmp_path).step == 5
    fmt.update_latest(tmp_path, 4)
    assert fmt.read_latest(tmp_path) == 5
    with pytest.raises(CheckpointError, match="not complete|expected one complete set"):
        CheckpointReader(tmp_path, 6)


def test_prune_keeps_the_newest_complete_steps(tmp_path: Path) -> None:
    state = model_state()
    for step in (1, 2, 3, 4):
        write(tmp_path, state, [list(state)], step=step)
    assert fmt.prune(tmp_path, keep=2) == [1, 2]
    assert fmt.complete_steps(tmp_path) == [3, 4]
