"""``make bench``: Checkmate next to the checkpointing users pick today, on the demo's model and network.

    python -m experiments.bench [--workloads tinylm,large-state] [--placement partitioned,colocated]
        [--worker-cpus 0 --infra-cpus 1] [--sweep-k 1,2,4,8,16] [--iterations N] [--k 10]
        [--rounds 3] [--workers 3] [--systems a,b,...] [--storage local|remote|local,remote]

For each workload (``WORKLOADS``: TinyLM, and a large-state 21.7M-parameter TinyLM) and
each placement — *partitioned*: the workers pinned to one CPU set, the switch, supervisor,
shadows and this process to another (:mod:`experiments.bench.partition`; what ran where
is read back from /proc into the results), and *colocated*: no pinning — one invocation
brings up the demo's emulated network (``topologies/single.json``, more workers added for
``--workers`` > 4, on the embedded switch target, its switch renamed so it can run next
to other networks), trains with the DDP workers once per system, the same number of
iterations each, and takes the network down. In the first placement the peers
``torch-save``, ``checkfreq`` and ``dcp-process`` also run once per k of ``--sweep-k``
(:mod:`experiments.bench.sweep`: the smallest k within 5 % of the ideal / matching
Checkmate). The systems:

* ``ideal-gloo`` — DDP over gloo, no checkpoints;
* ``ideal-cm-transport`` — DDP over Checkmate's UDP transport, nothing tagged
  and nothing copied (no shadows, the job not registered at the switch): the
  same-transport ideal;
* ``checkmate`` — the switch copies the tagged all-gather packets to the
  shadows sh1, sh2 (started fresh), which certify every iteration;
* ``host-replication`` — no switch copies (the job is not registered at the
  switch and the workers send nothing tagged): each chunk owner sends its
  reduced chunk to the shadow itself (``CHECKMATE_REPLICATION=host``);
* ``torch-save-1`` / ``torch-save-K`` — rank 0 ``torch.save``s model and
  optimizer state (temp file, fsync, rename) after every iteration / every K;
* ``dcp-async-1`` / ``dcp-async-K`` — ``torch.distributed.checkpoint.async_save``
  on a separate gloo group, waiting for the previous save first;
* ``checkfreq-k`` — CheckFreq-style: rank 0 copies the state to CPU memory, a
  background thread persists it (the next snapshot waits for it);
* ``dcp-process-k`` — ``async_save`` with ``AsyncCheckpointerType.PROCESS`` and
  ``use_collectives=False``.

Figures (see docs/benchmarks.md for the definitions): iterations/s over the
steady-state iterations of rank 0's log (the first ``--warmup`` skipped),
checkpoint frequency, expected repeated iterations per failure
(``k/2 + d``: checkpoints every ``k`` iterations that become complete ``d``
iterations after the iteration they capture), and ratios to both ideals.
Writes ``results/bench.json`` (every run under ``runs``; the first also at the top),
``results/bench.png`` and, when the file has the markers, the tables in
``docs/benchmarks.md`` — each file atomically, and only when every run finished.
Options are checked before anything starts.

The package: :mod:`~experiments.bench.config` (systems, workloads, a run's
configuration), :mod:`~experiments.bench.run` (one run on the emulated
network), :mod:`~experiments.bench.figures` (figures from the logs),
:mod:`~experiments.bench.report` (bench.json, the docs table),
:mod:`~experiments.bench.sweep`, :mod:`~experiments.bench.partition`,
:mod:`~experiments.bench.scaling` and :mod:`~experiments.bench.network` (an
emulated network for the host-side benchmarks); this module is the command
line (options and the plan of runs).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from experiments.bench import partition, sweep
from experiments.bench.config import (
    DEFAULT_SYSTEMS,
    MAX_WORKERS,
    MIN_WORKERS,
    PLACEMENTS,
    STORAGES,
    WORKLOADS,
    BenchConfig,
    BenchError,
    all_systems,
)
from experiments.bench.partition import PartitionError
from experiments.bench.report import suite_markdown, write_suite
from experiments.bench.run import BenchRun
from experiments.bench.sweep import SWEEP_PEERS, SweepError
from experiments.bench.worker_account import SyscallWindow
from experiments.commands import JobError

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="iterations per run (default per workload: "
        + ", ".join(f"{w.name} {w.iterations}" for w in WORKLOADS.values())
        + "); a sweep run gets at least warmup + 3k + 2",
    )
    parser.add_argument(
        "--workloads", default="tinylm,large-state", help=f"comma-separated, of {', '.join(WORKLOADS)}"
    )
    parser.add_argument(
        "--placement",
        default=None,
        help="comma-separated, of partitioned (workers on --worker-cpus, switch + shadows + supervisor + "
        "this process on --infra-cpus) and colocated (no pinning); the first one also runs the k sweep "
        "(default per workload: "
        + ", ".join(f"{w.name} {','.join(w.placements)}" for w in WORKLOADS.values())
        + ")",
    )
    parser.add_argument("--worker-cpus", default=None, help="CPU list for the workers (default: first half)")
    parser.add_argument(
        "--infra-cpus", default=None, help="CPU list for switch, shadows, supervisor (default: the rest)"
    )
    parser.add_argument(
        "--workers", type=int, default=defaults.workers, help=f"DDP workers ({MIN_WORKERS}-{MAX_WORKERS})"
    )
    parser.add_argument(
        "--sweep-k",
        default=None,
        help=f"checkpoint intervals swept for {', '.join(SWEEP_PEERS)} ('' for no sweep; default per "
        "workload: "
        + ", ".join(f"{w.name} {','.join(map(str, w.sweep_ks))}" for w in WORKLOADS.values())
        + ")",
    )
    parser.add_argument(
        "--warmup", type=int, default=defaults.warmup, help="first iterations left out of the rates"
    )
    parser.add_argument("--k", type=int, default=defaults.k, help="the 'every k iterations' baselines")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="runs per system, order alternating (default per workload: "
        + ", ".join(f"{w.name} {w.rounds}" for w in WORKLOADS.values())
        + ")",
    )
    parser.add_argument(
        "--systems",
        default="",
        help=f"comma-separated names to run, or 'all' (default: {', '.join(DEFAULT_SYSTEMS)}, and the "
        "swept peers at each k of the sweep); known: "
        + ", ".join(all_systems(defaults.k)).replace(str(defaults.k), "K"),
    )
    parser.add_argument(
        "--syscalls",
        type=int,
        default=0,
        metavar="N",
        help="count the workers' system calls by kind (strace -c -f) over the last N iterations of "
        "each run; the CPU figures then end where that window starts (0: off, the default)",
    )
    parser.add_argument("--work-dir", type=Path, default=defaults.work_dir)
    parser.add_argument("--json", type=Path, default=defaults.json_out, help="results JSON")
    parser.add_argument("--png", type=Path, default=defaults.png_out, help="bar chart")
    parser.add_argument(
        "--docs",
        type=Path,
        default=defaults.docs,
        help="Markdown file whose bench-table markers get the table",
    )
    parser.add_argument("--no-docs", action="store_true", help="do not touch the docs table")
    parser.add_argument(
        "--no-emulation-check",
        action="store_true",
        help="skip measuring the emulation's own fabric and storage bandwidths at the start of each run",
    )
    parser.add_argument(
        "--storage",
        default=None,
        help="where the peers' checkpoints and the shadows' snapshots go: local (this machine's disk), "
        "remote (an NFS server, nfs-ganesha, on its own host of the emulated network, its link shaped "
        "with tbf to --storage-cluster's checkpoint-write-to-all-reduce time ratio), or local,remote: "
        "each workload and placement runs on both, reported side by side (default per workload: "
        + ", ".join(f"{w.name} {','.join(w.storages)}" for w in WORKLOADS.values())
        + ")",
    )
    parser.add_argument(
        "--storage-cluster",
        default=defaults.storage_cluster,
        help="remote: the cluster configuration of checkmate-ctl plan --compare whose ratio shapes the "
        f"storage link (default {defaults.storage_cluster})",
    )
    parser.add_argument(
        "--storage-mbit",
        type=float,
        default=None,
        help="remote: the storage link's rate in Mbit/s instead of the cited ratio's",
    )
    parser.add_argument("--target", choices=["embedded", "bmv2"], default=defaults.target)
    parser.add_argument(
        "--switch-name",
        default=defaults.rename_switches[0][1],
        help="name of the benchmark's switch (its port interfaces are named after it; another name lets "
        "two benchmarks run side by side)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def _names(text: str, known: Sequence[str], option: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise BenchError(f"{option}: nothing given (known: {', '.join(known)})")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BenchError(f"{option}: unknown {unknown} (known: {', '.join(known)})")
    return names


def config_from(args: argparse.Namespace, command: str) -> BenchConfig:
    """The first run's configuration, every option checked (BenchError: refused before anything starts)."""
    return plan_from(args, command)[0]


