"""The cluster-scale comparison: Checkmate next to periodic checkpointing on named clusters.

``checkmate-ctl plan --compare [NAME ...]`` answers, for each named cluster configuration,
what each checkpointing system costs and what a failure costs with it:

* the per-iteration overhead when checkpointing every ``k`` iterations,
* the checkpoint interval at 5 % overhead (the smallest ``k`` whose overhead is at most 5 %),
* the repeated work per failure at that interval (``k/2 + d`` iterations, ``d`` the delay
  until a checkpoint is durable, plus the restart), at the cluster's failure rate,
* for Checkmate, the shadow cluster the capacity planner (:func:`controller.capacity.plan`)
  sizes from the apply rate measured in ``results/shadow_bench.json``.

Every input of a configuration carries a :class:`Source`: ``cited`` (a publication and the
figure it gives), ``derived`` (arithmetic on cited figures, the formula stated),
``measured`` (a results file of this repository) or ``assumed`` (nothing published that we
could cite; the value is ours). Every output is ``projected``: the arithmetic below, not a
measurement. docs/capacity.md states the model and its limits.

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
``k T``. :func:`machine_check` feeds the same model this machine's measured figures and
sets its predictions next to ``make bench``'s measured ratios (issue 27, item 4).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from controller.capacity import PlanInfeasible, PlanRequest, plan
from controller.capacity_inputs import DEFAULT_SHADOW_BENCH, GRAD_DTYPE_BYTES, MEASURED, PlanError

logger = logging.getLogger(__name__)

SourceKind = Literal["cited", "derived", "measured", "assumed", "given"]

OVERHEAD_BUDGET = 0.05
"""The overhead at which the interval is compared (5 % of an iteration)."""
MAX_INTERVAL = 10**9
"""The largest interval searched (iterations); a system that needs more is reported as not reaching 5 %."""
PEERS = ("torch-save", "checkfreq", "dcp-async")
SYSTEMS = ("checkmate", *PEERS)
SWITCHES = ("bmv2", "embedded", "tofino", "tofino2")
DEFAULT_BENCH = MEASURED / "bench.json"
DEFAULT_DISK_BENCH = MEASURED / "shadow_disk_bench.json"


class CompareError(ValueError):
    """A configuration the comparison refuses; the message names the field."""


@dataclass(frozen=True)
class Source:
    """Where one input comes from."""

    kind: SourceKind
    text: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.text}"


@dataclass(frozen=True)
class ClusterConfig:
    """One cluster and one job on it; ``sources`` names where each field's value comes from."""

    name: str
    description: str
    gpus: int
    gpu_memory_gib: float
    nic_gbps: float
    """Per-GPU network bandwidth, Gb/s (the shadows' links get the same unless set apart)."""
    model_params: float
    checkpoint_bytes_per_param: float
    """Bytes of checkpointed state per parameter (fp32 weights + optimizer moments)."""
    iteration_time_s: float
    """One training iteration without checkpoints."""
    dp: int
    model_parallel: int
    """GPUs per data-parallel replica (tp x pp): the planner's number of independent rings."""
    storage: str
    storage_write_gbytes_per_s: float
    """Aggregate write bandwidth of the checkpoint storage, GB/s (1e9 bytes)."""
    checkpoint_writers: int
    """Ranks that each write an equal share of one checkpoint."""
    writer_gbytes_per_s: float
    """Write bandwidth one writer can reach on its own, GB/s."""
    snapshot_gbytes_per_s: float
    """Copy rate of a writer's share from GPU memory to host memory, GB/s."""
    failures: float
    """Job interruptions counted over ``failure_window_days``."""
    failure_window_days: float
    restart_s: float
    """Time from a failure until training runs again (the same for every system)."""
    switch: str
    shadow_link_gbps: float
    grad_dtype: str
    checkmate_overhead: float
    """Share of an iteration Checkmate adds on the workers."""
    checkmate_lag_iterations: float
    sources: Mapping[str, Source] = field(default_factory=dict, compare=False)

    @property
    def state_bytes(self) -> float:
        return self.model_params * self.checkpoint_bytes_per_param

    @property
    def failures_per_hour(self) -> float:
        return self.failures / (self.failure_window_days * 24)

    def validate(self) -> None:
        """Refuse a configuration that cannot describe a cluster, naming the field."""
        for name in INPUT_FIELDS:
            if name not in self.sources:
                raise CompareError(f"{self.name}: {name} has no source (cited, derived, measured or assumed)")
        for name in ("gpus", "dp", "model_parallel", "checkpoint_writers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CompareError(f"{self.name}: {name} must be an integer >= 1, got {value!r}")
        for name in (
            "gpu_memory_gib",
            "nic_gbps",
            "model_params",
            "checkpoint_bytes_per_param",
            "iteration_time_s",
            "storage_write_gbytes_per_s",
            "writer_gbytes_per_s",
            "snapshot_gbytes_per_s",
            "failure_window_days",
            "shadow_link_gbps",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise CompareError(f"{self.name}: {name} must be a finite number, got {value!r}")
            if value <= 0:
                raise CompareError(f"{self.name}: {name} must be positive, got {value:g}")
        for name in ("failures", "restart_s", "checkmate_lag_iterations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise CompareError(f"{self.name}: {name} must be a finite number, got {value!r}")
            if value < 0:
                raise CompareError(f"{self.name}: {name} must be >= 0, got {value:g}")
        if not 0 <= self.checkmate_overhead < 1:
            raise CompareError(
                f"{self.name}: checkmate_overhead must be in [0, 1) (a share of an iteration), "
                f"got {self.checkmate_overhead!r}"
            )
        if self.dp < 2:
            raise CompareError(
                f"{self.name}: dp must be >= 2 (dp 1 has no all-reduce to copy), got {self.dp}"
            )
        if self.dp * self.model_parallel != self.gpus:
            raise CompareError(
                f"{self.name}: gpus {self.gpus} is not dp {self.dp} x model_parallel {self.model_parallel} "
                f"(= {self.dp * self.model_parallel})"
            )
        if self.checkpoint_writers > self.gpus:
            raise CompareError(
                f"{self.name}: checkpoint_writers {self.checkpoint_writers} exceeds gpus {self.gpus}"
            )
        memory = self.gpus * self.gpu_memory_gib * 2**30
        if self.state_bytes > memory:
            raise CompareError(
                f"{self.name}: model_params {self.model_params:g} x checkpoint_bytes_per_param "
                f"{self.checkpoint_bytes_per_param:g} = {self.state_bytes / 1e12:.3g} TB of state "
                f"does not fit the GPUs' aggregate memory ({self.gpus} x {self.gpu_memory_gib:g} GiB "
                f"= {memory / 1e12:.3g} TB)"
            )
        if self.switch not in SWITCHES:
            raise CompareError(f"{self.name}: switch {self.switch!r} unknown; known: {', '.join(SWITCHES)}")
        if self.grad_dtype not in GRAD_DTYPE_BYTES:
            raise CompareError(
                f"{self.name}: grad_dtype {self.grad_dtype!r} unknown; known: {', '.join(GRAD_DTYPE_BYTES)}"
            )


INPUT_FIELDS = tuple(
    f.name for f in fields(ClusterConfig) if f.name not in ("name", "description", "sources")
)
"""The fields every configuration must source."""


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


# --- the model ------------------------------------------------------------------------------


def snapshot_seconds(config: ClusterConfig) -> float:
    """A writer's share copied from GPU to host memory."""
    return config.state_bytes / config.checkpoint_writers / (config.snapshot_gbytes_per_s * 1e9)


def write_seconds(config: ClusterConfig) -> float:
    """One checkpoint written: the storage's aggregate rate or the writers' own, whichever is lower."""
    rate = min(config.storage_write_gbytes_per_s, config.checkpoint_writers * config.writer_gbytes_per_s)
    return config.state_bytes / (rate * 1e9)


def overhead(
    system: str, k: int, snapshot_s: float, write_s: float, iteration_s: float, checkmate: float = 0.0
) -> float:
    """Share of an iteration lost to checkpointing every ``k`` iterations."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if system == "checkmate":
        return checkmate
    if system == "torch-save":
        return (snapshot_s + write_s) / (k * iteration_s)
    if system in ("checkfreq", "dcp-async"):
        return (snapshot_s + max(0.0, write_s - k * iteration_s)) / (k * iteration_s)
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


# --- the named configurations ---------------------------------------------------------------

LLAMA3 = "The Llama 3 Herd of Models (Llama Team, AI @ Meta, 2024)"
CHECKMATE_PAPER = "Checkmate: Zero-Overhead Model Checkpointing via Network Gradient Replication (NSDI 2024)"


def measured_lag(bench: Path | None = None) -> tuple[float, Source]:
    """Checkmate's mean shadow lag from make bench (results/bench.json), or 1.0 assumed without it."""
    path = DEFAULT_BENCH if bench is None else bench
    try:
        systems = json.loads(path.read_text())["systems"]
        lag = float(next(s for s in systems if s["name"] == "checkmate")["shadow_lag_iterations"]["mean"])
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return 1.0, Source("assumed", f"1 iteration ({path.name} has no Checkmate shadow lag to read)")
    return lag, Source(
        "measured",
        f"{path.name}: Checkmate's mean shadow lag after a step (make bench, the emulated network)",
    )


CHECKPOINT_STATE = Source(
    "assumed",
    "12 bytes per parameter: fp32 weights and AdamW's two fp32 moments "
    "(capacity_inputs.OPTIMIZER_STATE_BYTES); bf16 copies and data-loader state not counted",
)
DESIGN_ZERO = Source(
    "assumed",
    f"0: the design's claim ({CHECKMATE_PAPER}: per-iteration checkpoints at throughput comparable to a "
    "no-checkpoint baseline); this machine's software host agent measured 0.72-0.88x its ideal "
    "(docs/benchmarks.md)",
)


def _shared_sources(lag_source: Source) -> dict[str, Source]:
    """The sources both named configurations share (their values are the same too)."""
    return {
        "checkpoint_bytes_per_param": CHECKPOINT_STATE,
        "restart_s": Source("assumed", "10 minutes from a failure to training again, for every system"),
        "grad_dtype": Source("assumed", "gradients reduced in fp32"),
        "checkmate_overhead": DESIGN_ZERO,
        "checkmate_lag_iterations": lag_source,
    }


def _llama3_iteration_s() -> float:
    return 6 * 405e9 * 16e6 / (16384 * 400e12)


def _llama3() -> ClusterConfig:
    lag, lag_source = measured_lag()
    return ClusterConfig(
        name="llama3-405b",
        description="Llama 3 405B pre-training on Meta's 16K-H100 RoCE cluster, checkpoints to Tectonic",
        gpus=16384,
        gpu_memory_gib=80.0,
        nic_gbps=400.0,
        model_params=405e9,
        checkpoint_bytes_per_param=12.0,
        iteration_time_s=_llama3_iteration_s(),
        dp=128,
        model_parallel=128,
        storage="Tectonic (Meta's distributed file system)",
        storage_write_gbytes_per_s=2000.0,
        checkpoint_writers=16384,
        writer_gbytes_per_s=50.0,
        snapshot_gbytes_per_s=25.0,
        failures=419,
        failure_window_days=54,
        restart_s=600.0,
        switch="tofino2",
        shadow_link_gbps=400.0,
        grad_dtype="fp32",
        checkmate_overhead=0.0,
        checkmate_lag_iterations=lag,
        sources={
            **_shared_sources(lag_source),
            "gpus": Source("cited", f"{LLAMA3}, §3.3.1 and Table 4: up to 16K H100 GPUs (16,384 in Table 4)"),
            "gpu_memory_gib": Source("cited", f"{LLAMA3}, §3.3.1: H100 with 80 GB HBM3"),
            "nic_gbps": Source(
                "cited",
                f"{LLAMA3}, §3.3.1: RoCE and InfiniBand clusters, both 400 Gbps interconnects between GPUs",
            ),
            "model_params": Source("cited", f"{LLAMA3}: the 405B flagship model"),
            "iteration_time_s": Source(
                "derived",
                "6 x 405e9 parameters x 16M tokens per step / (16,384 GPUs x 400 TFLOP/s): tokens per "
                f"batch and TFLOPs/GPU from {LLAMA3}, Table 4 (16,384 GPUs, TP 8, PP 16, DP 128); "
                "the 6N FLOP rule is ours",
            ),
            "dp": Source("cited", f"{LLAMA3}, Table 4: DP 128 at 16,384 GPUs"),
            "model_parallel": Source("cited", f"{LLAMA3}, Table 4: TP 8 x PP 16 (CP 1) at 16,384 GPUs"),
            "storage": Source("cited", f"{LLAMA3}, §3.3.1: checkpoints and data on Tectonic"),
            "storage_write_gbytes_per_s": Source(
                "cited",
                f"{LLAMA3}, §3.3.1: Tectonic sustains 2 TB/s (7 TB/s peak) from 7,500 SSD servers; a shared "
                "file system, so the whole figure for one job's checkpoint is an upper bound",
            ),
            "checkpoint_writers": Source(
                "assumed", "every GPU writes an equal share (a sharded save deduplicating replicated state)"
            ),
            "writer_gbytes_per_s": Source("assumed", "one GPU's 400 Gb/s NIC (50 GB/s) carries its share"),
            "snapshot_gbytes_per_s": Source(
                "assumed",
                "25 GB/s device-to-host per GPU (PCIe Gen5 x16 is 64 GB/s per direction nominal; "
                "8 GPUs share a host)",
            ),
            "failures": Source("cited", f"{LLAMA3}, §3.3.4: 419 unexpected interruptions (466 in all)"),
            "failure_window_days": Source("cited", f"{LLAMA3}, §3.3.4: a 54-day snapshot of pre-training"),
            "switch": Source(
                "assumed",
                "a Tofino 2 leaf replicating (the cited cluster uses Arista 7800 and Minipack2 switches, "
                "which do not run P4)",
            ),
            "shadow_link_gbps": Source("assumed", "shadow hosts on 400 Gb/s links, as the GPUs"),
        },
    )


def _testbed() -> ClusterConfig:
    lag, lag_source = measured_lag()
    unknown = "not recalled with confidence from the paper: a stand-in, not the testbed's figure"
    return ClusterConfig(
        name="checkmate-testbed",
        description=(
            f"a stand-in for the published testbed ({CHECKMATE_PAPER}): every figure assumed, "
            "none could be cited with confidence"
        ),
        gpus=8,
        gpu_memory_gib=40.0,
        nic_gbps=100.0,
        model_params=1.5e9,
        checkpoint_bytes_per_param=12.0,
        iteration_time_s=0.5,
        dp=8,
        model_parallel=1,
        storage="each server's local NVMe SSD",
        storage_write_gbytes_per_s=16.0,
        checkpoint_writers=8,
        writer_gbytes_per_s=2.0,
        snapshot_gbytes_per_s=12.0,
        failures=419 * 8 / 16384,
        failure_window_days=54,
        restart_s=600.0,
        switch="tofino",
        shadow_link_gbps=100.0,
        grad_dtype="fp32",
        checkmate_overhead=0.0,
        checkmate_lag_iterations=lag,
        sources={
            **_shared_sources(lag_source),
            "gpus": Source("assumed", f"8 GPUs, one per server ({unknown})"),
            "gpu_memory_gib": Source("assumed", f"A100 40 GB ({unknown})"),
            "nic_gbps": Source("assumed", f"100 Gb/s NICs ({unknown})"),
            "model_params": Source("assumed", f"a GPT-2 XL sized model, 1.5B parameters ({unknown})"),
            "iteration_time_s": Source("assumed", f"0.5 s per iteration ({unknown})"),
            "dp": Source("assumed", "pure data parallelism over the 8 GPUs"),
            "model_parallel": Source("assumed", "no model parallelism"),
            "storage": Source(
                "assumed", "local NVMe SSDs (where the testbed wrote was not recalled with confidence)"
            ),
            "storage_write_gbytes_per_s": Source("assumed", "8 local NVMe SSDs at 2 GB/s each"),
            "checkpoint_writers": Source("assumed", "each server writes an equal share to its own SSD"),
            "writer_gbytes_per_s": Source("assumed", "2 GB/s sequential write of one NVMe SSD"),
            "snapshot_gbytes_per_s": Source(
                "assumed", "12 GB/s device-to-host (PCIe Gen4 x16, 32 GB/s nominal)"
            ),
            "failures": Source(
                "derived",
                f"{LLAMA3}'s 419 interruptions per 16,384 GPUs in 54 days, scaled to 8 GPUs (an assumption "
                "that failures scale with GPUs)",
            ),
            "failure_window_days": Source(
                "cited", f"{LLAMA3}, §3.3.4: 54 days (the window of the rate above)"
            ),
            "switch": Source("assumed", f"a Tofino switch replicates ({unknown} which model)"),
            "shadow_link_gbps": Source("assumed", "shadow hosts on 100 Gb/s links, as the GPUs"),
        },
    )


CONFIGS = {"checkmate-testbed": _testbed, "llama3-405b": _llama3}
"""The named cluster configurations, in the order the docs show them."""


def named(name: str) -> ClusterConfig:
    try:
        return CONFIGS[name]()
    except KeyError:
        raise CompareError(f"unknown cluster configuration {name!r}; known: {', '.join(CONFIGS)}") from None


def with_overrides(config: ClusterConfig, overrides: Iterable[tuple[str, str]]) -> ClusterConfig:
    """``config`` with FIELD=VALUE settings applied (each marked ``given``); names a bad field."""
    types = {f.name: f.type for f in fields(ClusterConfig)}
    changes: dict[str, Any] = {}
    sources = dict(config.sources)
    for name, text in overrides:
        if name not in INPUT_FIELDS:
            raise CompareError(f"--set {name}: no such field; fields: {', '.join(INPUT_FIELDS)}")
        kind = types[name]
        value: Any
        try:
            if kind == "int":
                value = int(text)
            elif kind == "float":
                value = float(text)
            else:
                value = text
        except ValueError:
            raise CompareError(
                f"--set {name}={text}: not {'an integer' if kind == 'int' else 'a number'}"
            ) from None
        changes[name] = value
        sources[name] = Source("given", f"--set {name}={text}")
    return replace(config, **changes, sources=sources)


# --- item 4: the model against make bench ---------------------------------------------------

SNAPSHOT_ON_CPU = Source(
    "assumed",
    "5 GB/s: deep copy of the state dict within host memory (training runs on CPUs here; not measured)",
)


@dataclass(frozen=True)
class MachineRow:
    """One measured system of make bench next to the model's prediction."""

    workload: str
    system: str
    modelled_as: str
    k: int
    predicted_ratio: float
    measured_ratio: float

    @property
    def error(self) -> float:
        """Predicted over measured, minus one."""
        return self.predicted_ratio / self.measured_ratio - 1


@dataclass(frozen=True)
class MachineCheck:
    workload: str
    iteration_ms: float
    state_bytes: float
    state_source: str
    write_rate_mb_s: float
    write_s: float
    rows: tuple[MachineRow, ...]
    write_rate_source: str = "results/shadow_disk_bench.json, the nearest size, measured"


def _state_bytes(run: Mapping[str, Any]) -> tuple[float, str]:
    model = str(run.get("settings", {}).get("model", ""))
    match = re.search(r"~([\d.]+) MB of parameters \+ AdamW state", model)
    if match:
        return float(match.group(1)) * 1e6, f"results/bench.json settings.model ({match.group(0)})"
    if run.get("workload") == "tinylm":
        return 136960 * 12.0, "TinyLM's 136,960 parameters (experiments/tiny_lm.py) x 12 bytes (fp32 + AdamW)"
    raise CompareError(
        f"results/bench.json: workload {run.get('workload')!r} does not state its checkpoint size"
    )


def _write_rate(disk_bench: Mapping[str, Any], state_bytes: float) -> float:
    """Bytes/s of the measured write closest in size to ``state_bytes``."""
    rows = [r for r in disk_bench.get("rows", []) if r.get("bytes_written") and r.get("seconds_per_write")]
    if not rows:
        raise CompareError("results/shadow_disk_bench.json has no measured writes")
    best = min(rows, key=lambda r: abs(math.log(r["bytes_written"] / state_bytes)))
    return float(best["bytes_written"]) / float(best["seconds_per_write"])


def _run_write_rate(run: Mapping[str, Any], state_bytes: float) -> tuple[float, str] | None:
    """Bytes/s the peers' storage took in the run's own emulation check, and where that figure is
    from (None: not measured there, or at another size than this checkpoint's).

    ``make bench`` writes the workload's checkpoint size where the peers write before the systems
    run (experiments.bench.emulation). With ``--storage remote`` the peers wrote to the storage
    host over NFS: its ``remote_storage`` figure, durable (the client commits every file it
    closes), is the one their checkpoints paid; otherwise the local directory's, buffered, as
    ``torch.save`` writes.
    """
    emulation = run.get("emulation") or {}
    for key, rate_field, source in (
        ("remote_storage", "durable_MBps", REMOTE_RATE_SOURCE),
        ("storage", "buffered_MBps", LOCAL_RATE_SOURCE),
    ):
        storage = emulation.get(key) or {}
        rate = storage.get(rate_field)
        if not isinstance(rate, (int, float)) or rate <= 0 or not storage.get("bytes"):
            continue
        if abs(math.log(float(storage["bytes"]) / state_bytes)) > math.log(2):
            continue  # measured at another size than this checkpoint's
        return float(rate) * 1e6, source
    return None


LOCAL_RATE_SOURCE = "bench.json emulation.storage: this run's peers' directory, buffered, measured"
REMOTE_RATE_SOURCE = "bench.json emulation.remote_storage: the run's storage host over NFS, durable, measured"


def machine_check(bench: Path = DEFAULT_BENCH, disk_bench: Path = DEFAULT_DISK_BENCH) -> list[MachineCheck]:
    """The model fed this machine's measured figures, next to make bench's measured ratios.

    Per workload (partitioned runs): the iteration time is ``ideal-gloo``'s, the write rate
    the one the run measured where the peers wrote at the checkpoint's size (bench.json
    ``emulation.remote_storage`` with ``--storage remote``, else ``emulation.storage``), else
    the shadow disk benchmark's at the nearest
    size; one writer (rank 0 saves everything), the snapshot a copy in host memory (assumed
    5 GB/s). Each peer's predicted ratio to its ideal is ``1 / (1 + overhead(k))``;
    Checkmate's is ``1 / (1 + 0)``.
    """
    try:
        document = json.loads(bench.read_text())
    except (OSError, ValueError) as exc:
        raise CompareError(f"cannot read the measured results: {exc}") from None
    disk: Mapping[str, Any] | None = None
    checks = []
    for run in document.get("runs", []):
        if run.get("placement") != "partitioned":
            continue
        systems = {s["name"]: s for s in run["systems"]}
        if "ideal-gloo" not in systems:
            continue
        T = systems["ideal-gloo"]["mean_iteration_ms"] / 1e3
        state, state_source = _state_bytes(run)
        measured = _run_write_rate(run, state)
        if measured is not None:
            rate, rate_source = measured
        else:
            if disk is None:
                try:
                    disk = json.loads(disk_bench.read_text())
                except (OSError, ValueError) as exc:
                    raise CompareError(f"cannot read the measured results: {exc}") from None
            rate = _write_rate(disk, state)
            rate_source = MachineCheck.write_rate_source
        write_s = state / rate
        snapshot_s = state / 5e9
        rows = []
        for name, s in systems.items():
            k = s.get("checkpoint_every")
            family = name.rsplit("-", 1)[0]
            if not k or s.get("ratio_to_ideal") is None:
                continue
            model_system = {
                "checkmate": "checkmate",
                "torch-save": "torch-save",
                "checkfreq": "checkfreq",
                "dcp-async": "dcp-async",
                "dcp-process": "dcp-async",
            }.get(family if name != "checkmate" else "checkmate")
            if model_system is None:
                continue
            predicted = 1 / (1 + overhead(model_system, int(k), snapshot_s, write_s, T))
            rows.append(
                MachineRow(run["workload"], name, model_system, int(k), predicted, float(s["ratio_to_ideal"]))
            )
        checks.append(
            MachineCheck(
                run["workload"], T * 1e3, state, state_source, rate / 1e6, write_s, tuple(rows), rate_source
            )
        )
    return checks


# --- rendering (strings; the CLI and the docs generator print them) ----------------------------

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
            f"- {check.workload}, {MODELLED[system]}: {within} of {len(rows)} within 15 %, "
            f"largest error {worst.error:+.1%} ({worst.system})"
        )
    return lines


def machine_markdown(checks: Iterable[MachineCheck]) -> list[str]:
    """Item 4's table: the model's predicted ratio to ideal next to make bench's measured one."""
    rows: list[str] = []
    for check in checks:
        rows += [
            f"**{check.workload}** (partitioned): iteration {check.iteration_ms:,.1f} ms "
            f"(`ideal-gloo`, measured); state {check.state_bytes / 1e6:,.1f} MB ({check.state_source}); "
            f"write {check.write_rate_mb_s:,.0f} MB/s ({check.write_rate_source}) = "
            f"{_duration(check.write_s)}; snapshot at 5 GB/s (assumed); one writer (rank 0 saves everything)",
            "",
            "| system | modelled as | every k | predicted ratio to its ideal | measured (results/bench.json) "
            "| error | within 15 % |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        rows += [
            f"| {r.system} | {MODELLED[r.modelled_as]} | {r.k} | {r.predicted_ratio:.3f} | "
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
