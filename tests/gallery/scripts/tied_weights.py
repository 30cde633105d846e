"""A tiny language model whose output layer shares the embedding's weight (tied weights), Adam."""

from __future__ import annotations

import torch
from gallery_run import finish, maybe_hang, setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hosts


class Tied(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.out = nn.Linear(width, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


args = setup(__doc__)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = DDP(Tied())
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

point = hosts.resume(model, optimizer)
agent = hosts.enable_checkmate(model, optimizer, resume=point)
for iteration in range(point.iteration, args.iterations):
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    tokens = torch.randint(0, 32, (4, 9), generator=g)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
    maybe_hang(args, iteration)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
finish(args, agent, model, optimizer)
