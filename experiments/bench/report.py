"""What a benchmark run measured, and the files ``make bench`` writes: bench.json, bench.png, the docs table.

:class:`BenchResult` holds one (workload, placement) run's figures per system
and round; :meth:`BenchResult.summary` is its entry in ``bench.json``.
:func:`write_suite` writes the whole ``make bench`` (every run; the first also
at the top of ``bench.json``), the chart of the first run and the generated
section of ``docs/benchmarks.md`` between its bench-table markers — each file
atomically, and only when every run finished.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.bench import sweep
from experiments.bench.config import GLOO, SHADOW_DISK, WORKLOADS, BenchConfig, BenchError
from experiments.bench.cpu_time import mean_shares
from experiments.bench.emulation import compute_from, header_line
from experiments.bench.figures import LogFigures, frequency_targets, summarize, targets
from experiments.bench.worker_account import difference
from experiments.commands import REPO
from experiments.plots import bench_plot, save_atomically

TABLE_BEGIN = "<!-- bench-table:begin -->"
TABLE_END = "<!-- bench-table:end -->"
HEADLINE_BEGIN = "<!-- bench-headline:begin -->"
HEADLINE_END = "<!-- bench-headline:end -->"
README = REPO / "README.md"


def machine_info() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory_gib = round(pages / 2**30, 1)
    except (ValueError, OSError):
        pass
    import torch

    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def markdown_table(entries: Sequence[Mapping[str, Any]]) -> str:
    """The results as a Markdown table (the one in docs/benchmarks.md)."""

    def num(value: Any, digits: int = 2) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    lines = [
        "| system | transport | iterations/s | ms/iteration (mean / median) | checkpoint every | "
        "expected repeated iterations per failure | ratio to same-transport ideal | ratio to gloo ideal |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for e in entries:
        every = "never" if e["checkpoint_every"] is None else str(e["checkpoint_every"])
        repeated = e["expected_repeated_iterations_per_failure"]
        lines.append(
            f"| {e['name']} | {e['transport']} | {num(e['iterations_per_s'])} | "
            f"{num(e['mean_iteration_ms'], 1)} / {num(e.get('median_iteration_ms'), 1)} | {every} | "
            f"{'whole run' if repeated is None else num(repeated)} | "
            f"{num(e['ratio_to_ideal'], 3)} | {num(e['ratio_to_gloo_ideal'], 3)} |"
        )
    return "\n".join(lines) + "\n"


def update_docs_table(
    path: Path, table: str, header: str, markers: tuple[str, str] = (TABLE_BEGIN, TABLE_END)
) -> bool:
    """Replace the text between the ``markers`` (the bench-table ones) in ``path``; False when it has none."""
    start, stop = markers
    try:
        text = path.read_text()
    except OSError:
        return False
    begin, end = text.find(start), text.find(stop)
    if begin < 0 or end < begin:
        return False
    atomic_write_text(path, text[: begin + len(start)] + "\n" + header + "\n\n" + table + text[end:])
    return True


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` so that readers (and an interrupted run) never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


@dataclass
class BenchResult:
    config: BenchConfig
    runs: dict[str, list[LogFigures]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    switch_copies: dict[str, int | None] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    placement: dict[str, Any] = field(default_factory=dict)
    """System -> the CPU lists read back from /proc while it ran (role -> processes)."""
    placement_problems: list[str] = field(default_factory=list)
    cpu: dict[str, list[dict[str, Any] | None]] = field(default_factory=dict)
    """System -> per round, where the CPU time went (:func:`experiments.bench.cpu_time.cpu_shares`)."""
    worker_account: dict[str, list[dict[str, Any] | None]] = field(default_factory=dict)
    """System -> per round, what it cost each worker (:func:`experiments.bench.worker_account.account`)."""
    emulation: dict[str, Any] | None = None
    """The fabric and storage measured before the systems ran (experiments.bench.emulation.measure)."""
    shadow_snapshots: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """System -> per round, each shadow's snapshot writes (where, written, failed, the last failure)."""

    def summary(self) -> dict[str, Any]:
        known = self.config.known()
        ideals: dict[str, float | None] = {
            name: statistics.fmean(f.iterations_per_s for f in self.runs[name])
            if self.runs.get(name)
            else None
            for name in ("ideal-gloo", "ideal-cm-transport")
        }
        entries = {name: summarize(known[name], figs, ideals) for name, figs in self.runs.items() if figs}
        for name, per_round in self.cpu.items():
            if name in entries:
                entries[name]["cpu_time"] = mean_shares(per_round)
        for name, per_round in self.worker_account.items():
            if name in entries:
                entries[name]["worker_account"] = mean_shares(per_round)
        ideal_account = entries.get("ideal-cm-transport", {}).get("worker_account")
        for name, entry in entries.items():
            own = entry.get("worker_account")
            if ideal_account and own and name != "ideal-cm-transport" and known[name].transport != GLOO:
                entry["worker_account_vs_ideal_cm_transport"] = difference(own, ideal_account)
        for name, copies in self.switch_copies.items():
            if name in entries:
                entries[name]["switch_shadow_copies_packets"] = copies
        for name, writes in self.shadow_snapshots.items():
            if name in entries:
                entries[name]["shadow_snapshots"] = writes
        workload = WORKLOADS.get(self.config.workload)
        partition = self.config.partition
        swept = sweep.analyse(entries.values()) if self.config.sweep_ks else {}
        goals = targets(entries)
        if swept:
            goals["more_often_at_equal_throughput"] = frequency_targets(swept)
        emulation = dict(self.emulation) if self.emulation is not None else None
        if emulation is not None:
            emulation["compute"] = compute_from(entries)
        return {
            "systems": list(entries.values()),
            "emulation": emulation,
            "targets": goals,
            "sweep": swept,
            "errors": self.errors,
            "cpu_placement": {
                "mode": self.config.placement,
                "partition": partition.as_json() if partition is not None else None,
                "observed": self.placement,
                "problems": self.placement_problems,
            },
            "settings": {
                "workload": self.config.workload,
                "workers": self.config.workers,
                "shadows": 2,
                "iterations_per_run": self.config.iterations,
                "warmup_iterations_skipped": self.config.warmup,
                "k": self.config.k,
                "rounds": self.config.rounds,
                "global_batch": self.config.global_batch,
                "model": workload.description if workload else self.config.workload,
                "model_args": list(self.config.model_args),
                "sweep_k": list(self.config.sweep_ks),
                "network": f"topologies/single.json on the {self.config.target} target (Mininet)",
                "shadows_disk_tier": " ".join(SHADOW_DISK.split()),
                "storage": self.config.storage,
            },
            "machine": self.machine,
            "command": self.config.command,
            "seconds": round(self.seconds, 1),
        }


