"""Exports load back through the real libraries: dcp.load, safetensors, torch.load (DeepSpeed layout)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from checkmate import checkpoint as fmt
from checkmate.checkpoint import CheckpointReader
from checkmate.checkpoint.export import export_dcp, export_deepspeed_universal, export_safetensors, reshard

torch.set_num_threads(1)


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(4, 6)).square().sum().backward()
        optimizer.step()
    return model, optimizer


def universal(tmp_path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, shards: int = 2) -> Path:
    root = tmp_path / "universal"
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    fmt.write_global(
        root, 3, fmt.parameters_of(model.named_parameters()), {"kind": "Adam", "param_groups": groups}
    )
    states = fmt.capture_states(model.named_parameters(), optimizer)
    ordered = sorted(states)
    for shard in range(shards):
        fmt.write_shard(root, 3, shard, shards, {n: states[n] for n in ordered[shard::shards]})
    return root


def test_dcp_export_restores_model_and_optimizer(tmp_path: Path) -> None:
    model, optimizer = trained()
    export_dcp(CheckpointReader(universal(tmp_path, model, optimizer)), tmp_path / "dcp")
    fresh = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)
    model_sd, optim_sd = get_state_dict(fresh, fresh_optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name
        for key, value in optimizer.state[a].items():
            assert torch.equal(torch.as_tensor(fresh_optimizer.state[b][key]), torch.as_tensor(value)), (
                name,
                key,
            )
    assert fresh_optimizer.param_groups[0]["lr"] == 0.01


def test_safetensors_export_has_an_index_and_loads(tmp_path: Path) -> None:
    model, optimizer = trained()
    index = export_safetensors(
        CheckpointReader(universal(tmp_path, model, optimizer)), tmp_path / "st", max_shard_bytes=100
    )
    weight_map = json.loads(index.read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    for name, parameter in model.named_parameters():
        assert torch.equal(load_file(str(tmp_path / "st" / weight_map[name]))[name], parameter)


def test_deepspeed_universal_layout(tmp_path: Path) -> None:
    model, optimizer = trained()
    folder = export_deepspeed_universal(
        CheckpointReader(universal(tmp_path, model, optimizer)), tmp_path / "ds"
    )
    assert (tmp_path / "ds" / "latest_universal").read_text() == folder.name
    for name, parameter in model.named_parameters():
        directory = folder / "zero" / name
        assert torch.equal(torch.load(directory / "fp32.pt")["param"], parameter)
        assert torch.equal(
            torch.load(directory / "exp_avg.pt")["param"], optimizer.state[parameter]["exp_avg"]
        )
        assert torch.equal(
            torch.load(directory / "exp_avg_sq.pt")["param"], optimizer.state[parameter]["exp_avg_sq"]
        )
        assert torch.load(directory / "step.pt").item() == 3  # bare 0-d tensor, as DeepSpeed writes it
    groups = torch.load(folder / "zero" / "optimizer_state.pt")["optimizer_state_dict"]["param_groups"]
    assert groups[0]["lr"] == 0.01


def test_reshard_to_any_number_of_writers(tmp_path: Path) -> None:
    model, optimizer = trained()
    source = CheckpointReader(universal(tmp_path, model, optimizer, shards=2))
    for shards in (1, 3, 5):
        out = tmp_path / f"k{shards}"
        reshard(source, out, shards)
        again = CheckpointReader(out)
        assert len(again.manifests) == shards
        for name, parameter in model.named_parameters():
            assert torch.equal(again.parameter(name), parameter)
            assert torch.equal(again.parameter(name, "exp_avg"), optimizer.state[parameter]["exp_avg"])
