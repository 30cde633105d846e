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
from experiments.bench.config import WORKLOADS, BenchConfig, BenchError
from experiments.bench.figures import LogFigures, frequency_targets, summarize, targets
from experiments.plots import bench_plot, save_atomically

TABLE_BEGIN = "<!-- bench-table:begin -->"
TABLE_END = "<!-- bench-table:end -->"


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


def update_docs_table(path: Path, table: str, header: str) -> bool:
    """Replace the text between the bench-table markers in ``path``; False when it has none."""
    try:
        text = path.read_text()
    except OSError:
        return False
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if begin < 0 or end < begin:
        return False
    atomic_write_text(path, text[: begin + len(TABLE_BEGIN)] + "\n" + header + "\n\n" + table + text[end:])
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

    def summary(self) -> dict[str, Any]:
        known = self.config.known()
        ideals: dict[str, float | None] = {
            name: statistics.fmean(f.iterations_per_s for f in self.runs[name])
            if self.runs.get(name)
            else None
            for name in ("ideal-gloo", "ideal-cm-transport")
        }
        entries = {name: summarize(known[name], figs, ideals) for name, figs in self.runs.items() if figs}
        for name, copies in self.switch_copies.items():
            if name in entries:
                entries[name]["switch_shadow_copies_packets"] = copies
        workload = WORKLOADS.get(self.config.workload)
        partition = self.config.partition
        swept = sweep.analyse(entries.values()) if self.config.sweep_ks else {}
        goals = targets(entries)
        if swept:
            goals["more_often_at_equal_throughput"] = frequency_targets(swept)
        return {
            "systems": list(entries.values()),
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
        {"workload": s["settings"]["workload"], "placement": s["cpu_placement"]["mode"], **s}
        for s in summaries
    ]
    out["errors"] = {
        f"{s['settings']['workload']}/{s['cpu_placement']['mode']}: {name}": error
        for s in summaries
        for name, error in s["errors"].items()
    }
    out["command"] = command
    out["seconds"] = round(seconds, 1)
    return out


def placement_table(summaries: Sequence[Mapping[str, Any]], workload: str) -> str:
    """One workload's systems: the partitioned figures, with the co-located ones as a second column."""
    runs = {s["cpu_placement"]["mode"]: s for s in summaries if s["settings"]["workload"] == workload}
    names: list[str] = []
    for run in runs.values():
        names += [e["name"] for e in run["systems"] if e["name"] not in names]

    def cell(mode: str, name: str) -> str:
        entry = next((e for e in runs.get(mode, {}).get("systems", []) if e["name"] == name), None)
        if entry is None:
            return "— | — | —"
        ratio = "—" if entry["ratio_to_ideal"] is None else f"{entry['ratio_to_ideal']:.3f}"
        gloo = "—" if entry["ratio_to_gloo_ideal"] is None else f"{entry['ratio_to_gloo_ideal']:.3f}"
        return f"{entry['iterations_per_s']:.2f} | {ratio} | {gloo}"

    lines = [
        "| system | every | partitioned: iterations/s | ratio to same-transport ideal | "
        "ratio to gloo ideal | "
        "co-located: iterations/s | ratio to same-transport ideal | ratio to gloo ideal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    known = {e["name"]: e for run in runs.values() for e in run["systems"]}
    for name in names:
        every = known[name]["checkpoint_every"]
        lines.append(
            f"| {name} | {'never' if every is None else every} | {cell('partitioned', name)} | "
            f"{cell('colocated', name)} |"
        )
    return "\n".join(lines) + "\n"


def suite_markdown(summary: Mapping[str, Any]) -> str:
    """docs/benchmarks.md's generated section: per workload the placement table and the k sweep."""
    runs = summary["runs"]
    parts: list[str] = []
    for workload in dict.fromkeys(r["workload"] for r in runs):
        mine = [r for r in runs if r["workload"] == workload]
        parts.append(f"**{workload}** — {mine[0]['settings']['model']}\n\n" + placement_table(mine, workload))
        for run in mine:
            if run["settings"].get("sweep_k") and any(k != "checkmate" for k in run.get("sweep", {})):
                parts.append(
                    f"Checkpoint interval sweep ({workload}, {run['placement']}, k in "
                    f"{run['settings']['sweep_k']}):\n\n" + sweep.markdown(run["sweep"])
                )
            if run["cpu_placement"]["problems"]:
                parts.append(
                    f"CPU placement problems ({workload}, {run['placement']}): "
                    + "; ".join(run["cpu_placement"]["problems"][:5])
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
    return summary
