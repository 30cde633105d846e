"""Gradient accumulation: three micro-batches per step, the first two under DDP's no_sync()."""

from __future__ import annotations

import torch
from gallery_run import finish, maybe_hang, setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hosts

MICRO = 3

args = setup(__doc__)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)

point = hosts.resume(model, optimizer)
agent = hosts.enable_checkmate(model, optimizer, resume=point)
for iteration in range(point.iteration, args.iterations):
    optimizer.zero_grad()
    for micro in range(MICRO):
        g = torch.Generator().manual_seed(1000 * iteration + 10 * micro + rank)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
        if micro < MICRO - 1:
            with model.no_sync():
                (nn.functional.mse_loss(model(x), y) / MICRO).backward()
        else:
            loss = nn.functional.mse_loss(model(x), y) / MICRO
            maybe_hang(args, iteration)
            loss.backward()
    optimizer.step()
finish(args, agent, model, optimizer)
