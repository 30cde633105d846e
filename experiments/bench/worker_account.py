"""What a system costs each worker, from counters that do not depend on the neighbours.

A benchmark run's wall clock on a shared 2-core machine swings by 10-15 %; these counters do
not (or much less): per worker thread, CPU time in user and in kernel mode and voluntary and
involuntary context switches (``/proc/PID/task/TID/stat`` and ``status``); per worker host
(each worker runs in its own network namespace, so its counters are its own), UDP datagrams
and TCP segments in and out (``/proc/PID/net/snmp``) and bytes and packets on its interfaces
(``/proc/PID/net/dev``); and, when asked, system calls by kind from ``strace -c -f`` attached
to the workers for a window at the end of the run.

:class:`AccountSample` is one reading of every worker process; :func:`account` turns the first
and the last reading of a run into per-iteration figures (``bench.json``:
``systems[].worker_account``), summed over the workers and split by thread *kind* (the thread's
name without its per-instance suffix: ``cm-rx-10.0.0.1`` -> ``cm-rx``, ``cm-ctl-sh1`` ->
``cm-ctl``). :func:`difference` lines two systems' accounts up (Checkmate against its ideal).
:class:`SyscallWindow` runs ``strace`` on the worker processes and parses its summary.

Thread wake-ups show as voluntary context switches (a thread that sleeps in ``poll``,
``select``, a condition wait or a timed sleep gives the CPU up voluntarily, once per wake-up).
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.bench.cpu_time import PROC, TICKS_PER_S

logger = logging.getLogger(__name__)

_SUFFIX = re.compile(r"([-_.:]?[0-9]+)+$")


def thread_kind(name: str) -> str:
    """``cm-rx-10.0.0.1`` -> ``cm-rx``; ``cm-ctl-sh1`` -> ``cm-ctl``; ``python`` (main thread) -> ``main``."""
    if name.startswith("cm-ctl-"):
        return "cm-ctl"
    if name.startswith(("python", "pt_main_thread")):
        return "main"
    stripped = _SUFFIX.sub("", name)
    for prefix in ("cm-rx", "cm-timer", "cm-ring"):
        if stripped.startswith(prefix):
            return prefix
    return stripped or name


@dataclass(frozen=True)
class ThreadCounters:
    kind: str
    user_ticks: int
    system_ticks: int
    voluntary: int
    involuntary: int


def read_threads(pid: int, proc: Path = PROC) -> dict[int, ThreadCounters]:
    """Every thread of ``pid``: kind, user and system ticks, context switches (empty when it is gone)."""
    out: dict[int, ThreadCounters] = {}
    try:
        tids = [int(t.name) for t in (proc / str(pid) / "task").iterdir()]
    except (OSError, ValueError):
        return out
    for tid in tids:
        base = proc / str(pid) / "task" / str(tid)
        try:
            stat = (base / "stat").read_text()
            status = (base / "status").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat.rsplit(")", 1)[-1].split()
        switches = {}
        for line in status.splitlines():
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                key, _, value = line.partition(":")
                switches[key] = int(value)
        try:
            out[tid] = ThreadCounters(
                kind=thread_kind(name),
                user_ticks=int(fields[11]),
                system_ticks=int(fields[12]),
                voluntary=switches.get("voluntary_ctxt_switches", 0),
                involuntary=switches.get("nonvoluntary_ctxt_switches", 0),
            )
        except (IndexError, ValueError):
            continue
    return out


def read_network(pid: int, proc: Path = PROC) -> dict[str, int]:
    """``pid``'s network namespace: UDP datagrams, TCP segments, and interface bytes/packets (not lo)."""
    out: dict[str, int] = {}
    try:
        snmp = (proc / str(pid) / "net" / "snmp").read_text().splitlines()
        dev = (proc / str(pid) / "net" / "dev").read_text().splitlines()
    except OSError:
        return out
    for i in range(0, len(snmp) - 1, 2):
        names, values = snmp[i].split(), snmp[i + 1].split()
        if names[0] == "Udp:":
            row = dict(zip(names[1:], values[1:], strict=False))
            out["udp_in"] = int(row.get("InDatagrams", 0))
            out["udp_out"] = int(row.get("OutDatagrams", 0))
        elif names[0] == "Tcp:":
            row = dict(zip(names[1:], values[1:], strict=False))
            out["tcp_in_segments"] = int(row.get("InSegs", 0))
            out["tcp_out_segments"] = int(row.get("OutSegs", 0))
    for line in dev[2:]:
        iface, _, rest = line.partition(":")
        if iface.strip() == "lo":
            continue
        values = rest.split()
        if len(values) >= 10:
            out["rx_bytes"] = out.get("rx_bytes", 0) + int(values[0])
            out["rx_packets"] = out.get("rx_packets", 0) + int(values[1])
            out["tx_bytes"] = out.get("tx_bytes", 0) + int(values[8])
            out["tx_packets"] = out.get("tx_packets", 0) + int(values[9])
    return out


