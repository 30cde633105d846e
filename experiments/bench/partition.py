"""CPU partitioning for ``make bench``: emulate separate machines on one box by pinning processes.

In a deployment the workers, the switch and the shadows are different machines (and
switch hardware). On one machine the benchmark emulates that by giving the workers
one CPU set and everything else — the software switch, the network supervisor, the
shadows and the benchmark process itself — another, disjoint one
(:class:`CpuPartition`). The same partition is used for every system, both ideals
included.

How it is applied:

* the benchmark process pins all of its threads to the *infrastructure* set before it
  brings the network up (:func:`pin_process`); the supervisor, the switch, the Mininet
  host shells and the shadows are its descendants and inherit the mask;
* each worker is started through ``python -m experiments.bench.partition exec --cpus
  SET -- COMMAND...`` (:func:`exec_prefix`), which sets its own mask and ``exec``s the
  command (same pid, so the launcher's signals reach the worker);
* what actually ran where is read back from ``/proc/PID/status``
  (``Cpus_allowed_list``) of the started processes (:func:`read_back`) and recorded in
  ``results/bench.json``.

``sched_setaffinity`` needs no cgroup; the cgroup v1 cpuset controller is not used, so
nothing is left behind when a run is interrupted (a mask dies with its process).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PROC = Path("/proc")


class PartitionError(ValueError):
    """A CPU set or partition that cannot be applied on this machine; the message says why."""


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-2,5"`` -> {0, 1, 2, 5} (the kernel's list format, as ``taskset -c`` takes it)."""
    cpus: set[int] = set()
    if not text.strip():
        raise PartitionError("empty CPU list")
    for part in text.strip().split(","):
        part = part.strip()
        try:
            if "-" in part:
                low_text, high_text = part.split("-", 1)
                low, high = int(low_text), int(high_text)
                if low > high:
                    raise PartitionError(f"CPU range {part!r} runs backwards")
                cpus.update(range(low, high + 1))
            else:
                cpus.add(int(part))
        except ValueError as exc:
            if isinstance(exc, PartitionError):
                raise
            raise PartitionError(f"not a CPU list: {text!r} (expected e.g. 0 or 0-2,5)") from None
    if any(c < 0 for c in cpus):
        raise PartitionError(f"negative CPU number in {text!r}")
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> ``"0-2,5"``."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = previous = None
    for cpu in ordered:
        if previous is not None and cpu == previous + 1:
            previous = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = cpu
    if start is not None:
        parts.append(str(start) if start == previous else f"{start}-{previous}")
    return ",".join(parts)


def available_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity mask: online CPUs within its cpuset)."""
    return frozenset(os.sched_getaffinity(0))


@dataclass(frozen=True)
class CpuPartition:
    """Two disjoint CPU sets: the workers', and the switch's + shadows' + supervisor's."""

    workers: frozenset[int]
    infrastructure: frozenset[int]

    def as_json(self) -> dict[str, str]:
        return {
            "workers": format_cpu_list(self.workers),
            "infrastructure": format_cpu_list(self.infrastructure),
        }


def default_partition(available: Iterable[int]) -> CpuPartition:
    """The workers on the first half of the CPUs (rounded up), the rest for the switch and shadows.

    2 CPUs: workers on the first, switch + shadows + supervisor on the second.
    """
    ordered = sorted(set(available))
    if len(ordered) < 2:
        raise PartitionError(
            "a partitioned benchmark needs at least 2 CPUs, this process may use "
            f"{format_cpu_list(ordered) or 'none'}; "
            "use --placement colocated"
        )
    split = (len(ordered) + 1) // 2
    return CpuPartition(frozenset(ordered[:split]), frozenset(ordered[split:]))


def make_partition(
    workers: str | None, infrastructure: str | None, available: Iterable[int] | None = None
) -> CpuPartition:
    """The partition from ``--worker-cpus`` / ``--infra-cpus`` (None: the default), checked.

    Refused: CPUs this process may not use (the machine lacks them, or its cpuset excludes
    them), overlapping sets, empty sets.
    """
    allowed = frozenset(available) if available is not None else available_cpus()
    default = default_partition(allowed) if workers is None or infrastructure is None else None
    worker_set = parse_cpu_list(workers) if workers is not None else None
    infra_set = parse_cpu_list(infrastructure) if infrastructure is not None else None
    if worker_set is None:
        assert default is not None
        worker_set = default.workers if infra_set is None else allowed - infra_set
    if infra_set is None:
        assert default is not None
        infra_set = default.infrastructure if workers is None else allowed - worker_set
    for what, cpus in (("worker", worker_set), ("infrastructure", infra_set)):
        if not cpus:
            raise PartitionError(f"the {what} CPU set is empty (available: {format_cpu_list(allowed)})")
        missing = cpus - allowed
        if missing:
            raise PartitionError(
                f"{what} CPUs {format_cpu_list(missing)} are not available here "
                f"(this process may use {format_cpu_list(allowed)})"
            )
    overlap = worker_set & infra_set
    if overlap:
        raise PartitionError(
            f"the worker and infrastructure CPU sets overlap on {format_cpu_list(overlap)}: "
            "they emulate separate machines"
        )
    return CpuPartition(frozenset(worker_set), frozenset(infra_set))


# ---- applying and reading back --------------------------------------------------------------
def task_ids(pid: int) -> list[int]:
    """The thread ids of ``pid`` (just ``pid`` when /proc does not list them)."""
    try:
        return sorted(int(t) for t in os.listdir(PROC / str(pid) / "task"))
    except OSError:
        return [pid]


def pin_process(pid: int, cpus: Iterable[int]) -> None:
    """Set the affinity mask of every thread of ``pid`` (0: this process)."""
    target = os.getpid() if pid == 0 else pid
    mask = set(cpus)
    for tid in task_ids(target):
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:
            continue  # the thread ended meanwhile


def cpus_allowed(pid: int) -> frozenset[int] | None:
    """``Cpus_allowed_list`` of ``/proc/PID/status`` (None: no such process)."""
    try:
        text = (PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(line.split(":", 1)[1])
    return None


def command_line(pid: int, limit: int = 160) -> str:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:limit]


def children_map() -> dict[int, list[int]]:
    """ppid -> pids, from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def descendants(pid: int, children: Mapping[int, list[int]] | None = None) -> list[int]:
    """``pid``'s descendants (not ``pid``), breadth first."""
    tree = children_map() if children is None else children
    found: list[int] = []
    queue = list(tree.get(pid, []))
    while queue:
        child = queue.pop(0)
        found.append(child)
        queue.extend(tree.get(child, []))
    return found


