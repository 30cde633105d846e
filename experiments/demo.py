"""``make demo``: train through the emulated switch, kill a worker, recover from the shadows, verify.

    python -m experiments.demo [--iterations 100] [--kill-at 40] [--no-reference] [--work-dir DIR]

Steps (each a progress bar):

1. **network**: ``checkmate-net up`` of ``topologies/single.json`` on the
   embedded target, in a private run directory (``--work-dir``, default
   ``/tmp/checkmate-demo``; a network left there by an earlier demo is taken
   down first) with a free P4Runtime port and a private controller registry;
2. **job**: ``checkmate-ctl job add`` (workers h1-h3 in ring order, shadows
   sh1, sh2): the switch now copies the job's tagged all-gather packets;
3. **shadows**: ``checkmate-shadow run`` in sh1 and sh2, snapshotting every
   iteration into one shared directory;
4. **training**: :class:`~experiments.launcher.Launcher` runs
   ``examples/train_lm.py`` (TinyLM, AdamW, cosine LR, clipping)
   in h1-h3, kills one worker with SIGKILL during ``--kill-at``, and restarts
   all three from the shadows' latest certified state;
5. **verify**: the shadows' state after the last iteration, fetched from
   their memory, is compared bit for bit (SHA-256 of every parameter and
   optimizer tensor) with the workers' final state;
6. **reference** (unless ``--no-reference``): the same job without the
   failure; the recovered run must end bit-identical to it;
7. **teardown**: shadows stopped, ``checkmate-net down`` — always, also after
   an error or Ctrl-C.

Then a summary table, ``results/demo.json`` and ``results/demo.png`` (loss over
iterations with the failure and the recovery marked, and the shadows' lag).
:class:`~experiments.job.JobRun` does the work (:meth:`~experiments.job.JobRun.run`;
tests drive it with small settings), :class:`~experiments.progress.RichObserver`
draws it, :mod:`experiments.plots` draws ``demo.png``. This module is the
command line: its options (:func:`build_parser`) and how they become a
:class:`~experiments.job.JobConfig` (:func:`config_from_args`) are here and
nowhere else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType

from experiments.commands import JobError
from experiments.job import JobConfig, JobRun
from experiments.plots import demo_plot
from experiments.progress import RichObserver, print_summary
from experiments.results import JobResult

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    defaults = JobConfig()
    parser = argparse.ArgumentParser(prog="python -m experiments.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=defaults.iterations)
    parser.add_argument(
        "--kill-at", type=int, default=defaults.kill_iteration, help="iteration during which a worker dies"
    )
    parser.add_argument("--kill-rank", type=int, default=defaults.kill_rank)
    parser.add_argument("--no-failure", action="store_true", help="run without killing a worker")
    parser.add_argument(
        "--shadows-fail-too", action="store_true", help="stop the shadows with the worker: restore from disk"
    )
    parser.add_argument(
        "--no-reference", action="store_true", help="skip the uninterrupted run (bit-identity check)"
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="restart without the failed worker's host (N-1 workers, job resized at the switch)",
    )
    parser.add_argument("--work-dir", type=Path, default=defaults.work_dir)
    parser.add_argument("--results", type=Path, default=defaults.results_dir)
    parser.add_argument("--target", choices=["embedded", "bmv2"], default=defaults.target)
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: >1 runs a TP x DP job on h1-h4, one Checkmate lane (job, shadow, "
        "secret) per TP index, kills --kill-rank during --kill-at and resumes every lane from its own "
        "shadows, checks the result against an uninterrupted run and merges the lanes' snapshots "
        "(experiments/tp_demo.py)",
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="the workers train with FSDP2 (fully_shard) on the checkmate torch.distributed backend "
        "(examples/train_fsdp.py) instead of DDP: the switch copies each reduce-scatter's fully reduced "
        "shards, the shadows hold the full state; the same kill, resume and checks",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    return parser


def config_from_args(args: argparse.Namespace) -> JobConfig:
    """The demo's configuration from its parsed options (``make demo``'s defaults elsewhere)."""
    return replace(
        JobConfig(),
        iterations=args.iterations,
        kill_iteration=None if args.no_failure else args.kill_at,
        kill_rank=args.kill_rank,
        shadows_fail_too=args.shadows_fail_too,
        elastic=args.elastic,
        reference=not args.no_reference,
        work_dir=args.work_dir,
        results_dir=args.results,
        target=args.target,
        worker_module="examples.train_fsdp" if args.fsdp else JobConfig().worker_module,
    )


def write_results(result: JobResult, directory: Path, name: str = "demo") -> tuple[Path, Path]:
    """``NAME.json`` and ``NAME.png`` in ``directory`` (``demo``; ``demo-fsdp`` for ``--fsdp``)."""
    directory.mkdir(parents=True, exist_ok=True)
    summary = result.summary()
    json_path = directory / f"{name}.json"
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    png_path = directory / f"{name}.png"
    demo_plot(result, summary, png_path)
    return json_path, png_path


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR, format="%(levelname)s %(name)s: %(message)s"
    )
    from rich.console import Console

    console = Console()
    if os.geteuid() != 0:
        console.print(
            "[red]make demo needs root[/]: it creates network namespaces, veth pairs and a software switch "
            "(Mininet). Run it as root, e.g. `sudo make demo`."
        )
        return 1
    config = config_from_args(args)
    if config.kill_iteration is not None and not 1 <= config.kill_iteration < config.iterations:
        console.print(f"[red]--kill-at must lie in 1..{config.iterations - 1}")
        return 2
    if args.fsdp and (args.tp > 1 or args.elastic):
        console.print("[red]--fsdp runs one FSDP2 job on h1-h3: it does not combine with --tp or --elastic")
        return 2
    if args.tp > 1:  # TP x DP: one Checkmate lane per TP index (experiments/tp_demo.py)
        from experiments.tp_demo import tp_main

        return tp_main(console, config, args.tp)

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    console.print(
        f"[bold]Checkmate demo[/]: {len(config.workers)} {'FSDP2' if args.fsdp else 'DDP'} workers "
        f"({', '.join(config.workers)}) and "
        f"{len(config.shadows)} shadows ({', '.join(config.shadows)}) on one emulated P4 switch; "
        + (
            f"rank {config.kill_rank} is killed during iteration {config.kill_iteration}."
            if config.kill_iteration is not None
            else "no failure."
        )
    )
    try:
        with RichObserver() as observer:
            result = JobRun(config, observer).run()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: workers and shadows stopped, the network taken down.")
        return 130
    except JobError as exc:
        console.print(f"[red]demo failed[/]: {exc}")
        console.print(f"everything the demo started was stopped; its logs are in {config.work_dir}")
        return 1
    summary = result.summary()
    paths: tuple[Path, Path] | tuple[None, None] = (None, None)
    if config.results_dir is not None:
        paths = write_results(result, config.results_dir, "demo-fsdp" if args.fsdp else "demo")
    print_summary(console, summary, *paths)
    checks = [summary["shadow_equals_workers"], summary["recovered_equals_uninterrupted"]]
    if summary.get("elastic"):
        checks.append(summary["elastic"]["restored_state_equals_reference"])
    ok = all(c is not False for c in checks) and summary["lost_iterations"] <= 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
