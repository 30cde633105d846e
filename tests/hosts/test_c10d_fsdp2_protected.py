"""An FSDP2 (``fully_shard``) job on the ``checkmate`` backend is protected: shadows follow it bit for bit.

Issue 32, item 2. Two ranks train a sharded model (three Linears, uneven rows so FSDP2 pads the
last shard, and the root sharded) on ``backend="checkmate"`` with
``hosts.c10d_fsdp.enable_checkmate_fsdp``; two real shadow nodes receive the tagged, fully
reduced shards (host replication: the owner of each shard sends the copy a switch would make)
and rank 0's commits and bucket layout (segments of parameters). After every iteration rank 0
sends the fingerprint of the *gathered* full state, which each shadow compares with its own
state (none may differ, every iteration is checked); after the run the shadows' parameters and
optimizer state equal the workers' gathered state bit for bit. A job whose rank 1 is killed
(SIGKILL) after an iteration is resumed from the shadows by new processes with other initial
weights (``resume_fsdp``), and ends bit-identical to the uninterrupted job.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from shadow.node import ShadowConfig, ShadowNode
from shadow.repair import RepairPolicy
from tests.hosts.harness import _CTX, _child, run_ranks
from tests.listen_ports import listen_port

JOB_ID = 41
STEPS = 5
NET = f"127.{os.getpid() % 200 + 20}.{(os.getpid() // 200 + 101) % 250}"
"""This test process's own loopback /24 (shadows .70/.71, workers .80+)."""


def _model(seed: int, mixed: str | None = None, reshard: bool = True) -> torch.nn.Module:
    """The test's sharded model; ``reshard=False`` keeps parameters gathered between forward and
    backward (``reshard_after_forward=False``: ZeRO-2's memory layout, the same reduce-scatters)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 7), torch.nn.Linear(7, 4)
    )
    # mixed precision as FSDP2 does it: bf16 compute and bf16 reduce-scatters, fp32 parameters and step
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(mixed))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype) if dtype is not None else None
    kwargs: dict[str, Any] = {"mp_policy": policy} if policy is not None else {}
    if not reshard:
        kwargs["reshard_after_forward"] = False
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _gathered(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The full parameters and optimizer state by name (collective: all-gathers)."""
    params, states = {}, {}
    for name, param in model.named_parameters():
        params[name] = param.full_tensor().detach().clone()  # type: ignore[attr-defined]  # a DTensor
        states[name] = {
            key: value.full_tensor().detach().clone() if hasattr(value, "full_tensor") else value.clone()
            for key, value in optimizer.state[param].items()
        }
    return {"params": params, "state": states}


