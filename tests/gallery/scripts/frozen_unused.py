"""Frozen parameters and a branch unused in forward (find_unused_parameters=True), AdamW with weight decay."""

from __future__ import annotations

import torch
from gallery_run import finish, maybe_hang, setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hosts


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(16, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 4)  # in the optimizer, never in forward: its grad stays None
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.frozen(x))))


args = setup(__doc__)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = DDP(Net(), find_unused_parameters=True)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)

point = hosts.resume(model, optimizer)
agent = hosts.enable_checkmate(model, optimizer, resume=point)
for iteration in range(point.iteration, args.iterations):
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    maybe_hang(args, iteration)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
finish(args, agent, model, optimizer)
