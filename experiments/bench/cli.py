"""``make bench``: Checkmate next to the checkpointing users pick today, on the demo's model and network.

    python -m experiments.bench [--workloads tinylm,large-state] [--placement partitioned,colocated]
        [--worker-cpus 0 --infra-cpus 1] [--sweep-k 1,2,4,8,16] [--iterations N] [--k 10]
        [--rounds 3] [--workers 3] [--systems a,b,...]

For each workload (``WORKLOADS``: TinyLM, and a large-state 21.7M-parameter TinyLM) and
each placement — *partitioned*: the workers pinned to one CPU set, the switch, supervisor,
shadows and this process to another (:mod:`experiments.bench.partition`; what ran where
is read back from /proc into the results), and *colocated*: no pinning — one invocation
brings up the demo's emulated network (``topologies/single.json``, more workers added for
``--workers`` > 4, on the embedded switch target, its switch renamed so it can run next
to other networks), trains with the DDP workers once per system, the same number of
iterations each, and takes the network down. In the first placement the peers
``torch-save``, ``checkfreq`` and ``dcp-process`` also run once per k of ``--sweep-k``
(:mod:`experiments.bench.sweep`: the smallest k within 5 % of the ideal / matching
Checkmate). The systems:

* ``ideal-gloo`` — DDP over gloo, no checkpoints;
* ``ideal-cm-transport`` — DDP over Checkmate's UDP transport, nothing tagged
  and nothing copied (no shadows, the job not registered at the switch): the
  same-transport ideal;
* ``checkmate`` — the switch copies the tagged all-gather packets to the
  shadows sh1, sh2 (started fresh), which certify every iteration;
* ``host-replication`` — no switch copies (the job is not registered at the
  switch and the workers send nothing tagged): each chunk owner sends its
  reduced chunk to the shadow itself (``CHECKMATE_REPLICATION=host``);
* ``torch-save-1`` / ``torch-save-K`` — rank 0 ``torch.save``s model and
  optimizer state (temp file, fsync, rename) after every iteration / every K;
* ``dcp-async-1`` / ``dcp-async-K`` — ``torch.distributed.checkpoint.async_save``
  on a separate gloo group, waiting for the previous save first;
* ``checkfreq-k`` — CheckFreq-style: rank 0 copies the state to CPU memory, a
  background thread persists it (the next snapshot waits for it);
* ``dcp-process-k`` — ``async_save`` with ``AsyncCheckpointerType.PROCESS`` and
  ``use_collectives=False``.

Figures (see docs/benchmarks.md for the definitions): iterations/s over the
steady-state iterations of rank 0's log (the first ``--warmup`` skipped),
checkpoint frequency, expected repeated iterations per failure
(``k/2 + d``: checkpoints every ``k`` iterations that become complete ``d``
iterations after the iteration they capture), and ratios to both ideals.
Writes ``results/bench.json`` (every run under ``runs``; the first also at the top),
``results/bench.png`` and, when the file has the markers, the tables in
``docs/benchmarks.md`` — each file atomically, and only when every run finished.
Options are checked before anything starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

from experiments.bench import partition as bench_partition
from experiments.bench import sweep as bench_sweep
from experiments.bench.partition import CpuPartition, PartitionError
from experiments.bench.sweep import SWEEP_PEERS, SweepError
from experiments.demo import DemoConfig, DemoError, DemoRun, Observer, RunSeries
from experiments.launcher import LaunchConfig
from topologies.runstate import RunState, RunStateError

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_WORK_DIR = Path("/tmp/checkmate-bench")
TABLE_BEGIN = "<!-- bench-table:begin -->"
TABLE_END = "<!-- bench-table:end -->"
GLOO = "gloo"
CM_UDP = "checkmate-udp"


class BenchError(RuntimeError):
    """The benchmark could not run; the message says why."""


# ---- the systems ----------------------------------------------------------------------------
@dataclass(frozen=True)
class System:
    """One way of training (and checkpointing) the same job."""

    name: str
    description: str
    transport: str
    """``gloo`` or ``checkmate-udp`` (Checkmate's transport and ring all-reduce)."""
    checkpoint: str
    """none | checkmate | host-replication | torch-save | checkfreq | dcp-async | dcp-process"""
    every: int | None
    """Checkpoint after every ``every``-th iteration (None: never)."""

    @property
    def shadows(self) -> bool:
        return self.checkpoint in ("checkmate", "host-replication")

    @property
    def switch_replicates(self) -> bool:
        return self.checkpoint == "checkmate"

    @property
    def ideal(self) -> str:
        """The ideal on the same transport."""
        return "ideal-gloo" if self.transport == GLOO else "ideal-cm-transport"


def systems_for(k: int) -> dict[str, System]:
    """Every system the benchmark knows, by name (``K`` in names is the chosen ``k``)."""
    found = [
        System("ideal-gloo", "DDP over gloo, no checkpoints", GLOO, "none", None),
        System("ideal-cm-transport", "DDP over Checkmate's UDP transport, no shadows", CM_UDP, "none", None),
        System("checkmate", "Checkmate: the switch copies to 2 shadows", CM_UDP, "checkmate", 1),
        System(
            "host-replication", "workers unicast their reduced chunks to 2 shadows", CM_UDP,
            "host-replication", 1,
        ),
        System("torch-save-1", "rank 0 torch.save every iteration", GLOO, "torch-save", 1),
        System(f"torch-save-{k}", f"rank 0 torch.save every {k} iterations", GLOO, "torch-save", k),
        System("dcp-async-1", "DCP async_save every iteration", GLOO, "dcp-async", 1),
        System(f"dcp-async-{k}", f"DCP async_save every {k} iterations", GLOO, "dcp-async", k),
    ]  # fmt: skip
    return {s.name: s for s in found}


BASELINE_KINDS = ("torch-save", "checkfreq", "dcp-async", "dcp-process")
"""Checkpointing done by train_lm itself (``--checkpoint KIND``)."""

_PEER_DESCRIPTIONS = {
    "torch-save": "rank 0 torch.save",
    "checkfreq": "CheckFreq-style: rank 0 snapshots to CPU memory, a background thread persists",
    "dcp-async": "DCP async_save (thread)",
    "dcp-process": "DCP async_save, AsyncCheckpointerType.PROCESS, use_collectives=False",
}


def peer_system(peer: str, k: int) -> System:
    """A baseline peer checkpointing after every ``k``-th iteration, over gloo."""
    when = "every iteration" if k == 1 else f"every {k} iterations"
    return System(f"{peer}-{k}", f"{_PEER_DESCRIPTIONS[peer]} {when}", GLOO, peer, k)


def all_systems(k: int, sweep_ks: Sequence[int] = ()) -> dict[str, System]:
    """:func:`systems_for` plus the CheckFreq-style and DCP-process peers at 1 and ``k``, and the sweep."""
    found = dict(systems_for(k))
    for peer in ("checkfreq", "dcp-process"):
        for every in (1, k):
            found.setdefault(f"{peer}-{every}", peer_system(peer, every))
    for peer in SWEEP_PEERS:
        for every in sweep_ks:
            found.setdefault(f"{peer}-{every}", peer_system(peer, every))
    return found


# ---- figures from the workers' logs (pure) --------------------------------------------------
def read_log(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a worker log (torn last lines skipped)."""
    records = []
    try:
        text = path.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


@dataclass
class LogFigures:
    """What one run's rank-0 log says."""

    iterations_per_s: float
    seconds: float
    """Wall time of the measured (steady-state) iterations."""
    iterations_measured: int
    mean_step_s: float
    median_step_s: float
    durable_delay_iterations: float | None
    """Mean delay between the end of an iteration a checkpoint captures and that checkpoint being
    complete, in iterations (None: no checkpoints)."""
    checkpoints: int
    shadow_lag: dict[str, float] | None = None


def steady_times(records: Iterable[Mapping[str, Any]], warmup: int) -> dict[int, float]:
    """Iteration -> the time rank 0 logged it, for the first start, without the first ``warmup``."""
    times: dict[int, float] = {}
    starts = 0
    for record in records:
        if record.get("event") == "start":
            starts += 1
            if starts > 1:
                break
        elif "loss" in record and "iteration" in record:
            times[int(record["iteration"])] = float(record["time"])
    return {i: t for i, t in sorted(times.items()) if i >= warmup}


def iteration_rate(times: Mapping[int, float]) -> tuple[float, float, int]:
    """(iterations/s, seconds, intervals): finished iterations over the time between the first and last."""
    if len(times) < 2:
        raise ValueError(f"need at least 2 logged iterations to measure a rate, got {len(times)}")
    ordered = sorted(times)
    first, last = ordered[0], ordered[-1]
    seconds = times[last] - times[first]
    if seconds <= 0:
        raise ValueError("the logged times do not increase")
    return (last - first) / seconds, seconds, last - first


def expected_repeated_iterations(every: int | None, durable_delay: float | None) -> float | None:
    """Expected iterations redone after a failure at a uniformly random moment of steady training.

    Checkpoints after every ``every``-th iteration, each complete ``durable_delay`` iterations
    after the end of the iteration it captures: the progress since the last complete checkpoint
    is uniform over [d, every + d), so its mean is (every - 1)/2 finished iterations + 1/2 of the
    interrupted one + d = every/2 + d. None: no checkpoints (the whole run so far is redone).
    """
    if every is None:
        return None
    return every / 2 + max(0.0, durable_delay or 0.0)


def checkpoint_delays(
    records: Iterable[Mapping[str, Any]], times: Mapping[int, float], step: float
) -> list[float]:
    """Per baseline checkpoint of a steady iteration: (durable - iteration logged) / step, >= 0.

    train_lm logs an iteration after its checkpoint call returns, so a synchronous save is
    complete by then (0); an asynchronous one completes later.
    """
    delays = []
    for record in records:
        if record.get("event") != "checkpoint":
            continue
        iteration = int(record["iteration"])
        if iteration in times:
            delays.append(max(0.0, (float(record["durable"]) - times[iteration]) / step))
    return delays


def certification_delays(
    records: Iterable[Mapping[str, Any]], times: Mapping[int, float], step: float
) -> tuple[list[float], list[int]]:
    """Checkmate: (per steady iteration i, an upper bound of the delay until the shadows held it, in
    iterations; the lag ``i - certified`` rank 0 saw right after each step).

    Rank 0 logs after each step the last iteration every shadow certified; iteration i is
    certified at the latest when the first log whose ``certified`` >= i is written.
    """
    certified: dict[int, int] = {}
    for record in records:
        if record.get("event") == "start" and certified:
            break
        if "loss" in record and record.get("certified") is not None:
            certified[int(record["iteration"])] = int(record["certified"])
    order = sorted(i for i in certified if i in times)
    lags = [i - certified[i] for i in order]
    delays: list[float] = []
    for position, i in enumerate(order):
        for j in order[position:]:
            if certified[j] >= i:
                delays.append(max(0.0, (times[j] - times[i]) / step))
                break
    return delays, lags


def figures(records: Sequence[Mapping[str, Any]], system: System, warmup: int) -> LogFigures:
    times = steady_times(records, warmup)
    rate, seconds, intervals = iteration_rate(times)
    step = 1.0 / rate
    delay: float | None = None
    count = 0
    lag: dict[str, float] | None = None
    if system.checkpoint in BASELINE_KINDS:
        delays = checkpoint_delays(records, times, step)
        count = len(delays)
        delay = statistics.fmean(delays) if delays else None
    elif system.shadows:
        delays, lags = certification_delays(records, times, step)
        count = len(delays)
        delay = statistics.fmean(delays) if delays else None
        if lags:
            lag = {
                "mean": round(statistics.fmean(lags), 3),
                "max": max(lags),
                "certified_share": round(len(delays) / len(times), 3),
            }
    ordered = [times[i] for i in sorted(times)]
    median = statistics.median(b - a for a, b in zip(ordered, ordered[1:], strict=False))
    return LogFigures(rate, seconds, intervals, step, median, delay, count, lag)


def summarize(
    system: System, per_round: Sequence[LogFigures], ideals: Mapping[str, float | None]
) -> dict[str, Any]:
    """One system's entry in bench.json (rounds averaged)."""
    rate = statistics.fmean(f.iterations_per_s for f in per_round)
    delays = [f.durable_delay_iterations for f in per_round if f.durable_delay_iterations is not None]
    delay = statistics.fmean(delays) if delays else (None if system.every is None else 0.0)
    same = ideals.get(system.ideal)
    gloo = ideals.get("ideal-gloo")
    cm = ideals.get("ideal-cm-transport")
    entry: dict[str, Any] = {
        "name": system.name,
        "description": system.description,
        "transport": system.transport,
        "iterations_per_s": round(rate, 3),
        "iterations_per_s_per_round": [round(f.iterations_per_s, 3) for f in per_round],
        "mean_iteration_ms": round(1000 / rate, 2),
        "median_iteration_ms": round(1000 * statistics.median(f.median_step_s for f in per_round), 2),
        "checkpoint_every": system.every,
        "durable_delay_iterations": None if delay is None else round(delay, 3),
        "expected_repeated_iterations_per_failure": (
            None if system.every is None else round(expected_repeated_iterations(system.every, delay) or 0, 3)
        ),
        "ideal": system.ideal,
        "ratio_to_ideal": round(rate / same, 3) if same else None,
        "ratio_to_gloo_ideal": round(rate / gloo, 3) if gloo else None,
        "ratio_to_cm_transport_ideal": round(rate / cm, 3) if cm else None,
        "seconds": round(sum(f.seconds for f in per_round), 2),
        "iterations_measured": sum(f.iterations_measured for f in per_round),
        "checkpoints_measured": sum(f.checkpoints for f in per_round),
    }
    lags = [f.shadow_lag for f in per_round if f.shadow_lag]
    if lags:
        entry["shadow_lag_iterations"] = {
            "mean": round(statistics.fmean(lag["mean"] for lag in lags), 3),
            "max": max(lag["max"] for lag in lags),
            "certified_share": round(statistics.fmean(lag["certified_share"] for lag in lags), 3),
        }
    return entry


def targets(entries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The targets (issue 19), checked: Checkmate >= 0.97 of its same-transport ideal and >= 0.95 of
    gloo's; >= 1.3x each every-iteration system (see :func:`frequency_targets` for the sweep's)."""
    out: dict[str, Any] = {}
    checkmate = entries.get("checkmate")
    if checkmate is None:
        return out
    for key, ideal, target in (
        ("vs_same_transport_ideal", "ideal-cm-transport", 0.97),
        ("vs_gloo_ideal", "ideal-gloo", 0.95),
    ):
        if ideal in entries:
            ratio = checkmate["iterations_per_s"] / entries[ideal]["iterations_per_s"]
            out[key] = {"ideal": ideal, "ratio": round(ratio, 3), "target": target, "met": ratio >= target}
    speedups = {}
    for name, entry in entries.items():
        if name != "checkmate" and entry.get("checkpoint_every") == 1:
            ratio = checkmate["iterations_per_s"] / entry["iterations_per_s"]
            speedups[name] = {"speedup": round(ratio, 3), "target": 1.3, "met": ratio >= 1.3}
    out["vs_every_iteration_systems"] = speedups
    return out


FREQUENCY_TARGET = 5.0


def frequency_targets(sweep: Mapping[str, Any]) -> dict[str, Any]:
    """Checkmate >= 5x more frequent than each swept peer at equal overhead (matching its throughput).

    A peer that never matched Checkmate within the sweep counts as met when the largest swept k
    already is >= 5 (the true k is larger); otherwise it is undecided (None), never guessed.
    """
    out: dict[str, Any] = {}
    for peer, result in sweep.items():
        match = result.get("matching_checkmate") if isinstance(result, Mapping) else None
        if match is None:
            continue
        if match["reached"]:
            times, met = match["times_more_often"], match["times_more_often"] >= FREQUENCY_TARGET
        else:
            times = None
            met = True if match["at_least"] >= FREQUENCY_TARGET else None
        out[peer] = {"times_more_often": times, "target": FREQUENCY_TARGET, "met": met, **match}
    return out


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


# ---- workloads, topology, atomic files ------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """A model and batch for train_lm: TinyLM as the demo trains it, or a large-state one."""

    name: str
    description: str
    model_args: tuple[str, ...]
    per_worker_batch: int
    iterations: int
    """Iterations per run unless --iterations says otherwise."""


WORKLOADS = {
    w.name: w
    for w in (
        Workload("tinylm", "TinyLM (examples/tiny_lm.py: width 64, 2 layers, ~0.1M parameters), "
                 "16 samples of 64 bytes per worker, AdamW", (), 16, 150),
        Workload("large-state", "TinyLM widened to width 768, 3 layers, 12 heads (~21.7M parameters, "
                 "~260 MB of parameters + AdamW state), 1 sample of 32 bytes per worker, 8 MB buckets",
                 ("--width", "768", "--layers", "3", "--heads", "12", "--context", "32",
                  "--bucket-cap-mb", "8"), 1, 30),
        Workload("medium", "TinyLM at width 256, 4 layers, 8 heads (~3.2M parameters), 4 samples of 64 bytes "
                 "per worker, 2 MB buckets (the scaling sweep's middle size)",
                 ("--width", "256", "--layers", "4", "--heads", "8", "--bucket-cap-mb", "2"), 4, 60),
    )
}  # fmt: skip
PLACEMENTS = ("partitioned", "colocated")
MIN_WORKERS, MAX_WORKERS = 2, 6
TOPOLOGY = REPO / "topologies" / "single.json"


def worker_names(count: int) -> tuple[str, ...]:
    return tuple(f"h{i}" for i in range(1, count + 1))


def scaled_topology(base: Mapping[str, Any], workers: int) -> dict[str, Any]:
    """``base`` (single.json) with worker hosts added up to ``workers`` (h5, h6 on new switch ports)."""
    data = json.loads(json.dumps(base))
    hosts = data["hosts"]
    switch = next(iter(data["switches"]))
    used = [int(end.rsplit("-p", 1)[1]) for link in data["links"] for end in link[:2] if "-p" in str(end)]
    port = max(used, default=0)
    for i in range(1, workers + 1):
        name = f"h{i}"
        if name in hosts:
            continue
        hosts[name] = {"ip": f"10.0.1.{i}/8", "mac": f"08:00:00:00:01:{i:02x}", "role": "worker"}
        port += 1
        data["links"].append([name, f"{switch}-p{port}"])
    return data


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` so that readers (and an interrupted run) never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


# ---- running it -----------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchConfig:
    iterations: int = 150
    warmup: int = 5
    k: int = 10
    rounds: int = 3
    systems: tuple[str, ...] = ()
    """Names to run (empty: all), in this order; later rounds alternate the order."""
    work_dir: Path = DEFAULT_WORK_DIR
    json_out: Path | None = REPO / "results" / "bench.json"
    png_out: Path | None = REPO / "results" / "bench.png"
    docs: Path | None = REPO / "docs" / "benchmarks.md"
    rename_switches: tuple[tuple[str, str], ...] = (("s1", "bn1"),)
    target: str = "embedded"
    global_batch: int = 48
    model_args: tuple[str, ...] = ()
    train_timeout: float = 600.0
    command: str = "make bench"
    workers: int = 3
    workload: str = "tinylm"
    placement: str = "colocated"
    """partitioned: workers on ``partition.workers``, everything else on ``partition.infrastructure``."""
    partition: CpuPartition | None = None
    sweep_ks: tuple[int, ...] = ()
    """Checkpoint intervals swept for each of SWEEP_PEERS (run in the partitioned placement only)."""

    def known(self) -> dict[str, System]:
        return all_systems(self.k, self.sweep_ks)

    def selected(self) -> list[System]:
        known = self.known()
        names = list(self.systems) or list(known)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise BenchError(f"unknown system(s) {unknown}; known: {list(known)}")
        return [known[n] for n in names]


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
        sweep = bench_sweep.analyse(entries.values()) if self.config.sweep_ks else {}
        goals = targets(entries)
        if sweep:
            goals["more_often_at_equal_throughput"] = frequency_targets(sweep)
        return {
            "systems": list(entries.values()),
            "targets": goals,
            "sweep": sweep,
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


class _Renamer(Observer):
    """Shows the demo's "training" phase under the name of the system being run."""

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


class BenchRun(DemoRun):
    """The demo's network, job and shadows, reused: one training run per system (and round)."""

    def __init__(self, config: BenchConfig, observer: Observer | None = None) -> None:
        self.bench = config
        self.renamer = _Renamer(observer or Observer())
        topology = TOPOLOGY
        workers = worker_names(config.workers)
        base = json.loads(TOPOLOGY.read_text())
        if any(w not in base["hosts"] for w in workers):
            topology = config.work_dir.resolve() / f"topology-{config.workers}-workers.json"
            atomic_write_text(topology, json.dumps(scaled_topology(base, config.workers), indent=2))
        demo = DemoConfig(
            iterations=config.iterations,
            kill_iteration=None,
            reference=False,
            workers=workers,
            global_batch=config.global_batch,
            model_args=config.model_args,
            topology=topology,
            rename_switches=config.rename_switches,
            target=config.target,
            work_dir=config.work_dir,
            results_dir=None,
            train_timeout=config.train_timeout,
            max_restarts=0,
        )
        super().__init__(demo, self.renamer)
        self.base_log_dir = self.log_dir
        self._system: System | None = None
        self._job_at_switch = False
        self._result: BenchResult | None = None
        self._sampled = False

    def run_all(self) -> BenchResult:
        started = time.monotonic()
        result = BenchResult(self.bench, machine=machine_info())
        self._result = result
        systems = self.bench.selected()
        partition = self.bench.partition if self.bench.placement == "partitioned" else None
        own_mask = bench_partition.available_cpus()
        try:
            if partition is not None:
                # the supervisor, switch, host shells and shadows are started from here: they inherit it
                bench_partition.pin_process(0, partition.infrastructure)
            self._prepare()
            self._network_up_step()
            self._add_job()
            self._job_at_switch = True
            for round_number in range(self.bench.rounds):
                order = systems if round_number % 2 == 0 else list(reversed(systems))
                for system in order:
                    try:
                        figs = self._run_system(system, round_number, result)
                    except (DemoError, ValueError) as exc:
                        result.errors[f"{system.name} (round {round_number + 1})"] = str(exc)[:2000]
                        self.observer.say(f"{system.name} failed: {str(exc)[:300]}")
                        continue
                    result.runs.setdefault(system.name, []).append(figs)
        finally:
            self._teardown()
            if partition is not None:
                bench_partition.pin_process(0, own_mask)
            result.machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
            result.seconds = time.monotonic() - started
        return result

    def _run_iterations(self, system: System) -> int:
        """Iterations for ``system``: enough for at least 3 of its checkpoints after the warmup."""
        every = system.every or 1
        return max(self.bench.iterations, self.bench.warmup + 3 * every + 2)

    def _show_progress(self, series: RunSeries, phase: str, incarnation: int, record: dict[str, Any]) -> None:
        super()._show_progress(series, phase, incarnation, record)
        if not self._sampled and int(record.get("iteration", -1)) >= self.bench.warmup:
            self._sampled = True
            try:
                self._sample_placement()
            except (OSError, ValueError) as exc:  # a process that ended while being read
                logger.warning("reading back the CPU placement: %s", exc)

    def _placement_roles(self) -> dict[str, list[int]]:
        """The pids of what runs now: workers, shadows, switch, supervisor (and host shells), this process."""
        roles: dict[str, list[int]] = {
            "workers": [],
            "shadows": [],
            "switch": [],
            "supervisor": [],
            "bench": [],
        }
        children = bench_partition.children_map()
        for rank in range(len(self.config.workers)):
            for record in read_log(self.log_dir / f"rank{rank}.jsonl"):
                if record.get("event") == "start" and isinstance(record.get("pid"), int):
                    pid = int(record["pid"])
                    roles["workers"] += [pid, *bench_partition.descendants(pid, children)]
                    break
        for process in self._shadows.values():
            roles["shadows"] += [process.pid, *bench_partition.descendants(process.pid, children)]
        try:
            state = RunState.load(self.net_dir)
            roles["switch"] = [record.pid for record in state.switches.values()]
            roles["supervisor"] = [state.supervisor_pid, *(h.pid for h in state.hosts.values())]
        except RunStateError as exc:
            logger.warning("no network state to read back the placement from: %s", exc)
        roles["bench"] = [os.getpid()]
        return roles

    def _sample_placement(self) -> None:
        result, system = self._result, self._system
        if result is None or system is None or system.name in result.placement:
            return
        observed = bench_partition.read_back(self._placement_roles())
        result.placement[system.name] = observed
        partition = self.bench.partition
        if self.bench.placement == "partitioned" and partition is not None:
            required = ("workers", "switch", "supervisor", "bench", *(("shadows",) if self._shadows else ()))
            problems = bench_partition.check_placement(observed, partition, required)
            result.placement_problems += [f"{system.name}: {p}" for p in problems]

    def _run_system(self, system: System, round_number: int, result: BenchResult) -> LogFigures:
        self._system = system
        self.renamer.current = f"{system.name} ({round_number + 1}/{self.bench.rounds})"
        self._sampled = False
        self.log_dir = self.base_log_dir / f"round{round_number + 1}-{system.name}"
        shutil.rmtree(self.log_dir, ignore_errors=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if system.switch_replicates != self._job_at_switch:
            if system.switch_replicates:
                self._add_job()
            else:
                self._ctl("job", "remove", str(self.config.job_id))
            self._job_at_switch = system.switch_replicates
        if system.shadows:
            shutil.rmtree(self.snapshot_dir, ignore_errors=True)
            self._start_shadows()
        series = RunSeries("main")
        try:
            self._train(series, None, system.shadows)
            if system.switch_replicates:
                result.switch_copies[system.name] = self._switch_counters().get("packets")
        finally:
            if self._shadows:
                self._stop_shadows()
        return figures(read_log(self.log_dir / "rank0.jsonl"), system, self.bench.warmup)

    def _launch_config(self, *args: Any, **kwargs: Any) -> LaunchConfig:
        """The demo's launch configuration plus this system's train_lm options and environment."""
        launch: LaunchConfig = super()._launch_config(*args, **kwargs)
        system = self._system
        if system is None:
            return launch
        extra: list[str] = []
        env = dict(launch.env)
        if system.transport == GLOO:
            extra.append("--no-checkmate")
        extra += ["--iterations", str(self._run_iterations(system))]  # the last --iterations counts
        if system.checkpoint in BASELINE_KINDS:
            assert system.every is not None
            checkpoints = self.work / "checkpoints" / system.name
            shutil.rmtree(checkpoints, ignore_errors=True)
            extra += ["--checkpoint", system.checkpoint, "--checkpoint-every", str(system.every)]
            extra += ["--checkpoint-dir", str(checkpoints)]
        if system.checkpoint == "host-replication" or system.name == "ideal-cm-transport":
            # host mode never tags; without shadows in the job file it copies nothing either
            env["CHECKMATE_REPLICATION"] = "host"
        command = (*launch.command, *extra)
        if self.bench.placement == "partitioned" and self.bench.partition is not None:
            command = (
                *bench_partition.exec_prefix(self.bench.partition.workers, self.config.python),
                *command,
            )
        return replace(launch, command=command, env=env)


# ---- outputs --------------------------------------------------------------------------------
def plot(summary: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
            if e["transport"] != GLOO and e["ratio_to_ideal"] is not None:
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


def write_outputs(result: BenchResult) -> dict[str, Any]:
    summary = result.summary()
    config = result.config
    if config.json_out is not None:
        atomic_write_text(config.json_out, json.dumps(summary, indent=2) + "\n")
    if config.png_out is not None and summary["systems"]:
        atomic_plot(summary, config.png_out)
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


def atomic_plot(summary: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        plot(summary, temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


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
                    f"{run['settings']['sweep_k']}):\n\n" + bench_sweep.markdown(run["sweep"])
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
        atomic_plot(summary, config.png_out)
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


# ---- the command line -----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="iterations per run (default per workload: "
        + ", ".join(f"{w.name} {w.iterations}" for w in WORKLOADS.values())
        + "); a sweep run gets at least warmup + 3k + 2",
    )
    parser.add_argument(
        "--workloads", default="tinylm,large-state", help=f"comma-separated, of {', '.join(WORKLOADS)}"
    )
    parser.add_argument(
        "--placement",
        default="partitioned,colocated",
        help="comma-separated, of partitioned (workers on --worker-cpus, switch + shadows + supervisor + "
        "this process on --infra-cpus) and colocated (no pinning); the first one also runs the k sweep",
    )
    parser.add_argument("--worker-cpus", default=None, help="CPU list for the workers (default: first half)")
    parser.add_argument(
        "--infra-cpus", default=None, help="CPU list for switch, shadows, supervisor (default: the rest)"
    )
    parser.add_argument(
        "--workers", type=int, default=defaults.workers, help=f"DDP workers ({MIN_WORKERS}-{MAX_WORKERS})"
    )
    parser.add_argument(
        "--sweep-k",
        default="1,2,4,8,16",
        help=f"checkpoint intervals swept for {', '.join(SWEEP_PEERS)} ('' for no sweep)",
    )
    parser.add_argument(
        "--warmup", type=int, default=defaults.warmup, help="first iterations left out of the rates"
    )
    parser.add_argument("--k", type=int, default=defaults.k, help="the 'every k iterations' baselines")
    parser.add_argument(
        "--rounds", type=int, default=defaults.rounds, help="runs per system (order alternates)"
    )
    parser.add_argument(
        "--systems",
        default="",
        help="comma-separated names to run (default all): "
        + ", ".join(systems_for(defaults.k)).replace(str(defaults.k), "K"),
    )
    parser.add_argument("--work-dir", type=Path, default=defaults.work_dir)
    parser.add_argument("--json", type=Path, default=defaults.json_out, help="results JSON")
    parser.add_argument("--png", type=Path, default=defaults.png_out, help="bar chart")
    parser.add_argument(
        "--docs",
        type=Path,
        default=defaults.docs,
        help="Markdown file whose bench-table markers get the table",
    )
    parser.add_argument("--no-docs", action="store_true", help="do not touch the docs table")
    parser.add_argument("--target", choices=["embedded", "bmv2"], default=defaults.target)
    parser.add_argument(
        "--switch-name",
        default=defaults.rename_switches[0][1],
        help="name of the benchmark's switch (its port interfaces are named after it; another name lets "
        "two benchmarks run side by side)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def _names(text: str, known: Sequence[str], option: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise BenchError(f"{option}: nothing given (known: {', '.join(known)})")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BenchError(f"{option}: unknown {unknown} (known: {', '.join(known)})")
    return names


def config_from(args: argparse.Namespace, command: str) -> BenchConfig:
    """The first run's configuration, every option checked (BenchError: refused before anything starts)."""
    return plan_from(args, command)[0]


def plan_from(args: argparse.Namespace, command: str) -> list[BenchConfig]:
    """One configuration per (workload, placement), in run order; refuses bad options with a clear message."""
    systems = tuple(s.strip().replace("K", str(args.k)) for s in args.systems.split(",") if s.strip())
    workloads = _names(args.workloads, list(WORKLOADS), "--workloads")
    placements = _names(args.placement, PLACEMENTS, "--placement")
    if not (args.switch_name.isascii() and args.switch_name.isalnum() and 1 <= len(args.switch_name) <= 8):
        raise BenchError(f"--switch-name must be 1-8 letters or digits, got {args.switch_name!r}")
    if not MIN_WORKERS <= args.workers <= MAX_WORKERS:
        raise BenchError(f"--workers must be {MIN_WORKERS} to {MAX_WORKERS}, got {args.workers}")
    if args.warmup < 0:
        raise BenchError(f"--warmup must be >= 0, got {args.warmup}")
    if args.iterations is not None and args.iterations <= args.warmup + 2:
        raise BenchError(f"--iterations ({args.iterations}) must exceed --warmup ({args.warmup}) + 2")
    if args.iterations is not None and args.iterations > 100_000:
        raise BenchError(f"--iterations ({args.iterations}) is out of range (at most 100000)")
    if not 1 <= args.k <= bench_sweep.MAX_SWEEP_K or not 1 <= args.rounds <= 100:
        raise BenchError(f"--k must be 1 to {bench_sweep.MAX_SWEEP_K} and --rounds 1 to 100")
    try:
        sweep_ks = bench_sweep.parse_k_list(args.sweep_k)
    except SweepError as exc:
        raise BenchError(str(exc)) from None
    partition = None
    if "partitioned" in placements:
        try:
            partition = bench_partition.make_partition(args.worker_cpus, args.infra_cpus)
        except PartitionError as exc:
            raise BenchError(f"--worker-cpus/--infra-cpus: {exc}") from None
    elif args.worker_cpus is not None or args.infra_cpus is not None:
        raise BenchError("--worker-cpus/--infra-cpus need --placement partitioned")
    plan: list[BenchConfig] = []
    for name in workloads:
        workload = WORKLOADS[name]
        iterations = args.iterations if args.iterations is not None else workload.iterations
        if iterations <= args.warmup + 2:
            raise BenchError(f"{name}: {iterations} iterations must exceed --warmup ({args.warmup}) + 2")
        for placement in placements:
            swept = placement == placements[0]
            mine = systems
            if systems and not swept:  # the sweep's systems run in the first placement only
                mine = tuple(
                    n for n in systems if n in all_systems(args.k) or n not in all_systems(args.k, sweep_ks)
                )
                if not mine:
                    continue
            plan.append(
                BenchConfig(
                    iterations=iterations,
                    warmup=args.warmup,
                    k=args.k,
                    rounds=args.rounds,
                    systems=mine,
                    work_dir=args.work_dir,
                    json_out=args.json,
                    png_out=args.png,
                    docs=None if args.no_docs else args.docs,
                    target=args.target,
                    command=command,
                    rename_switches=(("s1", args.switch_name),),
                    workers=args.workers,
                    workload=name,
                    placement=placement,
                    partition=partition if placement == "partitioned" else None,
                    sweep_ks=sweep_ks if swept else (),
                    global_batch=workload.per_worker_batch * args.workers,
                    model_args=workload.model_args,
                )
            )
    for config in plan:
        config.selected()  # unknown --systems names are refused here
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR, format="%(levelname)s %(name)s: %(message)s"
    )
    from rich.console import Console
    from rich.markdown import Markdown

    from experiments.demo import RichObserver

    console = Console()
    given = list(sys.argv[1:] if argv is None else argv)
    if argv is None and os.environ.get("MAKELEVEL"):
        command = "make bench" + (f' BENCH_ARGS="{" ".join(given)}"' if given else "")
    else:
        command = " ".join(["python -m experiments.bench", *given])
    try:
        plan = plan_from(args, command)
    except BenchError as exc:
        console.print(f"[red]{exc}")
        return 2
    config = plan[0]
    if os.geteuid() != 0:
        console.print(
            "[red]make bench needs root[/]: it builds the demo's emulated network (Mininet). "
            "Run it as root, e.g. `sudo make bench`."
        )
        return 1

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    started = time.monotonic()
    summaries: list[dict[str, Any]] = []
    try:
        for part in plan:
            names = [s.name for s in part.selected()]
            where = (
                f"partitioned {json.dumps(part.partition.as_json())}"
                if part.partition is not None
                else "co-located"
            )
            console.print(
                f"[bold]Checkmate benchmark[/] ({part.workload}, {where}): {len(names)} systems x "
                f"{part.rounds} round(s) x >= {part.iterations} iterations, {part.workers} workers: "
                + ", ".join(names)
            )
            with RichObserver() as observer:
                summaries.append(BenchRun(part, observer).run_all().summary())
    except KeyboardInterrupt:
        console.print(
            "[yellow]interrupted[/]: workers and shadows stopped, the network taken down, no results written."
        )
        return 130
    except (DemoError, BenchError) as exc:
        console.print(f"[red]benchmark failed[/]: {exc} (no results written)")
        return 1
    summary = write_suite(summaries, config, time.monotonic() - started)
    console.print(Markdown(suite_markdown(summary)))
    for key, value in summary["targets"].items():
        console.print(f"{key}: {json.dumps(value)}")
    for name, error in summary["errors"].items():
        console.print(f"[red]{name} failed[/]: {error[:500]}")
    for run in summary["runs"]:
        for problem in run["cpu_placement"]["problems"]:
            console.print(f"[red]CPU placement[/] ({run['workload']}): {problem}")
    console.print(f"wrote {config.json_out} and {config.png_out} ({summary['seconds']} s)")
    failed = summary["errors"] or any(run["cpu_placement"]["problems"] for run in summary["runs"])
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
