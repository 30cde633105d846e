"""Real 2-rank DDP training with ``hosts.enable_checkmate`` and two shadow nodes on loopback.

The switch's copy is emulated by :mod:`tests.shadow.copy_tap`. After N
iterations the shadows' parameters and optimizer state must equal the
workers' bit for bit (SGD+momentum, Adam, AdamW; LR schedule, clipping), also
when copies are lost, duplicated and reordered (repairs counted), and the
restore client must hand back exactly the workers' state.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from checkmate import checkpoint as fmt
from checkmate.checkpoint.shadow_memory import fetch_state
from shadow.cluster import certified_through, snapshot_certified_through
from shadow.node import ShadowConfig, ShadowNode
from shadow.repair import RepairPolicy
from shadow.snapshots import SnapshotPolicy
from tests.hosts.harness import run_ranks
from tests.shadow.copy_tap import CopyFaults

MAX_NORM = 0.05
JOB_ID = 21


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    body, head = list(model.body.parameters()), list(model.head.parameters())  # type: ignore[union-attr]
    if kind == "sgd":
        return torch.optim.SGD(
            [{"params": body}, {"params": head, "lr": 0.05}], lr=0.1, momentum=0.9, weight_decay=1e-4
        )
    if kind == "adam":
        return torch.optim.Adam([{"params": body}, {"params": head, "lr": 3e-3}], lr=1e-2, amsgrad=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)


def _train(
    rank: int,
    world: int,
    store: str,
    kind: str,
    steps: int,
    env: dict[str, str],
    copies: dict[int, tuple[str, int]],
    faults: CopyFaults,
    pause: float,
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts
    from hosts.ddp import CheckmateConfig
    from tests.shadow.copy_tap import CopyTap

    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=0.004)  # several buckets; DDP rebuilds them after iteration 0
    opt = _optimizer(kind, ddp.module)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    config = dataclasses.replace(CheckmateConfig.from_env(), keep_iterations=64)
    agent = hosts.enable_checkmate(ddp, opt, config)
    if agent.channel is not None:
        for link in agent.channel.links:
            link.config = dataclasses.replace(link.config, reconnect_interval=0.05)
    tap = CopyTap(agent.transport, copies, faults, rank)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
        opt.step()
        sched.step()
        time.sleep(pause)
    tap.flush()
    certified = None
    if agent.channel is not None:
        # the last step's commit goes at the next forward pass, or here (no forward pass follows)
        agent.wait_certified(steps - 1, timeout=30.0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            certified = agent.channel.certified_through()
            if certified is not None and certified >= steps - 1:
                break
            time.sleep(0.01)
    dist.barrier()
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    out = {
        "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
        "state": {
            names[id(p)]: {k: torch.as_tensor(v).clone() for k, v in s.items()} for p, s in opt.state.items()
        },
        "certified_through": certified,
        "tap": tap.counters,
        "stats": agent.stats(),
    }
    agent.close()
    dist.destroy_process_group()
    return out


def _shadows(tmp: Path, **overrides: Any) -> list[ShadowNode]:
    nodes = []
    for i in range(2):
        config = ShadowConfig(
            name=f"s{i}",
            control_bind=(f"127.0.0.{40 + i}", 0),
            data_bind=(f"127.0.0.{40 + i}", 0),
            snapshots=SnapshotPolicy(tmp / "ckpt", every_iterations=2, keep=2),
            repair=RepairPolicy(grace=0.01, timeout=0.05),
            **overrides,
        )
        nodes.append(ShadowNode(config).start())
    return nodes


def _env(nodes: list[ShadowNode]) -> dict[str, str]:
    shadows = ",".join(f"{n.name}={n.control_address[0]}:{n.control_address[1]}" for n in nodes)
    return {"CHECKMATE_JOB_ID": str(JOB_ID), "CHECKMATE_SHADOWS": shadows}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def assert_bit_equal(
    shadow_params: dict[str, Any], shadow_states: dict[str, Any], worker: dict[str, Any]
) -> None:
    assert set(shadow_params) == set(worker["params"])
    for name, value in worker["params"].items():
        assert torch.equal(_bits(shadow_params[name]), _bits(value)), f"parameter {name} differs"
        want = worker["state"].get(name, {})
        got = shadow_states.get(name, {})
        assert set(got) == set(want), (name, set(got), set(want))
        for key, tensor in want.items():
            assert torch.equal(_bits(torch.as_tensor(got[key])), _bits(tensor)), f"{name}::{key} differs"


def _run(
    kind: str, faults: CopyFaults, steps: int = 10
) -> tuple[list[dict[str, Any]], list[ShadowNode], Path]:
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="shadow-e2e-"))
    nodes = _shadows(tmp)
    copies = {i: n.data_address for i, n in enumerate(nodes)}
    try:
        results = run_ranks(
            _train, 2, f"{tmp}/store", kind, steps, _env(nodes), copies, faults, 0.0, timeout=120
        )
    except BaseException:
        for n in nodes:
            n.close()
        raise
    return results, nodes, tmp


@pytest.mark.parametrize(
    "kind,faults",
    [
        ("sgd", CopyFaults()),
        ("adam", CopyFaults(loss=0.08, duplicate=0.05, reorder=0.1, seed=3)),
        ("adamw", CopyFaults(loss=0.05, seed=7)),
    ],
)
def test_shadows_equal_workers_bit_for_bit(kind: str, faults: CopyFaults) -> None:
    steps = 10
    results, nodes, tmp = _run(kind, faults, steps)
    try:
        r0, r1 = results
        assert r0["certified_through"] == steps - 1, "rank 0 did not see every iteration certified"
        for node in nodes:
            assert node.wait_applied(steps - 1, 5.0), node.status()
        params: dict[str, Any] = {}
        states: dict[str, Any] = {}
        for node in nodes:
            mine = node.parameters()
            assert mine and not set(mine) & set(params), "shards must not overlap"
            params.update(mine)
            states.update(node.optimizer_states())
        assert_bit_equal(params, states, r0)
        assert_bit_equal(params, states, r1)
        statuses = [n.status() for n in nodes]
        for status in statuses:
            assert status["applied_iteration"] == steps - 1 and status["blocked"] is None, status
            assert status["reseeds"] >= 2, status  # initial state + DDP's bucket rebuild
        repairs = sum(s["repairs"].get("elements_repaired", 0) for s in statuses)
        if faults.loss:
            lost = sum(r["tap"]["lost"] for r in results)
            assert lost > 0 and repairs > 0, (lost, statuses)
        if faults.duplicate:
            assert sum(s["drops"].get("duplicate", 0) for s in statuses) > 0
        # cluster-wide certification, over the status port and on disk
        assert certified_through([n.control_address for n in nodes]) == steps - 1
        assert snapshot_certified_through(tmp / "ckpt") is not None  # periodic (some skipped when busy)
        for n in nodes:
            assert n.snapshot_now(10) == steps - 1
        persisted = snapshot_certified_through(tmp / "ckpt")
        assert persisted == steps - 1
        reader = fmt.CheckpointReader(tmp / "ckpt", persisted)
        for name, value in r0["params"].items():
            assert torch.equal(_bits(reader.parameter(name)), _bits(value))
        # the restore service: merged shards equal the workers' state
        state = fetch_state([n.control_address for n in nodes], timeout=10)
        assert state["iteration"] == steps - 1 and state["job_id"] == JOB_ID
        assert_bit_equal(state["parameters"], state["optimizer_state"], r0)
        assert state["optimizer_step"] == steps
    finally:
        for n in nodes:
            n.close()


def test_shadow_restarted_from_its_snapshot_catches_up() -> None:
    import threading

    torch.set_num_threads(1)
    steps = 40
    tmp = Path(tempfile.mkdtemp(prefix="shadow-restart-"))
    nodes = _shadows(tmp)
    copies = {i: n.data_address for i, n in enumerate(nodes)}
    outcome: dict[str, Any] = {}

    def train() -> None:
        try:
            outcome["results"] = run_ranks(
                _train, 2, f"{tmp}/store", "adam", steps, _env(nodes), copies, CopyFaults(), 0.05, timeout=120
            )
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    restarted: ShadowNode | None = None
    try:
        old = nodes[1]
        assert old.wait_applied(6, 60.0), old.status()
        closing = time.monotonic()
        old.close()
        time.sleep(0.2)  # training goes on without shadow s1
        restarted = ShadowNode(
            dataclasses.replace(
                old.config, control_bind=old.control_address, data_bind=old.data_address, resume=True
            )
        )
        resumed = restarted.status()["restored_from_snapshot"]
        assert resumed is not None and resumed >= 1, restarted.status()
        restarted.start()
        nodes[1] = restarted
        down = time.monotonic() - closing
        trainer.join(120)
        assert "error" not in outcome, outcome.get("error")
        r0 = outcome["results"][0]
        assert r0["certified_through"] == steps - 1, repr((down, restarted.status(), r0["stats"]["control"]))
        assert restarted.wait_applied(steps - 1, 5.0), restarted.status()
        params: dict[str, Any] = {}
        states: dict[str, Any] = {}
        for node in nodes:
            params.update(node.parameters())
            states.update(node.optimizer_states())
        assert_bit_equal(params, states, r0)
        assert restarted.status()["reseeds"] >= 1
    finally:
        for n in nodes:
            n.close()
