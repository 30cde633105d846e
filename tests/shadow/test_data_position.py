"""The workers' data position through a shadow: kept per applied iteration, restored, snapshotted, refused."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from checkmate import checkpoint as fmt
from checkmate.checkpoint import CheckpointReader
from checkmate.checkpoint.load import data_position
from checkmate.checkpoint.shadow_memory import fetch_shard, fetch_state, merge_shards
from checkmate.control import MAX_DATA_POSITION_BYTES, BucketLayout, Commit, JobStart, RestoreRefused
from shadow.node import ShadowConfig, ShadowNode
from shadow.repair import RepairPolicy
from shadow.snapshots import SnapshotPolicy
from tests.hosts.fake_shadow import FakeShadow
from tests.hosts.harness import run_ranks
from tests.shadow.test_node import GRAD, JOB, LAYOUT, Rank0, datagram, job_start, wait_for, worker_socket

# One shadow owns both shard keys, so it alone covers the model (a restore merges one shard).
SPEC = {"job_id": JOB, "workers": ["a", "b"], "shadows": ["s0"], "shard_to_shadow": {"0": "s0", "1": "s0"}}


def _config(tmp_path: Path, **overrides: Any) -> ShadowConfig:
    config = ShadowConfig(
        name="s0",
        control_bind=("127.0.0.52", 0),
        data_bind=("127.0.0.52", 0),
        status_file=tmp_path / "status.json",
        horizon=4,
        repair=RepairPolicy(grace=5.0),  # every copy is sent: no repairs
        snapshots=SnapshotPolicy(tmp_path / "snapshots", every_iterations=1, keep=10),
    )
    return dataclasses.replace(config, **overrides)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[ShadowNode]:
    torch.set_num_threads(1)
    shadow = ShadowNode(_config(tmp_path)).start()
    yield shadow
    shadow.close()


def _join(node: ShadowNode, position: Any = None) -> Rank0:
    rank0 = Rank0(node)
    start = dataclasses.replace(job_start([("127.0.0.62", 9), ("127.0.0.63", 9)]), job=SPEC)
    if position is not None:
        start.extra["data_position"] = position
    rank0.send(start)
    rank0.send(BucketLayout(JOB, 0, LAYOUT))
    assert wait_for(lambda: node.status()["state"] == "running", timeout=60), node.status()
    return rank0


def _iteration(node: ShadowNode, rank0: Rank0, iteration: int, position: Any = None) -> None:
    """Rank 0's commit and every copy of ``iteration`` (both buckets); waits until it is snapshotted."""
    rank0.send(Commit(JOB, iteration, [0.1], optimizer_step=iteration + 1, data_position=position))
    with worker_socket("127.0.0.62") as sender:
        sender.sendto(datagram(iteration, 0, GRAD[:8]), node.data_address)
        sender.sendto(datagram(iteration, 8, GRAD[8:]), node.data_address)
        sender.sendto(datagram(iteration, 0, GRAD[:6], bucket_id=1, shard_key=1), node.data_address)
    assert node.wait_applied(iteration, 10), node.status()
    # one write at a time: a snapshot offered while the writer is busy would be skipped
    snapshotter = node.snapshotter
    assert snapshotter is not None
    assert wait_for(lambda: snapshotter.stats.last_step == iteration, timeout=10), snapshotter.stats


def _restored_position(node: ShadowNode, iteration: int | None = None) -> Any:
    reply = fetch_shard(node.control_address, iteration, 0.0, 5.0, JOB)
    assert isinstance(reply, JobStart), reply
    return reply.extra["iteration"], reply.extra["data_position"]


