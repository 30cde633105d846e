"""Scaling of ``make bench``: iteration time and Checkmate's ratio to its ideal, 2-6 workers x model sizes.

    python -m experiments.bench.scaling [--workers 2,3,4,5,6] [--workloads tinylm,medium,large-state]

For each worker count and workload one partitioned benchmark run (``experiments.bench``'s
:class:`~experiments.bench.run.BenchRun`: its own network, the same CPU partition as
``make bench``) of ``ideal-cm-transport`` and ``checkmate`` (``--systems`` to change),
``--rounds`` rounds each. Writes ``results/scaling.json`` and ``results/scaling.png``
(mean iteration time per worker count, one line per workload and system; Checkmate's
ratio to its same-transport ideal), each file written atomically; nothing is written
when the run is interrupted. More than 4 workers use a copy of ``single.json`` with
h5, h6 added (:func:`experiments.bench.run.scaled_topology`).

Each row also has the network's and the shadows' share of the time (:func:`time_shares`,
from the CPU accounting of :mod:`experiments.bench.cpu_time`): the switch's CPU plus the
infrastructure CPUs' softirq, the shadows' CPU (each in CPUs: 1.0 is one CPU busy the
whole time) and the workers' CPUs' busy fraction; the plot's third panel shows them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any

from experiments.bench import partition
from experiments.bench.config import MAX_WORKERS, MIN_WORKERS, WORKLOADS, BenchConfig, BenchError
from experiments.bench.partition import PartitionError
from experiments.bench.report import atomic_write_text
from experiments.bench.run import BenchRun
from experiments.commands import REPO, JobError
from experiments.plots import save_atomically, scaling_plot

logger = logging.getLogger(__name__)

DEFAULT_SYSTEMS = ("ideal-cm-transport", "checkmate")


def parse_workers(text: str) -> tuple[int, ...]:
    """``"2,3,6"`` -> (2, 3, 6); each within MIN_WORKERS..MAX_WORKERS."""
    values: list[int] = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            count = int(part)
        except ValueError:
            raise BenchError(f"--workers: {part.strip()!r} is not a whole number") from None
        if not MIN_WORKERS <= count <= MAX_WORKERS:
            raise BenchError(f"--workers: {count} is out of range ({MIN_WORKERS} to {MAX_WORKERS})")
        values.append(count)
    if not values:
        raise BenchError("--workers: no worker count given")
    return tuple(sorted(set(values)))


def plan_from(args: argparse.Namespace) -> list[BenchConfig]:
    """One partitioned configuration per (workload, worker count); bad options refused here."""
    counts = parse_workers(args.workers)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        raise BenchError(f"--workloads: unknown or none {unknown} (known: {', '.join(WORKLOADS)})")
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    if args.rounds < 1 or args.rounds > 100:
        raise BenchError("--rounds must be 1 to 100")
    try:
        cpus = partition.make_partition(args.worker_cpus, args.infra_cpus)
    except PartitionError as exc:
        raise BenchError(f"--worker-cpus/--infra-cpus: {exc}") from None
    if getattr(args, "append", False):
        merged_with(args.json, [], [])  # an unreadable file to append to is refused before anything runs
    plan = []
    for name in workloads:
        workload = WORKLOADS[name]
        iterations = args.iterations or workload.iterations
        if iterations <= args.warmup + 2:
            raise BenchError(f"{name}: {iterations} iterations must exceed --warmup ({args.warmup}) + 2")
        for count in counts:
            config = BenchConfig(
                iterations=iterations,
                warmup=args.warmup,
                rounds=args.rounds,
                systems=systems,
                work_dir=args.work_dir,
                json_out=None,
                png_out=None,
                docs=None,
                workers=count,
                workload=name,
                placement="partitioned",
                partition=cpus,
                global_batch=workload.per_worker_batch * count,
                model_args=workload.model_args,
                rename_switches=(("s1", "bs1"),),
                command="python -m experiments.bench.scaling",
            )
            config.selected()
            plan.append(config)
    return plan


def rows_from(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per system of one run: workers, workload, mean ms per iteration, ratio to its ideal."""
    settings = summary["settings"]
    return [
        {
            "workload": settings["workload"],
            "workers": settings["workers"],
            "system": entry["name"],
            "mean_iteration_ms": entry["mean_iteration_ms"],
            "iterations_per_s": entry["iterations_per_s"],
            "ratio_to_ideal": entry["ratio_to_ideal"],
            "ratio_to_gloo_ideal": entry["ratio_to_gloo_ideal"],
            **time_shares(entry.get("cpu_time")),
        }
        for entry in summary["systems"]
    ]


