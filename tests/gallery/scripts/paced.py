"""An MLP in several buckets trained as fast as it goes; rank 0 writes each iteration it starts to
<out>/progress, so a test can kill the job at any moment and know how far it got."""

from __future__ import annotations

import torch
from gallery_run import finish, maybe_hang, setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hosts

args = setup(__doc__)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)), bucket_cap_mb=0.02)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
point = hosts.resume(model, optimizer)
agent = hosts.enable_checkmate(model, optimizer, resume=point)
args.out.mkdir(parents=True, exist_ok=True)
progress = args.out / "progress"
for iteration in range(point.iteration, args.iterations):
    if rank == 0:
        progress.write_text(str(iteration))
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    loss = nn.functional.mse_loss(model(torch.randn(16, 64, generator=g)), torch.randn(16, 64, generator=g))
    maybe_hang(args, iteration)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
finish(args, agent, model, optimizer)
