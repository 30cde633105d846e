"""Taking a network away: stop its supervisor, then find and remove whatever is left.

Like ``mn -c``, but only for what one run created. The run's ``state.json``
names the supervisor, the switch processes (pid plus start time, so a reused
pid is never hit), the hosts' network namespaces (by inode) and every
interface created in the root namespace. :func:`cleanup`

1. asks the supervisor to stop (SIGTERM: it stops Mininet in order) and
   kills it when it does not finish in time;
2. kills what is left: the recorded switch processes, every process inside a
   recorded host namespace, every process carrying the run's environment
   marker (:data:`topologies.runstate.RUN_ENV`);
3. waits for the hosts' namespaces to vanish (they are anonymous: they go
   with their last process, taking their veth ends along) and deletes any
   recorded interface still present;
4. verifies, reports anything it could not remove, and (when clean) renames
   ``state.json`` to ``last-state.json``.

It works from the record alone, so it also cleans up after a crash of ``up``
or a killed supervisor.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from topologies.runstate import (
    LAST_STATE_FILE,
    RUN_ENV,
    RunState,
    RunStateError,
    is_same_process,
    netns_inode,
)

logger = logging.getLogger(__name__)

SUPERVISOR_STOP_TIMEOUT_S = 20.0
KILL_GRACE_S = 3.0
NETNS_GONE_TIMEOUT_S = 5.0
IP_TIMEOUT_S = 5.0


@dataclass
class CleanupReport:
    """What :func:`cleanup` did, and what it could not undo."""

    found_state: bool = False
    supervisor_stopped: bool = False
    killed: list[str] = field(default_factory=list)
    deleted_interfaces: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.leftovers


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait until no pid of ``pids`` is alive; return those still alive at the deadline."""
    remaining = list(pids)
    deadline = time.monotonic() + timeout
    while remaining:
        remaining = [pid for pid in remaining if pid_alive(pid)]
        if not remaining or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return remaining


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _ancestors() -> set[int]:
    """This process and its parents: never killed, even when they carry the marker."""
    pids = set()
    pid = os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return pids


def run_processes(run_dir: str, netns_inodes: set[int]) -> list[int]:
    """Live processes that belong to the run: inside one of its namespaces, or carrying its marker."""
    marker = f"{RUN_ENV}={run_dir}".encode()
    spare = _ancestors()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid in spare or not pid_alive(pid):
            continue
        if netns_inodes and netns_inode(pid) in netns_inodes:
            found.append(pid)
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append(pid)
    return found


def _terminate(pids: list[int], what: dict[int, str], report: CleanupReport) -> None:
    if not pids:
        return
    for pid in pids:
        _signal(pid, signal.SIGTERM)
        _signal(pid, signal.SIGHUP)  # Mininet's host shells are interactive bash: they ignore SIGTERM
    stubborn = _wait_gone(pids, KILL_GRACE_S)
    for pid in stubborn:
        _signal(pid, signal.SIGKILL)
    for pid in _wait_gone(stubborn, KILL_GRACE_S):
        report.leftovers.append(f"process {pid} ({what.get(pid, 'run process')}) survived SIGKILL")
    report.killed += [f"{pid} ({what.get(pid, 'run process')})" for pid in pids]


def interface_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def stop_supervisor(state: RunState, timeout: float = SUPERVISOR_STOP_TIMEOUT_S) -> bool:
    """SIGTERM the supervisor and wait for it; SIGKILL after ``timeout``. True if it stopped by itself."""
    pid = state.supervisor_pid
    if not is_same_process(pid, state.supervisor_start_time):
        return False
    _signal(pid, signal.SIGTERM)
    if not _wait_gone([pid], timeout):
        return True
    logger.warning("supervisor %d did not stop within %.0f s; killing it", pid, timeout)
    _signal(pid, signal.SIGKILL)
    _wait_gone([pid], KILL_GRACE_S)
    return False


def cleanup(run_dir: str | Path, supervisor_timeout: float = SUPERVISOR_STOP_TIMEOUT_S) -> CleanupReport:
    """Stop the network recorded in ``run_dir`` and remove everything it left behind."""
    run_dir = str(Path(run_dir).resolve())
    report = CleanupReport()
    try:
        state = RunState.load(run_dir)
    except RunStateError:
        # Nothing recorded: still sweep processes that carry this run's marker.
        _terminate(run_processes(run_dir, set()), {}, report)
        return report
    report.found_state = True
    report.supervisor_stopped = stop_supervisor(state, supervisor_timeout)

    what: dict[int, str] = {}
    doomed: list[int] = []
    for name, switch in state.switches.items():
        if is_same_process(switch.pid, switch.start_time):
            what[switch.pid] = f"switch {name}"
            doomed.append(switch.pid)
    inodes = {host.netns for host in state.hosts.values()}
    names = {host.netns: name for name, host in state.hosts.items()}
    for pid in run_processes(run_dir, inodes):
        if pid not in what:
            inode = netns_inode(pid)
            what[pid] = f"in host {names[inode]}" if inode in names else "carries the run marker"
            doomed.append(pid)
    _terminate(doomed, what, report)

    # Namespaces are anonymous: they go with their last process (asynchronously in the kernel).
    deadline = time.monotonic() + NETNS_GONE_TIMEOUT_S
    while time.monotonic() < deadline and any(interface_exists(i) for i in state.interfaces):
        time.sleep(0.05)
    for interface in state.interfaces:
        if not interface_exists(interface):
            continue
        result = subprocess.run(
            ["ip", "link", "del", "dev", interface],
            capture_output=True,
            text=True,
            timeout=IP_TIMEOUT_S,
            check=False,
        )
        if result.returncode == 0 or not interface_exists(interface):
            report.deleted_interfaces.append(interface)
        else:
            report.leftovers.append(f"interface {interface}: {result.stderr.strip()}")

    for pid in run_processes(run_dir, inodes):
        report.leftovers.append(f"process {pid} still runs in the network")
    if is_same_process(state.supervisor_pid, state.supervisor_start_time):
        report.leftovers.append(f"supervisor {state.supervisor_pid} still runs")
    if report.clean:
        # Kept for post-mortems (and tests): what the network was, now that it is gone.
        os.replace(state.path, state.path.with_name(LAST_STATE_FILE))
    else:
        logger.warning("cleanup of %s left: %s", run_dir, "; ".join(report.leftovers))
    return report
