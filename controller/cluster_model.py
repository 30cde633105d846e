"""The cluster-scale comparison's model: what checkpointing costs each system, and :func:`compare`.

Every output is ``projected``: the arithmetic below, not a measurement. docs/capacity.md
states the model and its limits.

The model per checkpoint (``S`` bytes of state, written as ``W`` shares, each staged by the
rank that writes it):

* ``snapshot_s = S / W / snapshot rate`` (device-to-host copy of one writer's share),
* ``write_s = S / min(storage write rate, W * per-writer rate)``,
* synchronous ``torch.save``: the GPUs wait ``snapshot_s + write_s`` every ``k``
  iterations; the checkpoint is durable when training resumes (``d = 0``);
* CheckFreq-style snapshot + background persist, and DCP ``async_save``: the GPUs wait
  ``snapshot_s`` every ``k`` iterations, and a snapshot first waits for the previous
  persist, i.e. ``max(0, write_s - k T)`` more; durable ``snapshot_s + write_s`` after the
  captured iteration (the model does not tell these two apart);
* Checkmate: a fixed share of every iteration (``checkmate_overhead``, 0 on clusters by
  the design's claim, an assumption), a checkpoint of every iteration certified
  ``checkmate_lag_iterations`` later (1.0 measured by ``make bench``), provided the shadows
  keep up (the planner says when they cannot).

Overhead when checkpointing every ``k`` iterations is the waiting per checkpoint over
``k T``. :mod:`controller.cluster_bench_check` feeds the same model this machine's measured figures.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from controller.capacity import PlanInfeasible, PlanRequest, plan
from controller.capacity_inputs import DEFAULT_SHADOW_BENCH, PlanError
from controller.cluster_inputs import ClusterConfig

logger = logging.getLogger(__name__)

OVERHEAD_BUDGET = 0.05
"""The overhead at which the interval is compared (5 % of an iteration)."""
MAX_INTERVAL = 10**9
"""The largest interval searched (iterations); a system that needs more is reported as not reaching 5 %."""
PEERS = ("torch-save", "checkfreq", "dcp-async")
SYSTEMS = ("checkmate", *PEERS)


@dataclass(frozen=True)
class SystemResult:
    """One checkpointing system on one cluster (every figure projected by the model)."""

    system: str
    wait_per_checkpoint_s: float
    """What the GPUs wait per checkpoint at k = 1 (Checkmate: per iteration)."""
    durable_delay_iterations: float
    """d: iterations after the captured one until the checkpoint is durable."""
    overhead_every_iteration: float
    """Overhead (share of an iteration) when checkpointing every iteration."""
    interval_at_budget: int | None
    """Smallest k with overhead <= 5 %; None when no k reaches it."""
    overhead_at_interval: float | None
    interval_s: float | None
    repeated_iterations: float | None
    """k/2 + d at that interval."""
    repeated_s: float | None
    """Repeated work plus the restart, seconds of the whole cluster, per failure."""
    repeated_gpu_hours: float | None
    lost_share: float | None
    """Share of the cluster's time lost at that interval: overhead plus failures x repeated time."""
    note: str = ""


@dataclass(frozen=True)
class Comparison:
    """A configuration, its derived figures, each system's result and Checkmate's shadows."""

    config: ClusterConfig
    state_bytes: float
    snapshot_s: float
    write_s: float
    failures_per_hour: float
    systems: tuple[SystemResult, ...]
    shadows: dict[str, Any] | None
    shadow_error: str | None
    more_often_at_budget: dict[str, float | None]
    """Per peer: its interval at 5 % over Checkmate's (None when either does not reach 5 %)."""
    throughput_every_iteration: dict[str, float]
    """Per peer: Checkmate's throughput over the peer's, both checkpointing every iteration."""
    repeated_work_saved: dict[str, float | None]
    """Per peer: 1 - Checkmate's repeated iterations over the peer's, each at its 5 % interval."""

    def system(self, name: str) -> SystemResult:
        for result in self.systems:
            if result.system == name:
                return result
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["config"]["sources"] = {k: str(v) for k, v in self.config.sources.items()}
        return document


def snapshot_seconds(config: ClusterConfig) -> float:
    """A writer's share copied from GPU to host memory."""
    return config.state_bytes / config.checkpoint_writers / (config.snapshot_gbytes_per_s * 1e9)


def write_seconds(config: ClusterConfig) -> float:
    """One checkpoint written: the storage's aggregate rate or the writers' own, whichever is lower."""
    rate = min(config.storage_write_gbytes_per_s, config.checkpoint_writers * config.writer_gbytes_per_s)
    return config.state_bytes / (rate * 1e9)


