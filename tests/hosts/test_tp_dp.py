"""Checkmate for a TP=2 x DP=2 job: one lane per TP index, shadows per lane, merged into universal atoms.

A real 4-rank CPU run (gloo, one thread each): the tiny transformer under torch tensor
parallelism (``ColwiseParallel`` / ``RowwiseParallel`` on a ``("dp", "tp")`` mesh), DDP
over each TP index's DP group with ``enable_checkmate`` (``CHECKMATE_TP_DEGREE=2``,
host replication on loopback), two real shadows per lane. The shadows must equal the
workers bit for bit per TP shard; their snapshots, merged, must restore as TP=1 (element
for element the lanes' tensors put together, and the same loss) and back as TP=2 (bit
for bit the workers' tensors, optimizer state included).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from checkmate import checkpoint as fmt
from checkmate.job import JobSpec, JobSpecError
from checkmate.universal.layout import Layout
from checkmate.universal.load import load_module, load_rank
from checkmate.universal.runs import write_initial
from checkmate.universal.shadow_merge import lane_steps, merge_lane_snapshots
from checkmate.universal.spec import LayoutError
from checkmate.universal.tiny import TinyConfig, batch, build, logical_shapes, tiny_spec
from checkmate.wire import CHECKMATE_UDP_PORT
from hosts.ddp import CheckmateConfig, CheckmateConfigError
from shadow.node import ShadowConfig, ShadowNode
from shadow.repair import RepairPolicy
from shadow.snapshots import SnapshotPolicy
from tests.hosts.harness import run_ranks

TP, DP, SHADOWS_PER_LANE = 2, 2, 2
STEPS = 6
JOB_ID = 41
EVAL_STEP = 999
CONFIG = TinyConfig()
NET = f"127.{os.getpid() % 200 + 20}.{os.getpid() // 200 % 250}"


def _tp_dp_rank(rank: int, world: int, store: str, initial: str, env: dict[str, str]) -> dict[str, Any]:
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts
    from hosts.ddp_tp import localize_tensor_parallel

    os.environ.update(
        env,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        CHECKMATE_BIND=f"{NET}.{110 + rank}",
    )
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    layout = Layout(tp=TP, dp=DP)
    _, dp_index, tp_index = layout.coords(rank)
    model = build(CONFIG, layout, rank)  # DTensor parameters, TP-sharded on the mesh's "tp" dimension
    load_module(fmt.CheckpointReader(Path(initial)), model, None, layout, rank, tiny_spec(CONFIG))
    dp_group = None
    for t in range(TP):  # every rank creates every DP group, in the same order
        group = dist.new_group([d * TP + t for d in range(DP)])
        if t == tp_index:
            dp_group = group
    assert localize_tensor_parallel(model)  # DDP, the optimizer and Checkmate see TP-local parameters
    ddp = DDP(model, process_group=dp_group, bucket_cap_mb=0.01)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    config = dataclasses.replace(CheckmateConfig.from_env(), keep_iterations=64)
    agent = hosts.enable_checkmate(ddp, optimizer, config)
    rows = CONFIG.batch // DP
    for step in range(STEPS):
        tokens = batch(CONFIG, step)[dp_index * rows : (dp_index + 1) * rows]
        logits = ddp(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, CONFIG.vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    certified = agent.wait_certified(STEPS - 1, timeout=30.0)
    with torch.no_grad():  # the whole eval batch on every rank: the TP=2 model's loss
        tokens = batch(CONFIG, EVAL_STEP)
        logits = model(tokens[:, :-1])
        eval_loss = float(F.cross_entropy(logits.reshape(-1, CONFIG.vocab), tokens[:, 1:].reshape(-1)))
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    out = {
        "tp_index": tp_index,
        "job_id": agent.config.job_id,
        "ring": agent.workers,
        "certified": certified,
        "eval_loss": eval_loss,
        "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
        "state": {
            names[id(p)]: {k: torch.as_tensor(v).clone() for k, v in s.items()}
            for p, s in optimizer.state.items()
        },
    }
    agent.close()
    dist.destroy_process_group()
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _lane_shadows(tmp: Path) -> list[list[ShadowNode]]:
    lanes = []
    for t in range(TP):
        nodes = []
        for k in range(SHADOWS_PER_LANE):
            host = f"{NET}.{100 + t * SHADOWS_PER_LANE + k}"
            config = ShadowConfig(
                name=f"tp{t}-s{k}",
                control_bind=(host, 0),
                data_bind=(host, CHECKMATE_UDP_PORT),  # where host replication sends the copies
                snapshots=SnapshotPolicy(tmp / f"lane{t}", every_iterations=2, keep=4),
                repair=RepairPolicy(grace=0.05, timeout=0.2),
            )
            nodes.append(ShadowNode(config).start())
        lanes.append(nodes)
    return lanes


@pytest.fixture(scope="module")
def tp_run() -> Any:
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="tp-dp-"))
    initial = write_initial(tmp / "initial", CONFIG)
    lanes = _lane_shadows(tmp)
    env = {"CHECKMATE_JOB_ID": str(JOB_ID), "CHECKMATE_TP_DEGREE": str(TP), "CHECKMATE_REPLICATION": "host"}
    for t, nodes in enumerate(lanes):
        env[f"CHECKMATE_SHADOWS_TP{t}"] = ",".join(
            f"{n.name}={n.control_address[0]}:{n.control_address[1]}" for n in nodes
        )
    try:
        results = run_ranks(_tp_dp_rank, TP * DP, f"{tmp}/store", str(initial), env, timeout=180)
        for nodes in lanes:
            for node in nodes:
                assert node.wait_applied(STEPS - 1, 10.0), node.status()
                assert node.snapshot_now() == STEPS - 1, node.status()
        yield results, lanes, tmp
    finally:
        for nodes in lanes:
            for node in nodes:
                node.close()


def test_each_tp_index_is_its_own_lane_and_its_shadows_equal_its_workers_bit_for_bit(tp_run: Any) -> None:
    results, lanes, _ = tp_run
    assert [r["tp_index"] for r in results] == [0, 1, 0, 1]
    assert [r["job_id"] for r in results] == [JOB_ID, JOB_ID + 1, JOB_ID, JOB_ID + 1]
    assert results[0]["ring"] == results[2]["ring"] and results[0]["ring"] != results[1]["ring"]
    assert all(r["certified"] for r in results)
    for t, nodes in enumerate(lanes):
        workers = [r for r in results if r["tp_index"] == t]
        params: dict[str, torch.Tensor] = {}
        states: dict[str, dict[str, torch.Tensor]] = {}
        for node in nodes:
            assert node.status()["job_id"] == JOB_ID + t, node.status()
            mine = node.parameters()
            assert mine and not set(mine) & set(params), "a lane's shadows own disjoint parameters"
            params.update(mine)
            states.update(node.optimizer_states())
        for worker in workers:  # both DP replicas of TP shard t
            assert set(params) == set(worker["params"])
            for name, value in worker["params"].items():
                assert params[name].shape == value.shape, (t, name)  # TP-local shapes
                assert torch.equal(_bits(params[name]), _bits(value)), f"lane {t}: {name} differs"
                for key, tensor in worker["state"][name].items():
                    assert torch.equal(_bits(states[name][key]), _bits(tensor)), f"lane {t}: {name}::{key}"
    # the shards differ between the lanes: the copies carried different TP shards
    qkv = "layers.0.attn.qkv.weight"
    assert not torch.equal(results[0]["params"][qkv], results[1]["params"][qkv])


def _lane_tensor(results: list[dict[str, Any]], t: int, name: str, state: str = "param") -> torch.Tensor:
    r = next(r for r in results if r["tp_index"] == t)
    return r["params"][name] if state == "param" else r["state"][name][state]


def test_the_lanes_snapshots_merge_into_a_checkpoint_that_restores_as_tp1_and_back_as_tp2(
    tp_run: Any,
) -> None:
    results, _, tmp = tp_run
    roots = [tmp / f"lane{t}" for t in range(TP)]
    assert STEPS - 1 in lane_steps(roots)
    merged_root = tmp / "merged"
    spec, shapes = tiny_spec(CONFIG), logical_shapes(CONFIG)
    step = merge_lane_snapshots(roots, merged_root, spec, shapes)
    assert step == STEPS - 1 and fmt.read_latest(merged_root) == step
    reader = fmt.CheckpointReader(merged_root)
    assert reader.global_state["extra"]["lane_job_ids"] == [JOB_ID, JOB_ID + 1]
    reader.verify_files()

    # TP=1: every tensor is the lanes' TP-local tensors put together, element for element
    one = load_rank(reader, Layout(), 0)
    d, f, v = CONFIG.dim, CONFIG.ffn, CONFIG.vocab
    for state in ("param", "exp_avg", "exp_avg_sq"):

        def get(name: str, lanes: range = range(TP), state: str = state) -> list[torch.Tensor]:
            return [_lane_tensor(results, t, name, state) for t in lanes]

        def whole(name: str, state: str = state) -> torch.Tensor:
            return one.params[name] if state == "param" else one.states[name][state]

        assert torch.equal(
            whole("layers.1.mlp.down.weight"), torch.cat(get("layers.1.mlp.down.weight"), dim=1)
        )
        assert torch.equal(
            whole("head.weight"), torch.cat(get("head.weight"))[:v]
        )  # padded vocabulary trimmed
        assert torch.equal(whole("embed.weight"), torch.cat(get("embed.weight"))[:v])
        qkv = get("layers.0.attn.qkv.weight")  # fused: each lane holds its heads of q, k and v
        want = torch.cat(
            [torch.cat([lane[p * d // TP : (p + 1) * d // TP] for lane in qkv]) for p in range(3)]
        )
        assert torch.equal(whole("layers.0.attn.qkv.weight"), want)
        gate_up = get("layers.0.mlp.gate_up.weight")
        want = torch.cat(
            [torch.cat([lane[p * f // TP : (p + 1) * f // TP] for lane in gate_up]) for p in range(2)]
        )
        assert torch.equal(whole("layers.0.mlp.gate_up.weight"), want)
        for replicated in ("norm.weight", "layers.0.attn.out.bias"):
            lane0, lane1 = get(replicated)
            assert torch.equal(lane0, lane1) and torch.equal(whole(replicated), lane0), replicated
    assert int(one.scalars["head.weight"]["step"]) == STEPS

    # the same math: a TP=1 model loaded from it computes the TP=2 job's loss
    model = build(CONFIG, Layout(), 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    assert load_module(reader, model, optimizer, Layout(), 0, spec) == step
    with torch.no_grad():
        tokens = batch(CONFIG, EVAL_STEP)
        logits = model(tokens[:, :-1])
        loss = float(F.cross_entropy(logits.reshape(-1, CONFIG.vocab), tokens[:, 1:].reshape(-1)))
    assert loss == pytest.approx(results[0]["eval_loss"], rel=1e-5, abs=1e-6)

    # and back as TP=2: each TP index gets exactly its workers' tensors and optimizer state
    for t in range(TP):
        back = load_rank(reader, Layout(tp=TP), t)
        for name, value in next(r for r in results if r["tp_index"] == t)["params"].items():
            assert torch.equal(_bits(back.params[name]), _bits(value)), (t, name)
            assert torch.equal(
                _bits(back.states[name]["exp_avg_sq"]), _bits(_lane_tensor(results, t, name, "exp_avg_sq"))
            )


def test_merging_lanes_in_the_wrong_order_or_missing_one_is_refused_before_anything_is_written(
    tp_run: Any,
) -> None:
    _, _, tmp = tp_run
    roots = [tmp / f"lane{t}" for t in range(TP)]
    spec, shapes = tiny_spec(CONFIG), logical_shapes(CONFIG)
    with pytest.raises(LayoutError, match="lane 0 of 2"):
        merge_lane_snapshots(roots[::-1], tmp / "swapped", spec, shapes)
    with pytest.raises(LayoutError, match="TP index 0 of 2"):
        merge_lane_snapshots(roots[:1], tmp / "one-lane", spec, shapes)
    for folder in ("swapped", "one-lane"):
        assert fmt.complete_steps(tmp / folder) == [] if (tmp / folder).exists() else True


def test_tp_configuration_from_the_environment() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "CHECKMATE_TP_DEGREE": "2"}
    env.update(CHECKMATE_JOB_ID="7", CHECKMATE_SHADOWS="a=127.0.0.1:9", CHECKMATE_SHADOWS_TP1="b=127.0.0.2:9")
    config = CheckmateConfig.from_env(env)
    assert (config.rank, config.world_size, config.tp_index, config.tp_degree) == (1, 2, 1, 2)
    assert config.job_id == 8 and dict(config.shadow_control) == {"b": ("127.0.0.2", 9)}
    assert config.bind[0] == "127.0.0.13"  # by the global rank: unique across lanes
    env["RANK"] = "2"
    config = CheckmateConfig.from_env(env)
    assert (config.rank, config.tp_index, config.job_id) == (1, 0, 7)
    assert dict(config.shadow_control) == {"a": ("127.0.0.1", 9)}
    with pytest.raises(CheckmateConfigError, match="does not divide"):
        CheckmateConfig.from_env({**env, "CHECKMATE_TP_DEGREE": "3"})
    job = JobSpec(7, ("w0", "w1"), ("s0",), tp_degree=2, tp_index=1)
    assert JobSpec.from_json(job.to_json()) == job
    assert "tp_index" not in JobSpec(7, ("w0", "w1"), ("s0",)).to_json()  # plain jobs' JSON unchanged
    with pytest.raises(JobSpecError, match="tp_index 2"):
        JobSpec(7, ("w0", "w1"), ("s0",), tp_degree=2, tp_index=2)
    with pytest.raises(CheckmateConfigError, match="TP index 1 of 2"):
        CheckmateConfig(job_id=7, rank=0, world_size=2, bind=("127.0.0.1", 1), job=job)


def _wrong_group_rank(rank: int, world: int, store: str) -> str:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", CHECKMATE_TP_DEGREE="2",
        CHECKMATE_BIND=f"{NET}.{120 + rank}",
    )  # fmt: skip
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ddp = DDP(torch.nn.Linear(4, 4))  # over every rank, not over a TP index's DP group
        with pytest.raises(CheckmateConfigError) as caught:
            hosts.enable_checkmate(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
        return str(caught.value)
    finally:
        dist.destroy_process_group()


def test_a_ddp_group_that_is_not_the_lane_is_refused_at_enable(tmp_path: Path) -> None:
    messages = run_ranks(_wrong_group_rank, 2, f"{tmp_path}/store", timeout=60)
    for rank, message in enumerate(messages):
        assert f"has 2 ranks, this one rank {rank}" in message and "CHECKMATE_TP_DEGREE" in message, message
