"""An MLP with nn.Dropout: every iteration draws from torch's generator; hosts.RandomState saves it.

Every rank is seeded identically (torch, NumPy, Python) (the dropout masks are the same on both ranks; each
rank's data comes from its own generator seeded by (batch, rank)), so rank 0's
generator state is every rank's. ``--option``:

* ``""``: ``stateful={"rng": hosts.RandomState()}`` — a resumed job draws exactly the
  masks an uninterrupted one would have;
* ``no-rng``: no RandomState (rank 0 warns that the generator is not checkpointed;
  logging goes to stdout, which the test captures);
* ``per-rank``: each rank seeded with its rank — enable_checkmate refuses it; the
  refusal's message is written to ``--out``/refused{rank}.txt.
"""

from __future__ import annotations

import logging
import os
import random
import sys

import numpy
import torch
import torch.distributed as dist
from gallery_run import finish, maybe_hang, setup
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hosts
from hosts.ddp_config import CheckmateConfigError

args = setup(__doc__)
rank = dist.get_rank()
logging.basicConfig(stream=sys.stdout, level=logging.WARNING)
torch.manual_seed(rank if args.option == "per-rank" else 0)
numpy.random.seed(0)  # RandomState saves these too: seeded alike, like torch's
random.seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
stateful = {} if args.option == "no-rng" else {"rng": hosts.RandomState()}

point = hosts.resume(model, optimizer, stateful=stateful)
try:
    agent = hosts.enable_checkmate(model, optimizer, stateful=stateful, resume=point)
except CheckmateConfigError as exc:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"refused{rank}.txt").write_text(str(exc))
    dist.destroy_process_group()
    os._exit(0)
for iteration in range(point.iteration, args.iterations):
    g = torch.Generator().manual_seed(7919 * iteration + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    maybe_hang(args, iteration)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
finish(args, agent, model, optimizer, stateful)