def time_shares(cpu_time: Mapping[str, Any] | None) -> dict[str, float | None]:
    """The network's and the shadows' share of the time, from one entry's ``cpu_time``.

    ``network_share``: the switch's CPU-seconds per second plus the infrastructure CPUs' softirq
    (the kernel's packet delivery of the emulated network), as a fraction of one CPU;
    ``shadows_share``: the shadows' CPU-seconds per second; ``workers_busy``: the busy fraction of
    the workers' CPUs (1 - it is the time they wait). None where not measured.
    """
    out: dict[str, float | None] = {"network_share": None, "shadows_share": None, "workers_busy": None}
    if not cpu_time:
        return out
    roles = cpu_time.get("roles", {})
    sets = cpu_time.get("cpu_sets", {})
    infra = sets.get("infrastructure") or sets.get("all")
    switch = roles.get("switch", {}).get("cpu_s_per_s")
    if switch is not None and infra is not None:
        cpus = len(str(infra["cpus"]).split(","))
        out["network_share"] = round(switch + infra["softirq"] * cpus, 3)
    if roles.get("shadows", {}).get("processes"):
        out["shadows_share"] = roles["shadows"]["cpu_s_per_s"]
    workers = sets.get("workers") or sets.get("all")
    if workers is not None:
        out["workers_busy"] = workers["busy"]
    return out


def write(
    rows: list[dict[str, Any]], runs: list[dict[str, Any]], args: argparse.Namespace, seconds: float
) -> None:
    command = " ".join(["python -m experiments.bench.scaling", *args.given])
    commands = [command]
    if args.append:
        rows, runs, earlier = merged_with(args.json, rows, runs)
        commands = [*earlier, command]
    document = {
        "rows": rows,
        "runs": runs,
        "command": command,
        "commands": commands,
        "seconds": round(seconds, 1),
    }
    atomic_write_text(args.json, json.dumps(document, indent=2) + "\n")
    load = runs[0]["machine"].get("load_average_at_start") if runs else None
    title = f"scaling, partitioned CPUs, {len(runs)} run(s) (load average at start {load})"
    save_atomically(lambda path: scaling_plot(rows, path, title), args.png)


def merged_with(
    path: Path, rows: list[dict[str, Any]], runs: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """``--append``: the rows and runs of ``path`` (an earlier scaling.json) with these added; a
    (workload, workers[, system]) measured again replaces the earlier one. Also the earlier commands."""
    try:
        earlier = json.loads(path.read_text())
    except FileNotFoundError:
        return rows, runs, []
    except (OSError, ValueError) as exc:
        raise BenchError(f"--append: cannot read {path}: {exc}") from None
    if not isinstance(earlier, dict) or not isinstance(earlier.get("rows"), list):
        raise BenchError(f"--append: {path} is not a scaling.json (no rows)")
    fresh = {(r["workload"], r["workers"], r["system"]) for r in rows}
    kept_rows = [
        r for r in earlier["rows"] if (r.get("workload"), r.get("workers"), r.get("system")) not in fresh
    ]
    measured = {(r["settings"]["workload"], r["settings"]["workers"]) for r in runs}
    kept_runs = [
        r
        for r in earlier.get("runs", [])
        if (r.get("settings", {}).get("workload"), r.get("settings", {}).get("workers")) not in measured
    ]
    commands = earlier.get("commands") or ([earlier["command"]] if earlier.get("command") else [])
    return kept_rows + rows, kept_runs + runs, list(commands)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench.scaling", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--workers", default="2,3,4,5,6", help=f"worker counts ({MIN_WORKERS}-{MAX_WORKERS})")
    parser.add_argument("--workloads", default="tinylm,medium,large-state", help=", ".join(WORKLOADS))
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    parser.add_argument("--iterations", type=int, default=None, help="per run (default: the workload's)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker-cpus", default=None)
    parser.add_argument("--infra-cpus", default=None)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/checkmate-bench-scaling"))
    parser.add_argument("--json", type=Path, default=REPO / "results" / "scaling.json")
    parser.add_argument("--png", type=Path, default=REPO / "results" / "scaling.png")
    parser.add_argument(
        "--append",
        action="store_true",
        help="add to the rows already in --json (a size and worker count measured again replaces its rows) "
        "and plot them all: sizes can be run separately, e.g. large-state with fewer worker counts",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(given)
    args.given = given
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    try:
        plan = plan_from(args)
    except BenchError as exc:
        print(f"bench_scaling: {exc}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("bench_scaling: needs root (the emulated network)", file=sys.stderr)
        return 1
    from experiments.progress import RichObserver

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    try:
        for config in plan:
            with RichObserver() as observer:
                summary = BenchRun(replace(config), observer).run_all().summary()
            runs.append(summary)
            rows += rows_from(summary)
    except KeyboardInterrupt:
        print("bench_scaling: interrupted; the network taken down, nothing written", file=sys.stderr)
        return 130
    except (JobError, BenchError) as exc:
        print(f"bench_scaling: failed: {exc} (nothing written)", file=sys.stderr)
        return 1
    write(rows, runs, args, time.monotonic() - started)
    errors = [e for run in runs for e in run["errors"].values()]
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