def _job(rank: int, world: int, env: dict[str, str], port: int, scenario: dict[str, Any]) -> dict[str, Any]:
    import dataclasses
    import datetime

    import torch.distributed as dist

    from hosts.c10d_backend import CheckmateBackendOptions
    from hosts.c10d_fsdp import enable_checkmate_fsdp, resume_fsdp
    from hosts.ddp_config import CheckmateConfig
    from hosts.ddp_gradients import CheckmateStateError

    os.environ.update(
        env, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    options = CheckmateBackendOptions(bind=f"{NET}.{80 + rank}", peer_timeout=3.0)
    # A collective waits at most 30 s: a rank killed after it acknowledged everything rank 0 had
    # sent leaves rank 0 nothing unacknowledged, so no peer timeout fires, only this one (torch's
    # default is 30 minutes, far past the test's own limit; seen once under load)
    dist.init_process_group("checkmate", pg_options=options, timeout=datetime.timedelta(seconds=30))
    model = _model(scenario.get("seed", 0), scenario.get("mixed"), scenario.get("reshard", True))
    optimizer = _optimizer(scenario["optimizer"], model)
    point = resume_fsdp(model, optimizer, timeout=10.0) if scenario.get("resume") else None
    restored = _gathered(model, optimizer) if point is not None else None
    config = dataclasses.replace(CheckmateConfig.from_env(), keep_iterations=64)
    if "fingerprint_bytes" in scenario:  # fingerprints in turns: every rank gathers the turn's parameters
        config = dataclasses.replace(config, fingerprint_bytes=scenario["fingerprint_bytes"])
    agent = enable_checkmate_fsdp(model, optimizer, config, resume=point)
    first = point.iteration if point is not None else 0
    for step in range(first, STEPS):
        data = torch.Generator().manual_seed(
            1000 * rank + step
        )  # the same batches when an iteration is redone
        x = torch.randn(8, 16, generator=data)
        loss = model(x).float().square().mean()
        if scenario.get("expect_error"):
            try:
                loss.backward()
            except CheckmateStateError as exc:
                return {"error": str(exc)}
        loss.backward()
        if scenario.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
        if step == scenario.get("kill_after"):
            certified = agent.wait_certified(step, 30.0)  # rank 0; the others return True at once
            dist.barrier()
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            try:  # the next iteration's collectives fail: rank 1 is gone
                model(x).square().mean().backward()
            except Exception as exc:  # noqa: BLE001 - the failure is the point; report it
                return {"certified": certified, "error": str(exc)}
            return {"certified": certified, "error": None}
    certified = agent.wait_certified(STEPS - 1, 30.0)
    out = {
        **_gathered(model, optimizer),
        "certified": certified,
        "divergences": agent.divergences,
        "first": first,
        "restored": restored,
        "commits": [(c.iteration, c.clip_coefficient, c.gradient_scaling) for c in agent.commits],
        "tags": [(t.iteration, t.bucket_id, t.element_offset, t.element_count) for t in agent.ring.tag_log],
        "bucket_numels": [comm.numel for comm in agent.comms],
    }
    agent.close()
    dist.destroy_process_group()
    return out


def _shadows() -> list[ShadowNode]:
    from checkmate.wire import CHECKMATE_UDP_PORT

    return [
        ShadowNode(
            ShadowConfig(
                name=f"s{i}",
                control_bind=(f"{NET}.{70 + i}", 0),
                data_bind=(f"{NET}.{70 + i}", CHECKMATE_UDP_PORT),
                repair=RepairPolicy(grace=0.05, timeout=0.2),
            )
        ).start()
        for i in range(2)
    ]


def _env(nodes: list[ShadowNode]) -> dict[str, str]:
    return {
        "CHECKMATE_JOB_ID": str(JOB_ID),
        "CHECKMATE_REPLICATION": "host",
        "CHECKMATE_SHADOWS": ",".join(
            f"{n.name}={n.control_address[0]}:{n.control_address[1]}" for n in nodes
        ),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _assert_same_state(expected: dict[str, Any], params: dict[str, Any], states: dict[str, Any]) -> None:
    assert set(params) == set(expected["params"])
    for name, value in expected["params"].items():
        assert torch.equal(_bits(params[name]), _bits(value)), f"parameter {name} differs"
        want, got = expected["state"][name], states.get(name, {})
        assert set(got) == set(want), (name, set(got), set(want))
        for key, tensor in want.items():
            assert torch.equal(_bits(torch.as_tensor(got[key])), _bits(torch.as_tensor(tensor))), (
                f"{name}::{key}"
            )


def _shadow_state(nodes: list[ShadowNode]) -> tuple[dict[str, Any], dict[str, Any]]:
    params: dict[str, Any] = {}
    states: dict[str, Any] = {}
    for node in nodes:
        params.update(node.parameters())
        states.update(node.optimizer_states())
    return params, states


@pytest.mark.parametrize(
    "scenario",
    [
        {"optimizer": "sgd"},
        {"optimizer": "adamw", "clip": True},
        {"optimizer": "adamw", "world": 3},
        {"optimizer": "adamw", "mixed": "bf16"},
        {"optimizer": "adamw", "clip": True, "fingerprint_bytes": 600},
        {"optimizer": "adamw", "clip": True, "reshard": False},
    ],
    ids=[
        "sgd",
        "adamw-clipped",
        "adamw-3-ranks",
        "adamw-bf16-mixed-precision",
        "adamw-fingerprint-turns",
        "adamw-zero2-no-reshard-after-forward",
    ],
)
def test_shadows_hold_the_sharded_jobs_full_state_bit_for_bit(scenario: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    nodes = _shadows()
    try:
        results = run_ranks(_job, scenario.get("world", 2), _env(nodes), listen_port(), scenario, timeout=180)
        for node in nodes:
            assert node.wait_applied(STEPS - 1, 10.0), node.status()
        r0 = results[0]
        assert r0["certified"] and r0["divergences"] == []
        for result in results[1:]:
            _assert_same_state(r0, result["params"], result["state"])  # every rank gathers the same
        params, states = _shadow_state(nodes)
        _assert_same_state(r0, params, states)
        for node in nodes:
            status = node.status()
            assert status["divergences"] == 0 and status["fingerprints_checked"] >= STEPS, status
        _assert_tagged_once_on_the_hop_to_the_owner(results)
        if scenario.get("clip"):  # the clipping was recorded and replayed (not a no-op)
            assert all(c[1] is not None or c[2] for c in r0["commits"]), r0["commits"]
    finally:
        for node in nodes:
            node.close()


@pytest.mark.parametrize("world", [2, 3])
def test_the_bucket_layout_places_every_element_where_fsdp2s_chunk_cat_puts_it(world: int) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import foreach_reduce_scatter_copy_in

    from hosts.c10d_fsdp import _Shard, bucket_params

    shapes = {"a.weight": (33, 16), "a.bias": (33,), "b.weight": (7, 33), "c.weight": (4, 7), "d": (1,)}
    grads = {n: torch.randn(*shape) for n, shape in shapes.items()}
    padded = [(-(-shape[0] // world) * world, *shape[1:]) for shape in shapes.values()]
    # FSDP2 pads each gradient on dim 0 to a multiple of the world size before chunk_cat
    padded_grads = [
        torch.cat([g, g.new_zeros(p[0] - g.shape[0], *g.shape[1:])])
        for g, p in zip(grads.values(), padded, strict=True)
    ]
    numel, slices = bucket_params(
        [_Shard(n, grads[n].numel(), p.numel() // world) for n, p in zip(shapes, padded_grads, strict=True)],
        world,
    )
    flat = torch.empty(numel)
    foreach_reduce_scatter_copy_in(padded_grads, flat, world)
    rebuilt = {n: torch.full((g.numel(),), float("nan")) for n, g in grads.items()}
    for piece in slices:
        rebuilt[piece.name][piece.param_offset : piece.param_offset + piece.numel] = flat[
            piece.offset : piece.offset + piece.numel
        ]
    for name, grad in grads.items():
        assert torch.equal(rebuilt[name], grad.reshape(-1)), name
    # rank r's part of the input ([r*S, (r+1)*S)) holds only rank r's shards
    per_rank = numel // world
    for piece in slices:
        assert piece.offset // per_rank == (piece.offset + piece.numel - 1) // per_rank


def test_a_layout_whose_segments_do_not_tile_a_parameter_is_refused_and_segments_travel() -> None:
    from checkmate.control import BucketLayout, BucketSpec, ParamSlice, decode_message, encode_message
    from shadow.iteration_window import ParameterSlot, check_segments

    whole = [ParameterSlot("w", 0, 12, (3, 4))]
    check_segments(0, whole)
    check_segments(0, [ParameterSlot("w", 6, 6, (3, 4), 6), ParameterSlot("w", 20, 6, (3, 4), 0)])
    with pytest.raises(ValueError, match="do not tile"):
        check_segments(0, [ParameterSlot("w", 0, 6, (3, 4), 0), ParameterSlot("w", 8, 5, (3, 4), 7)])
    with pytest.raises(ValueError, match="cover 6 of its 12"):
        check_segments(0, [ParameterSlot("w", 0, 6, (3, 4), 0)])
    layout = BucketLayout(
        5, 0, [BucketSpec(0, "float32", 16, 0, (ParamSlice("w", 8, 6, 6), ParamSlice("v", 0, 4)))]
    )
    _, text = encode_message(layout)
    assert (
        bytes(text).count(b"param_offset") == 1
    )  # only the segment carries it: DDP's layouts read as before
    decoded = decode_message(text)
    assert decoded == layout, decoded


def _assert_tagged_once_on_the_hop_to_the_owner(results: list[dict[str, Any]]) -> None:
    """Every element of every bucket of every iteration tagged exactly once, by the rank before its owner."""
    world = len(results)
    numels = results[0]["bucket_numels"]
    covered: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for rank, result in enumerate(results):
        owner = (rank + 1) % world  # the tagged hop goes from rank to rank + 1, the shard's owner
        for iteration, bucket, offset, count in result["tags"]:
            per_rank = numels[bucket] // world
            assert owner * per_rank <= offset and offset + count <= (owner + 1) * per_rank, (
                rank,
                bucket,
                offset,
            )
            covered.setdefault((iteration, bucket), []).append((offset, count))
    assert set(covered) == {(i, b) for i in range(STEPS) for b in range(len(numels))}
    for (iteration, bucket), ranges in covered.items():
        position = 0
        for offset, count in sorted(ranges):
            assert offset == position, (iteration, bucket, sorted(ranges))
            position += count
        assert position == numels[bucket], (iteration, bucket)


def _run_allowing_a_killed_rank(env: dict[str, str], scenario: dict[str, Any]) -> dict[int, Any]:
    """Both ranks of :func:`_job`; a rank killed by SIGKILL reports nothing (the others' results only)."""
    out = _CTX.Queue()
    port = listen_port()
    procs = [_CTX.Process(target=_child, args=(_job, r, 2, (env, port, scenario), out)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < 1:
            rank, ok, value = out.get(timeout=120)
            assert ok, value
            results[rank] = pickle.loads(value)
    except queue.Empty:
        raise TimeoutError("rank 0 did not finish") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
    assert procs[1].exitcode == -signal.SIGKILL
    return results


def test_a_killed_rank_resumes_from_the_shadows_bit_identical_to_the_uninterrupted_job() -> None:
    torch.set_num_threads(1)
    scenario = {"optimizer": "adamw"}
    nodes = _shadows()
    try:
        env = _env(nodes)
        whole = run_ranks(_job, 2, env, listen_port(), scenario, timeout=120)[0]
        killed = _run_allowing_a_killed_rank(env, {**scenario, "kill_after": 1})
        assert killed[0]["certified"] and killed[0]["error"], killed
        resumed = run_ranks(_job, 2, env, listen_port(), {**scenario, "resume": True, "seed": 7}, timeout=120)
        r0 = resumed[0]
        assert r0["first"] == 2, r0["first"]  # iteration 1 certified: at most the killed iteration redone
        assert r0["certified"] and r0["divergences"] == []
        _assert_same_state(whole, r0["params"], r0["state"])
        params, states = _shadow_state(nodes)
        _assert_same_state(whole, params, states)
    finally:
        for node in nodes:
            node.close()


def test_a_job_killed_at_2_ranks_resumes_at_3_from_the_shadows_full_state() -> None:
    """Re-sharding: the certified full state loads into 3 ranks' shards, and the shadows follow on."""
    torch.set_num_threads(1)
    scenario = {"optimizer": "adamw"}
    nodes = _shadows()
    try:
        env = _env(nodes)
        killed = _run_allowing_a_killed_rank(env, {**scenario, "kill_after": 1})
        assert killed[0]["certified"], killed
        certified_params, certified_states = _shadow_state(nodes)
        resumed = run_ranks(_job, 3, env, listen_port(), {**scenario, "resume": True, "seed": 7}, timeout=180)
        r0 = resumed[0]
        assert r0["first"] == 2, r0["first"]
        _assert_same_state(
            r0["restored"], certified_params, certified_states
        )  # gathered from 3 ranks' shards
        assert r0["certified"] and r0["divergences"] == []
        params, states = _shadow_state(nodes)
        _assert_same_state(r0, params, states)
        for node in nodes:
            status = node.status()
            assert status["divergences"] == 0 and status["fingerprints_checked"] >= STEPS - 2, status
    finally:
        for node in nodes:
            node.close()


def _not_on_checkmate(rank: int, world: int, store: str) -> str:
    import torch.distributed as dist

    from hosts.c10d_fsdp import enable_checkmate_fsdp
    from hosts.ddp_config import CheckmateConfig, CheckmateConfigError

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = _model(0)
        config = CheckmateConfig(job_id=JOB_ID, rank=rank, world_size=world, bind=("127.0.0.1", 0))
        enable_checkmate_fsdp(model, _optimizer("sgd", model), config)
    except CheckmateConfigError as exc:
        return str(exc)
    finally:
        dist.destroy_process_group()
    return "accepted"


def test_what_the_shadows_cannot_replay_is_refused_naming_the_cause(tmp_path: Path) -> None:
    # FSDP2 reduces fp16 gradients with SUM and divides after the reduce-scatter: refused at the backward
    nodes = _shadows()
    try:
        scenario = {"optimizer": "sgd", "mixed": "fp16", "expect_error": True}
        results = run_ranks(_job, 2, _env(nodes), listen_port(), scenario, timeout=120)
        for result in results:
            assert "SUM and divides them afterwards" in result["error"], result
            assert "MixedPrecisionPolicy.reduce_dtype" in result["error"], result
    finally:
        for node in nodes:
            node.close()
    (message,) = run_ranks(_not_on_checkmate, 1, str(tmp_path / "store"), timeout=60)
    assert "needs the checkmate backend" in message and "backend is 'gloo'" in message, message
