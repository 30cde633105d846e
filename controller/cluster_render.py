"""The cluster-scale comparison as text and Markdown: what ``plan --compare`` and docs/capacity.md show.

Strings only (the CLI and the docs generator print them): :func:`render_text`,
:func:`markdown`, :func:`machine_markdown` (the check against make bench) and
:func:`storage_sensitivity` (a docs table).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from controller.capacity_inputs import DEFAULT_SHADOW_BENCH
from controller.cluster_bench_check import MachineCheck
from controller.cluster_inputs import INPUT_FIELDS, with_overrides
from controller.cluster_model import PEERS, SYSTEMS, Comparison, compare
from controller.named_clusters import named

LABELS = {
    "checkmate": "Checkmate",
    "torch-save": "torch.save (synchronous)",
    "checkfreq": "CheckFreq-style snapshot + persist",
    "dcp-async": "DCP async_save",
}


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def _times(value: float | None) -> str:
    return "—" if value is None else f"{value:,.2f}x"


def _saved(saved: float | None) -> str:
    if saved is None:
        return "repeated work not comparable"
    return f"{saved:.0%} less repeated work" if saved >= 0 else f"{-saved:.0%} more repeated work"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:,.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:,.1f} min"
    if seconds >= 1:
        return f"{seconds:,.2f} s"
    return f"{seconds * 1e3:,.1f} ms"


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.6g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _derived_line(c: Comparison) -> str:
    cfg = c.config
    mtbf = 1 / c.failures_per_hour if c.failures_per_hour > 0 else math.inf
    return (
        f"state {c.state_bytes / 1e9:,.1f} GB per checkpoint; snapshot {_duration(c.snapshot_s)} per writer; "
        f"write {_duration(c.write_s)} to {cfg.storage}; iteration {_duration(cfg.iteration_time_s)}; "
        f"{c.failures_per_hour:.3g} failures per hour (one every {_duration(mtbf * 3600)})"
    )


def _shadow_line(c: Comparison) -> str:
    if c.shadows is None:
        return f"shadows: cannot keep up: {c.shadow_error}"
    s = c.shadows
    line = (
        f"{s['processes']:,} shadow processes (one core each) on {s['hosts']:,} hosts, "
        f"{s['memory_bytes_total'] / 2**40:,.2f} TiB of shadow memory"
    )
    return line if c.shadow_error is None else f"{line}; does not fit: {c.shadow_error}"


def render_text(comparisons: Iterable[Comparison]) -> str:
    """The comparison for a terminal: per configuration, the systems, the ratios and every input's source."""
    lines: list[str] = []
    for c in comparisons:
        cfg = c.config
        lines += [
            f"{cfg.name}: {cfg.description}",
            f"  {cfg.gpus:,} GPUs (dp {cfg.dp} x model-parallel {cfg.model_parallel}); {_derived_line(c)}",
            f"  {'system':<36} {'overhead k=1':>12} {'k at 5 %':>9} {'overhead':>9} {'interval':>10} "
            f"{'repeated its':>12} {'repeated+restart':>16} {'GPU-h/failure':>13} {'time lost':>9}",
        ]
        for r in c.systems:
            lines.append(
                f"  {LABELS[r.system]:<36} {_pct(r.overhead_every_iteration):>12} "
                f"{'—' if r.interval_at_budget is None else f'{r.interval_at_budget:,}':>9} "
                f"{_pct(r.overhead_at_interval):>9} "
                f"{'—' if r.interval_s is None else _duration(r.interval_s):>10} "
                f"{'—' if r.repeated_iterations is None else f'{r.repeated_iterations:,.2f}':>12} "
                f"{'—' if r.repeated_s is None else _duration(r.repeated_s):>16} "
                f"{'—' if r.repeated_gpu_hours is None else f'{r.repeated_gpu_hours:,.1f}':>13} "
                f"{_pct(r.lost_share):>9}" + (f"  ({r.note})" if r.note else "")
            )
        for peer in PEERS:
            saved = c.repeated_work_saved[peer]
            lines.append(
                f"  Checkmate vs {LABELS[peer]}: {_times(c.more_often_at_budget[peer])} as often "
                f"at 5 % overhead, {_times(c.throughput_every_iteration[peer])} its throughput when both "
                "checkpoint every iteration, "
                f"{_saved(saved)} per failure (iterations, each at its 5 % interval)"
            )
        lines.append(
            f"  {_shadow_line(c)} (controller.capacity.plan, apply rate measured in "
            "results/shadow_bench.json)"
        )
        lines.append("  inputs:")
        for name in INPUT_FIELDS:
            lines.append(f"    {name} = {_value(getattr(cfg, name))}  [{cfg.sources[name]}]")
        lines.append(
            "  every figure in the table is projected by the model (docs/capacity.md), not measured; "
            "the inputs say which are cited, derived, measured, assumed or given"
        )
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def markdown(comparisons: Iterable[Comparison]) -> list[str]:
    """The docs' tables: the systems per configuration, the ratios, then every input with its source."""
    comparisons = list(comparisons)
    rows = [
        "| configuration | system | overhead, every iteration | interval at 5 % (iterations) "
        "| overhead there | interval | repeated iterations per failure | repeated work + restart "
        "| GPU-hours per failure | cluster time lost (overhead + failures) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in comparisons:
        for r in c.systems:
            rows.append(
                f"| {c.config.name} | {LABELS[r.system]} | {_pct(r.overhead_every_iteration)} | "
                f"{'—' if r.interval_at_budget is None else f'{r.interval_at_budget:,}'} | "
                f"{_pct(r.overhead_at_interval)} | "
                f"{'—' if r.interval_s is None else _duration(r.interval_s)} | "
                f"{'—' if r.repeated_iterations is None else f'{r.repeated_iterations:,.2f}'} | "
                f"{'—' if r.repeated_s is None else _duration(r.repeated_s)} | "
                f"{'—' if r.repeated_gpu_hours is None else f'{r.repeated_gpu_hours:,.1f}'} | "
                f"{_pct(r.lost_share)} |"
            )
    rows += [
        "",
        "| configuration | peer | Checkmate as often, at 5 % overhead "
        "| Checkmate's throughput, both every iteration "
        "| repeated work per failure saved (iterations, each at its 5 % interval) |",
        "|---|---|---:|---:|---:|",
    ]
    for c in comparisons:
        for peer in PEERS:
            saved = c.repeated_work_saved[peer]
            rows.append(
                f"| {c.config.name} | {LABELS[peer]} | {_times(c.more_often_at_budget[peer])} | "
                f"{_times(c.throughput_every_iteration[peer])} | {'—' if saved is None else f'{saved:.0%}'} |"
            )
    rows += [
        "",
        "| configuration | derived | Checkmate's shadows (the planner, projected) |",
        "|---|---|---|",
    ]
    for c in comparisons:
        rows.append(f"| {c.config.name} | {_derived_line(c)} | {_shadow_line(c)} |")
    for c in comparisons:
        rows += [
            "",
            f"Inputs of `{c.config.name}` ({c.config.description}):",
            "",
            "| field | value | source |",
            "|---|---:|---|",
        ]
        rows += [
            f"| `{name}` | {_value(getattr(c.config, name))} | {c.config.sources[name]} |"
            for name in INPUT_FIELDS
        ]
    return rows


MODELLED = {
    "checkmate": "Checkmate at no cost (the clusters' assumption)",
    "torch-save": LABELS["torch-save"],
    "checkfreq": LABELS["checkfreq"],
    "dcp-async": LABELS["dcp-async"],
}


def _error_summary(check: MachineCheck) -> list[str]:
    """Per modelled system: rows within 15 % and the largest error."""
    lines = []
    for system in SYSTEMS:
        rows = [r for r in check.rows if r.modelled_as == system]
        if not rows:
            continue
        within = sum(abs(r.error) <= 0.15 for r in rows)
        worst = max(rows, key=lambda r: abs(r.error))
        lines.append(
            f"- {check.workload} ({check.storage} storage), {MODELLED[system]}: "
            f"{within} of {len(rows)} within 15 %, "
            f"largest error {worst.error:+.1%} ({worst.system})"
        )
    return lines


def machine_markdown(checks: Iterable[MachineCheck]) -> list[str]:
    """Item 4's table: the model's predicted ratio to ideal next to make bench's measured one."""
    rows: list[str] = []
    for check in checks:
        rows += [
            f"**{check.workload}** (partitioned, {check.storage} storage): "
            f"iteration {check.iteration_ms:,.1f} ms "
            f"(`ideal-gloo`, measured); state {check.state_bytes / 1e6:,.1f} MB ({check.state_source}); "
            f"write {check.write_rate_mb_s:,.0f} MB/s ({check.write_rate_source}) = "
            f"{_duration(check.write_s)}; snapshot at 5 GB/s (assumed); "
            "one writer (rank 0 saves everything); a background persist's CPU on the workers' CPU set "
            f"{_duration(check.persist_cpu_s)} per checkpoint ({check.persist_cpu_source})",
            "",
            "| system | modelled as | every k | predicted ratio to its ideal | measured (bench.json) "
            "| error | within 15 % |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        rows += [
            f"| {r.system} | {MODELLED[r.modelled_as]}"
            + (f", {r.writers} ranks each writing the whole state" if r.writers > 1 else "")
            + f" | {r.k} | {r.predicted_ratio:.3f} | "
            f"{r.measured_ratio:.3f} | {r.error:+.1%} | {'yes' if abs(r.error) <= 0.15 else '**no**'} |"
            for r in check.rows
        ]
        rows += ["", *_error_summary(check), ""]
    return rows[:-1] if rows else ["(no partitioned run in results/bench.json)"]


STORAGE_SHARES = (1.0, 0.25, 0.1, 0.05)
"""Shares of the cited storage bandwidth one job's checkpoint gets (assumed; the table shows each)."""


def storage_sensitivity(
    name: str, shares: Iterable[float] = STORAGE_SHARES, shadow_bench: Path = DEFAULT_SHADOW_BENCH
) -> list[str]:
    """Checkmate against the peers as the storage bandwidth one job gets shrinks (a docs table)."""
    base = named(name)
    rows = [
        f"| `{name}`: share of {base.storage_write_gbytes_per_s:,g} GB/s | write | "
        + " | ".join(f"{LABELS[p]}: k at 5 % / Checkmate's throughput at k = 1" for p in PEERS)
        + " |",
        "|---:|---:|" + "---:|" * len(PEERS),
    ]
    for share in shares:
        config = with_overrides(
            base, [("storage_write_gbytes_per_s", repr(base.storage_write_gbytes_per_s * share))]
        )
        c = compare(config, shadow_bench)
        cells = []
        for peer in PEERS:
            k = c.system(peer).interval_at_budget
            cells.append(f"{'—' if k is None else f'{k:,}'} / {_times(c.throughput_every_iteration[peer])}")
        rows.append(f"| {share:.0%} | {_duration(c.write_s)} | " + " | ".join(cells) + " |")
    return rows
