"""A bfloat16 model: parameters, gradients and so DDP's gradient buckets are bf16; SGD with momentum."""

from __future__ import annotations

import torch
from gallery_run import finish, maybe_hang, setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hosts

args = setup(__doc__)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(torch.bfloat16))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

point = hosts.resume(model, optimizer)
agent = hosts.enable_checkmate(model, optimizer, resume=point)
for iteration in range(point.iteration, args.iterations):
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = nn.functional.mse_loss(model(x.bfloat16()).float(), y)
    maybe_hang(args, iteration)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
finish(args, agent, model, optimizer)
