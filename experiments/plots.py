"""The figures experiments draw: ``demo.png``, ``bench.png`` and ``scaling.png`` (matplotlib, Agg).

Each function takes what the experiment measured (a :class:`~experiments.results.JobResult`
and its summary, or the summary documents ``bench.json`` and ``scaling.json`` hold) and
writes one PNG; :func:`save_atomically` writes it so that a reader never sees half a file.
Nothing here runs anything.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from experiments.results import JobResult


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported on first use: it is slow to import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_atomically(draw: Callable[[Path], None], path: Path) -> None:
    """``draw(temporary)`` next to ``path``, then rename it to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        draw(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def demo_plot(result: JobResult, summary: Mapping[str, Any], path: Path) -> None:
    """Loss over iterations (failure and recovery marked), the shadows' lag, and progress over time."""
    plt = _pyplot()
    main = result.main
    fig, (ax_loss, ax_lag, ax_time) = plt.subplots(
        3, 1, figsize=(9, 9), gridspec_kw={"height_ratios": [3, 1.3, 1.6]}
    )
    if result.reference is not None:
        ref = result.reference.mean_loss(0)
        ax_loss.plot(list(ref), list(ref.values()), color="0.75", lw=4, label="uninterrupted run (reference)")
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:purple"]
    for number in sorted(main.losses):
        losses = main.mean_loss(number)
        label = "before the failure" if number == 0 else f"after restart {number} (from the shadows)"
        ax_loss.plot(list(losses), list(losses.values()), color=colours[number % 4], lw=1.6, label=label)
    failure = summary.get("failure_iteration")
    resumed = summary.get("resumed_from_iteration")
    for ax in (ax_loss, ax_lag):
        if failure is not None:
            ax.axvline(failure, color="tab:red", ls="-", lw=1.2)
        if resumed is not None:
            ax.axvline(resumed, color="tab:green", ls="--", lw=1.2)
    if failure is not None:
        ax_loss.annotate(
            f"{summary['failed_worker']} killed (SIGKILL)\nduring iteration {failure}",
            xy=(failure, ax_loss.get_ylim()[1]),
            xytext=(6, -30),
            textcoords="offset points",
            color="tab:red",
            fontsize=9,
        )
    if resumed is not None:
        ax_loss.annotate(
            f"resumed at {resumed} from {summary['restore_source']}\n"
            f"lost work: {summary['lost_iterations']} iteration(s)",
            xy=(resumed, ax_loss.get_ylim()[1]),
            xytext=(6, -62),
            textcoords="offset points",
            color="tab:green",
            fontsize=9,
        )
    ax_loss.set_ylabel("training loss (mean over workers)")
    ax_loss.set_title(
        f"Checkmate demo: {summary['workers']} workers, {summary['shadows']} shadows, "
        f"{summary['iterations']} iterations, TinyLM"
    )
    ax_loss.legend(loc="upper right", fontsize=8)
    ax_loss.grid(alpha=0.3)
    for number in sorted(main.certified):
        lag = main.lag(number)
        ax_lag.step(list(lag), list(lag.values()), where="mid", color=colours[number % 4], lw=1.2)
    ax_lag.set_ylabel("shadow lag\n(iterations)")
    ax_lag.set_xlabel("iteration")
    ax_lag.set_ylim(bottom=0, top=max([2, *(v for n in main.certified for v in main.lag(n).values())]) + 0.5)
    ax_lag.yaxis.get_major_locator().set_params(integer=True)
    ax_lag.grid(alpha=0.3)
    start = min((t for per in main.times.values() for t in per.values()), default=0.0)
    for number in sorted(main.times):
        times = main.times[number]
        ax_time.plot([t - start for t in times.values()], list(times), color=colours[number % 4], lw=1.6)
    if result.reference is not None:
        ref_times = result.reference.times.get(0, {})
        if ref_times:
            ref_start = min(ref_times.values())
            ax_time.plot(
                [t - ref_start for t in ref_times.values()], list(ref_times), color="0.75", lw=3, zorder=0
            )
    if summary.get("recovery_seconds") is not None:
        ax_time.set_title(
            f"recovery (kill to first resumed iteration): {summary['recovery_seconds']:.1f} s", fontsize=9
        )
    ax_time.set_xlabel("seconds since the first iteration")
    ax_time.set_ylabel("iteration")
    ax_time.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_plot(summary: Mapping[str, Any], path: Path) -> None:
    """Iterations/s per system (with ratios to the ideals) and the expected work redone per failure."""
    plt = _pyplot()
    entries = summary["systems"]
    names = [e["name"] for e in entries]
    colours = []
    for e in entries:
        if e["checkpoint_every"] is None:
            colours.append("0.6")
        elif e["name"] == "checkmate":
            colours.append("tab:green")
        elif e["name"] == "host-replication":
            colours.append("tab:olive")
        elif e["name"].startswith("torch-save"):
            colours.append("tab:blue")
        else:
            colours.append("tab:purple")
    fig, (ax_rate, ax_rep) = plt.subplots(1, 2, figsize=(13, 5.2))
    bars = ax_rate.barh(names, [e["iterations_per_s"] for e in entries], color=colours)
    for bar, e in zip(bars, entries, strict=True):
        label = f" {e['iterations_per_s']:.1f}"
        if e["ratio_to_gloo_ideal"] is not None:
            label += f"  ({e['ratio_to_gloo_ideal']:.2f}x gloo"
            if e["transport"] != "gloo" and e["ratio_to_ideal"] is not None:
                label += f", {e['ratio_to_ideal']:.2f}x same transport"
            label += ")"
        ax_rate.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=8)
    ax_rate.invert_yaxis()
    ax_rate.set_xlabel("iterations/s (higher is better)")
    ax_rate.set_xlim(0, max(e["iterations_per_s"] for e in entries) * 1.6)
    settings = summary["settings"]
    placement = summary.get("cpu_placement", {}).get("mode", "colocated")
    ax_rate.set_title(
        f"throughput ({settings.get('workers', 3)} workers, {settings.get('workload', 'tinylm')}, "
        f"{placement}, emulated switch)",
        fontsize=10,
    )
    ax_rate.grid(axis="x", alpha=0.3)
    repeated = [e["expected_repeated_iterations_per_failure"] for e in entries]
    shown = [r if r is not None else 0 for r in repeated]
    bars = ax_rep.barh(names, shown, color=colours)
    for bar, r, e in zip(bars, repeated, entries, strict=True):
        text = " no checkpoint: whole run" if r is None else f" {r:.2f} (every {e['checkpoint_every']})"
        ax_rep.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, text, va="center", fontsize=8)
    ax_rep.invert_yaxis()
    ax_rep.set_yticklabels([])
    ax_rep.set_xlabel("expected repeated iterations per failure (lower is better)")
    ax_rep.set_xlim(0, max([1.0, *shown]) * 1.7)
    ax_rep.set_title("work redone after a failure", fontsize=10)
    ax_rep.grid(axis="x", alpha=0.3)
    load = summary["machine"].get("load_average_at_start")
    fig.suptitle(
        f"make bench — {summary['machine'].get('cores')} cores, {summary['settings']['rounds']} round(s) of "
        f"{summary['settings']['iterations_per_run']} iterations per system (load at start {load})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scaling_plot(rows: Sequence[Mapping[str, Any]], path: Path, title: str) -> None:
    """Mean iteration time per worker count (a line per workload and system); Checkmate vs. its ideal."""
    plt = _pyplot()
    fig, (ax_time, ax_ratio, ax_share) = plt.subplots(1, 3, figsize=(17, 4.8))
    keys = list(dict.fromkeys((r["workload"], r["system"]) for r in rows))
    for workload, system in keys:
        mine = sorted(
            (r for r in rows if r["workload"] == workload and r["system"] == system),
            key=lambda r: r["workers"],
        )
        style = "-" if system == "checkmate" else "--"
        ax_time.plot(
            [r["workers"] for r in mine],
            [r["mean_iteration_ms"] for r in mine],
            style,
            marker="o",
            label=f"{workload}: {system}",
        )
        if system == "checkmate":
            ratios = [(r["workers"], r["ratio_to_ideal"]) for r in mine if r["ratio_to_ideal"] is not None]
            if ratios:
                ax_ratio.plot(*zip(*ratios, strict=True), marker="o", label=workload)
            for key, style, what in (("network_share", "-", "network"), ("shadows_share", ":", "shadows")):
                shares = [(r["workers"], r[key]) for r in mine if r.get(key) is not None]
                if shares:
                    ax_share.plot(*zip(*shares, strict=True), style, marker="o", label=f"{workload}: {what}")
    ax_time.set_xlabel("workers")
    ax_time.set_ylabel("mean iteration time (ms)")
    ax_time.set_yscale("log")
    ax_time.grid(alpha=0.3)
    ax_time.legend(fontsize=7)
    ax_ratio.axhline(1.0, color="0.5", lw=0.8)
    ax_ratio.set_xlabel("workers")
    ax_ratio.set_ylabel("Checkmate / same-transport ideal (iterations/s)")
    ax_ratio.grid(alpha=0.3)
    ax_ratio.legend(fontsize=7)
    ax_share.set_xlabel("workers")
    ax_share.set_ylabel("Checkmate: CPUs busy (switch + softirq; shadows)")
    ax_share.grid(alpha=0.3)
    if ax_share.get_legend_handles_labels()[0]:
        ax_share.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
