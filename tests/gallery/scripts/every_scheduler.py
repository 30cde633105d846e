"""One torch.optim.lr_scheduler scheduler (--option NAME), or named param groups, on a small MLP.

Schedulers that add their own keys to the param groups (OneCycleLR: ``max_lr``,
``min_lr``, ``initial_lr``, ``base_momentum``/``max_momentum``; CyclicLR with
``cycle_momentum=True`` the same) and cycle the momentum or Adam's betas each
step; ReduceLROnPlateau stepped with a metric; SequentialLR and ChainedScheduler
composing others; and ``named-groups``: groups with a ``name`` and user keys of
every JSON-like kind, as training frameworks add them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from gallery_run import finish, maybe_hang, setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import lr_scheduler as sched

import hosts

Build = Callable[[list[dict[str, Any]]], tuple[torch.optim.Optimizer, Any]]


def _sgd(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-3)


def _adam(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return torch.optim.Adam(groups, lr=1e-2, weight_decay=1e-3)


def _with(
    make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer], scheduler: Callable[..., Any]
) -> Build:
    def build(groups: list[dict[str, Any]]) -> tuple[torch.optim.Optimizer, Any]:
        optimizer = make(groups)
        return optimizer, scheduler(optimizer)

    return build


def _sequential(optimizer: torch.optim.Optimizer) -> Any:
    warmup = sched.LinearLR(optimizer, start_factor=0.25, total_iters=3)
    decay = sched.ExponentialLR(optimizer, gamma=0.8)
    return sched.SequentialLR(optimizer, [warmup, decay], milestones=[3])


def _chained(optimizer: torch.optim.Optimizer) -> Any:
    return sched.ChainedScheduler(
        [sched.ConstantLR(optimizer, factor=0.5, total_iters=2), sched.ExponentialLR(optimizer, gamma=0.9)]
    )


OPTIONS: dict[str, Build] = {
    "LambdaLR": _with(_sgd, lambda o: sched.LambdaLR(o, lambda step: 1.0 / (1 + step))),
    "MultiplicativeLR": _with(_sgd, lambda o: sched.MultiplicativeLR(o, lambda step: 0.9)),
    "StepLR": _with(_sgd, lambda o: sched.StepLR(o, step_size=2, gamma=0.5)),
    "MultiStepLR": _with(_sgd, lambda o: sched.MultiStepLR(o, milestones=[2, 5], gamma=0.3)),
    "ConstantLR": _with(_sgd, lambda o: sched.ConstantLR(o, factor=0.3, total_iters=4)),
    "LinearLR": _with(_adam, lambda o: sched.LinearLR(o, start_factor=0.1, total_iters=5)),
    "ExponentialLR": _with(_adam, lambda o: sched.ExponentialLR(o, gamma=0.85)),
    "PolynomialLR": _with(_adam, lambda o: sched.PolynomialLR(o, total_iters=6, power=2.0)),
    "CosineAnnealingLR": _with(_adam, lambda o: sched.CosineAnnealingLR(o, T_max=5, eta_min=1e-4)),
    "CosineAnnealingWarmRestarts": _with(
        _sgd, lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2)
    ),
    "CyclicLR": _with(
        _sgd, lambda o: sched.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2, cycle_momentum=True)
    ),
    "OneCycleLR": _with(_sgd, lambda o: sched.OneCycleLR(o, max_lr=0.1, total_steps=12)),
    "OneCycleLR-Adam": _with(_adam, lambda o: sched.OneCycleLR(o, max_lr=0.05, total_steps=12)),
    "ReduceLROnPlateau": _with(_sgd, lambda o: sched.ReduceLROnPlateau(o, factor=0.5, patience=1)),
    "SequentialLR": _with(_sgd, _sequential),
    "ChainedScheduler": _with(_adam, _chained),
    "named-groups": _with(
        lambda groups: torch.optim.AdamW(groups, lr=1e-2), lambda o: sched.StepLR(o, step_size=3, gamma=0.5)
    ),
}
PLATEAU = [1.0, 0.8, 0.8, 0.8, 0.8, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7]
"""ReduceLROnPlateau's metric per iteration (the same on every rank): it plateaus twice."""

args = setup(__doc__)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
body, head = model.module[0], model.module[2]
if args.option == "named-groups":
    groups: list[dict[str, Any]] = [
        {"params": body.parameters(), "name": "body", "weight_decay": 0.1, "layer_scale": [1.0, 0.5]},
        {"params": head.parameters(), "name": "head", "lr": 3e-3, "tags": {"frozen": False, "depth": 2}},
    ]
else:
    groups = [{"params": body.parameters()}, {"params": head.parameters(), "lr": 0.02}]
optimizer, scheduler = OPTIONS[args.option](groups)
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
    if isinstance(scheduler, sched.ReduceLROnPlateau):
        scheduler.step(PLATEAU[iteration % len(PLATEAU)])
    else:
        scheduler.step()
finish(args, agent, model, optimizer, stateful)