def describe(pid: int) -> dict[str, Any] | None:
    """pid, command line, and the CPU list read back from /proc (also per thread when they differ)."""
    allowed = cpus_allowed(pid)
    if allowed is None:
        return None
    threads = {tid: cpus_allowed(tid) for tid in task_ids(pid)}
    distinct = {format_cpu_list(c) for c in threads.values() if c is not None}
    entry: dict[str, Any] = {
        "pid": pid,
        "command": command_line(pid),
        "cpus_allowed_list": format_cpu_list(allowed),
    }
    if len(distinct) > 1:
        entry["threads_cpus_allowed_lists"] = sorted(distinct)
    return entry


def read_back(roles: Mapping[str, Sequence[int]]) -> dict[str, list[dict[str, Any]]]:
    """role -> what /proc says about each of its processes (vanished ones left out)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for role, pids in roles.items():
        out[role] = [d for d in (describe(p) for p in pids) if d is not None]
    return out


def check_placement(
    observed: Mapping[str, Sequence[Mapping[str, Any]]],
    partition: CpuPartition,
    required: Iterable[str] = ("workers",),
) -> list[str]:
    """What ran outside its set: one line per process (empty: the partition held).

    ``workers`` (and their descendants, e.g. DCP's checkpoint process) must be on the worker set;
    every other role on the infrastructure set. A ``required`` role with no process is a problem.
    """
    problems: list[str] = []
    for role in required:
        if not observed.get(role):
            problems.append(f"no {role} process was found to check")
    for role, processes in observed.items():
        expected = partition.workers if role == "workers" else partition.infrastructure
        for process in processes:
            lists = [process["cpus_allowed_list"], *process.get("threads_cpus_allowed_lists", [])]
            for text in lists:
                if not parse_cpu_list(text) <= expected:
                    problems.append(
                        f"{role} pid {process['pid']} may run on {text}, outside {format_cpu_list(expected)}"
                    )
    return problems


def exec_prefix(cpus: Iterable[int], python: str | None = None) -> tuple[str, ...]:
    """The argv prefix that starts a command pinned to ``cpus``."""
    return (
        python or sys.executable,
        "-m",
        "experiments.bench.partition",
        "exec",
        "--cpus",
        format_cpu_list(cpus),
        "--",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench.partition", description="Run a command pinned to a CPU set."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("exec", help="set this process's CPU set, then exec the command (same pid)")
    run.add_argument("--cpus", required=True, help="CPU list, e.g. 0 or 0-2,5")
    run.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = list(args.argv)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("no command given after --")
    try:
        cpus = parse_cpu_list(args.cpus)
        # not checked against this process's own mask: a parent pinned elsewhere may start us
        os.sched_setaffinity(0, cpus)
    except PartitionError as exc:
        print(f"bench_partition: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"bench_partition: cannot run on CPUs {args.cpus}: {exc}", file=sys.stderr)
        return 2
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"bench_partition: cannot run {command[0]}: {exc}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
