"""Mixed precision: fp16 autocast, fp32 master weights, a GradScaler whose first steps overflow and skip."""

from __future__ import annotations

import torch
from gallery_run import finish, maybe_hang, setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hosts

args = setup(__doc__)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
# A scale so large that the first iterations' scaled gradients overflow: those steps are skipped.
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60, growth_interval=3)
stateful = {"scaler": scaler}

point = hosts.resume(model, optimizer, stateful=stateful)
agent = hosts.enable_checkmate(model, optimizer, stateful=stateful, resume=point)
for iteration in range(point.iteration, args.iterations):
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    maybe_hang(args, iteration)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
finish(args, agent, model, optimizer, stateful)
