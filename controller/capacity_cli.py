"""``checkmate-ctl plan``: the capacity planner's command line and its text rendering.

The plan itself is :func:`controller.capacity.plan` (docs/capacity.md); this module
parses sizes such as ``70e9`` / ``7B`` / ``350M``, builds the
:class:`~controller.capacity.PlanRequest`, and prints the plan as text or JSON.
``plan --compare`` prints :mod:`controller.cluster_model`'s cluster-scale comparison
(the clusters in :mod:`controller.named_clusters`) instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from controller.capacity import PLAN_PARALLELISMS, PlanInfeasible, PlanRequest, plan
from controller.capacity_inputs import (
    DDP_DEFAULT_BUCKET_MB,
    DEFAULT_SHADOW_BENCH,
    GRAD_DTYPE_BYTES,
    OPTIMIZER_STATE_BYTES,
    PlanError,
)
from controller.cluster_bench_check import machine_check
from controller.cluster_inputs import DEFAULT_BENCH, CompareError, with_overrides
from controller.cluster_model import compare
from controller.cluster_render import machine_markdown, render_text
from controller.named_clusters import CONFIGS, named

logger = logging.getLogger(__name__)


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def render(result: dict[str, Any]) -> str:
    """The plan as text for a terminal."""
    r, s, sw, rep = (
        result["request"],
        result["shadows"],
        result["switch"],
        result["repeated_work_per_failure"],
    )
    ring = result["rings"]
    sent = ring["gradient_bytes_sent_per_worker_per_iteration"]
    buckets = (
        f"{r['fsdp_modules']} FSDP modules"
        if r["parallelism"] == "fsdp2"
        else f"{r['bucket_mb']:g} MB buckets"
    )
    lines = [
        f"{_si(r['model_params'], 'params')} {r['optimizer']}, {result['gpus']} GPUs "
        f"({r['parallelism']}: dp {r['dp']} x tp {r['tp']}), "
        f"{r['iteration_time_s'] * 1e3:g} ms/iteration, {r['grad_dtype']} gradients, {buckets}",
        f"protection: {result['protection']}",
        f"gradients sent per worker per iteration: {_si(sent['tagged'], 'B')} on the tagged ring "
        f"({_si(sent['untagged'], 'B')} without Checkmate); "
        f"{ring['parameter_all_gathers_per_iteration']} parameter all-gather(s), untagged",
        f"shadows: {s['processes']} processes ({s['per_ring']} per ring), one core each, on {s['hosts']} "
        f"host(s) (room for {s['shadows_per_host']} per host, limited by {s['host_limited_by']})",
        f"  each applies {_si(s['parameters_per_shadow'], 'params')} in "
        f"{s['apply_seconds_per_iteration'] * 1e3:.1f} ms "
        f"per iteration ({s['busy_share']:.0%} busy) at "
        f"{s['apply_rate_params_per_s_per_core'] / 1e6:.1f} M params/s",
        f"  memory {_si(s['memory_bytes_per_shadow'], 'B')} per shadow, "
        f"{_si(s['memory_bytes_total'], 'B')} in all",
        f"  link: {_si(s['link_bytes_per_shadow_per_iteration'], 'B')} per shadow per iteration, "
        f"{s['link_share_per_host']:.0%} of a host's {r['link_gbps']:g} Gb/s link",
        f"switch {sw['target']}: {sw['leaves']} leaves of {sw['workers_per_leaf']} workers; "
        "the busiest copies "
        f"{sw['copies_per_leaf_per_iteration']:,.0f} datagrams "
        f"({_si(sw['copy_bytes_per_leaf_per_iteration'], 'B')}) "
        f"per iteration, {sw['copy_gbps_per_leaf']:.2f} Gb/s",
    ]
    for row in sw["resources"]:
        mark = "ok  " if row["fits"] else "OVER"
        lines.append(f"  {mark} {row['resource']}: {row['needed']:,} of {row['limit']:,}")
    lines.append(
        f"repeated work per failure: {rep['iterations']:g} iterations = {rep['seconds']:.3g} s "
        f"= {rep['gpu_hours']:.3g} GPU-hours"
    )
    if rep["periodic"]:
        p = rep["periodic"]
        lines.append(
            f"  a checkpoint every {p['every']} iterations: {p['iterations']:g} iterations = "
            f"{p['gpu_hours']:.3g} GPU-hours ({p['checkmate_saves']:.0%} saved by Checkmate)"
        )
    lines.append("sources:")
    lines.extend(f"  {k}: {v}" for k, v in result["sources"].items())
    return "\n".join(lines)


def _number(text: str) -> float:
    """A size such as 70e9, 7B, 1.3b, 350M, 137k."""
    suffixes = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    cleaned = text.strip().replace("_", "").replace(",", "")
    factor = 1.0
    if cleaned and cleaned[-1].lower() in suffixes:
        factor = suffixes[cleaned[-1].lower()]
        cleaned = cleaned[:-1]
    try:
        value = float(cleaned) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 70e9, 7B, 350M)") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def parameter_count(text: str) -> int:
    """argparse type: a parameter count such as 7B or 350M, as a whole number (``job add --model-params``)."""
    value = _number(text)
    if value > 1e15:
        raise argparse.ArgumentTypeError(f"{text!r} is not a model size (more than 10^15 parameters)")
    return round(value)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (shared with controller.cli_parser)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def add_plan_parser(commands: Any) -> None:
    """Register ``plan`` on ``checkmate-ctl``'s sub-command parser."""
    p = commands.add_parser(
        "plan",
        help="capacity plan: shadows, memory, links and switch resources for a job size",
        description="How many shadow CPUs, how much memory, link and switch capacity a job needs "
        "(docs/capacity.md). Needs no network description and touches no switch.",
    )
    p.add_argument("--model-params", type=_number, help="parameters, e.g. 70e9, 7B, 350M (required)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE_BYTES), help="optimizer (required)")
    p.add_argument("--iteration-time", type=_number, help="seconds per training iteration (required)")
    p.add_argument("--dp", type=positive_int, help="data-parallel degree (workers per ring) (required)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (rings), default 1")
    p.add_argument("--link-gbps", type=_number, default=100.0, help="shadow host link, Gb/s (default 100)")
    p.add_argument("--switch", default="tofino", choices=["bmv2", "embedded", "tofino", "tofino2"])
    p.add_argument("--grad-dtype", default="fp32", choices=sorted(GRAD_DTYPE_BYTES), help="bucket dtype")
    p.add_argument(
        "--parallelism",
        default="ddp",
        choices=PLAN_PARALLELISMS,
        help="how the workers reduce gradients: ddp (all-reduce), fsdp2 (reduce-scatter per fully_shard "
        "module), zero1, zero2 (sized, not protected yet); tensor parallelism is --tp (default ddp)",
    )
    p.add_argument(
        "--fsdp-modules",
        type=positive_int,
        default=None,
        help="with --parallelism fsdp2: the fully_shard modules holding parameters (e.g. layers + 1)",
    )
    p.add_argument(
        "--bucket-mb",
        type=_number,
        default=None,
        help=f"DDP bucket_cap_mb, ZeRO's reduce bucket ({DDP_DEFAULT_BUCKET_MB:g}); not with fsdp2",
    )
    p.add_argument(
        "--shadow-cores-per-host", type=positive_int, default=32, help="cores per shadow host (32)"
    )
    p.add_argument("--shadow-memory-gib", type=_number, default=256.0, help="memory per shadow host (256)")
    p.add_argument(
        "--shadow-busy",
        type=float,
        default=0.5,
        help="share of an iteration a shadow may spend applying (0.5)",
    )
    p.add_argument("--workers-per-switch", type=positive_int, default=32, help="workers per leaf switch (32)")
    p.add_argument(
        "--max-groups",
        dest="plan_max_groups",
        type=positive_int,
        default=None,
        help="the switch's group limit",
    )
    p.add_argument("--switch-gbps", type=_number, default=None, help="the switch's capacity, Gb/s")
    p.add_argument("--lag", type=float, default=1.0, help="iterations until a step is certified (1)")
    p.add_argument(
        "--compare-every",
        type=positive_int,
        default=None,
        help="compare with a checkpoint every N iterations",
    )
    p.add_argument(
        "--shadows-per-ring",
        type=positive_int,
        default=None,
        help="use this many shadows per ring (default: fewest)",
    )
    p.add_argument("--shadow-bench", type=Path, default=DEFAULT_SHADOW_BENCH, help="make bench-shadow's JSON")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--compare",
        nargs="*",
        metavar="CLUSTER",
        default=None,
        help="instead of a plan: Checkmate next to torch.save, CheckFreq and DCP on named cluster "
        f"configurations ({', '.join(CONFIGS)}; all when none is named), docs/capacity.md",
    )
    p.add_argument(
        "--set",
        dest="compare_set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="with --compare: override a configuration's field (repeatable), "
        "e.g. storage_write_gbytes_per_s=500",
    )
    p.add_argument(
        "--check-bench",
        nargs="?",
        type=Path,
        const=DEFAULT_BENCH,
        default=None,
        metavar="BENCH_JSON",
        help="with --compare: also set the model, fed this machine's measured figures, "
        "next to make bench's ratios (from BENCH_JSON, default results/bench.json)",
    )


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    if args.parallelism == "fsdp2" and args.bucket_mb is not None:
        raise PlanError(
            "--bucket-mb with --parallelism fsdp2: FSDP2 reduce-scatters once per fully_shard module "
            "(--fsdp-modules), it has no buckets of its own"
        )
    return PlanRequest(
        model_params=args.model_params,
        optimizer=args.optimizer,
        iteration_time_s=args.iteration_time,
        dp=args.dp,
        tp=args.tp,
        link_gbps=args.link_gbps,
        switch=args.switch,
        grad_dtype=args.grad_dtype,
        bucket_mb=DDP_DEFAULT_BUCKET_MB if args.bucket_mb is None else args.bucket_mb,
        parallelism=args.parallelism,
        fsdp_modules=args.fsdp_modules,
        shadow_cores_per_host=args.shadow_cores_per_host,
        shadow_memory_gib=args.shadow_memory_gib,
        shadow_busy=args.shadow_busy,
        workers_per_switch=args.workers_per_switch,
        max_groups=args.plan_max_groups,
        switch_gbps=args.switch_gbps,
        lag_iterations=args.lag,
        compare_every=args.compare_every,
        shadows_per_ring=args.shadows_per_ring,
        shadow_bench=args.shadow_bench,
    )


