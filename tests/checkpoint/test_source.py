"""State sources and the one loader: whichever source a state comes from, the same strict checks."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from torch import nn

from checkmate import checkpoint as fmt
from checkmate.checkpoint.load import load_into, load_state
from checkmate.checkpoint.shadow_memory import ShadowMemory
from checkmate.checkpoint.source import (
    SOURCE_SHADOW_MEMORY,
    SOURCE_SNAPSHOT,
    RestoredState,
    SnapshotDirectory,
    SourceError,
    StateSource,
)
from hosts import recovery

torch.set_num_threads(1)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _groups(net: nn.Module) -> list[dict[str, object]]:
    p = dict(net.named_parameters())
    return [{"params": [p["0.weight"], p["0.bias"]]}, {"params": [p["2.weight"], p["2.bias"]], "lr": 0.5}]


def _trained() -> tuple[nn.Sequential, torch.optim.Adam]:
    net = _net()
    optimizer = torch.optim.Adam(_groups(net), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        net(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    return net, optimizer


def _spec(optimizer: torch.optim.Optimizer, net: nn.Module) -> dict[str, object]:
    names = {id(p): n for n, p in net.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [names[id(p)] for p in group["params"]]})
    return {"kind": type(optimizer).__name__, "param_groups": groups}


def _write(root: Path, step: int, net: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    named = list(net.named_parameters())
    fmt.write_global(root, step, fmt.parameters_of(named), _spec(optimizer, net), {"optimizer_step": 2})
    fmt.write_shard(root, step, 0, 1, fmt.capture_states(named, optimizer))
    fmt.update_latest(root, step)


def _closed_port() -> tuple[str, int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return "127.0.0.1", int(probe.getsockname()[1])


def test_both_sources_are_state_sources(tmp_path: Path) -> None:
    assert isinstance(SnapshotDirectory(tmp_path), StateSource)
    assert isinstance(ShadowMemory({"sh1": _closed_port()}), StateSource)
    assert SnapshotDirectory(tmp_path).kind == SOURCE_SNAPSHOT
    assert ShadowMemory({}).kind == SOURCE_SHADOW_MEMORY


def test_sources_without_a_state_say_so(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no usable checkpoint"):
        SnapshotDirectory(tmp_path / "empty").latest()
    with pytest.raises(SourceError, match="no shadow addresses"):
        ShadowMemory({}).latest(1.0)
    with pytest.raises(SourceError, match="cannot serve a state"):
        ShadowMemory({"sh1": _closed_port()}).latest(1.0)


def test_the_shadow_memory_refuses_a_node_that_is_not_the_shadow_named() -> None:
    """A restore that reaches another node than the shadow it names asks it nothing (issue 29)."""
    from shadow.node import ShadowConfig, ShadowNode

    node = ShadowNode(ShadowConfig(name="sh2", control_bind=("127.0.0.3", 0), data_bind=("127.0.0.3", 0)))
    node.start()
    try:
        address = node.control_address
        refused = "the server says it is 'sh2', not 'sh1': connected to another node"
        with pytest.raises(SourceError, match=refused):
            ShadowMemory({"sh1": address}).latest(2.0)
        with pytest.raises(SourceError, match=refused):
            ShadowMemory({"sh1": address}).at(0, 1.0)
        # the right name, or a name made up for an address given without one, gets an answer
        with pytest.raises(SourceError, match="holds no state yet"):
            ShadowMemory({"sh2": address}).latest(2.0)
        with pytest.raises(SourceError, match="holds no state yet"):
            ShadowMemory({"shadow0": address}, unnamed={"shadow0"}).latest(2.0)
    finally:
        node.close()


def test_the_snapshot_directory_reads_the_newest_complete_step_bit_for_bit(tmp_path: Path) -> None:
    net, optimizer = _trained()
    _write(tmp_path, 4, net, optimizer)
    fmt.write_global(tmp_path, 6, {}, {})  # a partial newer step: not a state
    (tmp_path / "status-sh1.json").write_text(json.dumps({"applied_iteration": 7}))
    state = SnapshotDirectory(tmp_path).latest()
    assert (state.iteration, state.source, state.optimizer_step, state.lost_iterations) == (
        4,
        "snapshot",
        2,
        3,
    )
    assert state.optimizer_kind == "Adam" and len(state.optimizer["param_groups"]) == 2
    for name, parameter in net.named_parameters():
        assert torch.equal(state.parameters[name], parameter)
        for key, value in optimizer.state[parameter].items():
            assert torch.equal(torch.as_tensor(state.optimizer_state[name][key]), value), (name, key)


def _memory_state(net: nn.Module, optimizer: torch.optim.Optimizer) -> RestoredState:
    """What the shadows' memory source hands out (shadow_memory.state_of_merged's shape)."""
    return RestoredState(
        iteration=4,
        source=SOURCE_SHADOW_MEMORY,
        parameters={n: p.detach().clone() for n, p in net.named_parameters()},
        optimizer_state=recovery.optimizer_states_by_name(net, optimizer),
        optimizer_kind=type(optimizer).__name__,
        optimizer=_spec(optimizer, net),
    )


def test_a_restored_state_loads_bit_for_bit_from_memory_and_disk(tmp_path: Path) -> None:
    net, optimizer = _trained()
    _write(tmp_path, 4, net, optimizer)
    for state in (_memory_state(net, optimizer), SnapshotDirectory(tmp_path).latest()):
        fresh = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        fresh_optimizer = torch.optim.Adam(_groups(fresh), lr=0.1)
        fresh_optimizer.param_groups[1]["lr"] = 0.01  # the state's hyperparameters win
        recovery.load_state(fresh, fresh_optimizer, state)
        assert fresh_optimizer.param_groups[1]["lr"] == 0.5
        for (name, a), b in zip(net.named_parameters(), fresh.parameters(), strict=True):
            assert torch.equal(a, b), name
            for key, value in optimizer.state[a].items():
                assert torch.equal(fresh_optimizer.state[b][key], value), (name, key)


@pytest.mark.parametrize("source", ["memory", "disk"])
def test_every_source_gets_the_optimizer_kind_and_param_group_checks(source: str, tmp_path: Path) -> None:
    """The loader that used to serve hosts.resume skipped these; now every path runs them."""
    net, optimizer = _trained()
    _write(tmp_path, 4, net, optimizer)

    def state() -> RestoredState:
        return _memory_state(net, optimizer) if source == "memory" else SnapshotDirectory(tmp_path).latest()

    fresh = _net()
    with pytest.raises(recovery.ResumeError, match="holds Adam state, the optimizer is SGD"):
        recovery.load_state(fresh, torch.optim.SGD(_groups(fresh), lr=0.1), state())
    with pytest.raises(recovery.ResumeError, match="2 param groups, the optimizer 1"):
        recovery.load_state(fresh, torch.optim.Adam(fresh.parameters(), lr=0.1), state())
    p = dict(fresh.named_parameters())
    swapped = [{"params": [p["0.weight"], p["2.bias"]]}, {"params": [p["2.weight"], p["0.bias"]]}]
    before = {n: t.detach().clone() for n, t in fresh.named_parameters()}
    with pytest.raises(recovery.ResumeError, match="param group 0 holds other parameters"):
        recovery.load_state(fresh, torch.optim.Adam(swapped, lr=0.1), state())
    for name, tensor in fresh.named_parameters():  # refused before anything was copied
        assert torch.equal(tensor, before[name]), name


def test_load_into_is_the_same_loader(tmp_path: Path) -> None:
    net, optimizer = _trained()
    _write(tmp_path, 4, net, optimizer)
    fresh = _net()
    with pytest.raises(fmt.CheckpointError, match="holds Adam state, the optimizer is SGD"):
        load_into(fmt.CheckpointReader(tmp_path), fresh, torch.optim.SGD(_groups(fresh), lr=0.1))
    fresh_optimizer = torch.optim.Adam(_groups(fresh), lr=0.1)
    assert load_into(fmt.CheckpointReader(tmp_path), fresh, fresh_optimizer) == 4
    load_state(fresh, fresh_optimizer, SnapshotDirectory(tmp_path).latest())
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), fresh.parameters(), strict=True))
