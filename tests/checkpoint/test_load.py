"""Loading into any layout: K writers -> K' writers, whole-model restore, ZeRO-1 slices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from checkmate import checkpoint as fmt
from checkmate.checkpoint import CheckpointError, CheckpointReader
from checkmate.checkpoint.export import reshard
from checkmate.checkpoint.load import load_into, zero1_bounds, zero1_slice

torch.set_num_threads(1)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 7), nn.GELU(), nn.Linear(7, 3))


def trained(optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = make_model()
    optimizer = optimizer_class(model.parameters(), lr=0.01)
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.randint(0, 11, (5,))).square().mean().backward()
        optimizer.step()
    return model, optimizer


def write_universal(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, shards: int) -> None:
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    spec = {"kind": type(optimizer).__name__, "param_groups": groups}
    fmt.write_global(root, 4, fmt.parameters_of(model.named_parameters()), spec)
    states = fmt.capture_states(model.named_parameters(), optimizer)
    ordered = sorted(states)
    for shard in range(shards):  # uneven, and with more shards than parameters some are empty
        fmt.write_shard(root, 4, shard, shards, {n: states[n] for n in ordered[shard::shards]})


@pytest.mark.parametrize("writers", [1, 2, 3, 5])
@pytest.mark.parametrize("readers", [1, 2, 3, 5])
def test_k_writers_to_k_prime_writers_round_trip(tmp_path: Path, writers: int, readers: int) -> None:
    model, optimizer = trained()
    write_universal(tmp_path / "a", model, optimizer, writers)
    reshard(CheckpointReader(tmp_path / "a"), tmp_path / "b", readers)
    fresh = make_model()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    assert load_into(CheckpointReader(tmp_path / "b"), fresh, fresh_optimizer) == 4
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name
        for key, value in optimizer.state[a].items():
            assert torch.equal(fresh_optimizer.state[b][key], value), (name, key)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.01


def test_restored_training_continues_bit_identically(tmp_path: Path) -> None:
    model, optimizer = trained(torch.optim.Adam)
    write_universal(tmp_path, model, optimizer, 2)
    fresh = make_model()
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)
    load_into(CheckpointReader(tmp_path), fresh, fresh_optimizer)
    batch = torch.randint(0, 11, (5,), generator=torch.Generator().manual_seed(9))
    for m, o in ((model, optimizer), (fresh, fresh_optimizer)):
        o.zero_grad()
        m(batch).square().mean().backward()
        o.step()
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_zero1_slices_partition_the_flat_state_and_read_only_their_files(
    tmp_path: Path, world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = trained()
    write_universal(tmp_path, model, optimizer, 3)
    reader = CheckpointReader(tmp_path)
    order = sorted(reader.parameters)
    flat = torch.cat([dict(model.named_parameters())[n].detach().reshape(-1) for n in order])
    opened: list[str] = []
    original = CheckpointReader._open

    def spy(self: CheckpointReader, file: str):  # type: ignore[no-untyped-def]
        opened.append(file)
        return original(self, file)

    monkeypatch.setattr(CheckpointReader, "_open", spy)
    parts = []
    for rank in range(world):
        opened.clear()
        part = zero1_slice(reader, rank, world)
        assert (part.start, part.end) == zero1_bounds(flat.numel(), rank, world)
        assert torch.equal(part.states["param"], flat[part.start : part.end])
        # Only files holding parameters that overlap this rank's range were opened.
        cursor, needed = 0, set()
        for name in order:
            numel = dict(model.named_parameters())[name].numel()
            if cursor < part.end and part.start < cursor + numel:
                needed.add(reader.slices[(name, "param")][0].file)
            cursor += numel
        assert set(opened) <= needed
        parts.append(part.states["exp_avg"])
    expected = torch.cat(
        [optimizer.state[dict(model.named_parameters())[n]]["exp_avg"].reshape(-1) for n in order]
    )
    assert torch.equal(torch.cat(parts), expected)


def test_another_model_or_optimizer_is_refused(tmp_path: Path) -> None:
    model, optimizer = trained()
    write_universal(tmp_path, model, optimizer, 2)
    other = nn.Sequential(nn.Linear(6, 7))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_into(CheckpointReader(tmp_path), other)
    fresh = make_model()
    with pytest.raises(CheckpointError, match="AdamW state, the optimizer is SGD"):
        load_into(CheckpointReader(tmp_path), fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    wrong_shape = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 7), nn.GELU(), nn.Linear(7, 4))
    with pytest.raises(CheckpointError, match=r"3.weight: state shape \(3, 7\), model \(4, 7\)"):
        load_into(CheckpointReader(tmp_path), wrong_shape)