def _size_flags(args: argparse.Namespace) -> list[tuple[str, object]]:
    """The job-size flags of ``plan`` with their values (None: not given)."""
    return [
        ("--model-params", args.model_params),
        ("--optimizer", args.optimizer),
        ("--iteration-time", args.iteration_time),
        ("--dp", args.dp),
    ]


def run_compare(args: argparse.Namespace, prog: str = "checkmate-ctl") -> int:
    """``checkmate-ctl plan --compare``: the cluster table; 2 naming the field for a bad configuration."""
    given = [flag for flag, value in _size_flags(args) if value is not None]
    if given:
        print(
            f"{prog}: error: plan --compare takes its sizes from the named configurations, not "
            f"{', '.join(given)} (use --set FIELD=VALUE)",
            file=sys.stderr,
        )
        return 2
    overrides: list[tuple[str, str]] = []
    for item in args.compare_set:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            print(f"{prog}: error: plan --compare: --set {item!r} is not FIELD=VALUE", file=sys.stderr)
            return 2
        overrides.append((name.strip(), value.strip()))
    try:
        configs = [with_overrides(named(name), overrides) for name in (args.compare or list(CONFIGS))]
        comparisons = [compare(config, args.shadow_bench) for config in configs]
        checks = machine_check(args.check_bench) if args.check_bench is not None else []
    except CompareError as exc:
        print(f"{prog}: error: plan --compare: {exc}", file=sys.stderr)
        return 2
    if args.json:
        document: dict[str, Any] = {"clusters": [c.to_json() for c in comparisons]}
        if args.check_bench is not None:
            document["machine_check"] = [
                {**asdict(check), "rows": [{**asdict(r), "error": r.error} for r in check.rows]}
                for check in checks
            ]
        print(json.dumps(document, indent=2))
        return 0
    print(render_text(comparisons))
    if args.check_bench is not None:
        print(f"\nthe model fed this machine's measured figures, next to make bench ({args.check_bench}):")
        print("\n".join(machine_markdown(checks)))
    return 0


def run_plan(args: argparse.Namespace, prog: str = "checkmate-ctl") -> int:
    """``checkmate-ctl plan``: print the plan; 1 with the limiting resource when none fits."""
    if args.compare is not None:
        return run_compare(args, prog)
    if args.compare_set or args.check_bench is not None:
        print(f"{prog}: error: plan: --set and --check-bench go with --compare", file=sys.stderr)
        return 2
    missing = [flag for flag, value in _size_flags(args) if value is None]
    if missing:
        print(
            f"{prog}: error: plan: the following arguments are required: {', '.join(missing)} (or --compare)",
            file=sys.stderr,
        )
        return 2
    try:
        result = plan(request_from_args(args))
    except PlanInfeasible as exc:
        if args.json:
            print(json.dumps({**exc.plan, "error": str(exc)}, indent=2))
        else:
            print(render(exc.plan))
        print(f"{prog}: error: cannot fit: {exc}", file=sys.stderr)
        return 1
    except PlanError as exc:
        print(f"{prog}: error: cannot plan: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0
