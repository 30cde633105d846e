"""An ordinary PyTorch DDP training script, plus the Checkmate lines.

Launch it like any DDP script, with ``torchrun`` or with the variables
torchrun sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)::

    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 20

It trains a small MLP classifier on a synthetic but deterministic data set
(a fixed random "teacher" labels Gaussian inputs; the same seed gives the same
samples, shards and initial weights everywhere) with Adam and gradient
clipping, using a ``DistributedSampler`` and ``DistributedDataParallel`` over
gloo. Rank 0 prints the loss and step time and can save the final weights.

The Checkmate-specific lines end with ``# Checkmate`` (the import, the resume
call and the one line that enables it): delete them and this is plain DDP over
gloo, with bit-identical results for 2 workers. With them, gradients are all-reduced by Checkmate's host agent
(:func:`hosts.enable_checkmate`), configured from ``CHECKMATE_*`` variables
(see :class:`hosts.ddp.CheckmateConfig`). With ``--resume`` a restarted job first
restores the shadows' latest certified state (or the newest checkpoint in
``CHECKMATE_SNAPSHOT_DIR``) with :func:`hosts.resume` and continues with the
step after it; the data position is the step (a fixed number of batches per
epoch), so the loader skips to it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hosts  # Checkmate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    parser.add_argument("--samples", type=int, default=4096, help="size of the synthetic data set")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.1, help="DDP gradient bucket size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", type=Path, default=None, help="rank 0 saves the final state_dict here")
    parser.add_argument("--resume", action="store_true", help="restore the latest certified state first")
    return parser


def synthetic_dataset(samples: int, features: int, classes: int, seed: int) -> TensorDataset:
    """Gaussian inputs labelled by a fixed random two-layer teacher: a pure function of the seed."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator)
    teacher = torch.randn(features, 32, generator=generator), torch.randn(32, classes, generator=generator)
    labels = (torch.tanh(inputs @ teacher[0]) @ teacher[1]).argmax(dim=1)
    return TensorDataset(inputs, labels)


def make_model(features: int, hidden: int, classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # rendezvous from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()

    dataset = synthetic_dataset(args.samples, args.features, args.classes, args.seed)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(args.seed)  # identical initial weights on every rank (DDP also broadcasts them)
    model = DistributedDataParallel(
        make_model(args.features, args.hidden, args.classes), bucket_cap_mb=args.bucket_cap_mb
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    step = 0
    point = hosts.resume(model, optimizer) if args.resume else None  # Checkmate
    hosts.enable_checkmate(model, optimizer, resume=point)  # Checkmate
    step = point.iteration if point is not None else step  # Checkmate
    epoch, skip = divmod(step, len(loader))
    first, started = step, time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for index, (inputs, labels) in enumerate(loader):
            if index < skip:
                continue  # batches of this epoch the restored state already trained on
            loss = nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
            optimizer.step()
            step += 1
            if rank == 0:
                elapsed = time.perf_counter() - started
                rate = 1000 * elapsed / (step - first)
                print(f"step {step:4d}  loss {loss.item():.4f}  {rate:.1f} ms/step", flush=True)
            if step == args.steps:
                break
        epoch, skip = epoch + 1, 0

    dist.barrier()  # every rank has finished its last step before rank 0 saves and anyone exits
    if rank == 0 and args.save is not None:
        torch.save(model.module.state_dict(), args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
