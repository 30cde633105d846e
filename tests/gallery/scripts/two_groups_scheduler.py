"""Two parameter groups (own lr and weight decay), Adam with amsgrad, a warm-up + cosine scheduler."""

from __future__ import annotations

import torch
from gallery_run import finish, maybe_hang, setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hosts

args = setup(__doc__)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)))
body, head = model.module[0], model.module[2]
optimizer = torch.optim.Adam(
    [{"params": body.parameters(), "weight_decay": 1e-2}, {"params": head.parameters(), "lr": 3e-3}],
    lr=1e-2,
    amsgrad=True,
)
warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=3)
cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[3])
stateful = {"scheduler": scheduler}

point = hosts.resume(model, optimizer, stateful=stateful)
agent = hosts.enable_checkmate(model, optimizer, stateful=stateful, resume=point)
for iteration in range(point.iteration, args.iterations):
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    maybe_hang(args, iteration)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
finish(args, agent, model, optimizer, stateful)
