"""What a job run shows as it goes: the :class:`Observer` interface and its displays.

:class:`~experiments.job.JobRun` reports each step (``phase``, ``advance``,
``phase_done``) and noteworthy events (``say``) to an :class:`Observer`; the
default one shows nothing (tests). :class:`RichObserver` draws a progress bar
per step with rich (``make demo``, ``make bench``), :class:`LogObserver` turns
the reports into log records, :class:`PhaseRenamer` shows the training step
under another name (the benchmark: the system being run).
:func:`print_summary` prints the demo's summary table.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class Observer:
    """What the demo reports as it goes; the default does nothing (tests), see :class:`RichObserver`."""

    def phase(self, name: str, total: int | None = None) -> None:
        """A step starts (``total``: its units, e.g. iterations)."""

    def advance(self, name: str, completed: int | None = None, info: str = "") -> None:
        """Progress within a step."""

    def phase_done(self, name: str, info: str = "") -> None:
        """A step ends."""

    def say(self, text: str) -> None:
        """Something worth a line of its own."""


class LogObserver(Observer):
    """A job run's reports as log records: step ends at INFO, events at WARNING."""

    def phase_done(self, name: str, info: str = "") -> None:
        logger.info("%s: %s", name, info)

    def say(self, text: str) -> None:
        logger.warning("%s", text)


class PhaseRenamer(Observer):
    """Shows another observer the "training" phase under the name of what is being run (``current``)."""

    def __init__(self, inner: Observer) -> None:
        self.inner = inner
        self.current = "training"

    def _name(self, name: str) -> str:
        return self.current if name == "training" else name

    def phase(self, name: str, total: int | None = None) -> None:
        self.inner.phase(self._name(name), total)

    def advance(self, name: str, completed: int | None = None, info: str = "") -> None:
        self.inner.advance(self._name(name), completed, info)

    def phase_done(self, name: str, info: str = "") -> None:
        self.inner.phase_done(self._name(name), info)

    def say(self, text: str) -> None:
        self.inner.say(text)


class RichObserver(Observer):
    """Progress bars per step, live training figures, and event lines, with rich."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.table import Column

        self.console = Console()
        self.progress = Progress(
            SpinnerColumn(finished_text="[green]✓"),
            TextColumn("[bold]{task.description}", table_column=Column(min_width=9, no_wrap=True)),
            BarColumn(bar_width=16),
            MofNCompleteColumn(table_column=Column(min_width=7, no_wrap=True)),
            TimeElapsedColumn(table_column=Column(min_width=7, no_wrap=True)),
            TextColumn("{task.fields[info]}", table_column=Column(ratio=1, no_wrap=True, overflow="crop")),
            console=self.console,
            refresh_per_second=8,
            expand=True,
        )
        self.tasks: dict[str, Any] = {}

    def __enter__(self) -> RichObserver:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def phase(self, name: str, total: int | None = None) -> None:
        if name in self.tasks:
            self.progress.reset(self.tasks[name], total=total, info="")
        else:
            self.tasks[name] = self.progress.add_task(name, total=total, info="")

    def advance(self, name: str, completed: int | None = None, info: str = "") -> None:
        if name in self.tasks:
            self.progress.update(self.tasks[name], completed=completed, info=info)

    def phase_done(self, name: str, info: str = "") -> None:
        if name in self.tasks:
            task = self.tasks[name]
            total = self.progress.tasks[task].total or 1
            self.progress.update(task, completed=total, info=f"[dim]{info}")
            self.progress.stop_task(task)

    def say(self, text: str) -> None:
        self.progress.console.print(f"  [yellow]▸[/] {text}")


def print_summary(
    console: Any, summary: dict[str, Any], json_path: Path | None, png_path: Path | None
) -> None:
    from rich.table import Table

    def yes_no(value: bool | None) -> str:
        return "[dim]not checked" if value is None else ("[green]yes, bit for bit" if value else "[red]NO")

    table = Table(title="Checkmate demo", show_header=False, title_style="bold")
    table.add_column(style="bold")
    table.add_column()
    certified = str(summary["certified_iterations"])
    if summary["certified_iterations"] == summary["iterations"]:
        certified += " (a checkpoint of every iteration)"
    failure = "none"
    if summary["failure_iteration"] is not None:
        failure = f"{summary['failed_worker']} killed during iteration {summary['failure_iteration']}"
    resumed = "-"
    if summary["resumed_from_iteration"] is not None:
        resumed = (
            f"iteration {summary['resumed_from_iteration']} from {summary['restore_source']} "
            f"(the state after iteration {summary['restored_checkpoint_iteration']})"
        )
    recovery = "-"
    if summary["recovery_seconds"] is not None:
        recovery = f"{summary['recovery_seconds']:.1f} s (kill to first resumed iteration)"
    lag = summary["shadow_lag_iterations"]
    rows = [
        ("workers / shadows", f"{summary['workers']} / {summary['shadows']}"),
        ("iterations", str(summary["iterations"])),
        ("certified iterations", certified),
        ("failure", failure),
        ("resumed at", resumed),
        ("lost iterations", str(summary["lost_iterations"])),
        ("recovery time", recovery),
        ("shadow lag", f"mean {lag['mean']}, max {lag['max']} iteration(s)"),
        ("protection", _protection(summary)),
        ("shadows == workers", yes_no(summary["shadow_equals_workers"])),
        ("recovered == uninterrupted", yes_no(summary["recovered_equals_uninterrupted"])),
        ("loss", f"{summary['first_loss']} -> {summary['final_loss']}"),
        ("iteration time", f"{summary['mean_iteration_ms']} ms"),
        ("copies to shadows", f"{summary['shadow_copies_packets']} packets (switch counter)"),
        ("total time", f"{summary['seconds']} s"),
    ]
    elastic = summary.get("elastic")
    if elastic:
        counts = " -> ".join(map(str, elastic["workers_per_incarnation"]))
        deviation = elastic["loss_max_relative_deviation_after_restart"]
        rows.insert(-4, ("elastic restart", f"workers {counts} (not bit-identical to the reference)"))
        rows.insert(-4, ("restored == uninterrupted", yes_no(elastic["restored_state_equals_reference"])))
        rows.insert(-4, ("loss after restart", f"max relative deviation from uninterrupted: {deviation}"))
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    if json_path is not None and png_path is not None:
        console.print(f"wrote {_shown(json_path)} and {_shown(png_path)}")


def _protection(summary: dict[str, Any]) -> str:
    """Whether rank 0 found the shadows protecting the job at every iteration (hosts.protection)."""
    count = summary.get("unprotected_iterations")
    if count is None:
        return "[dim]not recorded"
    if count == 0:
        return "[green]every iteration (certified within max_lag)"
    return f"[red]UNPROTECTED at {count} iteration(s): {summary.get('unprotected_reason')}"


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
