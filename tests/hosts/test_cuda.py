"""CUDA tensors through the host agent (copied through host memory): skipped without a GPU.

Run on a GPU machine with ``.venv/bin/pytest tests/hosts/test_cuda.py``. Two ranks share GPU 0.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch

from checkmate.control import Commit
from hosts.ring_allreduce import RingAllReduce
from hosts.ring_config import ReduceOp, RingConfig, reference_allreduce
from hosts.transport import Transport, TransportConfig
from tests.hosts.fake_shadow import FakeShadow
from tests.hosts.harness import run_ranks, worker_addr
from tests.hosts.test_ddp import Net

pytestmark = pytest.mark.cuda

JOB = 11


def _ring_on_cuda(rank: int, world: int, n: int) -> dict[str, torch.Tensor]:
    transport = Transport(TransportConfig(bind=worker_addr(rank), peer_timeout=10.0))
    ring = RingAllReduce(
        transport, RingConfig(job_id=JOB, rank=rank, workers=tuple(worker_addr(r) for r in range(world)))
    )
    try:
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank)).to("cuda:0")
        before = x.clone()
        result = ring.allreduce(0, 0, x, ReduceOp.SUM)
        unchanged = torch.equal(x, before)
        return {"result": result.cpu(), "input": x.cpu(), "unchanged": torch.tensor(unchanged)}
    finally:
        ring.close()
        transport.close()


def test_ring_allreduce_of_cuda_tensors_is_bit_exact() -> None:
    n = 100_003
    results = run_ranks(_ring_on_cuda, 2, n, timeout=120)
    expected = reference_allreduce([r["input"] for r in results], ReduceOp.SUM)
    for r in results:
        assert bool(r["unchanged"]), "the all-reduce modified its CUDA input"
        assert torch.equal(r["result"].view(torch.int32), expected.view(torch.int32))


def _train_cuda(rank: int, world: int, store: str, steps: int, env: dict[str, str]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts

    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    for checkmate in (False, True):
        torch.manual_seed(0)
        ddp = DDP(Net().to("cuda:0"), bucket_cap_mb=0.004)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        agent = hosts.enable_checkmate(ddp, opt) if checkmate else None
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            x = torch.randn(8, 16, generator=g).to("cuda:0")
            y = torch.randn(8, 4, generator=g).to("cuda:0")
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        params = {n: p.detach().cpu().clone() for n, p in ddp.module.named_parameters()}
        devices = {str(p.device) for p in ddp.module.parameters()} | {
            str(p.grad.device) for p in ddp.module.parameters() if p.grad is not None
        }
        out["ours" if checkmate else "baseline"] = {"params": params, "devices": devices}
        if agent is not None:
            out["certified"] = agent.wait_certified(steps - 1, timeout=30.0)
            agent.close()
        dist.barrier()
    dist.destroy_process_group()
    return out


def test_ddp_on_cuda_with_the_hook_matches_gloo_and_reports_to_the_shadow() -> None:
    steps = 3
    shadow = FakeShadow(("127.0.0.31", 0))
    env = {"CHECKMATE_JOB_ID": "12", "CHECKMATE_SHADOWS": f"shadow0=127.0.0.31:{shadow.address[1]}"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            r0, r1 = run_ranks(_train_cuda, 2, f"{tmp}/store", steps, env, timeout=180)
    finally:
        shadow.close()
    assert r0["ours"]["devices"] == {"cuda:0"}, "parameters or gradients left the GPU"
    for name, value in r0["ours"]["params"].items():
        assert torch.equal(value, r1["ours"]["params"][name]), f"ranks diverged at {name}"
        assert torch.equal(value, r0["baseline"]["params"][name]), f"differs from DDP over gloo at {name}"
    assert r0["certified"]
    assert [m.iteration for m in shadow.messages if isinstance(m, Commit)] == list(range(steps))
