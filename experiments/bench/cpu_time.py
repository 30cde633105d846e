"""Where a benchmark run's CPU time goes: per role (workers, switch, shadows, ...) and per CPU set.

:class:`CpuClock` takes samples while a system trains — the first at the first
steady-state iteration, then at most every ``interval_s`` until rank 0's last
logged iteration — of ``/proc/PID/stat`` (utime + stime: every thread of every
process of a role) and of ``/proc/stat`` (per CPU: busy, of which softirq, and
all ticks). :func:`cpu_shares` turns the first and the last sample into what
``bench.json`` records per system (``cpu_time``):

* per role, ``cpu_s_per_s`` (CPU-seconds per wall second: 1.0 is one CPU busy
  the whole time) and ``cpu_ms_per_iteration``;
* per CPU set (``workers`` / ``infrastructure`` when partitioned, ``all``
  co-located), the ``busy`` fraction and its ``softirq`` part — the kernel's
  packet processing of the emulated network (veth delivery, UDP receive) is
  charged there, to no process — and ``steal`` (the hypervisor ran another
  machine; a source of run-to-run noise on a virtual machine).

The network's share of an iteration is then the switch's CPU plus the
infrastructure set's softirq; the shadows' share is their CPU; the workers'
idle share (1 - busy of their set) is the time they wait. Only processes seen in
both samples count (a process that ended in between is left out, not guessed).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")


def process_ticks(pid: int, proc: Path = PROC) -> int | None:
    """utime + stime of ``pid`` (all its threads), in clock ticks; None when it is gone or unreadable."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    try:
        return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), after "pid (comm)"
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class CpuTicks:
    """One CPU's counters from /proc/stat, in clock ticks."""

    busy: int
    softirq: int
    total: int
    steal: int = 0
    """Time the hypervisor ran something else while this CPU had work (counted in ``busy``)."""


def cpu_ticks(proc: Path = PROC) -> dict[int, CpuTicks]:
    """Per CPU: busy ticks (user, nice, system, irq, softirq, steal), softirq, all (busy + idle + iowait)."""
    out: dict[int, CpuTicks] = {}
    try:
        lines = (proc / "stat").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            cpu = int(name[3:])
            user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in values[:8])
        except ValueError:
            continue
        busy = user + nice + system + irq + softirq + steal
        out[cpu] = CpuTicks(busy=busy, softirq=softirq, total=busy + idle + iowait, steal=steal)
    return out


@dataclass(frozen=True)
class CpuSample:
    """The counters at one moment: every role's processes, every CPU."""

    wall: float
    iteration: int
    processes: dict[str, dict[int, int]]
    """role -> pid -> utime + stime ticks (processes that could be read)."""
    cpus: dict[int, CpuTicks]


def take_sample(roles: Mapping[str, Sequence[int]], iteration: int, proc: Path = PROC) -> CpuSample:
    processes: dict[str, dict[int, int]] = {}
    for role, pids in roles.items():
        ticks = {pid: t for pid in dict.fromkeys(pids) if (t := process_ticks(pid, proc)) is not None}
        processes[role] = ticks
    return CpuSample(time.monotonic(), iteration, processes, cpu_ticks(proc))


def cpu_shares(
    first: CpuSample, last: CpuSample, cpu_sets: Mapping[str, Iterable[int]]
) -> dict[str, Any] | None:
    """What the two samples say (the module docstring's figures); None when no time or iteration passed."""
    seconds = last.wall - first.wall
    iterations = last.iteration - first.iteration
    if seconds <= 0 or iterations <= 0:
        return None
    roles: dict[str, dict[str, float | int]] = {}
    for role, before in first.processes.items():
        after = last.processes.get(role, {})
        common = [pid for pid in before if pid in after]
        cpu_s = sum(after[pid] - before[pid] for pid in common) / TICKS_PER_S
        roles[role] = {
            "processes": len(common),
            "cpu_s_per_s": round(cpu_s / seconds, 3),
            "cpu_ms_per_iteration": round(1000 * cpu_s / iterations, 2),
        }
    sets: dict[str, dict[str, Any]] = {}
    for name, cpus in cpu_sets.items():
        chosen = [c for c in sorted(set(cpus)) if c in first.cpus and c in last.cpus]
        total = sum(last.cpus[c].total - first.cpus[c].total for c in chosen)
        if not chosen or total <= 0:
            continue
        busy = sum(last.cpus[c].busy - first.cpus[c].busy for c in chosen)
        softirq = sum(last.cpus[c].softirq - first.cpus[c].softirq for c in chosen)
        steal = sum(last.cpus[c].steal - first.cpus[c].steal for c in chosen)
        sets[name] = {
            "cpus": ",".join(str(c) for c in chosen),
            "busy": round(busy / total, 3),
            "softirq": round(softirq / total, 3),
            "steal": round(steal / total, 3),
        }
    return {"seconds": round(seconds, 2), "iterations": iterations, "roles": roles, "cpu_sets": sets}


@dataclass
class CpuClock:
    """Samples for one system's run: :meth:`tick` on each rank-0 iteration past the warmup."""

    interval_s: float = 0.5
    first: CpuSample | None = None
    last: CpuSample | None = None
    roles: dict[str, list[int]] = field(default_factory=dict)

    def start(self, roles: Mapping[str, Sequence[int]], iteration: int) -> None:
        self.roles = {role: list(pids) for role, pids in roles.items()}
        self.first = take_sample(self.roles, iteration)
        self.last = None

    def tick(self, iteration: int, final: bool = False) -> None:
        """A sample at ``iteration`` if ``interval_s`` passed since the last (always when ``final``)."""
        if self.first is None:
            return
        previous = self.last or self.first
        if final or time.monotonic() - previous.wall >= self.interval_s:
            self.last = take_sample(self.roles, iteration)

    def shares(self, cpu_sets: Mapping[str, Iterable[int]]) -> dict[str, Any] | None:
        if self.first is None or self.last is None:
            return None
        return cpu_shares(self.first, self.last, cpu_sets)


def mean_shares(per_round: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """The rounds' ``cpu_time`` averaged leaf by leaf (numbers only; rounds without figures left out)."""
    rounds = [r for r in per_round if r]
    if not rounds:
        return None

    def merge(values: list[Any]) -> Any:
        if all(isinstance(v, Mapping) for v in values):
            keys = dict.fromkeys(k for v in values for k in v)
            return {k: merge([v[k] for v in values if k in v]) for k in keys}
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            mean = sum(values) / len(values)
            return round(mean, 3) if any(isinstance(v, float) for v in values) else round(mean, 1)
        return values[0]

    merged = merge(list(rounds))
    merged["rounds"] = len(rounds)
    return merged
