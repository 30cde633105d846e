"""The long-run and slow-shadow section of ``docs/reliability.md``, from what the runs measured.

``make soak`` runs ``python -m tests.shadow.soak`` (2,000 iterations with copy loss,
duplicates, reordering and shadow restarts) and ``python -m tests.shadow.pressure``
(one shadow slowed down) before the report; each writes its figures as JSON under
``results/``. This module turns those files into Markdown: every figure in the section
is read from them, none is written here. A soak whose final shadow state differs from
the workers' is a loss (:func:`soak_lost`), and the report exits non-zero for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SOAK_FILE = "soak.json"
PRESSURE_FILE = "shadow_pressure.json"


def _load(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when the file is absent. ValueError when it is not an object."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def soak_lost(results: Path) -> bool:
    """True when the recorded soak ended with shadows that differ from the workers."""
    soak = _load(results / SOAK_FILE)
    return soak is not None and soak.get("equal_to_workers") is not True


def _growth(figures: dict[str, Any]) -> str:
    early, late, peak = figures["early"], figures["late"], figures["max"]
    change = 100.0 * (late - early) / early if early else 0.0
    return f"{early:,.0f} -> {late:,.0f} ({change:+.1f} %, max {peak:,.0f})"


def _soak_lines(soak: dict[str, Any]) -> list[str]:
    copies = soak["copies"]
    lines = [
        f"**Soak** (`results/{SOAK_FILE}`): {soak['steps']} iterations in {soak['seconds']} s, "
        f"shadows restarted from their snapshots at iterations "
        f"{', '.join(str(i) for i in soak['shadow_restarts_at'])}; of {copies['copied']} copies "
        f"{copies['lost']} lost, {copies['duplicated']} duplicated, {copies['reordered']} reordered; "
        f"{soak['repaired_elements']:,} elements repaired. Final shadow state equal to the "
        f"workers' bit for bit: **{'yes' if soak['equal_to_workers'] else 'NO'}**. Snapshot "
        f"directories: at most {soak['step_dirs_max']}, {soak['step_dirs_last']} at the end; "
        f"disk at most {soak['disk_bytes']['max']:,} bytes. Sampled {soak['samples_taken']} times "
        "(early = median over the second quarter of the run, late = over the last quarter, "
        "max = from the second quarter on):",
        "",
        "| Process | Resident KiB early -> late | Open files early -> late | Threads early -> late |",
        "|---|---|---|---|",
    ]
    for name in ("rank0", "rank1", "shadows"):
        proc = soak[name]
        lines.append(
            f"| {name} | {_growth(proc['rss_kib'])} | {_growth(proc['fds'])} | {_growth(proc['threads'])} |"
        )
    return lines


def _pressure_lines(pressure: dict[str, Any]) -> list[str]:
    lines = [
        f"**A slow shadow** (`results/{PRESSURE_FILE}`; docs/shadow.md explains the mechanism):",
        "",
        "| Case | Worker iteration median / max | Slow shadow's largest lag | Largest stash / cap "
        "| Dropped copies | Certified never went back | Rank 0's certified lag at the end |",
        "|---|---|---:|---|---|---|---:|",
    ]
    for case, run in pressure.items():
        slow = run["slow_shadow"]
        drops = ", ".join(f"{k} {v}" for k, v in sorted(slow["drops"].items())) or "none"
        times = run["worker_iteration_ms"]
        lines.append(
            f"| {case} | {times['median']} / {times['max']} ms | {slow['max_lag_iterations']} "
            f"| {slow['max_stash_bytes']:,} / {slow['stash_limit_bytes']:,} B | {drops} "
            f"| {'yes' if slow['certified_never_went_back'] else 'NO'} "
            f"| {run['rank0_certified_lag_at_end']} |"
        )
    return lines


def render(results: Path) -> str:
    """The section's Markdown; empty when neither file exists."""
    soak, pressure = _load(results / SOAK_FILE), _load(results / PRESSURE_FILE)
    if soak is None and pressure is None:
        return ""
    lines = ["", "## Long runs and a slow shadow", ""]
    if soak is not None:
        lines += _soak_lines(soak) + [""]
    if pressure is not None:
        lines += _pressure_lines(pressure) + [""]
    return "\n".join(lines)
