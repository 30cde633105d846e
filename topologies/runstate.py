"""What a running network is made of, recorded in its run directory.

The supervisor writes ``state.json`` before it creates anything (the names of
every interface it is about to create) and again as hosts and switches come
up (their pids and network-namespace inodes), so ``checkmate-net down`` can
take away exactly what this network created — also after ``up`` crashed or
the supervisor was killed. Every process the network starts carries
``CHECKMATE_NET_RUN=<run dir>`` in its environment, a second way to find it.

Layout of a run directory::

    state.json        this record (last-state.json once the network is down)
    supervisor.log    the supervisor's log (Mininet, switches, controller)
    logs/<switch>.log each switch's console log
    pcap/             per-port pcaps when brought up with --pcap
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_RUN_DIR = Path("/tmp/checkmate-net")
RUN_ENV = "CHECKMATE_NET_RUN"
"""Environment marker set on every process a network starts; its value is the run directory."""
STATE_FILE = "state.json"
LAST_STATE_FILE = "last-state.json"
"""``state.json`` of a network that was taken down cleanly, kept for post-mortems."""

STARTING = "starting"
UP = "up"
FAILED = "failed"
STOPPING = "stopping"
STOPPED = "stopped"


class RunStateError(RuntimeError):
    """The run directory holds no readable state."""


@dataclass
class HostRecord:
    pid: int
    """The host's shell (Mininet's ``bash``), the anchor of its namespaces."""
    netns: int
    """Inode of the host's network namespace (``/proc/PID/ns/net``)."""
    interface: str
    ip: str
    mac: str
    role: str


@dataclass
class SwitchRecord:
    pid: int
    """The switch process (checkmate-switch or simple_switch_grpc)."""
    start_time: int
    """Its start time in clock ticks (/proc/PID/stat field 22): tells it from a reused pid."""
    grpc: str
    device_id: int
    log_file: str
    command: list[str]


@dataclass
class RunState:
    run_dir: str
    network_file: str
    target: str
    supervisor_pid: int
    supervisor_start_time: int
    status: str = STARTING
    error: str = ""
    started_at: float = field(default_factory=time.time)
    interfaces: list[str] = field(default_factory=list)
    """Every interface this network creates in the root namespace (switch ends of links)."""
    hosts: dict[str, HostRecord] = field(default_factory=dict)
    switches: dict[str, SwitchRecord] = field(default_factory=dict)
    pcap_dir: str = ""
    controller_state_dir: str = ""

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / STATE_FILE

    def save(self) -> None:
        """Write atomically: readers never see half a file."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, run_dir: str | Path, name: str = STATE_FILE) -> RunState:
        """The running network's record (or, with ``name=LAST_STATE_FILE``, the last one taken down)."""
        path = Path(run_dir) / name
        try:
            data: dict[str, Any] = json.loads(path.read_text())
        except FileNotFoundError:
            raise RunStateError(f"no network is recorded in {run_dir} (no {name})") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise RunStateError(f"{path} is unreadable: {exc}") from None
        data["hosts"] = {name: HostRecord(**rec) for name, rec in data.get("hosts", {}).items()}
        data["switches"] = {name: SwitchRecord(**rec) for name, rec in data.get("switches", {}).items()}
        return cls(**data)


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def is_same_process(pid: int, start_time: int) -> bool:
    """Whether ``pid`` is still the process that started at ``start_time`` (and not a zombie)."""
    if process_start_time(pid) != start_time:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None
