"""A CNN with BatchNorm (running statistics are buffers), SGD with momentum and a StepLR scheduler."""

from __future__ import annotations

import torch
from gallery_run import finish, maybe_hang, setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hosts

args = setup(__doc__)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
net = nn.Sequential(
    nn.Conv2d(3, 8, 3, padding=1),
    nn.BatchNorm2d(8),
    nn.ReLU(),
    nn.Conv2d(8, 8, 3, padding=1),
    nn.BatchNorm2d(8, momentum=None),  # cumulative average: uses num_batches_tracked
    nn.ReLU(),
    nn.AdaptiveAvgPool2d(1),
    nn.Flatten(),
    nn.Linear(8, 5),
)
model = DDP(net)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
stateful = {"scheduler": scheduler}

point = hosts.resume(model, optimizer, stateful=stateful)
agent = hosts.enable_checkmate(model, optimizer, stateful=stateful, resume=point)
for iteration in range(point.iteration, args.iterations):
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    maybe_hang(args, iteration)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
finish(args, agent, model, optimizer, stateful)
