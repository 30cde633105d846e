"""One cluster configuration for the comparison, and where each of its inputs comes from.

:class:`ClusterConfig` is one cluster and one job on it; every input carries a
:class:`Source`: ``cited`` (a publication and the figure it gives), ``derived``
(arithmetic on cited figures, the formula stated), ``measured`` (a results file of this
repository), ``assumed`` (nothing published that we could cite; the value is ours) or
``given`` (``--set FIELD=VALUE``, :func:`with_overrides`). :meth:`ClusterConfig.validate`
refuses a configuration that cannot describe a cluster, naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from controller.capacity_inputs import GRAD_DTYPE_BYTES, MEASURED

SourceKind = Literal["cited", "derived", "measured", "assumed", "given"]


SWITCHES = ("bmv2", "embedded", "tofino", "tofino2")
DEFAULT_BENCH = MEASURED / "bench.json"
STORAGE_BENCH = MEASURED / "bench_large_state_storage.json"
"""make bench's large-state workload on local and remote storage (issue 27), when run on its own."""


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
