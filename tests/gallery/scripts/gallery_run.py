"""Scaffolding shared by the gallery scripts: what a test needs from an ordinary DDP script.

Not part of any script's training logic: rendezvous from torchrun's variables,
``--iterations``/``--out``/``--hang-at``, a hang that lets the test kill the job in
the middle of an iteration, and a dump of the final state (parameters, buffers,
optimizer state, each stateful object's state) for bit-for-bit comparison.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def setup(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True, help="where rank{r}.pt is written at the end")
    parser.add_argument("--hang-at", type=int, default=None, help="hang after this iteration's forward pass")
    parser.add_argument("--option", default="", help="a script-specific choice (e.g. the optimizer)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun sets them
    return args


def maybe_hang(args: argparse.Namespace, iteration: int) -> None:
    """In the middle of iteration ``--hang-at`` wait to be killed (the test's SIGKILL is the failure)."""
    if args.hang_at is not None and iteration == args.hang_at:
        time.sleep(3600)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def finish(
    args: argparse.Namespace,
    agent: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stateful: Mapping[str, Any] | None = None,
) -> None:
    """Wait until every shadow certified the last iteration, dump this rank's state, close."""
    module = getattr(model, "module", model)
    certified = agent.wait_certified(args.iterations - 1, timeout=60.0)
    names = {id(p): n for n, p in module.named_parameters()}
    state = {
        "certified": certified,
        "start_iteration": agent.config.start_iteration,  # where hosts.resume said to continue
        "optimizer_names": [names[id(p)] for group in optimizer.param_groups for p in group["params"]],
        "buffer_names": [n for n, _ in module.named_buffers() if n in module.state_dict()],
        "divergences": list(getattr(agent, "divergences", [])),
        "model": {k: _plain(v) for k, v in module.state_dict().items()},
        "optimizer": _plain(optimizer.state_dict()),
        "stateful": {name: _plain(obj.state_dict()) for name, obj in (stateful or {}).items()},
    }
    agent.close()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(state, args.out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()
    os._exit(0)  # no interpreter teardown races with daemon threads
