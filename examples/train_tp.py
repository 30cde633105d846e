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
(``eval_loss``).

Resumable, lane by lane: with ``--resume`` (or ``CHECKMATE_RESUME=1``, what the demo's
launcher sets on a restart) every rank first calls ``hosts.resume(ddp, optimizer)``, which
restores each rank's TP shard from its own lane's shadows (else its lane's snapshots,
``--snapshot-dir`` with ``{tp_index}``, else ``--merged-dir``, the lanes' merged universal
checkpoint), every lane at the same iteration (:mod:`hosts.recovery`); training goes on
from the iteration after it, with the batches of those iterations. The ``start`` record
says where the state came from, per lane, and how many finished iterations were lost
(measured by the shadows); a ``restored`` record holds the digests of the restored state::

    CHECKMATE_TP_DEGREE=2 CHECKMATE_RESUME=1 python -m examples.train_tp --tp 2 --iterations 20 \
        --snapshot-dir 'snapshots/lane{tp_index}' --log logs/rank{rank}.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
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
from examples.train_lm import RESUME_ENV, JsonLog
from hosts.ddp_tp import localize_tensor_parallel
from hosts.recovery import ResumePoint, optimizer_states_by_name

logger = logging.getLogger("train_tp")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (divides WORLD_SIZE)")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--log", default="rank{rank}.jsonl")
    parser.add_argument("--no-checkmate", action="store_true", help="plain TP x DDP, no Checkmate")
    parser.add_argument(
        "--resume",
        action="store_true",
        default=os.environ.get(RESUME_ENV, "") not in ("", "0"),
        help=f"restore each lane's latest certified state first (also {RESUME_ENV}=1)",
    )
    parser.add_argument(
        "--snapshot-dir",
        default=None,
        help="each lane's snapshots, with {tp_index} (fallback to the shadows)",
    )
    parser.add_argument(
        "--merged-dir", default=None, help="the lanes' merged universal checkpoint (last fallback)"
    )
    parser.add_argument("--restore-timeout", type=float, default=20.0, help="seconds to fetch the state")
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
        point = ResumePoint(iteration=0)
        if args.resume:
            # Checkmate: the one call to resume (every rank; each lane restores its own TP shard)
            point = hosts.resume(
                ddp,
                optimizer,
                snapshot_dir=args.snapshot_dir,
                merged_dir=args.merged_dir,
                timeout=args.restore_timeout,
                tp_degree=args.tp,
            )
        log.write(
            event="start",
            rank=rank,
            world_size=world,
            pid=os.getpid(),
            tp_index=tp_index,
            start_iteration=point.iteration,
            restored_from=point.restored_iteration,
            source=point.source if point.restored else None,
            detail=point.detail if point.restored else None,
            lost_iterations=point.lost_iterations if point.restored else None,
            lanes=[dataclasses.asdict(lane) for lane in point.lanes],
            time=time.time(),
        )
        if point.restored:
            module = ddp.module
            log.write(
                event="restored",
                iteration=point.restored_iteration,
                tp_index=tp_index,
                params_sha256=parameters_digest(module.named_parameters()),
                optimizer_sha256=optimizer_digest(optimizer_states_by_name(module, optimizer)),
            )
        # Checkmate: the one added line (CHECKMATE_TP_DEGREE makes this DP group a lane)
        agent = None if args.no_checkmate else hosts.enable_checkmate(ddp, optimizer, resume=point)
        rows = config.batch // layout.dp
        for iteration in range(point.iteration, args.iterations):
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
