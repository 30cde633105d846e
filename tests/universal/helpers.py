"""Shared fixtures for the universal-checkpoint tests: a tiny model's atoms as a checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from checkmate import checkpoint as fmt
from checkmate.universal.tiny import TinyConfig, logical_shapes, tiny_spec

CONFIG = TinyConfig()


def random_atoms(seed: int = 0, config: TinyConfig = CONFIG) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter with Adam-like state; values are all distinct so misplacement shows."""
    generator = torch.Generator().manual_seed(seed)
    atoms = {}
    for name, shape in sorted(logical_shapes(config).items()):
        atoms[name] = {
            "param": torch.randn(shape, generator=generator),
            "exp_avg": torch.randn(shape, generator=generator),
            "exp_avg_sq": torch.rand(shape, generator=generator),
            "step": torch.tensor(7.0),
        }
    return atoms


def write_atoms(
    root: Path,
    atoms: dict[str, dict[str, torch.Tensor]],
    step: int = 7,
    shards: int = 2,
    zero_style: bool = False,
    config: TinyConfig = CONFIG,
) -> fmt.CheckpointReader:
    """Write ``atoms`` as a universal checkpoint (whole parameters, or ZeRO-style flat slices)."""
    extra = {"universal": {"spec": tiny_spec(config).to_json(), "source_layout": "tp=1,pp=1,dp=1"}}
    parameters = {n: (list(s["param"].shape), "torch.float32") for n, s in atoms.items()}
    groups = [{"lr": 0.01, "betas": [0.9, 0.999], "params": sorted(atoms)}]
    fmt.write_global(root, step, parameters, {"kind": "Adam", "param_groups": groups}, extra)
    names = sorted(atoms)
    for shard in range(shards):
        if zero_style:
            states, ranges = {}, {}
            for name in names:
                numel = atoms[name]["param"].numel()
                lo, hi = numel * shard // shards, numel * (shard + 1) // shards
                ranges[name] = (lo, hi)
                states[name] = {
                    k: (v.reshape(-1)[lo:hi].clone() if v.dim() else v.clone())
                    for k, v in atoms[name].items()
                    if v.dim() or shard == 0
                }
            fmt.write_shard(root, step, shard, shards, states, ranges)
        else:
            mine = {n: {k: v.clone() for k, v in atoms[n].items()} for n in names[shard::shards]}
            fmt.write_shard(root, step, shard, shards, mine)
    fmt.update_latest(root, step)
    return fmt.CheckpointReader(root, step)


def assert_atoms_equal(reader: fmt.CheckpointReader, atoms: dict[str, dict[str, torch.Tensor]]) -> None:
    """Element for element, every state of every parameter."""
    assert set(reader.parameters) == set(atoms)
    for name, states in atoms.items():
        assert reader.states_of(name) == sorted(states), name
        for state, value in states.items():
            got = reader.parameter(name, state)
            assert torch.equal(got, value), f"{name}::{state} differs"
