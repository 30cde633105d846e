"""Train the tiny byte-level language model with DDP, plus the one Checkmate line; resumable.

An ordinary DDP script: gloo rendezvous from the variables torchrun sets
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), :class:`TinyLM`,
AdamW with a cosine learning rate set per iteration, gradient clipping, and
deterministic batches (:func:`batch_for`: a pure function of the iteration,
so the iteration is the whole data position)::

    python -m examples.train_lm --iterations 100 --log logs/rank{rank}.jsonl

Checkmate adds one line (``hosts.enable_checkmate``, configured from
``CHECKMATE_*`` variables, see :class:`hosts.ddp.CheckmateConfig`). With
``--resume`` (or ``CHECKMATE_RESUME=1``) every rank first calls ``hosts.resume``:
the latest certified state — from the shadows' memory, or when they do not
answer from their snapshot directory (``--snapshot-dir``) — is loaded on every
rank and training continues at the certified iteration + 1 with that
iteration's batches (:mod:`hosts.recovery`). The batch cursor (the index of the
next batch) is the data position every iteration tells the shadows
(``agent.set_data_position``); a restore that carries it resumes there, one
without it at the restored iteration + 1 (the same here).

The log (``--log``, ``{rank}`` is replaced; appended to, so a restarted job
adds to it) holds JSON lines: ``{"event": "start", ...}`` per start, one
``{"iteration", "loss", "lr", "time", "certified"}`` per iteration
(``certified``: rank 0's view of the last iteration every shadow applied),
and ``{"event": "done", "params_sha256", "optimizer_sha256", ...}`` at the end (with
``agent_stats``, the Checkmate agent's counters of the run, when it ran on Checkmate).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import hosts
from checkmate import nfs
from checkmate.checkpoint.digest import optimizer_digest, parameters_digest
from experiments.tiny_lm import ModelConfig, TinyLM, TrainConfig, batch_for, cosine_lr, load_corpus, loss_of
from hosts.recovery import ResumePoint, optimizer_states_by_name

logger = logging.getLogger("train_lm")

RESUME_ENV = "CHECKMATE_RESUME"


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options every TinyLM training script here takes (train_lm, train_fsdp): the schedule,
    the model's size, the log and how to resume."""
    defaults = TrainConfig()
    parser.add_argument("--iterations", type=int, default=defaults.iterations, help="total iterations")
    parser.add_argument(
        "--global-batch", type=int, default=defaults.global_batch, help="samples per iteration"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--lr", type=float, default=defaults.peak_lr, help="peak learning rate")
    parser.add_argument("--max-norm", type=float, default=defaults.max_norm, help="gradient clipping norm")
    parser.add_argument("--width", type=int, default=defaults.model.width)
    parser.add_argument("--layers", type=int, default=defaults.model.layers)
    parser.add_argument("--heads", type=int, default=defaults.model.heads)
    parser.add_argument("--context", type=int, default=defaults.model.context)
    parser.add_argument("--log", type=str, required=True, help="JSON-lines log; {rank} is replaced")
    parser.add_argument(
        "--resume",
        action="store_true",
        default=os.environ.get(RESUME_ENV, "") not in ("", "0"),
        help=f"restore the latest certified state first (also {RESUME_ENV}=1)",
    )
    parser.add_argument(
        "--snapshot-dir",
        type=nfs.location_argument,
        default=None,
        help="the shadows' snapshots (fallback): a directory or nfs://SERVER/EXPORT/PATH",
    )
    parser.add_argument("--restore-timeout", type=float, default=20.0, help="seconds to fetch the state")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(parser)
    parser.add_argument("--bucket-cap-mb", type=float, default=TrainConfig().bucket_cap_mb)
    parser.add_argument(
        "--no-checkmate", action="store_true", help="plain DDP over gloo (for comparison; no shadows)"
    )
    parser.add_argument(
        "--log-digests",
        action="store_true",
        help="rank 0 adds params_sha256 to every iteration's record (to compare states across runs)",
    )
    add_checkpoint_options(parser)
    return parser


# ---- baseline checkpointing (what users do today; experiments/bench/cli.py compares it) ------------
CHECKPOINT_KINDS = ("none", "torch-save", "checkfreq", "dcp-async", "dcp-process")


def add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("baseline checkpointing (for benchmarks; independent of Checkmate)")
    group.add_argument(
        "--checkpoint",
        choices=CHECKPOINT_KINDS,
        default="none",
        help="torch-save: rank 0 torch.save()s model + optimizer state dicts to a temporary file, "
        "fsyncs and renames it; dcp-async: every rank calls torch.distributed.checkpoint.async_save "
        "on a separate gloo group, after waiting for the previous save; checkfreq: rank 0 copies the state "
        "to CPU memory (CheckFreq's snapshot) and a background thread persists it like torch-save, the "
        "next snapshot waiting for the previous persist; dcp-process: dcp-async with "
        "AsyncCheckpointerType.PROCESS and use_collectives=False",
    )
    group.add_argument(
        "--checkpoint-every", type=int, default=1, metavar="K", help="after every K-th iteration"
    )
    group.add_argument(
        "--checkpoint-dir",
        type=nfs.location_argument,
        default=None,
        help="where checkpoints are written: a directory, or nfs://SERVER/EXPORT/PATH (an NFS export "
        "written through checkmate.nfs, the userspace client: this machine's kernel has no NFS client)",
    )


class BaselineCheckpointer:
    """Checkpoints the training state after every K-th optimizer step, the usual ways.

    Logs ``{"event": "checkpoint", "iteration", "started", "durable"}`` per finished
    checkpoint (``durable``: when it was complete on disk; for dcp-async when its
    future completed, reported at the next step or at :meth:`close`).
    """

    def __init__(
        self,
        kind: str,
        every: int,
        directory: Path | str | None,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        rank: int,
        log: JsonLog,
    ) -> None:
        if kind != "none" and directory is None:
            raise SystemExit(f"--checkpoint {kind} needs --checkpoint-dir")
        if every < 1:
            raise SystemExit(f"--checkpoint-every must be >= 1, got {every}")
        self.kind, self.every, self.rank, self.log = kind, every, rank, log
        self.module, self.optimizer = module, optimizer
        self.directory: Path | str = directory or Path(".")
        self._nfs: Any = None  # checkmate.nfs.NFSClient when the directory is an nfs:// URL
        self._future: Any = None
        self._done: list[tuple[int, float, float]] = []
        self._saves = 0
        self._group: Any = None
        if kind != "none" and isinstance(self.directory, str):
            from checkmate.nfs_fsspec import register

            register()  # DCP's FsspecWriter resolves nfs:// URLs
            if rank == 0 or kind in ("dcp-async", "dcp-process"):
                self._nfs, path = nfs.NFSClient.from_url(self.directory)
                self._nfs.makedirs(path)
        elif kind != "none":
            Path(self.directory).mkdir(parents=True, exist_ok=True)
        if kind in ("dcp-async", "dcp-process"):
            self._group = dist.new_group(backend="gloo")  # async saves stay off the training group
        self._persist: threading.Thread | None = None

    def after_step(self, iteration: int) -> None:
        self._report()
        if self.kind == "none" or (iteration + 1) % self.every:
            return
        started = time.time()
        if self.kind == "torch-save":
            if self.rank == 0:
                state = {
                    "iteration": iteration,
                    "model": self.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                }
                self._write(state, iteration, started)  # synchronously
        elif self.kind == "checkfreq":
            if self.rank == 0:
                self._join_persist()  # CheckFreq: a snapshot waits for the previous persist
                snapshot = {
                    "iteration": iteration,
                    "model": _cloned(self.module.state_dict()),
                    "optimizer": _cloned(self.optimizer.state_dict()),
                }
                self._persist = threading.Thread(
                    target=self._write,
                    args=(snapshot, iteration, started),
                    name="checkfreq-persist",
                    daemon=True,
                )
                self._persist.start()
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            if self._future is not None:
                self._future.result()  # the documented pattern: one save in flight at a time
            model_state, optimizer_state = get_state_dict(self.module, self.optimizer)
            slot = f"{self.directory}/dcp-{self._saves % 2}"  # the other slot holds the last complete one
            self._saves += 1
            options: dict[str, Any] = {}
            if self.kind == "dcp-process":
                from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

                options = {"async_checkpointer_type": AsyncCheckpointerType.PROCESS, "use_collectives": False}
            if self._nfs is not None:
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

                # durable when each file closes (checkmate.nfs); sync_files would os.sync() this machine
                options["storage_writer"] = FsspecWriter(slot, sync_files=False)
            response = dcp.async_save(
                {"model": model_state, "optimizer": optimizer_state, "iteration": iteration},
                checkpoint_id=slot,
                process_group=self._group,
                **options,
            )
            future: Any = getattr(response, "upload_completion", response)
            done = self._done
            future.add_done_callback(lambda _f: done.append((iteration, started, time.time())))
            self._future = future

    def _report(self) -> None:
        while self._done:
            iteration, started, durable = self._done.pop(0)
            self.log.write(
                event="checkpoint", kind=self.kind, iteration=iteration, started=started, durable=durable
            )

    def _write(self, state: dict[str, Any], iteration: int, started: float) -> None:
        """Write a checkpoint: temporary file, fsync, rename (torch-save inline, checkfreq in its thread)."""
        if self._nfs is not None:
            path = f"{nfs.NFSURL.parse(str(self.directory)).path.rstrip('/')}/checkpoint.pt"
            nfs.write_atomically(self._nfs, path, lambda stream: torch.save(state, stream))
            self._done.append((iteration, started, time.time()))
            return
        target = Path(self.directory) / "checkpoint.pt"
        temporary = target.with_suffix(".pt.tmp")
        with open(temporary, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, target)
        self._done.append((iteration, started, time.time()))

    def _join_persist(self) -> None:
        if self._persist is not None:
            self._persist.join(timeout=600)
            if self._persist.is_alive():
                raise RuntimeError("the checkfreq persist thread did not finish within 600 s")
            self._persist = None

    def close(self) -> None:
        if self._future is not None:
            self._future.result()
            self._future = None
        self._join_persist()
        self._report()
        if self._nfs is not None:
            self._nfs.close()
            self._nfs = None


def _cloned(value: Any) -> Any:
    """A deep copy of a state dict's tensors (the snapshot in CPU memory), other values as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value


def config_from(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        iterations=args.iterations,
        global_batch=args.global_batch,
        seed=args.seed,
        peak_lr=args.lr,
        max_norm=args.max_norm,
        bucket_cap_mb=getattr(args, "bucket_cap_mb", TrainConfig().bucket_cap_mb),  # DDP's only
        model=ModelConfig(context=args.context, width=args.width, heads=args.heads, layers=args.layers),
    )


class JsonLog:
    """Appends one JSON object per line and flushes it (a watcher reads the file while it grows)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, **record: Any) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def start_record(point: ResumePoint, rank: int, world: int) -> dict[str, Any]:
    """The log's ``start`` record of a (re)started rank: where it starts and what it restored."""
    return {
        "event": "start",
        "rank": rank,
        "world_size": world,
        "pid": os.getpid(),
        "start_iteration": point.iteration,
        "restored_from": point.restored_iteration,
        "source": point.source if point.restored else None,
        "detail": point.detail if point.restored else None,
        "lost_iterations": point.lost_iterations if point.restored else None,
        "time": time.time(),
    }