def test_restore_returns_the_data_position_of_the_restored_iteration(node: ShadowNode) -> None:
    rank0 = _join(node, position={"epoch": 0, "batch": 0})
    assert _restored_position(node) == (-1, {"epoch": 0, "batch": 0})  # from the job_start's extra

    _iteration(node, rank0, 0, {"epoch": 0, "batch": 1})
    assert _restored_position(node) == (0, {"epoch": 0, "batch": 1})
    _iteration(node, rank0, 1)  # no position in this commit: unchanged
    assert _restored_position(node) == (1, {"epoch": 0, "batch": 1})
    _iteration(node, rank0, 2, {"epoch": 1, "batch": 0})

    # the whole restore: one shadow covers the model; its state after 2 with 2's position
    state = fetch_state([node.control_address], timeout=5.0, job_id=JOB)
    assert state["iteration"] == 2 and state["optimizer_step"] == 3
    assert state["data_position"] == {"epoch": 1, "batch": 0}
    assert set(state["parameters"]) == {"w", "b", "other"}

    # a restore waiting for an iteration gets that iteration's position, not a later one's
    waiting: dict[str, Any] = {}
    asker = threading.Thread(
        target=lambda: waiting.update(reply=fetch_shard(node.control_address, 3, 10.0, 5.0, JOB))
    )
    asker.start()
    assert wait_for(lambda: 3 in node.waiting_restores(), timeout=5)
    _iteration(node, rank0, 3, {"epoch": 1, "batch": 1})
    _iteration(node, rank0, 4, {"epoch": 1, "batch": 2})
    asker.join(10)
    reply = waiting["reply"]
    assert isinstance(reply, JobStart) and reply.start_iteration == 4
    assert reply.extra["data_position"] == {"epoch": 1, "batch": 1}
    behind = fetch_shard(node.control_address, 3, 0.0, 5.0, JOB)  # the shadow has moved on
    assert isinstance(behind, RestoreRefused) and behind.iteration == 4
    rank0.close()


def test_snapshots_store_the_data_position_and_a_restarted_shadow_serves_it(
    node: ShadowNode, tmp_path: Path
) -> None:
    rank0 = _join(node)
    assert _restored_position(node) == (-1, None)  # the workers set none: null
    sampler = {"seed": 7, "epoch": 3, "indices_consumed": 960}
    _iteration(node, rank0, 0, sampler)
    _iteration(node, rank0, 1, dict(sampler, indices_consumed=1008))
    _iteration(node, rank0, 2)  # unchanged: iteration 2's position is 1's
    root = tmp_path / "snapshots"
    assert fmt.complete_steps(root) == [0, 1, 2]
    for step, consumed in ((0, 960), (1, 1008), (2, 1008)):
        extra = json.loads((fmt.step_dir(root, step) / "global.json").read_text())["extra"]
        want = dict(sampler, indices_consumed=consumed)
        assert extra["iteration"] == step and extra["data_position"] == want
        assert data_position(CheckpointReader(root, step)) == want
    assert data_position(CheckpointReader(root)) == dict(sampler, indices_consumed=1008)  # latest
    rank0.close()
    node.close()

    restarted = ShadowNode(_config(tmp_path, resume=True)).start()
    try:
        assert restarted.status()["restored_from_snapshot"] == 2
        assert _restored_position(restarted) == (2, dict(sampler, indices_consumed=1008))
        state = fetch_state([restarted.control_address], timeout=5.0, job_id=JOB)
        assert state["iteration"] == 2 and state["data_position"] == dict(sampler, indices_consumed=1008)
    finally:
        restarted.close()


def test_a_bad_data_position_is_refused_and_counted_and_the_iteration_still_applies(
    node: ShadowNode, tmp_path: Path
) -> None:
    rank0 = _join(node, position=[0, 0])
    _iteration(node, rank0, 0, [0, 1])
    _iteration(node, rank0, 1, {"cursor": float("nan")})  # NaN travels in the frame, is not JSON
    assert node.status()["drops"].get("bad_data_position") == 1
    assert _restored_position(node) == (1, None)  # unknown, never the stale [0, 1]
    _iteration(node, rank0, 2)  # unchanged: still unknown
    assert _restored_position(node) == (2, None)
    _iteration(node, rank0, 3, "x" * (MAX_DATA_POSITION_BYTES + 1))  # too large
    assert node.status()["drops"].get("bad_data_position") == 2
    assert _restored_position(node) == (3, None)
    _iteration(node, rank0, 4, [0, 5])  # a valid one again
    assert _restored_position(node) == (4, [0, 5])
    status = node.status()
    assert status["control_connected"] and status["applied_iteration"] == 4 and status["state"] == "running"
    root = tmp_path / "snapshots"
    assert data_position(CheckpointReader(root, 1)) is None
    assert data_position(CheckpointReader(root, 4)) == [0, 5]
    rank0.close()


