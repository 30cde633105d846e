"""FSDP2 (``fully_shard``) trains on the ``checkmate`` torch.distributed backend as it does on gloo.

Issue 32, item 2 starts here: sharded data parallelism runs over the project's transport with no
change to the script but the backend's name. Each rank runs the same FSDP2 job (every Linear and
the root sharded, AdamW, gradient clipping by the global norm) once on ``checkmate`` and once on
gloo; the full parameters and the optimizer's state after the last step must be bit-identical
with 2 ranks (both reduce a pair in the same order) and within the summation-order bound with 3.
The backend does not tag these collectives for the shadows yet (docs/backend.md).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.hosts.harness import run_ranks
from tests.listen_ports import listen_port

STEPS = 4


def _fsdp2_job(rank: int, world: int, backend: str, port: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import hosts.c10d_backend as backend_module

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ[backend_module.BIND_ENV] = f"127.0.0.{210 + rank}"
    dist.init_process_group(backend)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 7), torch.nn.Linear(7, 4)
        )
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
        for _ in range(STEPS):
            x = torch.randn(8, 16, generator=data)
            loss = model(x).square().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the global norm: an all-reduce
            optimizer.step()
            optimizer.zero_grad()
        out: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            out[name] = param.full_tensor().detach().clone()
            for key, value in optimizer.state[param].items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    out[f"{name}::{key}"] = value.full_tensor().detach().clone()
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_on_the_checkmate_backend_matches_gloo(world: int) -> None:
    ours = run_ranks(_fsdp2_job, world, "checkmate", listen_port(), timeout=120.0)
    theirs = run_ranks(_fsdp2_job, world, "gloo", listen_port(), timeout=120.0)
    assert set(ours[0]) == set(theirs[0]) and len(ours[0]) == 6 * 3  # 6 tensors: param, exp_avg, exp_avg_sq
    for rank in range(world):
        for name, tensor in ours[rank].items():
            assert torch.equal(tensor, ours[0][name]), f"rank {rank} holds another {name} than rank 0"
    differs = _differences(ours[0], theirs[0], exact=world == 2)
    assert not differs, differs


def _differences(ours: dict[str, Any], theirs: dict[str, Any], exact: bool) -> list[str]:
    """Names whose tensors differ: bit for bit, or beyond what another summation order explains."""
    out = []
    for name, mine in ours.items():
        other = theirs[name]
        if exact:
            if not torch.equal(mine, other):
                out.append(f"{name}: max diff {(mine - other).abs().max().item()}")
        elif not torch.allclose(mine, other, rtol=1e-4, atol=1e-6):
            out.append(f"{name}: max diff {(mine - other).abs().max().item()} (beyond rtol 1e-4)")
    return out
