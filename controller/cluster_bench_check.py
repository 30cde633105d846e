"""The comparison's model against this machine's measurements: :func:`machine_check`.

Feeds :mod:`controller.cluster_model` the figures ``make bench`` measured here
(results/bench.json, results/shadow_disk_bench.json) and sets its predicted ratios next to
the measured ones (issue 27, item 4).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.capacity_inputs import MEASURED
from controller.cluster_inputs import DEFAULT_BENCH, CompareError, Source
from controller.cluster_model import overhead

DEFAULT_DISK_BENCH = MEASURED / "shadow_disk_bench.json"


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
    writers: int = 1
    """Ranks that each write the whole state (DCP in a process: every rank, see :func:`machine_check`)."""

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
    storage: str = "local"
    """Where the run's peers wrote: ``local`` (this machine's disk) or ``remote`` (the storage host)."""
    persist_cpu_s: float = 0.0
    """CPU seconds one checkpoint's write takes on the writer's CPU (0: not measured)."""
    persist_cpu_source: str = "not measured (an older bench.json): 0"


def _state_bytes(run: Mapping[str, Any]) -> tuple[float, str]:
    model = str(run.get("settings", {}).get("model", ""))
    match = re.search(r"~([\d.]+) MB of parameters \+ AdamW state", model)
    if match:
        return float(match.group(1)) * 1e6, f"bench.json settings.model ({match.group(0)})"
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


def _storage(run: Mapping[str, Any]) -> str:
    """Where a bench.json run's peers wrote (``local`` in files older than ``--storage``)."""
    return str(run.get("storage") or run.get("settings", {}).get("storage") or "local")


def _persist_cpu(run: Mapping[str, Any], state_bytes: float) -> tuple[float, str] | None:
    """CPU seconds of one checkpoint-sized write on the workers' CPU set, and where it is from.

    Remote storage: the storage probe's own CPU time per write (``cpu_s_per_write``: the NFS
    client's work, run on the workers' CPU set). Local storage: the buffered write's wall time,
    which is CPU (a page-cache write is a copy in the kernel). None when not measured, or at
    another size than this checkpoint's.
    """
    emulation = run.get("emulation") or {}
    key = "remote_storage" if _storage(run) == "remote" else "storage"
    measured = emulation.get(key) or {}
    if not measured.get("bytes") or abs(math.log(float(measured["bytes"]) / state_bytes)) > math.log(2):
        return None
    if key == "remote_storage":
        cpu = measured.get("cpu_s_per_write")
        source = "bench.json emulation.remote_storage.cpu_s_per_write: the probe's CPU per write, measured"
    else:
        buffered = measured.get("buffered_s") or []
        cpu = statistics.median(buffered) if buffered else None
        source = "bench.json emulation.storage.buffered_s: a page-cache write's time, which is CPU, measured"
    if not isinstance(cpu, (int, float)) or cpu < 0:
        return None
    return float(cpu), source


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
    5 GB/s). DCP in a process (``dcp-process``, ``use_collectives=False``) plans without the
    other ranks, so each rank writes the whole replicated state: the run's workers times the
    bytes through the same storage (seen in the bench's counters: every rank sends one
    checkpoint's size per checkpoint, where ``torch.save`` and DCP with collectives send it once).
    A background persist (CheckFreq, DCP) hides the wait for the storage but not its CPU: here
    the writer shares the workers' CPU set with training, so its CPU per checkpoint (measured by
    the run's storage probe, :func:`_persist_cpu`) is added to the checkpoint's cost; on the
    clusters it is 0. Each peer's predicted ratio to its ideal is ``1 / (1 + overhead(k))``;
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
        workers = int(run.get("settings", {}).get("workers") or 1)
        persist = _persist_cpu(run, state)
        persist_cpu, persist_source = (
            persist if persist is not None else (0.0, MachineCheck.persist_cpu_source)
        )
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
            writers = workers if family == "dcp-process" else 1
            predicted = 1 / (
                1
                + overhead(model_system, int(k), snapshot_s, write_s * writers, T, 0.0, persist_cpu * writers)
            )
            rows.append(
                MachineRow(
                    run["workload"],
                    name,
                    model_system,
                    int(k),
                    predicted,
                    float(s["ratio_to_ideal"]),
                    writers,
                )
            )
        checks.append(
            MachineCheck(
                run["workload"],
                T * 1e3,
                state,
                state_source,
                rate / 1e6,
                write_s,
                tuple(rows),
                rate_source,
                _storage(run),
                persist_cpu,
                persist_source,
            )
        )
    return checks
