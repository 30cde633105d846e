"""A job whose Stateful object goes bad (--option enable|unserializable|too-large), or whose param group
holds a value that cannot travel (--option group): the error names it."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from gallery_run import setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hosts

BAD_FROM = 3


class Sampler:
    """Stateful; from iteration BAD_FROM on (or always with --option enable) its state cannot travel."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        if self.mode == "enable" or self.position >= BAD_FROM:
            if self.mode == "too-large":
                return {"position": self.position, "cache": torch.zeros(5 << 20)}  # 20 MiB
            return {"position": self.position, "rng": torch.Generator()}
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


args = setup(__doc__)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = DDP(nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if args.option == "group":
    optimizer.param_groups[0]["frozen_layers"] = {"head", "body"}  # a set: not JSON-like
sampler = Sampler("fine" if args.option == "group" else args.option)
try:
    agent = hosts.enable_checkmate(model, optimizer, stateful={"loader": sampler})
    for iteration in range(args.iterations):
        g = torch.Generator().manual_seed(1000 * iteration + rank)
        sampler.position += 1
        loss = model(torch.randn(4, 8, generator=g)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    agent.wait_certified(args.iterations - 1, timeout=30)
    agent.close()
except ValueError as exc:  # CheckmateConfigError at enable, JobStateError later: both name the object
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.err").write_text(f"{type(exc).__name__}: {exc}")
    if args.option not in ("enable", "group"):
        time.sleep(3600)  # the process keeps running after the error (the test kills the job)
os._exit(0)
