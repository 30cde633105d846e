"""Train the tiny byte-level language model with FSDP2 on the ``checkmate`` backend; resumable.

An ordinary FSDP2 script: ``init_process_group("checkmate")`` (the one argument that puts the
job's collectives on Checkmate's transport, docs/backend.md) with the variables torchrun
sets, :class:`TinyLM` with every transformer block and the root sharded, AdamW with a cosine
learning rate set per iteration, gradient clipping and the batches of
:mod:`examples.train_lm` (a pure function of the iteration)::

    python -m examples.train_fsdp --iterations 20 --log logs/rank{rank}.jsonl

Checkmate adds one line, ``hosts.enable_checkmate_fsdp(model, optimizer)``: each reduce-scatter's
fully reduced shards are tagged, the switch copies them to the shadows, and rank 0 sends the
shadows the full state at the start and a commit per step (hosts/c10d_fsdp.py). With ``--resume``
(or ``CHECKMATE_RESUME=1``) every rank first calls ``hosts.resume_fsdp``: the shadows' latest
certified full state (or their snapshots, ``--snapshot-dir``) is loaded into this run's shards,
at any world size. ``--no-checkmate`` runs the same script on gloo without Checkmate.

The backend's UDP address: ``CHECKMATE_BACKEND_BIND`` when set, else this rank's entry of the
job file's ``worker_addresses`` (the address the switch's ring entries name), else the
backend's own default. The log has :mod:`examples.train_lm`'s format (``start``, ``restored``,
one record per iteration, ``done``); the digests are of the full (gathered) parameters and
optimizer state, by parameter name: what the shadows hold.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hosts
import hosts.c10d_backend  # noqa: F401  (registers the "checkmate" torch.distributed backend)
from checkmate.checkpoint.digest import optimizer_digest, parameters_digest
from examples.train_lm import JsonLog, add_run_options, config_from, start_record
from experiments.tiny_lm import TinyLM, TrainConfig, batch_for, cosine_lr, load_corpus, loss_of
from hosts.recovery import ResumePoint

logger = logging.getLogger("train_fsdp")

BIND_ENV = "CHECKMATE_BACKEND_BIND"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(parser)  # train_lm's, less DDP's --bucket-cap-mb
    parser.add_argument(
        "--no-checkmate", action="store_true", help="FSDP2 on gloo (for comparison; no shadows)"
    )
    return parser


def bind_from_job_file(rank: int, environ: dict[str, str]) -> str | None:
    """This rank's ``worker_addresses`` entry of ``CHECKMATE_JOB_FILE``, or None when there is none."""
    path = environ.get("CHECKMATE_JOB_FILE")
    if not path:
        return None
    try:
        addresses = json.loads(Path(path).read_text(encoding="utf-8")).get("worker_addresses") or []
    except (OSError, ValueError, AttributeError) as exc:
        raise SystemExit(f"cannot read the job file {path}: {exc}") from None
    if rank >= len(addresses):
        return None
    return str(addresses[rank])


def sharded_model(config: TrainConfig) -> torch.nn.Module:
    """TinyLM with every transformer block and then the root under ``fully_shard`` (same seed everywhere)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(config.seed)
    model = TinyLM(config.model)
    for block in model.blocks.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def _full(value: Any) -> Any:
    """A DTensor gathered into the full tensor (collective); anything else as it is."""
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else value


def full_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in model.named_parameters():
        yield name, _full(param.detach())


def full_optimizer_states(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, dict[str, Any]]:
    """The optimizer's state by parameter name, every sharded tensor gathered (collective: every rank)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(p)]: {key: _full(value) for key, value in state.items()}
        for p, state in optimizer.state.items()
        if id(p) in names
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("TRAIN_LOG_LEVEL", "WARNING"),
        format="%(asctime)s rank" + os.environ.get("RANK", "?") + " %(name)s %(levelname)s %(message)s",
    )
    config = config_from(args)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    if not args.no_checkmate and not os.environ.get(BIND_ENV):
        bind = bind_from_job_file(rank, dict(os.environ))
        if bind is not None:
            os.environ[BIND_ENV] = bind  # read once, by the backend's entry point (init_process_group)
    dist.init_process_group("gloo" if args.no_checkmate else "checkmate")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = JsonLog(Path(args.log.format(rank=rank)))
    try:
        corpus = load_corpus()
        model = sharded_model(config)
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cosine_lr(0, config.iterations, config.peak_lr, config.warmup),
            weight_decay=config.weight_decay,
        )
        point = ResumePoint(iteration=0)
        if args.resume and not args.no_checkmate:
            # Checkmate: the one call to resume (every rank; the shadows' memory, else the disk)
            point = hosts.resume_fsdp(
                model,
                optimizer,
                timeout=args.restore_timeout,
                snapshot_dir=str(args.snapshot_dir) if args.snapshot_dir else None,
            )
        start = point.iteration
        log.write(**start_record(point, rank, world))
        if point.restored:
            params = parameters_digest(full_parameters(model))
            states = optimizer_digest(full_optimizer_states(model, optimizer))
            log.write(
                event="restored",
                iteration=point.restored_iteration,
                params_sha256=params,
                optimizer_sha256=states,
            )
        agent = None
        if not args.no_checkmate:
            # Checkmate: the one added line (a resumed job keeps the job's iteration numbers)
            agent = hosts.enable_checkmate_fsdp(model, optimizer, resume=point)
        for iteration in range(start, config.iterations):
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(iteration, config.iterations, config.peak_lr, config.warmup)
            inputs, targets = batch_for(
                corpus, config.seed, iteration, rank, world, config.global_batch, config.model.context
            )
            loss = loss_of(model, inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_norm)
            optimizer.step()
            certified = None
            if agent is not None and agent.channel is not None:
                certified = agent.channel.certified_through()
            log.write(
                iteration=iteration,
                loss=round(float(loss.item()), 6),  # this rank's share (as train_lm logs it)
                lr=optimizer.param_groups[0]["lr"],
                time=time.time(),
                certified=certified,
            )
        if agent is not None:
            agent.close()
        params = parameters_digest(full_parameters(model))
        states = optimizer_digest(full_optimizer_states(model, optimizer))
        log.write(
            event="done",
            rank=rank,
            iteration=config.iterations - 1,
            params_sha256=params,
            optimizer_sha256=states,
            time=time.time(),
        )
        dist.destroy_process_group()
        return 0
    finally:
        log.close()


if __name__ == "__main__":
    raise SystemExit(main())