def write_outputs(result: BenchResult) -> dict[str, Any]:
    summary = result.summary()
    config = result.config
    if config.json_out is not None:
        atomic_write_text(config.json_out, json.dumps(summary, indent=2) + "\n")
    if config.png_out is not None and summary["systems"]:
        save_atomically(lambda path: bench_plot(summary, path), config.png_out)
    if config.docs is not None and summary["systems"]:
        machine = summary["machine"]
        settings = summary["settings"]
        header = (
            f"Measured by `{summary['command']}` on {machine.get('cores')} cores ({machine.get('cpu')}), "
            f"{machine.get('memory_gib')} GiB, torch {machine.get('torch')}; "
            f"{settings['rounds']} round(s) x {settings['iterations_per_run']} iterations per system, "
            f"first {settings['warmup_iterations_skipped']} skipped, k = {settings['k']}; load average "
            f"{machine.get('load_average_at_start')} at the start, {machine.get('load_average_at_end')} "
            f"at the end; {summary['seconds']} s in all."
        )
        update_docs_table(config.docs, markdown_table(summary["systems"]), header)
    return summary


def suite_summary(summaries: Sequence[Mapping[str, Any]], command: str, seconds: float) -> dict[str, Any]:
    """bench.json of a whole ``make bench``: every (workload, placement) run, the first one also at the top.

    The top-level ``systems``/``targets``/``sweep`` are the first run's (TinyLM, partitioned, by default),
    as the single-run file had them.
    """
    if not summaries:
        raise BenchError("no run to summarise")
    first = summaries[0]
    out = dict(first)
    out["runs"] = [
        {
            "workload": s["settings"]["workload"],
            "placement": s["cpu_placement"]["mode"],
            "storage": storage_of(s),
            **s,
        }
        for s in summaries
    ]
    several = len({storage_of(s) for s in summaries}) > 1
    out["errors"] = {
        f"{s['settings']['workload']}/{s['cpu_placement']['mode']}"
        + (f"/{storage_of(s)}" if several else "")
        + f": {name}": error
        for s in summaries
        for name, error in s["errors"].items()
    }
    out["command"] = command
    out["seconds"] = round(seconds, 1)
    return out


def storage_of(run: Mapping[str, Any]) -> str:
    """Where a run's peers (and shadows) wrote: ``local`` or ``remote`` (runs before the setting: local)."""
    return str(run.get("storage") or run.get("settings", {}).get("storage") or "local")