@dataclass(frozen=True)
class AccountSample:
    """One reading of every worker process: its threads, and its network namespace's counters."""

    iteration: int
    threads: dict[int, dict[int, ThreadCounters]]
    """pid -> tid -> counters."""
    network: dict[int, dict[str, int]]
    """pid -> namespace counters (one entry per namespace: the first pid seen in it)."""


def _namespace(pid: int, proc: Path) -> str | None:
    try:
        return str((proc / str(pid) / "ns" / "net").readlink())
    except OSError:
        return None


def take_account(pids: Sequence[int], iteration: int, proc: Path = PROC) -> AccountSample:
    threads = {pid: t for pid in dict.fromkeys(pids) if (t := read_threads(pid, proc))}
    network: dict[int, dict[str, int]] = {}
    seen: set[str] = set()
    for pid in threads:
        ns = _namespace(pid, proc)
        if ns is None or ns in seen:
            continue
        seen.add(ns)
        network[pid] = read_network(pid, proc)
    return AccountSample(iteration, threads, network)


def account(first: AccountSample, last: AccountSample, workers: int) -> dict[str, Any] | None:
    """Per worker-iteration figures between two readings (threads alive in both); None without iterations.

    ``by_thread``: per thread kind, ``user_ms``, ``system_ms``, ``voluntary`` and
    ``involuntary`` context switches per worker-iteration; ``total``: their sum;
    ``network``: per worker-iteration datagrams, segments, bytes and packets.
    """
    iterations = last.iteration - first.iteration
    if iterations <= 0 or workers <= 0:
        return None
    scale = 1.0 / (iterations * workers)
    kinds: dict[str, dict[str, float]] = {}
    for pid, before in first.threads.items():
        after = last.threads.get(pid, {})
        for tid, a in before.items():
            b = after.get(tid)
            if b is None:
                continue
            row = kinds.setdefault(
                a.kind, {"threads": 0, "user_ms": 0.0, "system_ms": 0.0, "voluntary": 0.0, "involuntary": 0.0}
            )
            row["threads"] += 1
            row["user_ms"] += 1000.0 * (b.user_ticks - a.user_ticks) / TICKS_PER_S
            row["system_ms"] += 1000.0 * (b.system_ticks - a.system_ticks) / TICKS_PER_S
            row["voluntary"] += b.voluntary - a.voluntary
            row["involuntary"] += b.involuntary - a.involuntary
    by_thread = {
        kind: {k: (int(v) if k == "threads" else round(v * scale, 3)) for k, v in row.items()}
        for kind, row in sorted(kinds.items())
    }
    total = {
        k: round(sum(float(row[k]) for row in by_thread.values()), 3)
        for k in ("user_ms", "system_ms", "voluntary", "involuntary")
    }
    network: dict[str, float] = {}
    for pid, before_net in first.network.items():
        after_net = last.network.get(pid)
        if after_net is None:
            continue
        for key, value in before_net.items():
            if key in after_net:
                network[key] = network.get(key, 0.0) + after_net[key] - value
    return {
        "iterations": iterations,
        "workers": workers,
        "total": total,
        "by_thread": by_thread,
        "network": {k: round(v * scale, 2) for k, v in sorted(network.items())},
    }


