"""Writes the planner's tables into docs/capacity.md (``python -m controller.capacity_table``).

Every figure in the tables comes from :func:`controller.capacity.plan`; nothing is typed
by hand. The text between the ``capacity-table`` markers is replaced; ``--check`` exits 1
when the file differs from what would be written (the test suite runs it).

Two tables: public model sizes from 8 to 10,000 GPUs on Tofino 2, and the small end
next to what ``make bench`` measured in the emulated network (results/bench.json). Between
the ``cluster-compare`` markers: the cluster-scale comparison of
:mod:`controller.cluster_model` and its check against make bench. Between the
``capacity-sharded`` markers: one model as DDP and as FSDP2 (``--parallelism``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from controller.capacity import PlanInfeasible, PlanRequest, plan
from controller.capacity_inputs import DEFAULT_SHADOW_BENCH, PlanError
from controller.cluster_bench_check import machine_check
from controller.cluster_inputs import DEFAULT_BENCH, STORAGE_BENCH, CompareError
from controller.cluster_model import compare
from controller.cluster_render import machine_markdown, markdown, storage_sensitivity
from controller.named_clusters import CONFIGS, named

logger = logging.getLogger(__name__)

DOC = Path(__file__).resolve().parents[1] / "docs" / "capacity.md"
"""The page this tool of the checkout rewrites (a checkout's docs/; an installed package has none)."""
BENCH = DEFAULT_BENCH
BEGIN = "<!-- capacity-table:begin (python -m controller.capacity_table writes this) -->"
END = "<!-- capacity-table:end -->"
COMPARE_BEGIN = "<!-- cluster-compare:begin (python -m controller.capacity_table writes this) -->"
COMPARE_END = "<!-- cluster-compare:end -->"
SHARDED_BEGIN = "<!-- capacity-sharded:begin (python -m controller.capacity_table writes this) -->"
SHARDED_END = "<!-- capacity-sharded:end -->"
SHARDED_MODEL = ("Llama-2 7B", 6.74e9, 64)
"""The sharded-job table's model, parameters and GPUs (dp; no TP: FSDP2 with TP is not protected)."""
SHARDED_LAYOUTS = (
    ("DDP, 25 MB buckets", "ddp", None),
    ("FSDP2, one `fully_shard` per block + the root (33 modules)", "fsdp2", 33),
    ("FSDP2, attention and MLP apart (65 modules)", "fsdp2", 65),
    ("FSDP2, 129 modules", "fsdp2", 129),
)

MODELS = (
    # name, parameters, tensor-parallel degree used in the table
    ("GPT-2 XL 1.5B", 1.5e9, 1),
    ("Llama-2 7B", 6.74e9, 2),
    ("Llama-2 13B", 13.0e9, 4),
    ("Llama-2 70B", 69.0e9, 8),
)
GPU_COUNTS = (8, 64, 512, 2048, 10000)
TOKENS_PER_REPLICA = 16384
"""Tokens one data-parallel replica processes per iteration (an assumption of the table)."""
GPU_FLOPS = 400e12
"""Achieved FLOP/s per GPU (an assumption: about 40% of an H100's dense bf16 peak)."""


def iteration_time(params: float, tp: int) -> float:
    """6 * params * tokens / (tp * FLOP/s): the assumed compute time of one iteration."""
    return 6 * params * TOKENS_PER_REPLICA / (tp * GPU_FLOPS)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f}"