PLACEMENT_NAMES = {"partitioned": "partitioned", "colocated": "co-located"}


def placement_table(summaries: Sequence[Mapping[str, Any]], workload: str) -> str:
    """One workload's systems: a column group per placement measured (partitioned first), and within a
    placement one per storage when the runs wrote to more than one (local, then remote) side by side."""
    mine = [s for s in summaries if s["settings"]["workload"] == workload]
    several = len({storage_of(s) for s in mine}) > 1
    order = {"partitioned": 0, "colocated": 1, "local": 0, "remote": 1}
    keys = sorted(
        {(s["cpu_placement"]["mode"], storage_of(s)) for s in mine},
        key=lambda k: (order.get(k[0], 2), order.get(k[1], 2)),
    )
    runs = {(s["cpu_placement"]["mode"], storage_of(s)): s for s in mine}
    if not several and {mode for mode, _ in keys} <= {"partitioned", "colocated"}:
        keys = [(mode, keys[0][1]) for mode in ("partitioned", "colocated")]  # both placements, as before
    names: list[str] = []
    for run in runs.values():
        names += [e["name"] for e in run["systems"] if e["name"] not in names]

    def cell(key: tuple[str, str], name: str) -> str:
        entry = next((e for e in runs.get(key, {}).get("systems", []) if e["name"] == name), None)
        if entry is None:
            return "— | — | —"
        ratio = "—" if entry["ratio_to_ideal"] is None else f"{entry['ratio_to_ideal']:.3f}"
        gloo = "—" if entry["ratio_to_gloo_ideal"] is None else f"{entry['ratio_to_gloo_ideal']:.3f}"
        return f"{entry['iterations_per_s']:.2f} | {ratio} | {gloo}"

    def title(key: tuple[str, str]) -> str:
        mode = PLACEMENT_NAMES.get(key[0], key[0])
        return f"{mode}, {key[1]} storage" if several else mode

    lines = [
        "| system | every | "
        + " | ".join(
            f"{title(key)}: iterations/s | ratio to same-transport ideal | ratio to gloo ideal"
            for key in keys
        )
        + " |",
        "|---|---:|" + "---:|" * (3 * len(keys)),
    ]
    known = {e["name"]: e for run in runs.values() for e in run["systems"]}
    for name in names:
        every = known[name]["checkpoint_every"]
        cells = " | ".join(cell(key, name) for key in keys)
        lines.append(f"| {name} | {'never' if every is None else every} | {cells} |")
    return "\n".join(lines) + "\n"


