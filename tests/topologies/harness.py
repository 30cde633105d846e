"""Helpers for the emulated-network tests: bring a topology up through ``checkmate-net``, run
things in its hosts, capture what arrives, and check that nothing is left behind."""

from __future__ import annotations

import io
import json
import os
import re
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scapy.layers.l2 import Ether
from scapy.packet import Packet
from scapy.utils import PcapReader

import checkmate.scapy_layer  # noqa: F401  (binds the Checkmate layer for dissection)
from checkmate.network import Network
from tests.listen_ports import listen_port
from topologies.cleanup import cleanup, pid_alive, run_processes
from topologies.runstate import RunState, RunStateError, is_same_process

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NET = (
    [str(BIN / "checkmate-net")]
    if (BIN / "checkmate-net").exists()
    else [sys.executable, "-m", "topologies.cli"]
)
CTL = (
    [str(BIN / "checkmate-ctl")]
    if (BIN / "checkmate-ctl").exists()
    else [sys.executable, "-m", "controller.cli"]
)
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
OUR_INTERFACE = re.compile(r"^[A-Za-z][A-Za-z0-9_]*-p[0-9]+$")


def run(argv: list[str], timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=ENV, cwd=REPO, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} -> {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def free_tcp_port() -> int:
    """A free port below the ephemeral range (tests/listen_ports.py says why)."""
    return listen_port()


def topology_copy(name: str, folder: Path) -> Path:
    """topologies/NAME.json with the P4Runtime ports moved to free ones (nothing else changed)."""
    data = json.loads((REPO / "topologies" / f"{name}.json").read_text())
    for switch in data["switches"].values():
        switch["grpc"] = f"127.0.0.1:{free_tcp_port()}"
    path = folder / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def root_interfaces() -> set[str]:
    return set(os.listdir("/sys/class/net"))


@dataclass
class RunningNetwork:
    """A network brought up with ``checkmate-net up`` for a test."""

    name: str
    target: str
    network_file: Path
    run_dir: Path
    state_dir: Path
    network: Network
    interfaces_before: set[str]
    state: RunState | None = None
    up_seconds: float = 0.0
    switch_args: tuple[str, ...] = ()
    """``checkmate-net up --switch-args`` values, e.g. ``"s1=--drop-egress 1:0.01"``."""
    up_args: tuple[str, ...] = ()
    """More ``checkmate-net up`` options, e.g. ``("--tls",)``."""

    def up(self, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
        started = time.monotonic()
        result = run(
            [
                *NET,
                "up",
                str(self.network_file),
                "--target",
                self.target,
                "--run-dir",
                str(self.run_dir),
                "--state-dir",
                str(self.state_dir),
                *[f"--switch-args={value}" for value in self.switch_args],
                *self.up_args,
            ],
            timeout=timeout,
            check=False,
        )
        self.up_seconds = time.monotonic() - started
        try:
            self.state = RunState.load(self.run_dir)
        except RunStateError:
            self.state = None
        return result

    def down(self, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return run([*NET, "down", "--run-dir", str(self.run_dir)], timeout=timeout, check=False)

    def exec(
        self, host: str, argv: list[str], timeout: float = 30.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return run(
            [*NET, "exec", "--run-dir", str(self.run_dir), host, "--", *argv], timeout=timeout, check=check
        )

    def popen(self, host: str, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen(  # type: ignore[call-overload]
            [*NET, "exec", "--run-dir", str(self.run_dir), host, "--", *argv], env=ENV, cwd=REPO, **kwargs
        )

    def ctl(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return run(
            [*CTL, "--network", str(self.network_file), "--state-dir", str(self.state_dir), *args],
            timeout=timeout,
        )

    def finalize(self) -> None:
        """Always safe: take the network down and sweep leftovers (used by fixture finalizers)."""
        try:
            self.down()
        finally:
            cleanup(self.run_dir)

    def leftovers(self) -> list[str]:
        """Everything of this network still on the machine (empty when clean)."""
        found: list[str] = []
        state = self.state
        if state is None:
            return [f"no state was recorded in {self.run_dir}"]
        for name in state.interfaces:
            if Path("/sys/class/net", name).exists():
                found.append(f"interface {name}")
        for name, host in state.hosts.items():
            if pid_alive(host.pid):
                found.append(f"host {name}'s shell {host.pid}")
        for name, switch in state.switches.items():
            if is_same_process(switch.pid, switch.start_time):
                found.append(f"switch {name} process {switch.pid}")
        if is_same_process(state.supervisor_pid, state.supervisor_start_time):
            found.append(f"supervisor {state.supervisor_pid}")
        inodes = {host.netns for host in state.hosts.values()}
        found += [
            f"process {pid} in a host namespace or marked" for pid in run_processes(state.run_dir, inodes)
        ]
        new = {i for i in root_interfaces() - self.interfaces_before if OUR_INTERFACE.match(i)}
        found += [f"new interface {name}" for name in sorted(new)]
        return found


class Capture:
    """tcpdump inside a host, writing a pcap to its stdout; started and confirmed listening."""

    def __init__(self, net: RunningNetwork, host: str, bpf: str, count: int | None = None) -> None:
        argv = ["tcpdump", "-i", "eth0", "-n", "-U", "-Z", "root", "-s", "0", "-w", "-"]
        if count is not None:
            argv += ["-c", str(count)]
        self.host = host
        self.process = net.popen(host, [*argv, bpf], stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def wait_listening(self, timeout: float = 10.0) -> None:
        assert self.process.stderr is not None
        deadline = time.monotonic() + timeout
        seen = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stderr], [], [], 0.1)
            if ready:
                chunk = os.read(self.process.stderr.fileno(), 4096)
                seen += chunk
                if b"listening on" in seen:
                    return
                if not chunk:
                    break
        self.process.kill()
        raise AssertionError(f"tcpdump in {self.host} did not start: {seen.decode(errors='replace')}")

    def packets(self, timeout: float = 5.0, stop: bool = False) -> list[Packet]:
        """Wait for tcpdump to end (its count reached) or stop it, and return what it captured."""
        if stop:
            time.sleep(0.2)
            self.process.terminate()
        try:
            out, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            out, _ = self.process.communicate(timeout=5)
        if not out:
            return []
        reader = PcapReader(io.BytesIO(out))  # type: ignore[arg-type]  # it takes file objects too
        return [Ether(bytes(p)) for p in reader]


SEND_FRAME = (
    "import socket, sys\n"
    "s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)\n"
    "s.bind(('eth0', 0))\n"
    "s.send(bytes.fromhex(sys.argv[1]))\n"
)


def send_frame(net: RunningNetwork, host: str, frame: bytes) -> None:
    net.exec(host, [sys.executable, "-c", SEND_FRAME, frame.hex()])
