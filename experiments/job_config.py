"""What one job run runs: :class:`JobConfig`, the demo's defaults.

Its own module so that what reads a configuration (:mod:`experiments.results`,
:mod:`experiments.shadows`) need not import :mod:`experiments.job`, which runs the job
and imports them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from experiments.commands import REPO

DEFAULT_WORK_DIR = Path("/tmp/checkmate-demo")


@dataclass(frozen=True)
class JobConfig:
    """What a job run runs; the defaults are ``make demo``'s."""

    iterations: int = 100
    kill_iteration: int | None = 40
    """The iteration during which a worker is killed (None: no failure)."""
    kill_rank: int = 1
    elastic: bool = False
    """Restart without the failed worker's host (N-1 workers; the job is resized at the switch)
    instead of all N: the job continues, but is no longer bit-identical to the reference."""
    shadows_fail_too: bool = False
    """Stop the shadows together with the failed worker: the job must restore from their snapshots."""
    reference: bool = True
    """Also run the job without the failure and compare the final parameters bit for bit."""
    workers: tuple[str, ...] = ("h1", "h2", "h3")
    shadows: tuple[str, ...] = ("sh1", "sh2")
    job_id: int = 1
    global_batch: int = 48
    model_args: tuple[str, ...] = ()
    """Extra train_lm arguments (e.g. a smaller model: ``--width 32 --layers 1``)."""
    worker_module: str = "examples.train_lm"
    """What the workers run (``python -m``); it takes train_lm's options and writes its log."""
    topology: Path = REPO / "topologies" / "single.json"
    rename_switches: tuple[tuple[str, str], ...] = ()
    """(old, new) switch names in the private copy of the topology, so that it can run next to
    another network built from the same description (switch port interfaces are named after
    their switch, in the root namespace)."""
    switch_args: tuple[str, ...] = ()
    """``checkmate-net up --switch-args`` values (``[SWITCH=]ARGS``), e.g. seeded loss."""
    target: str = "embedded"
    work_dir: Path = DEFAULT_WORK_DIR
    results_dir: Path | None = REPO / "results"
    """Where demo.json and demo.png go (None: nowhere)."""
    snapshot_keep: int = 3
    """``checkmate-shadow run --keep``: snapshot steps each shadow keeps on disk."""
    network_timeout: float = 150.0
    shadow_start_timeout: float = 60.0
    train_timeout: float = 480.0
    verify_timeout: float = 60.0
    max_restarts: int = 3

    @property
    def python(self) -> str:
        return sys.executable