def run_label(run: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> str:
    """``workload, placement``, and the storage when the runs wrote to more than one."""
    label = f"{run['workload']}, {run['placement']}"
    return label + (f", {storage_of(run)} storage" if len({storage_of(r) for r in runs}) > 1 else "")


def cpu_table(run: Mapping[str, Any]) -> str:
    """Where one run's CPU time went, per system (``cpu_time``; :mod:`experiments.bench.cpu_time`)."""
    lines = [
        "| system | workers' CPUs busy | infrastructure CPUs busy (softirq) | switch CPU | shadows CPU | "
        "shadows CPU ms per iteration |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for entry in run["systems"]:
        cpu = entry.get("cpu_time")
        if not cpu:
            lines.append(f"| {entry['name']} | — | — | — | — | — |")
            continue
        sets, roles = cpu.get("cpu_sets", {}), cpu.get("roles", {})
        workers = sets.get("workers") or sets.get("all")
        infra = sets.get("infrastructure")

        def pct(value: Any) -> str:
            return "—" if value is None else f"{100 * value:.0f} %"

        infra_text = "—" if infra is None else f"{pct(infra['busy'])} ({pct(infra['softirq'])})"
        shadows = roles.get("shadows", {})
        has_shadows = bool(shadows.get("processes"))
        lines.append(
            f"| {entry['name']} | {pct(workers and workers['busy'])} | {infra_text} | "
            f"{pct(roles.get('switch', {}).get('cpu_s_per_s'))} | "
            f"{pct(shadows.get('cpu_s_per_s')) if has_shadows else '—'} | "
            f"{shadows.get('cpu_ms_per_iteration') if has_shadows else '—'} |"
        )
    return "\n".join(lines) + "\n"


def targets_markdown(summary: Mapping[str, Any]) -> str:
    """Every run's targets as a list: the measured figure, the target, met or not (never assumed)."""

    def verdict(met: Any) -> str:
        return "**met**" if met is True else "**not met**" if met is False else "undecided"

    lines: list[str] = []
    for run in summary["runs"]:
        where = run_label(run, summary["runs"])
        goals = run.get("targets", {})
        for key, what in (
            ("vs_same_transport_ideal", "its same-transport ideal"),
            ("vs_gloo_ideal", "gloo's"),
        ):
            goal = goals.get(key)
            if goal:
                lines.append(
                    f"- {where}: Checkmate at {goal['ratio']:.3f}x {what} (target {goal['target']}): "
                    f"{verdict(goal['met'])}"
                )
        for name, goal in goals.get("vs_every_iteration_systems", {}).items():
            bound = goal.get("at_zero_cost")
            lines.append(
                f"- {where}: Checkmate {goal['speedup']:.3f}x `{name}` (target {goal['target']}x): "
                f"{verdict(goal['met'])}"
                + ("" if bound is None else f"; a Checkmate that cost nothing would be {bound:.3f}x")
            )
        for peer, goal in goals.get("more_often_at_equal_throughput", {}).items():
            times = goal.get("times_more_often")
            shown = f"{times:g}x" if times is not None else f">= {goal.get('at_least', 0):g}x"
            lines.append(
                f"- {where}: Checkmate checkpoints {shown} more often than `{peer}` at equal throughput "
                f"(target {goal['target']:g}x): {verdict(goal['met'])}"
            )
    return "\n".join(lines) + "\n"


def suite_markdown(summary: Mapping[str, Any]) -> str:
    """docs/benchmarks.md's generated section: the targets, then per workload the placement table, the k
    sweep and where the CPU time went."""
    runs = summary["runs"]
    parts: list[str] = ["Against issue 19's targets:\n\n" + targets_markdown(summary)]
    for workload in dict.fromkeys(r["workload"] for r in runs):
        mine = [r for r in runs if r["workload"] == workload]
        settings = mine[0]["settings"]
        parts.append(
            f"**{workload}** — {settings['model']}; {settings['rounds']} round(s) x >= "
            f"{settings['iterations_per_run']} iterations per system\n\n" + placement_table(mine, workload)
        )
        parts += [
            f"{run_label(run, runs).split(', ', 1)[1]}: {header_line(run.get('emulation'))}" for run in mine
        ]
        for run in mine:
            where = run_label(run, runs)
            if run["settings"].get("sweep_k") and any(k != "checkmate" for k in run.get("sweep", {})):
                parts.append(
                    f"Checkpoint interval sweep ({where}, k in "
                    f"{run['settings']['sweep_k']}):\n\n" + sweep.markdown(run["sweep"])
                )
            if any(e.get("cpu_time") for e in run["systems"]):
                parts.append(
                    f"Where the CPU time went ({where}; CPU-seconds per second of the "
                    "steady state, 100 % = one CPU):\n\n" + cpu_table(run)
                )
            if run["cpu_placement"]["problems"]:
                parts.append(
                    f"CPU placement problems ({where}): " + "; ".join(run["cpu_placement"]["problems"][:5])
                )
    return "\n".join(parts)


def write_suite(
    summaries: Sequence[Mapping[str, Any]], config: BenchConfig, seconds: float
) -> dict[str, Any]:
    """Write the combined bench.json, the first run's chart and the docs section (each file atomically)."""
    summary = suite_summary(summaries, config.command, seconds)
    if config.json_out is not None:
        atomic_write_text(config.json_out, json.dumps(summary, indent=2) + "\n")
    if config.png_out is not None and summary["systems"]:
        save_atomically(lambda path: bench_plot(summary, path), config.png_out)
    if config.docs is not None and summary["systems"]:
        machine, settings = summary["machine"], summary["settings"]
        partition = summary["cpu_placement"]["partition"]
        header = (
            f"Measured by `{summary['command']}` on {machine.get('cores')} cores ({machine.get('cpu')}), "
            f"{machine.get('memory_gib')} GiB, torch {machine.get('torch')}; {settings['workers']} workers; "
            f"{settings['rounds']} round(s) x >= {settings['iterations_per_run']} iterations per system, "
            "first "
            f"{settings['warmup_iterations_skipped']} skipped, k = {settings['k']}; partition "
            f"{json.dumps(partition)}; load average {machine.get('load_average_at_start')} "
            "at the start of the "
            f"first run; {summary['seconds']} s in all."
        )
        update_docs_table(config.docs, suite_markdown(summary), header)
        if config.docs.resolve().parent == README.parent / "docs":  # the project's own docs: its README too
            update_docs_table(README, targets_markdown(summary), header, (HEADLINE_BEGIN, HEADLINE_END))
    return summary
