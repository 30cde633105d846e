"""A job its shadows do not protect (--option refused: an optimizer the shadows cannot import;
--option silent: shadows that serve another job): every rank raises UnprotectedError, or with
CHECKMATE_UNPROTECTED=log trains to the end. Each rank writes rank{r}.err or rank{r}.done."""

from __future__ import annotations

import os

import torch
from gallery_run import setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from user_optimizer import SignSGD

import hosts

args = setup(__doc__)
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = DDP(nn.Linear(8, 2))
if args.option == "refused":
    optimizer: torch.optim.Optimizer = SignSGD(model.parameters(), lr=0.01)
else:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
args.out.mkdir(parents=True, exist_ok=True)
agent = hosts.enable_checkmate(model, optimizer)
iteration = 0
try:
    for iteration in range(args.iterations):
        g = torch.Generator().manual_seed(1000 * iteration + rank)
        loss = model(torch.randn(4, 8, generator=g)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    protection = agent.stats().get("protection")
    agent.close()  # collective: no rank leaves while another still needs its datagrams
    (args.out / f"rank{rank}.done").write_text(str(protection))
except hosts.UnprotectedError as exc:
    (args.out / f"rank{rank}.err").write_text(f"{iteration} {type(exc).__name__}: {exc}")
os._exit(0)