def cluster_table(shadow_bench: Path) -> list[str]:
    rows = [
        "| model | GPUs (dp x tp) | s/iteration (assumed) | shadow processes (= cores) | shadow hosts "
        "(32 cores, 256 GiB) | shadow memory GiB | MB per shadow per iteration | busiest leaf: groups / "
        "replication entries / rids | copies Gb/s per leaf | repeated GPU-h per failure (every 100 its) |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for name, params, tp in MODELS:
        t = iteration_time(params, tp)
        for gpus in GPU_COUNTS:
            dp = gpus // tp
            layout = f"{gpus:,} ({dp} x {tp})"
            request = PlanRequest(
                model_params=params,
                optimizer="adamw",
                iteration_time_s=t,
                dp=dp,
                tp=tp,
                link_gbps=400,
                switch="tofino2",
                grad_dtype="fp32",
                workers_per_switch=32,
                compare_every=100,
                shadow_bench=shadow_bench,
            )
            try:
                r = plan(request)
            except PlanInfeasible as exc:
                rows.append(f"| {name} | {layout} | {t:.2f} | does not fit: {exc} |||||||")
                continue
            except PlanError as exc:
                rows.append(f"| {name} | {layout} | {t:.2f} | cannot plan: {exc} |||||||")
                continue
            s, sw, rep = r["shadows"], r["switch"], r["repeated_work_per_failure"]
            need = {row["resource"]: row["needed"] for row in sw["resources"]}
            rows.append(
                f"| {name} | {layout} | {t:.2f} | {s['processes']:,} | {s['hosts']:,} | "
                f"{_gib(s['memory_bytes_total'])} | {s['link_bytes_per_shadow_per_iteration'] / 1e6:,.0f} | "
                f"{need['multicast groups']:,} / {need['replicate_to_shadow entries']:,} / "
                f"{need['rewrite_shadow_copy entries (rids)']:,} | {sw['copy_gbps_per_leaf']:.1f} | "
                f"{rep['gpu_hours']:.2f} ({rep['periodic']['gpu_hours']:.1f}) |"
            )
    return rows


def sharded_table(shadow_bench: Path) -> list[str]:
    """One model as DDP and as FSDP2 with coarser and finer ``fully_shard`` modules (docs/capacity.md)."""
    name, params, dp = SHARDED_MODEL
    t = iteration_time(params, 1)
    rows = [
        f"{name} ({params:.3g} parameters) on {dp} GPUs at the assumed {t:.3f} s per iteration, AdamW, fp32 "
        "gradients, 400 Gb/s shadow links, Tofino 2:",
        "",
        "| layout | buckets of parameters | shadows (hosts) | per shadow: parameters, apply time, memory | "
        "busiest leaf: groups / entries | copied GB per ring per iteration | gradient GB a worker sends "
        "(without Checkmate) |",
        "|---|---|---:|---|---|---:|---|",
    ]
    for label, parallelism, modules in SHARDED_LAYOUTS:
        request = PlanRequest(
            model_params=params,
            optimizer="adamw",
            iteration_time_s=t,
            dp=dp,
            link_gbps=400,
            switch="tofino2",
            parallelism=parallelism,
            fsdp_modules=modules,
            shadow_bench=shadow_bench,
        )
        try:
            r = plan(request)
        except PlanError as exc:
            rows.append(f"| {label} | cannot plan: {exc} ||||||")
            continue
        ring, s = r["rings"], r["shadows"]
        need = {row["resource"]: row["needed"] for row in r["switch"]["resources"]}
        sent = ring["gradient_bytes_sent_per_worker_per_iteration"]
        rows.append(
            f"| {label} | {ring['buckets_per_ring']:,} of {ring['bucket_parameters'] / 1e6:,.2f} M | "
            f"{s['processes']:,} ({s['hosts']:,}) | {s['parameters_per_shadow'] / 1e6:,.0f} M, "
            f"{s['apply_seconds_per_iteration'] * 1e3:,.0f} ms, "
            f"{s['memory_bytes_per_shadow'] / 1e9:,.1f} GB | "
            f"{need['multicast groups']:,} / {need['replicate_to_shadow entries']:,} | "
            f"{ring['copied_bytes_per_ring_per_iteration'] / 1e9:,.2f} | "
            f"{sent['tagged'] / 1e9:,.1f} ({sent['untagged'] / 1e9:,.1f}) |"
        )
    return rows


def render_sharded(shadow_bench: Path = DEFAULT_SHADOW_BENCH) -> str:
    return "\n".join([SHARDED_BEGIN, "", *sharded_table(shadow_bench), "", SHARDED_END])


def bench_check(shadow_bench: Path, bench: Path) -> list[str]:
    """The planner for make bench's job next to what make bench measured."""
    try:
        measured: dict[str, Any] = json.loads(bench.read_text())
    except (OSError, ValueError) as exc:
        return [f"(no comparison: cannot read {bench}: {exc})"]
    settings = measured["settings"]
    systems = {s["name"]: s for s in measured["systems"]}
    cm = systems["checkmate"]
    t = cm["mean_iteration_ms"] / 1e3
    request = PlanRequest(
        model_params=136960,  # TinyLM's parameters (experiments/tiny_lm.py, ModelConfig())
        optimizer="adamw",
        iteration_time_s=t,
        dp=settings["workers"],
        link_gbps=1,
        switch="embedded",
        bucket_mb=0.1,  # train_lm.py's bucket_cap_mb
        shadows_per_ring=settings["shadows"],
        lag_iterations=cm["shadow_lag_iterations"]["mean"],
        shadow_bench=shadow_bench,
    )
    r = plan(request)
    fewest = plan(replace(request, shadows_per_ring=None))["shadows"]["processes"]
    per_iteration = r["rings"]["tagged_datagrams_per_ring_per_iteration"]
    iterations = settings["iterations_per_run"]
    measured_copies = cm["switch_shadow_copies_packets"]
    frames = {row["resource"]: row for row in r["switch"]["resources"]}[
        "frames per second in (ring traffic + copies)"
    ]
    return [
        "| figure | planner | make bench measured (results/bench.json) |",
        "|---|---:|---:|",
        f"| copies to shadows in one run of {iterations} iterations | {per_iteration} x {iterations} = "
        f"{per_iteration * iterations:,} | {measured_copies:,} (switch counter `shadow_copies`) |",
        f"| shadows needed / used | {fewest} needed, {r['shadows']['processes']} as run (CPU "
        f"{r['shadows']['busy_share']:.1%} busy) | {settings['shadows']} used; lag mean "
        f"{cm['shadow_lag_iterations']['mean']}, max {cm['shadow_lag_iterations']['max']} |",
        f"| frames/s into the switch | {frames['needed']:,} of {frames['limit']:,} lossless | no loss "
        "reported; iteration time includes retransmissions |",
        f"| repeated iterations per failure | {r['repeated_work_per_failure']['iterations']:g} "
        f"(0.5 + lag {request.lag_iterations:g}) | {cm['expected_repeated_iterations_per_failure']} |",
    ]


def render(shadow_bench: Path = DEFAULT_SHADOW_BENCH, bench: Path = BENCH) -> str:
    lines = [BEGIN, "", "### From 8 to 10,000 GPUs (Tofino 2, AdamW, fp32 gradients, 25 MB buckets)", ""]
    lines += cluster_table(shadow_bench)
    lines += ["", "### The small end next to the emulated run", ""]
    lines += bench_check(shadow_bench, bench)
    lines += ["", END]
    return "\n".join(lines)


def render_compare(shadow_bench: Path = DEFAULT_SHADOW_BENCH) -> str:
    """The cluster-scale comparison (controller.cluster_model) and its check against make bench."""
    comparisons = [compare(named(name), shadow_bench) for name in CONFIGS]
    lines = [COMPARE_BEGIN, "", *markdown(comparisons), ""]
    lines += [
        "### How much of the storage one job gets",
        "",
        *storage_sensitivity("llama3-405b", shadow_bench=shadow_bench),
    ]
    lines += ["", "### The model against make bench", ""]
    for bench in (DEFAULT_BENCH, STORAGE_BENCH):
        if bench != DEFAULT_BENCH and not bench.is_file():
            continue
        lines += [
            f"From `controller/measured/{bench.name}` (a copy of make bench's `results/{bench.name}`):",
            "",
        ]
        try:
            lines += machine_markdown(machine_check(bench))
        except CompareError as exc:
            lines.append(f"(no check: {exc})")
        lines.append("")
    lines.pop()
    lines += ["", COMPARE_END]
    return "\n".join(lines)


def update(text: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    if begin not in text or end not in text:
        raise ValueError(f"{DOC} lacks the markers {begin} ... {end}")
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    return head + table + tail


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/capacity.md is not up to date")
    parser.add_argument("--doc", type=Path, default=DOC)
    args = parser.parse_args(argv)
    current = args.doc.read_text()
    new = update(update(current, render()), render_compare(), COMPARE_BEGIN, COMPARE_END)
    new = update(new, render_sharded(), SHARDED_BEGIN, SHARDED_END)
    if args.check:
        if new != current:
            print(f"{args.doc} is out of date: run python -m controller.capacity_table", file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(new)
    print(f"wrote the tables in {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
