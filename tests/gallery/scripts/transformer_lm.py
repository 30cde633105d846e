"""A small Transformer language model: AdamW, warm-up (LambdaLR), clipping, a Stateful data cursor.

The data cursor is an ordinary object following PyTorch's Stateful convention
(state_dict/load_state_dict): the index of the next batch. Checkmate carries its
state with every iteration; a resumed job continues with exactly the batch an
uninterrupted one would have read.
"""

from __future__ import annotations

from typing import Any

import torch
from gallery_run import finish, maybe_hang, setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hosts

VOCAB, WIDTH, CONTEXT = 40, 32, 12


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        h = self.blocks(h, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.out(self.norm(h))


class DataCursor:
    """Where the data stream stands: the next batch's index (Stateful)."""

    def __init__(self) -> None:
        self.batch = 0

    def next_batch(self, rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(7919 * self.batch + rank)
        self.batch += 1
        return torch.randint(0, VOCAB, (4, CONTEXT + 1), generator=g)

    def state_dict(self) -> dict[str, Any]:
        return {"batch": self.batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch = int(state["batch"])


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


args = setup(__doc__)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = DDP(TinyTransformer())
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
cursor = DataCursor()
stateful = {"scheduler": scheduler, "loader": cursor}

point = hosts.resume(model, optimizer, stateful=stateful)
agent = hosts.enable_checkmate(model, optimizer, stateful=stateful, resume=point)
for iteration in range(point.iteration, args.iterations):
    tokens = cursor.next_batch(rank)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    maybe_hang(args, iteration)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    scheduler.step()
finish(args, agent, model, optimizer, stateful)
