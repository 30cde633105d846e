"""A ZeRO-1 job (torch's ``ZeroRedundancyOptimizer``) is refused on every rank, naming what to use instead.

Its optimizer state is sharded across the ranks, so rank 0 could neither seed the shadows with the
full state nor fingerprint it: before this check, rank 0 failed inside torch at the job start and
rank 1 waited at the agent's barrier until the group timed out. Now every rank raises at
``enable_checkmate``, before any collective, and none hangs.
"""

from __future__ import annotations

import os
import tempfile

import torch

from tests.hosts.harness import run_ranks


def _zero_one(rank: int, world: int, store: str) -> str:
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts
    from checkmate.optimizers import OptimizerReplayError

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ddp = DDP(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)))
        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        try:
            hosts.enable_checkmate(ddp, optimizer)
        except OptimizerReplayError as exc:
            return str(exc)
        return "nothing raised"
    finally:
        dist.destroy_process_group()


def test_zero_redundancy_optimizer_is_refused_on_every_rank_without_hanging() -> None:
    store = f"{tempfile.mkdtemp(prefix='zero-')}/store"
    for message in run_ranks(_zero_one, 2, store, timeout=60):
        assert "ZeroRedundancyOptimizer (ZeRO-1) keeps each rank's share" in message, message
        assert "hosts.enable_checkmate_fsdp" in message and "directly under DDP" in message, message
