"""An MLP trained with SGD (Nesterov momentum, weight decay) under DDP; Checkmate enabled and resumable."""

from __future__ import annotations

import torch
from gallery_run import finish, maybe_hang, setup
from torch.nn.parallel import DistributedDataParallel as DDP

import hosts

args = setup(__doc__)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)

point = hosts.resume(model, optimizer)
agent = hosts.enable_checkmate(model, optimizer, resume=point)
for iteration in range(point.iteration, args.iterations):
    g = torch.Generator().manual_seed(1000 * iteration + rank)  # the data: a function of the iteration
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    maybe_hang(args, iteration)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
finish(args, agent, model, optimizer)