def resume_cursor(point: ResumePoint) -> int:
    """The first batch to train on: the restored data position's ``batch``, else the start iteration."""
    position = point.data_position
    if isinstance(position, dict) and type(position.get("batch")) is int and position["batch"] >= 0:
        return int(position["batch"])
    return point.iteration


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("TRAIN_LOG_LEVEL", "WARNING"),
        format="%(asctime)s rank" + os.environ.get("RANK", "?") + " %(name)s %(levelname)s %(message)s",
    )
    logger.info("started")
    config = config_from(args)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # rendezvous from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    logger.info("rendezvous done: rank %d of %d", rank, world)
    log = JsonLog(Path(args.log.format(rank=rank)))
    try:
        corpus = load_corpus()
        torch.manual_seed(config.seed)  # identical initial weights everywhere (DDP broadcasts them too)
        module = TinyLM(config.model)
        optimizer = torch.optim.AdamW(
            module.parameters(),
            lr=cosine_lr(0, config.iterations, config.peak_lr, config.warmup),
            weight_decay=config.weight_decay,
        )
        model = DistributedDataParallel(module, bucket_cap_mb=config.bucket_cap_mb)
        point = ResumePoint(iteration=0)
        if args.resume:
            # Checkmate: the one call to resume (every rank; the shadows' memory, else the disk)
            point = hosts.resume(
                model,
                optimizer,
                snapshot_dir=args.snapshot_dir,
                timeout=args.restore_timeout,
                shadows={} if args.no_checkmate else None,
            )
        start = point.iteration
        cursor = resume_cursor(point)  # the next batch (== start unless a data position says otherwise)
        log.write(**start_record(point, rank, world))
        if point.restored:
            log.write(
                event="restored",
                iteration=point.restored_iteration,
                params_sha256=parameters_digest(module.named_parameters()),
                optimizer_sha256=optimizer_digest(optimizer_states_by_name(module, optimizer)),
            )
        logger.info("model ready (restored: %s)", point.restored_iteration)
        batch = batch_for(corpus, config.seed, cursor, rank, world, config.global_batch, config.model.context)
        hosts.settle_buckets(model, lambda: loss_of(model, *batch))  # same buckets at every start
        logger.info("buckets settled")
        agent = None
        if not args.no_checkmate:
            # Checkmate: the one added line (a resumed job keeps the job's iteration numbers)
            agent = hosts.enable_checkmate(model, optimizer, resume=point, data_position={"batch": cursor})

        checkpointer = BaselineCheckpointer(
            args.checkpoint, args.checkpoint_every, args.checkpoint_dir, module, optimizer, rank, log
        )
        logger.info("training from iteration %d", start)
        for iteration in range(start, config.iterations):
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(iteration, config.iterations, config.peak_lr, config.warmup)
            inputs, targets = batch_for(
                corpus, config.seed, cursor, rank, world, config.global_batch, config.model.context
            )
            loss = loss_of(model, inputs, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            hosts.clip_grad_norm_(model.parameters(), config.max_norm)
            cursor += 1  # the data position after this iteration: where a restore of it resumes
            if agent is not None:
                agent.set_data_position({"batch": cursor})  # before the step: sent with its commit
            optimizer.step()
            checkpointer.after_step(iteration)
            certified = None
            unprotected: dict[str, Any] = {}
            if agent is not None and agent.channel is not None:
                certified = agent.channel.certified_through()
                protection = agent.protection
                if protection is not None and protection["reason"] is not None:
                    unprotected["unprotected"] = protection["reason"]  # hosts.protection's verdict
            digest: dict[str, str] = {}
            if args.log_digests and rank == 0:
                digest["params_sha256"] = parameters_digest(module.named_parameters())
            log.write(
                iteration=iteration,
                loss=round(float(loss.item()), 6),
                lr=optimizer.param_groups[0]["lr"],
                time=time.time(),
                certified=certified,
                **unprotected,
                **digest,
            )

        checkpointer.close()
        agent_stats: dict[str, Any] = {}
        if agent is not None:
            # the transport's, ring's and control links' counters of the whole run (retransmissions,
            # repairs served, ...), taken before close: experiments.bench's worker account reads them
            agent_stats = {"agent_stats": agent.stats()}
            agent.close()
        else:
            dist.barrier()
        log.write(
            event="done",
            rank=rank,
            iteration=config.iterations - 1,
            params_sha256=parameters_digest(module.named_parameters()),
            optimizer_sha256=optimizer_digest(optimizer_states_by_name(module, optimizer)),
            time=time.time(),
            **agent_stats,
        )
        dist.destroy_process_group()
        return 0
    finally:
        log.close()


if __name__ == "__main__":
    sys.exit(main())
