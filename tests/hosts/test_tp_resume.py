"""A TP=2 x DP=2 job stopped after iteration 2 resumes lane by lane, bit for bit (``hosts.resume``).

Real 4-rank CPU runs (gloo, one thread each) of the tiny transformer under torch tensor
parallelism with DDP over each TP index's DP group and ``enable_checkmate``
(``CHECKMATE_TP_DEGREE=2``, host replication on loopback), one real shadow per lane
snapshotting every iteration into the lane's own directory:

* run A trains iterations 0-2 and stops (every worker gone, the shadows stay);
* run B, new processes, calls ``hosts.resume`` on every rank: each lane restores its own
  TP shard, from its shadows' memory; from the merged universal checkpoint alone; and
  from its snapshot directory alone. Every restore equals run A's tensors bit for bit
  (parameters and Adam state), then B trains iterations 3-5 under Checkmate;
* a reference run trains 0-5 without stopping: B's final tensors equal it bit for bit.

Lanes an iteration apart (lane 1's newest snapshot gone, no shadows asked) agree on the
older one, each lane reading it from its own snapshots. Bad input is refused on every rank
with a message naming the cause (a snapshot directory without ``{tp_index}``, a lane with no
state while the other has one, a group that is not the lane).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from checkmate import checkpoint as fmt
from checkmate.checkpoint.format import LATEST_FILE, step_name
from checkmate.checkpoint.source import SOURCE_SHADOW_MEMORY, SOURCE_SNAPSHOT, SnapshotDirectory
from checkmate.universal.layout import Layout
from checkmate.universal.load import load_module
from checkmate.universal.runs import write_initial
from checkmate.universal.shadow_merge import merge_lane_snapshots
from checkmate.universal.tiny import TinyConfig, batch, build, logical_shapes, tiny_spec
from checkmate.wire import CHECKMATE_UDP_PORT
from hosts.recovery import SOURCE_MERGED, ResumeError, resume
from shadow.node import ShadowConfig, ShadowNode
from shadow.repair import RepairPolicy
from shadow.snapshots import SnapshotPolicy
from tests.hosts.harness import run_ranks

TP, DP = 2, 2
STOP_AFTER, STEPS = 3, 6  # run A: iterations 0..2; run B: 3..5
CONFIG = TinyConfig()
NET = f"127.{os.getpid() % 200 + 20}.{os.getpid() // 200 % 250 + 1}"

Tensors = dict[str, Any]


def _capture(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Tensors:
    names = {id(p): n for n, p in module.named_parameters()}
    return {
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "state": {
            names[id(p)]: {k: torch.as_tensor(v).clone() for k, v in s.items()}
            for p, s in optimizer.state.items()
        },
    }


def _rank(rank: int, world: int, store: str, initial: str, env: dict[str, str], plan: dict[str, Any]) -> Any:
    """One rank: optionally resume (every way ``plan`` asks), then train ``plan['start']..STEPS``."""
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts
    from hosts.ddp import CheckmateConfig
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
        timeout=datetime.timedelta(seconds=90),
    )
    layout = Layout(tp=TP, dp=DP)
    _, dp_index, tp_index = layout.coords(rank)
    model = build(CONFIG, layout, rank)
    load_module(fmt.CheckpointReader(Path(initial)), model, None, layout, rank, tiny_spec(CONFIG))
    groups = [dist.new_group([d * TP + t for d in range(DP)]) for t in range(TP)]
    localize_tensor_parallel(model)
    ddp = DDP(model, process_group=groups[tp_index], bucket_cap_mb=0.01)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    out: dict[str, Any] = {"tp_index": tp_index}
    for name, kwargs in plan.get("refusals", {}).items():
        try:
            resume(ddp, optimizer, **kwargs)
        except ResumeError as exc:
            out[f"refused/{name}"] = str(exc)
        else:
            out[f"refused/{name}"] = None
    try:  # a group that is not this rank's lane: refused before any collective
        resume(ddp, optimizer, group=groups[1 - tp_index])
    except ResumeError as exc:
        out["refused/wrong_group"] = str(exc)
    for name, kwargs in plan.get("restores", {}).items():
        point = resume(ddp, optimizer, **kwargs)
        out[f"point/{name}"] = point
        out[f"restored/{name}"] = _capture(ddp.module, optimizer)
    point = resume(ddp, optimizer) if plan["resume"] else hosts.ResumePoint(iteration=0)
    out["point"] = point
    config = dataclasses.replace(CheckmateConfig.from_env(), keep_iterations=64)
    agent = hosts.enable_checkmate(ddp, optimizer, config, resume=point)
    rows = CONFIG.batch // DP
    for step in range(point.iteration, plan["stop"]):
        tokens = batch(CONFIG, step)[dp_index * rows : (dp_index + 1) * rows]
        logits = ddp(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, CONFIG.vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    out["certified"] = agent.wait_certified(plan["stop"] - 1, timeout=30.0)
    out["final"] = _capture(ddp.module, optimizer)
    agent.close()
    dist.destroy_process_group()
    return out


def _shadows(tmp: Path, base: int) -> list[ShadowNode]:
    nodes = []
    for t in range(TP):
        host = f"{NET}.{base + t}"
        config = ShadowConfig(
            name=f"lane{t}-s0",
            control_bind=(host, 0),
            data_bind=(host, CHECKMATE_UDP_PORT),
            snapshots=SnapshotPolicy(tmp / f"lane{t}", every_iterations=1, keep=8),
            repair=RepairPolicy(grace=0.05, timeout=0.2),
        )
        nodes.append(ShadowNode(config).start())
    return nodes


def _env(job_id: int, nodes: list[ShadowNode]) -> dict[str, str]:
    env = {"CHECKMATE_JOB_ID": str(job_id), "CHECKMATE_TP_DEGREE": str(TP), "CHECKMATE_REPLICATION": "host"}
    for t, node in enumerate(nodes):
        env[f"CHECKMATE_SHADOWS_TP{t}"] = f"{node.name}={node.control_address[0]}:{node.control_address[1]}"
    return env


def _lanes_apart(main_dir: Path, root: Path, empty: bool = False) -> str:
    """Copies of the lanes' snapshot directories where lane 1 lacks the newest step (``empty``: every
    step): lane 0 is one iteration ahead of lane 1, or lane 1 holds nothing. Returns the ``{tp_index}``
    template."""
    for t in range(TP):
        shutil.copytree(main_dir / f"lane{t}", root / f"lane{t}")
    lane1 = root / "lane1"
    for step in fmt.complete_steps(lane1):
        if empty or step == STOP_AFTER - 1:
            shutil.rmtree(lane1 / step_name(step))
    (lane1 / LATEST_FILE).unlink()
    if not empty:
        (lane1 / LATEST_FILE).write_text(step_name(STOP_AFTER - 2) + "\n")
    return str(root / "lane{tp_index}")


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, Any]]:
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="tp-resume-"))
    initial = str(write_initial(tmp / "initial", CONFIG))
    main_dir, ref_dir = tmp / "main", tmp / "reference"
    nodes = _shadows(main_dir, 100)
    ref_nodes: list[ShadowNode] = []
    try:
        env = _env(61, nodes)
        first = run_ranks(
            _rank, TP * DP, f"{tmp}/a", initial, env, {"resume": False, "stop": STOP_AFTER}, timeout=180
        )
        for node in nodes:
            assert node.wait_applied(STOP_AFTER - 1, 10.0), node.status()
            assert node.snapshot_now() == STOP_AFTER - 1, node.status()
        lanes = [main_dir / f"lane{t}" for t in range(TP)]
        merged = main_dir / "merged"
        merge_lane_snapshots(lanes, merged, tiny_spec(CONFIG), logical_shapes(CONFIG))
        lane_dir = str(main_dir / "lane{tp_index}")
        apart, holes = (
            _lanes_apart(main_dir, tmp / "apart"),
            _lanes_apart(main_dir, tmp / "holes", empty=True),
        )
        plan = {
            "resume": True,
            "stop": STEPS,
            "refusals": {
                "snapshot_dir_without_tp_index": {"snapshot_dir": str(main_dir / "lane0")},
                "a_lane_without_state": {"shadows": {}, "job_id": 61, "snapshot_dir": holes},
            },
            "restores": {
                "merged_only": {"shadows": {}, "job_id": 61, "merged_dir": str(merged)},
                "lane_snapshots_only": {"shadows": {}, "job_id": 61, "snapshot_dir": lane_dir},
                "lanes_apart": {"shadows": {}, "job_id": 61, "snapshot_dir": apart},
                "shadows": {"snapshot_dir": lane_dir, "merged_dir": str(merged)},
            },
        }
        second = run_ranks(_rank, TP * DP, f"{tmp}/b", initial, env, plan, timeout=240)
        ref_nodes = _shadows(ref_dir, 110)
        reference = run_ranks(
            _rank,
            TP * DP,
            f"{tmp}/ref",
            initial,
            _env(71, ref_nodes),
            {"resume": False, "stop": STEPS},
            timeout=240,
        )
        yield {"first": first, "second": second, "reference": reference, "tmp": tmp}
    finally:
        for node in [*nodes, *ref_nodes]:
            node.close()


def _assert_bits_equal(got: Tensors, want: Tensors, what: str) -> None:
    assert set(got["params"]) == set(want["params"]), what
    for name, value in want["params"].items():
        assert got["params"][name].shape == value.shape, (what, name)
        assert torch.equal(got["params"][name].view(torch.int32), value.view(torch.int32)), f"{what}: {name}"
    assert set(got["state"]) == set(want["state"]), what
    for name, states in want["state"].items():
        for key, tensor in states.items():
            mine = got["state"][name][key]
            assert mine.dtype == tensor.dtype and torch.equal(mine, tensor), f"{what}: {name}::{key}"


def test_every_rank_restores_its_own_lanes_shard_bit_for_bit_from_each_source(runs: dict[str, Any]) -> None:
    first, second = runs["first"], runs["second"]
    assert [r["tp_index"] for r in second] == [0, 1, 0, 1]
    for rank, result in enumerate(second):
        for source, expected in (
            ("shadows", SOURCE_SHADOW_MEMORY),
            ("merged_only", SOURCE_MERGED),
            ("lane_snapshots_only", SOURCE_SNAPSHOT),
        ):
            point = result[f"point/{source}"]
            assert point.restored_iteration == STOP_AFTER - 1, (rank, source, point)
            assert point.source == expected, (rank, source, point)
            assert [lane.tp_index for lane in point.lanes] == [0, 1]
            assert [lane.job_id for lane in point.lanes] == [61, 62]
            _assert_bits_equal(
                result[f"restored/{source}"], first[rank]["final"], f"rank {rank} from {source}"
            )
        point = result["point"]
        assert point.iteration == STOP_AFTER and point.lost_iterations == 0, point
        assert {lane.source for lane in point.lanes} == {SOURCE_SHADOW_MEMORY}
    # the lanes hold different TP shards: lane 1's restore is not lane 0's
    qkv = "layers.0.attn.qkv.weight"
    assert not torch.equal(
        second[0]["restored/shadows"]["params"][qkv], second[1]["restored/shadows"]["params"][qkv]
    )


def test_lanes_an_iteration_apart_agree_on_the_older_one_read_from_each_lanes_snapshots(
    runs: dict[str, Any],
) -> None:
    main_dir = runs["tmp"] / "main"
    for rank, result in enumerate(runs["second"]):
        point = result["point/lanes_apart"]
        assert point.restored_iteration == STOP_AFTER - 2, (rank, point)  # lane 1 has nothing newer
        assert [(lane.iteration, lane.source) for lane in point.lanes] == [
            (STOP_AFTER - 2, SOURCE_SNAPSHOT)
        ] * 2
        t = result["tp_index"]
        on_disk = SnapshotDirectory(main_dir / f"lane{t}", STOP_AFTER - 2).latest()
        restored = result["restored/lanes_apart"]
        for name, value in on_disk.parameters.items():
            assert torch.equal(restored["params"][name], value), (rank, name)
            for key, tensor in on_disk.optimizer_state[name].items():
                assert torch.equal(restored["state"][name][key], torch.as_tensor(tensor)), (rank, name, key)


def test_the_resumed_job_ends_bit_identical_to_an_uninterrupted_one(runs: dict[str, Any]) -> None:
    for rank, (resumed, reference) in enumerate(zip(runs["second"], runs["reference"], strict=True)):
        assert resumed["certified"] and reference["certified"]
        _assert_bits_equal(resumed["final"], reference["final"], f"rank {rank} after iteration {STEPS - 1}")


def test_bad_lane_input_is_refused_on_every_rank_with_the_cause(runs: dict[str, Any]) -> None:
    for result in runs["second"]:
        message = result["refused/snapshot_dir_without_tp_index"]
        assert message is not None and "{tp_index}" in message and "lane 0" in message and "lane 1" in message
        empty = result["refused/a_lane_without_state"]
        assert empty is not None and "lane(s) [1] hold no state while the others do" in empty, empty
        assert f"lane 0 (job 61): iteration {STOP_AFTER - 1} from snapshot" in empty, empty
        wrong = result["refused/wrong_group"]
        assert "its lane is the DP group of TP index" in wrong, wrong


def test_a_tp_degree_below_one_or_without_a_process_group_is_refused() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    with pytest.raises(ResumeError, match="at least 1"):
        resume(model, optimizer, tp_degree=0)
    with pytest.raises(ResumeError, match="needs the default process group"):
        resume(model, optimizer, tp_degree=2)