def plan_from(args: argparse.Namespace, command: str) -> list[BenchConfig]:
    """One configuration per (workload, placement, storage), in run order; refuses bad options clearly.

    Without ``--rounds``, ``--sweep-k`` or ``--placement`` each workload uses its own
    (:class:`~experiments.bench.config.Workload`); without ``--systems`` each run has
    ``DEFAULT_SYSTEMS`` and, in the first placement, the swept peers at every swept k.
    """
    chosen = tuple(s.strip().replace("K", str(args.k)) for s in args.systems.split(",") if s.strip())
    everything = chosen == ("all",)
    workloads = _names(args.workloads, list(WORKLOADS), "--workloads")
    given_placements = None if args.placement is None else _names(args.placement, PLACEMENTS, "--placement")
    if not (args.switch_name.isascii() and args.switch_name.isalnum() and 1 <= len(args.switch_name) <= 8):
        raise BenchError(f"--switch-name must be 1-8 letters or digits, got {args.switch_name!r}")
    if not MIN_WORKERS <= args.workers <= MAX_WORKERS:
        raise BenchError(f"--workers must be {MIN_WORKERS} to {MAX_WORKERS}, got {args.workers}")
    if args.warmup < 0:
        raise BenchError(f"--warmup must be >= 0, got {args.warmup}")
    if args.iterations is not None and args.iterations <= args.warmup + 2:
        raise BenchError(f"--iterations ({args.iterations}) must exceed --warmup ({args.warmup}) + 2")
    if args.iterations is not None and args.iterations > 100_000:
        raise BenchError(f"--iterations ({args.iterations}) is out of range (at most 100000)")
    if not 0 <= args.syscalls <= 10_000:
        raise BenchError(f"--syscalls must be 0 (off) to 10000 iterations, got {args.syscalls}")
    if args.syscalls and not SyscallWindow.available():
        raise BenchError("--syscalls needs strace on PATH (apt-get install strace)")
    given_storages = None
    if args.storage is not None:
        given_storages = tuple(dict.fromkeys(s.strip() for s in args.storage.split(",")))
        unknown = [s for s in given_storages if s not in STORAGES]
        if unknown or not given_storages:
            raise BenchError(
                f"--storage: unknown {', '.join(map(repr, unknown)) or repr(args.storage)} "
                "(local, remote, local,remote)"
            )
    storages_of = {
        name: given_storages if given_storages is not None else WORKLOADS[name].storages for name in workloads
    }
    if any("remote" in storages for storages in storages_of.values()):
        from controller.named_clusters import CONFIGS
        from experiments.bench.storage_host import ganesha_missing

        if args.storage_cluster not in CONFIGS:
            raise BenchError(
                f"--storage-cluster: unknown {args.storage_cluster!r} (known: {', '.join(CONFIGS)})"
            )
        if args.storage_mbit is not None and not 0 < args.storage_mbit <= 100_000:
            raise BenchError(f"--storage-mbit must be above 0 and at most 100000, got {args.storage_mbit}")
        if args.no_emulation_check and args.storage_mbit is None:
            raise BenchError(
                "remote storage's link is shaped from the fabric's busbw that the emulation check measures: "
                "give --storage-mbit with --no-emulation-check"
                + (" (or --storage local)" if given_storages is None else "")
            )
        missing = ganesha_missing()
        if missing is None:
            from checkmate.nfs import available

            missing = available()
        if missing is not None:
            if given_storages is None:  # remote by the workload's default, not asked for
                raise BenchError(
                    f"{', '.join(n for n, st in storages_of.items() if 'remote' in st)} also runs on remote "
                    f"storage by default, which cannot run here: {missing} (--storage local skips it)"
                )
            raise BenchError(f"--storage remote: {missing}")
    elif args.storage_mbit is not None:
        raise BenchError("--storage-mbit needs --storage remote")
    if not 1 <= args.k <= sweep.MAX_SWEEP_K or (args.rounds is not None and not 1 <= args.rounds <= 100):
        raise BenchError(f"--k must be 1 to {sweep.MAX_SWEEP_K} and --rounds 1 to 100")
    try:
        given_ks = None if args.sweep_k is None else sweep.parse_k_list(args.sweep_k)
    except SweepError as exc:
        raise BenchError(str(exc)) from None
    placements_of = {
        name: given_placements if given_placements is not None else WORKLOADS[name].placements
        for name in workloads
    }
    cpus = None
    if any("partitioned" in p for p in placements_of.values()):
        try:
            cpus = partition.make_partition(args.worker_cpus, args.infra_cpus)
        except PartitionError as exc:
            raise BenchError(f"--worker-cpus/--infra-cpus: {exc}") from None
    elif args.worker_cpus is not None or args.infra_cpus is not None:
        raise BenchError("--worker-cpus/--infra-cpus need --placement partitioned")
    plan: list[BenchConfig] = []
    for name in workloads:
        workload = WORKLOADS[name]
        iterations = args.iterations if args.iterations is not None else workload.iterations
        if iterations <= args.warmup + 2:
            raise BenchError(f"{name}: {iterations} iterations must exceed --warmup ({args.warmup}) + 2")
        sweep_ks = given_ks if given_ks is not None else workload.sweep_ks
        placements = placements_of[name]
        for placement, storage in ((p, s) for p in placements for s in storages_of[name]):
            swept = placement == placements[0]
            ks = sweep_ks if swept else ()
            if everything:
                mine: tuple[str, ...] = ()
            elif chosen:
                mine = chosen
                if not swept:  # the sweep's systems run in the first placement only
                    mine = tuple(
                        n
                        for n in chosen
                        if n in all_systems(args.k) or n not in all_systems(args.k, sweep_ks)
                    )
                    if not mine:
                        continue
            else:
                mine = (*DEFAULT_SYSTEMS, *sweep.sweep_system_names(ks))
                mine = tuple(dict.fromkeys(mine))
            plan.append(
                BenchConfig(
                    iterations=iterations,
                    warmup=args.warmup,
                    k=args.k,
                    rounds=args.rounds if args.rounds is not None else workload.rounds,
                    systems=mine,
                    work_dir=args.work_dir,
                    json_out=args.json,
                    png_out=args.png,
                    docs=None if args.no_docs else args.docs,
                    target=args.target,
                    command=command,
                    rename_switches=(("s1", args.switch_name),),
                    workers=args.workers,
                    workload=name,
                    placement=placement,
                    partition=cpus if placement == "partitioned" else None,
                    sweep_ks=ks,
                    syscall_iterations=args.syscalls,
                    storage=storage,
                    storage_cluster=args.storage_cluster,
                    storage_mbit=args.storage_mbit,
                    measure_emulation=not args.no_emulation_check,
                    global_batch=workload.per_worker_batch * args.workers,
                    model_args=workload.model_args,
                )
            )
    for config in plan:
        config.selected()  # unknown --systems names are refused here
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR, format="%(levelname)s %(name)s: %(message)s"
    )
    from rich.console import Console
    from rich.markdown import Markdown

    from experiments.progress import RichObserver

    console = Console()
    given = list(sys.argv[1:] if argv is None else argv)
    if argv is None and os.environ.get("MAKELEVEL"):
        command = "make bench" + (f' BENCH_ARGS="{" ".join(given)}"' if given else "")
    else:
        command = " ".join(["python -m experiments.bench", *given])
    try:
        plan = plan_from(args, command)
    except BenchError as exc:
        console.print(f"[red]{exc}")
        return 2
    config = plan[0]
    if os.geteuid() != 0:
        console.print(
            "[red]make bench needs root[/]: it builds the demo's emulated network (Mininet). "
            "Run it as root, e.g. `sudo make bench`."
        )
        return 1

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    started = time.monotonic()
    summaries: list[dict[str, Any]] = []
    try:
        for part in plan:
            names = [s.name for s in part.selected()]
            where = (
                f"partitioned {json.dumps(part.partition.as_json())}"
                if part.partition is not None
                else "co-located"
            )
            console.print(
                f"[bold]Checkmate benchmark[/] ({part.workload}, {where}): {len(names)} systems x "
                f"{part.rounds} round(s) x >= {part.iterations} iterations, {part.workers} workers: "
                + ", ".join(names)
            )
            with RichObserver() as observer:
                summaries.append(BenchRun(part, observer).run_all().summary())
    except KeyboardInterrupt:
        console.print(
            "[yellow]interrupted[/]: workers and shadows stopped, the network taken down, no results written."
        )
        return 130
    except (JobError, BenchError) as exc:
        console.print(f"[red]benchmark failed[/]: {exc} (no results written)")
        return 1
    summary = write_suite(summaries, config, time.monotonic() - started)
    console.print(Markdown(suite_markdown(summary)))
    for key, value in summary["targets"].items():
        console.print(f"{key}: {json.dumps(value)}")
    for name, error in summary["errors"].items():
        console.print(f"[red]{name} failed[/]: {error[:500]}")
    for run in summary["runs"]:
        for problem in run["cpu_placement"]["problems"]:
            console.print(f"[red]CPU placement[/] ({run['workload']}): {problem}")
    console.print(f"wrote {config.json_out} and {config.png_out} ({summary['seconds']} s)")
    failed = summary["errors"] or any(run["cpu_placement"]["problems"] for run in summary["runs"])
    return 0 if not failed else 1