def difference(system: Mapping[str, Any], ideal: Mapping[str, Any]) -> dict[str, Any]:
    """``system`` minus ``ideal``, leaf by leaf (per worker-iteration); a key missing on one side is 0."""

    def sub(a: Any, b: Any) -> Any:
        if isinstance(a, Mapping) or isinstance(b, Mapping):
            a = a if isinstance(a, Mapping) else {}
            b = b if isinstance(b, Mapping) else {}
            return {k: sub(a.get(k), b.get(k)) for k in dict.fromkeys([*a, *b])}
        if isinstance(a, (int, float)) or isinstance(b, (int, float)):
            return round(float(a or 0) - float(b or 0), 3)
        return None

    keys = ("total", "by_thread", "network", "syscalls", "agent_counters")
    return {k: sub(system.get(k), ideal.get(k)) for k in keys}


AGENT_COUNTER_GROUPS = ("transport", "ring")
"""The parts of ``CheckmateAgent.stats()`` that are counters of the whole run (the rest is state)."""


def agent_counters(done_events: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    """The Checkmate agents' own counters, summed over the ranks, per worker-iteration of the run.

    ``done_events``: each rank's ``{"event": "done", "iteration", "agent_stats"}`` record of
    ``examples/train_lm.py``. They count the whole run (warm-up included), so they explain the
    account rather than add to it: retransmissions (``transport.retransmit.*``), duplicates
    received, repairs served to the shadows (``ring.repair_*``), datagrams sent. None when no
    rank ran on Checkmate (gloo) or a rank has no record.
    """
    totals: dict[str, float] = {}
    iterations = 0
    for event in done_events:
        stats = event.get("agent_stats")
        if not isinstance(stats, Mapping):
            return None
        iterations += int(event.get("iteration", -1)) + 1
        for group in AGENT_COUNTER_GROUPS:
            for key, value in (stats.get(group) or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    totals[f"{group}.{key}"] = totals.get(f"{group}.{key}", 0) + value
    if not done_events or iterations <= 0:
        return None
    return {k: round(v / iterations, 3) for k, v in sorted(totals.items())}


# ---- system calls ---------------------------------------------------------------------------
_STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:(\d+)\s+)?(\w+)\s*$")


def parse_strace_summary(text: str) -> dict[str, int]:
    """``strace -c``'s table -> syscall name -> calls (the ``total`` row left out)."""
    calls: dict[str, int] = {}
    for line in text.splitlines():
        match = _STRACE_ROW.match(line)
        if match and match.group(3) != "total":
            calls[match.group(3)] = calls.get(match.group(3), 0) + int(match.group(1))
    return calls


@dataclass
class SyscallWindow:
    """``strace -c -f`` attached to each worker process from :meth:`start` to :meth:`stop`.

    strace slows every system call down, so the CPU figures must not overlap the window;
    only the counts are used.
    """

    pids: list[int] = field(default_factory=list)
    _procs: list[tuple[subprocess.Popen[bytes], Path]] = field(default_factory=list)
    _started_at: int = -1

    @staticmethod
    def available() -> bool:
        return shutil.which("strace") is not None

    def start(self, pids: Iterable[int], iteration: int) -> None:
        self.pids = list(dict.fromkeys(pids))
        self._started_at = iteration
        for pid in self.pids:
            out = Path(tempfile.mkstemp(prefix=f"strace-{pid}-", suffix=".txt")[1])
            proc = subprocess.Popen(
                ["strace", "-c", "-f", "-qq", "-o", str(out), "-p", str(pid)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self._procs.append((proc, out))

    def stop(self, iteration: int, workers: int) -> dict[str, Any] | None:
        """Detach; per worker-iteration calls by syscall (None when nothing was counted)."""
        counts: dict[str, int] = {}
        for proc, out in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            try:
                text = out.read_text()
            except OSError:
                text = ""
            out.unlink(missing_ok=True)
            for name, n in parse_strace_summary(text).items():
                counts[name] = counts.get(name, 0) + n
        self._procs = []
        iterations = iteration - self._started_at
        if not counts or iterations <= 0 or workers <= 0:
            return None
        scale = 1.0 / (iterations * workers)
        per = {k: round(v * scale, 2) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}
        return {
            "iterations": iterations,
            "workers": workers,
            "per_worker_iteration": per,
            "total": round(sum(counts.values()) * scale, 2),
        }