def overhead(
    system: str,
    k: int,
    snapshot_s: float,
    write_s: float,
    iteration_s: float,
    checkmate: float = 0.0,
    persist_cpu_s: float = 0.0,
) -> float:
    """Share of an iteration lost to checkpointing every ``k`` iterations.

    ``persist_cpu_s``: CPU time a background persist takes from training per checkpoint, where
    the writer shares its CPU with the training (0 on the clusters: training runs on the GPUs
    and the persist on host cores of its own; this machine's check sets it, see
    :mod:`controller.cluster_bench_check`). A synchronous save already pays it inside ``write_s``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if system == "checkmate":
        return checkmate
    if system == "torch-save":
        return (snapshot_s + write_s) / (k * iteration_s)
    if system in ("checkfreq", "dcp-async"):
        return (snapshot_s + max(0.0, write_s - k * iteration_s) + persist_cpu_s) / (k * iteration_s)
    raise ValueError(f"unknown system {system!r}")


def durable_delay(system: str, snapshot_s: float, write_s: float, iteration_s: float, lag: float) -> float:
    """Iterations after the captured iteration ends until its checkpoint is durable."""
    if system == "checkmate":
        return lag
    if system == "torch-save":
        return 0.0
    return (snapshot_s + write_s) / iteration_s


def interval_at(
    system: str,
    snapshot_s: float,
    write_s: float,
    iteration_s: float,
    checkmate: float = 0.0,
    budget: float = OVERHEAD_BUDGET,
) -> int | None:
    """Smallest k whose overhead is at most ``budget`` (it never rises with k); None past MAX_INTERVAL."""

    def ok(k: int) -> bool:
        return overhead(system, k, snapshot_s, write_s, iteration_s, checkmate) <= budget

    if system == "checkmate":
        return 1 if ok(1) else None
    if not ok(MAX_INTERVAL):
        return None
    low, high = 1, MAX_INTERVAL
    while low < high:
        middle = (low + high) // 2
        if ok(middle):
            high = middle
        else:
            low = middle + 1
    return low


def _system(
    config: ClusterConfig, name: str, snapshot_s: float, write_s: float, note: str = ""
) -> SystemResult:
    T = config.iteration_time_s
    lam = config.failures_per_hour / 3600
    every = overhead(name, 1, snapshot_s, write_s, T, config.checkmate_overhead)
    d = durable_delay(name, snapshot_s, write_s, T, config.checkmate_lag_iterations)
    wait = every * T
    k = None if note else interval_at(name, snapshot_s, write_s, T, config.checkmate_overhead)
    if k is None:
        return SystemResult(
            name,
            wait,
            d,
            every,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            note
            or (
                f"Checkmate costs {every:.1%} of every iteration, whatever the interval"
                if name == "checkmate"
                else f"no interval up to {MAX_INTERVAL:,} iterations keeps the overhead at 5 %"
            ),
        )
    o = overhead(name, k, snapshot_s, write_s, T, config.checkmate_overhead)
    t_eff = T * (1 + o)
    repeated = k / 2 + d
    repeated_s = repeated * t_eff + config.restart_s
    return SystemResult(
        name,
        wait,
        d,
        every,
        k,
        o,
        k * t_eff,
        repeated,
        repeated_s,
        repeated_s * config.gpus / 3600,
        o / (1 + o) + lam * repeated_s,
        note,
    )


def _shadows(config: ClusterConfig, shadow_bench: Path) -> tuple[dict[str, Any] | None, str | None]:
    request = PlanRequest(
        model_params=config.model_params,
        optimizer="adamw",
        iteration_time_s=config.iteration_time_s,
        dp=config.dp,
        tp=config.model_parallel,
        link_gbps=config.shadow_link_gbps,
        switch=config.switch,
        grad_dtype=config.grad_dtype,
        lag_iterations=config.checkmate_lag_iterations,
        shadow_bench=shadow_bench,
    )
    try:
        result = plan(request)
    except PlanInfeasible as exc:
        return exc.plan["shadows"], f"switch: {exc}"
    except PlanError as exc:
        return None, str(exc)
    return result["shadows"], None


def compare(config: ClusterConfig, shadow_bench: Path = DEFAULT_SHADOW_BENCH) -> Comparison:
    """Every system on ``config``; raises CompareError naming a bad field."""
    config.validate()
    snapshot_s = snapshot_seconds(config)
    write_s = write_seconds(config)
    shadows, shadow_error = _shadows(config, shadow_bench)
    note = f"shadows cannot keep up: {shadow_error}" if shadow_error else ""
    results = tuple(
        _system(config, name, snapshot_s, write_s, note if name == "checkmate" else "") for name in SYSTEMS
    )
    cm = results[0]
    often: dict[str, float | None] = {}
    throughput: dict[str, float] = {}
    saved: dict[str, float | None] = {}
    for peer in results[1:]:
        often[peer.system] = None
        if cm.interval_at_budget is not None and peer.interval_at_budget is not None:
            often[peer.system] = peer.interval_at_budget / cm.interval_at_budget
        throughput[peer.system] = (1 + peer.overhead_every_iteration) / (1 + cm.overhead_every_iteration)
        saved[peer.system] = None
        if cm.repeated_iterations is not None and peer.repeated_iterations:
            saved[peer.system] = 1 - cm.repeated_iterations / peer.repeated_iterations
    return Comparison(
        config,
        config.state_bytes,
        snapshot_s,
        write_s,
        config.failures_per_hour,
        results,
        shadows,
        shadow_error,
        often,
        throughput,
        saved,
    )
