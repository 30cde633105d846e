"""Train the tiny transformer with tensor parallelism x DDP, plus the Checkmate lines (demo ``--tp``).

Ranks form a ``("dp", "tp")`` grid (rank = dp_index * TP + tp_index): torch tensor
parallelism (``ColwiseParallel`` / ``RowwiseParallel``, a vocabulary-parallel
embedding; :func:`checkmate.universal.tiny.build`) inside each TP group, DDP over
each TP index's DP group. With ``CHECKMATE_TP_DEGREE`` = TP every DP group is a
Checkmate lane of its own (job id ``CHECKMATE_JOB_ID + tp_index`` or the lane's job
file, ``{tp_index}`` in ``CHECKMATE_JOB_FILE``), whose shadows hold that TP shard::

    CHECKMATE_TP_DEGREE=2 python -m examples.train_tp --tp 2 --iterations 20 --log logs/rank{rank}.jsonl

Every rank starts from the same step-0 weights (:func:`checkmate.universal.runs.write_initial`)
and trains on the same global batches (:func:`checkmate.universal.tiny.batch`), its DP
index's rows. The log (``{rank}`` replaced) is :mod:`examples.train_lm`'s: a ``start``
record, one ``{"iteration", "loss", "time", "certified"}`` per iteration and a ``done``
record with the digests of this rank's TP-local parameters and optimizer state, its
``tp_index`` and the loss of the trained TP model on a fixed evaluation batch
(``eval_loss``). No resume: a TP job is restored from the merged lanes' checkpoint
(:func:`checkmate.universal.shadow_merge.merge_lane_snapshots`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import hosts
from checkmate import checkpoint as fmt
from checkmate.checkpoint.digest import optimizer_digest, parameters_digest
from checkmate.universal.layout import Layout
from checkmate.universal.load import load_module
from checkmate.universal.runs import write_initial
from checkmate.universal.tiny import EVAL_STEP, TinyConfig, batch, build
from examples.train_lm import JsonLog
from hosts.ddp_tp import localize_tensor_parallel
from hosts.recovery import optimizer_states_by_name

logger = logging.getLogger("train_tp")

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (divides WORLD_SIZE)")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--log", default="rank{rank}.jsonl")
    parser.add_argument("--no-checkmate", action="store_true", help="plain TP x DDP, no Checkmate")
    return parser


def eval_loss(model: torch.nn.Module, config: TinyConfig) -> float:
    with torch.no_grad():
        tokens = batch(config, EVAL_STEP)
        logits = model(tokens[:, :-1])
        return float(F.cross_entropy(logits.reshape(-1, config.vocab), tokens[:, 1:].reshape(-1)))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("TRAIN_LOG_LEVEL", "WARNING"),
        format="%(asctime)s rank" + os.environ.get("RANK", "?") + " %(name)s %(levelname)s %(message)s",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # rendezvous from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.tp < 1 or world % args.tp:
        print(f"train_tp: --tp {args.tp} does not divide the world size {world}", file=sys.stderr)
        return 2
    log = JsonLog(Path(args.log.format(rank=rank)))
    try:
        config = TinyConfig()
        layout = Layout(tp=args.tp, dp=world // args.tp)
        _, dp_index, tp_index = layout.coords(rank)
        model = build(config, layout, rank)
        with tempfile.TemporaryDirectory(prefix="train-tp-") as initial:  # the same step 0 everywhere
            load_module(fmt.CheckpointReader(write_initial(Path(initial), config)), model, None, layout, rank)
        dp_group = None
        for t in range(layout.tp):  # every rank creates every DP group, in the same order
            group = dist.new_group([d * layout.tp + t for d in range(layout.dp)])
            if t == tp_index:
                dp_group = group
        localize_tensor_parallel(model)  # DDP and Checkmate see TP-local parameters
        ddp = DistributedDataParallel(model, process_group=dp_group, bucket_cap_mb=0.01)
        optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr)
        log.write(
            event="start", rank=rank, world_size=world, pid=os.getpid(), start_iteration=0, time=time.time()
        )
        # Checkmate: the one added line (CHECKMATE_TP_DEGREE makes this DP group a lane)
        agent = None if args.no_checkmate else hosts.enable_checkmate(ddp, optimizer)
        rows = config.batch // layout.dp
        for iteration in range(args.iterations):
            tokens = batch(config, iteration)[dp_index * rows : (dp_index + 1) * rows]
            logits = ddp(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, config.vocab), tokens[:, 1:].reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            certified = agent.channel.certified_through() if agent is not None and agent.channel else None
            log.write(
                iteration=iteration,
                loss=round(float(loss.detach()), 6),
                time=time.time(),
                certified=certified,
            )
        if agent is not None:
            agent.wait_certified(args.iterations - 1, timeout=30.0)
            agent.close()
        final_eval = eval_loss(model, config)
        module = ddp.module
        log.write(
            event="done",
            rank=rank,
            tp_index=tp_index,
            job_id=agent.config.job_id if agent is not None else None,
            iteration=args.iterations - 1,
            params_sha256=parameters_digest(module.named_parameters()),
            optimizer_sha256=optimizer_digest(optimizer_states_by_name(module, optimizer)),
            eval_loss=final_eval,
            time=time.time(),
        )
        dist.destroy_process_group()
        return 0
    finally:
        log.close()


if __name__ == "__main__":
    sys.exit(main())