def _shard(shadow: str, position: Any) -> JobStart:
    start = dataclasses.replace(job_start([]), start_iteration=8)
    keep = "param/w" if shadow == "s0" else "param/b"
    other = {"param/other": start.tensors["param/other"]} if shadow == "s0" else {}
    start.tensors = {keep: start.tensors[keep], **other}
    start.extra = {"shadow": shadow, "iteration": 7, "optimizer_step": 8}
    if position is not ...:
        start.extra["data_position"] = position
    return start


def test_merge_takes_the_shards_position_and_none_when_they_disagree() -> None:
    assert merge_shards([_shard("s0", {"b": 8}), _shard("s1", {"b": 8})])["data_position"] == {"b": 8}
    # a shard that does not know it (e.g. resumed from an older snapshot) does not hide it
    assert merge_shards([_shard("s0", None), _shard("s1", {"b": 8})])["data_position"] == {"b": 8}
    assert merge_shards([_shard("s0", ...), _shard("s1", ...)])["data_position"] is None
    assert merge_shards([_shard("s0", {"b": 8}), _shard("s1", {"b": 9})])["data_position"] is None


# ---- the agent's side: what rank 0 sends ----------------------------------------------------
def _train(rank: int, world: int, store: str, env: dict[str, str]) -> dict[str, Any]:
    """Four DDP iterations; the script sets the batch cursor before each step but iteration 2's."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts

    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    os.environ["CHECKMATE_BIND"] = f"127.0.0.{44 + rank}:48879"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets; DDP rebuilds them after iteration 0
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    agent = hosts.enable_checkmate(ddp, optimizer, data_position={"batch": 0})
    refused = []
    for bad in (float("nan"), {"sampler": object()}, "x" * (MAX_DATA_POSITION_BYTES + 1), None):
        try:
            agent.set_data_position(bad)
        except ValueError as exc:
            refused.append(str(exc))
    g = torch.Generator().manual_seed(rank)
    for iteration in range(4):
        loss = ddp(torch.randn(4, 8, generator=g)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        if iteration != 2:
            agent.set_data_position({"batch": iteration + 1})
        optimizer.step()
    out = {"refused": refused, "commits": list(agent.commits), "position": agent.data_position}
    out["certified"] = agent.wait_certified(3, timeout=20.0)
    agent.close()
    dist.destroy_process_group()
    return out


def test_rank0_sends_the_position_set_before_each_step_with_that_iteration() -> None:
    shadow = FakeShadow(("127.0.0.33", 0), name="s0")
    env = {"CHECKMATE_JOB_ID": "11", "CHECKMATE_SHADOWS": f"s0=127.0.0.33:{shadow.address[1]}"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            r0, r1 = run_ranks(_train, 2, f"{tmp}/store", env, timeout=90)
    finally:
        shadow.close()
    for result in (r0, r1):
        assert [m.split(":")[0] for m in result["refused"]] == [
            "data position is not JSON-serialisable",
            "data position is not JSON-serialisable",
            f"data position is {MAX_DATA_POSITION_BYTES + 3} bytes as JSON; the limit is 65536 bytes",
            "a data position cannot be None (null means 'unchanged' on the control channel)",
        ]
        assert result["position"] == {"batch": 4}
    assert r0["certified"]
    sent = [m for m in shadow.messages if isinstance(m, Commit)]
    assert [(c.iteration, c.data_position) for c in sent] == [
        (0, {"batch": 1}),
        (1, {"batch": 2}),
        (2, None),  # not set in iteration 2: unchanged, the field is left out
        (3, {"batch": 4}),
    ]
    assert sent == r0["commits"]
    # every job_start carries the position after start_iteration - 1: the first one the
    # enable_checkmate(data_position=...) value, DDP's rebuild re-seed (before iteration 1) commit 0's
    starts = [m for m in shadow.messages if isinstance(m, JobStart)]
    assert starts[0].start_iteration == 0 and starts[0].extra["data_position"] == {"batch": 0}
    assert len(starts) == 2  # DDP's rebuild moved parameters between buckets
    for start in starts[1:]:
        assert start.extra["data_position"] == {"batch": start.start_iteration}
