"""DDP with the Checkmate hook: bit-identical to DDP over gloo, tags cover every bucket once, commits."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from checkmate.control import BucketLayout, Commit, Goodbye, JobStart
from checkmate.job import JobSpec
from tests.hosts.fake_shadow import FakeShadow
from tests.hosts.harness import run_ranks

MAX_NORM = 0.05


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _train(rank: int, world: int, store: str, kind: str, steps: int, checkmate: bool) -> dict[str, Any]:
    """An ordinary DDP loop; ``checkmate`` adds the one line."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts

    torch.manual_seed(0)
    ddp = DDP(Net(), bucket_cap_mb=0.004)  # several buckets; DDP rebuilds them after iteration 0
    if kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4
        )
    else:
        opt = torch.optim.Adam(
            [{"params": ddp.module.body.parameters()}, {"params": ddp.module.head.parameters(), "lr": 3e-3}],
            lr=1e-2,
        )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    agent = hosts.enable_checkmate(ddp, opt) if checkmate else None
    norms = []
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM))
        opt.step()
        sched.step()
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    out: dict[str, Any] = {"params": params, "norms": norms}
    if agent is not None:
        out["certified_in_time"] = agent.wait_certified(steps - 1, timeout=30.0)
        out["tags"] = list(agent.ring.tag_log)
        out["stats"] = agent.stats()
        out["commits"] = agent.commits
        agent.close()
    dist.barrier()
    return out


def _both(rank: int, world: int, store: str, kind: str, steps: int, env: dict[str, str]) -> dict[str, Any]:
    import torch.distributed as dist

    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    baseline = _train(rank, world, store, kind, steps, checkmate=False)
    ours = _train(rank, world, store, kind, steps, checkmate=True)
    dist.destroy_process_group()
    return {"baseline": baseline, "ours": ours}


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a
    )


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_ddp_hook_matches_gloo_bit_for_bit_and_reports_to_shadow(kind: str) -> None:
    steps = 4
    shadow = FakeShadow(("127.0.0.30", 0))
    env = {"CHECKMATE_JOB_ID": "9", "CHECKMATE_SHADOWS": f"shadow0=127.0.0.30:{shadow.address[1]}"}
    if kind == "adam":
        env["CHECKMATE_LOSS"] = "0.25"  # the transport recovers; results stay bit-exact
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results = run_ranks(_both, 2, f"{tmp}/store", kind, steps, env, timeout=90)
    finally:
        shadow.close()
    r0, r1 = results
    assert _bits_equal(r0["ours"]["params"], r1["ours"]["params"]), "ranks diverged"
    assert _bits_equal(r0["ours"]["params"], r0["baseline"]["params"]), "differs from DDP over gloo"

    # the control channel: state, layout(s), one commit per iteration with the right numbers
    messages = shadow.messages
    starts = [m for m in messages if isinstance(m, JobStart)]
    layouts = [m for m in messages if isinstance(m, BucketLayout)]
    commits = [m for m in messages if isinstance(m, Commit)]
    assert starts[0].start_iteration == 0 and starts[0].job_id == 9
    # every later layout (DDP's rebuild) comes right after a re-seed with the state before it
    for i, m in enumerate(messages):
        if isinstance(m, BucketLayout) and m.first_iteration > 0:
            before = messages[i - 1]
            assert isinstance(before, JobStart) and before.start_iteration == m.first_iteration
    torch.manual_seed(0)
    initial = dict(Net().named_parameters())
    assert [p.name for p in starts[0].parameters] == list(initial)
    for name, p in initial.items():
        assert torch.equal(starts[0].tensors[f"param/{name}"], p.detach())
    assert starts[0].optimizer["kind"] == ("SGD" if kind == "sgd" else "Adam")
    assert layouts and layouts[0].first_iteration == 0
    assert [c.iteration for c in commits] == list(range(steps))
    base_lrs = [0.1] if kind == "sgd" else [1e-2, 3e-3]
    for c in commits:
        assert c.learning_rates == pytest.approx([lr * 0.7**c.iteration for lr in base_lrs], rel=1e-12)
        expected = torch.clamp(MAX_NORM / (r0["ours"]["norms"][c.iteration] + 1e-6), max=1.0).item()
        assert c.clip_coefficient == expected and c.clip_coefficient < 1.0
        assert not c.skip_step
    assert r0["ours"]["certified_in_time"], "the shadow's Certified replies did not reach rank 0"
    assert r0["ours"]["stats"]["control"]["shadow0"].get("certified", 0) == steps

    # tags: per iteration, each element of each bucket (as the layout says) tagged exactly once
    sizes_by_iteration: dict[int, dict[int, int]] = {}
    for it in range(steps):
        layout = [m for m in layouts if m.first_iteration <= it][-1]
        sizes_by_iteration[it] = {b.bucket_id: b.num_elements for b in layout.buckets}
        assert sum(sizes_by_iteration[it].values()) == sum(p.numel() for p in initial.values())
    covered: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r in results:
        for t in r["ours"]["tags"]:
            covered.setdefault((t.iteration, t.bucket_id), []).append((t.element_offset, t.element_count))
    for it, sizes in sizes_by_iteration.items():
        for bucket, n in sizes.items():
            ranges = sorted(covered.pop((it, bucket)))
            position = 0
            for offset, count in ranges:
                assert offset == position
                position += count
            assert position == n
    assert not covered
    if kind == "adam":
        stats = [r["ours"]["stats"]["transport"] for r in results]
        assert sum(v for t in stats for k, v in t.items() if k.startswith("retransmit")) > 0, stats


