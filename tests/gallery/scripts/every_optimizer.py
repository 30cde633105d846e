"""One torch.optim optimizer (--option NAME) with non-default options, on a small MLP."""

from __future__ import annotations

import torch
from gallery_run import finish, maybe_hang, setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hosts

OPTIONS = {
    "SGD": {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-3, "maximize": False},
    "Adam": {"lr": 1e-2, "amsgrad": True, "weight_decay": 1e-3},
    "AdamW": {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1, "maximize": True},
    "Adamax": {"lr": 1e-2, "weight_decay": 1e-3},
    "NAdam": {"lr": 1e-2, "momentum_decay": 3e-3, "decoupled_weight_decay": True, "weight_decay": 1e-2},
    "RAdam": {"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 1e-2},
    "RMSprop": {"lr": 1e-3, "centered": True, "momentum": 0.5, "weight_decay": 1e-3},
    "Adagrad": {"lr": 1e-2, "lr_decay": 1e-3, "initial_accumulator_value": 0.1},
    "Adadelta": {"lr": 1.0, "rho": 0.8, "weight_decay": 1e-3},
    "ASGD": {"lr": 1e-2, "t0": 2.0, "weight_decay": 1e-3},
    "Rprop": {"lr": 1e-2, "etas": (0.4, 1.3), "step_sizes": (1e-5, 1.0)},
}

args = setup(__doc__)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
optimizer = getattr(torch.optim, args.option)(model.parameters(), **OPTIONS[args.option])

point = hosts.resume(model, optimizer)
agent = hosts.enable_checkmate(model, optimizer, resume=point)
for iteration in range(point.iteration, args.iterations):
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    maybe_hang(args, iteration)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
finish(args, agent, model, optimizer)