def _shadow_comes_back_before_close(rank: int, world: int, store: str, port: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts

    env = {"CHECKMATE_JOB_ID": "13", "CHECKMATE_SHADOWS": f"shadow0=127.0.0.32:{port}"}
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    ddp = DDP(Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    agent = hosts.enable_checkmate(ddp, opt)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):  # the shadow is down the whole time: nothing can reach it
        loss = ddp(torch.randn(8, 16, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    shadow = FakeShadow(("127.0.0.32", port)) if rank == 0 else None  # it restarts before the job ends
    agent.close(timeout=10.0)
    if shadow is not None:
        shadow.close()
    final = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    dist.destroy_process_group()
    return {"final": final, "messages": shadow.messages if shadow is not None else []}


def test_a_shadow_that_rejoins_before_close_gets_the_final_state() -> None:
    with socket.socket() as probe:  # a free port, nobody listening during training
        probe.bind(("127.0.0.32", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        r0, _ = run_ranks(_shadow_comes_back_before_close, 2, f"{tmp}/store", port, timeout=90)
    starts = [m for m in r0["messages"] if isinstance(m, JobStart)]
    assert len(starts) == 1 and starts[0].start_iteration == 3, r0["messages"]
    for name, value in r0["final"].items():
        assert torch.equal(starts[0].tensors[f"param/{name}"], value), name
    assert isinstance(r0["messages"][-1], Goodbye)


def _peer_dies_mid_training(rank: int, world: int, store: str) -> str:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts

    env = {"CHECKMATE_JOB_ID": "14", "CHECKMATE_PEER_TIMEOUT": "2", "CHECKMATE_TIMEOUT": "8"}
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    ddp = DDP(Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    agent = hosts.enable_checkmate(ddp, opt)
    for step in range(3):
        if rank == 1 and step == 2:  # rank 1 goes silent: its agent stops answering
            agent.ring.close()
            agent.transport.close()
            time.sleep(10)
            return "silent"
        loss = ddp(torch.randn(8, 16)).square().mean()
        opt.zero_grad()
        try:
            loss.backward()
        except RuntimeError as exc:
            return str(exc)
        opt.step()
    return "no error"


def test_a_dead_peer_fails_backward_with_a_clear_error() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        error, _ = run_ranks(_peer_dies_mid_training, 2, f"{tmp}/store", timeout=60)
        took = time.monotonic() - started
    # Which clear error comes first depends on timing: the transport's dead-peer detection
    # (rank 0 still had datagrams unacknowledged) or the all-reduce's own deadline (it had not).
    assert (
        "PeerTimeoutError: job 14: peer rank 1 at 127.0.0.11:48879 is not responding" in error
        or "CollectiveTimeoutError: job 14 rank 0: all-reduce of bucket" in error
        and "from rank 1 at 127.0.0.11:48879" in error
    ), error
    assert "Unable to cast" not in error
    assert took < 40, f"backward took {took:.0f}s to fail; the timeouts are 2 s (peer) and 8 s (all-reduce)"


def _job_file(path: Path, shadow: str, address: tuple[str, int]) -> None:
    spec = JobSpec(job_id=15, workers=("h1", "h2"), shadows=(shadow,))
    document = {
        "job": spec.to_json(),
        "worker_addresses": ["127.0.0.10:48879", "127.0.0.11:48879"],
        "shadow_control": {shadow: f"{address[0]}:{address[1]}"},
    }
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(document))
    os.replace(temporary, path)  # as a launcher or controller would rewrite it


def _shadow_moves_mid_run(
    rank: int, world: int, store: str, job_file: str, new_address: tuple[str, int]
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts

    os.environ.update(
        CHECKMATE_JOB_FILE=job_file, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1"
    )
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    ddp = DDP(Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    agent = hosts.enable_checkmate(ddp, opt)
    g = torch.Generator().manual_seed(rank)
    for step in range(5):
        if rank == 0 and step == 2:  # `checkmate-ctl shadow move` + a new job file, mid-run
            _job_file(Path(job_file), "sb", new_address)
        loss = ddp(torch.randn(8, 16, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 2:
            after_step_2 = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    certified = agent.wait_certified(4, timeout=30.0) if rank == 0 else True
    agent.close()
    dist.destroy_process_group()
    return {"after_step_2": after_step_2, "certified": certified}


def test_rank0_follows_a_shadow_move_in_the_job_file_without_a_restart(tmp_path: Path) -> None:
    old, new = FakeShadow(("127.0.0.33", 0), "sa"), FakeShadow(("127.0.0.34", 0), "sb")
    job_file = tmp_path / "job.json"
    _job_file(job_file, "sa", old.address)
    try:
        r0, _ = run_ranks(
            _shadow_moves_mid_run, 2, str(tmp_path / "store"), str(job_file), new.address, timeout=90
        )
    finally:
        old.close()
        new.close()
    assert r0["certified"], f"the new shadow did not certify the last iteration: {new.messages[-3:]}"
    old_commits = [m.iteration for m in old.messages if isinstance(m, Commit)]
    assert old_commits == [0, 1, 2] and isinstance(old.messages[-1], Goodbye), old.messages
    starts = [m for m in new.messages if isinstance(m, JobStart)]
    assert [s.start_iteration for s in starts] == [3], new.messages
    assert starts[0].job is not None and starts[0].job["shadows"] == ["sb"]
    for name, value in r0["after_step_2"].items():
        assert torch.equal(starts[0].tensors[f"param/{name}"], value), name
    assert [m.iteration for m in new.messages if isinstance(m, Commit)] == [3, 4]
