"""Mininet switches whose data plane is a P4 target process.

:class:`P4Switch` is a Mininet ``Switch`` in the root namespace (so its
P4Runtime server is reachable on 127.0.0.1) that runs ``checkmate-switch`` or
``simple_switch_grpc`` with one ``-i N@IFACE`` per port, its device id, its
P4Runtime address, its log file and an optional pcap folder. The process is
started with :mod:`subprocess`, not through Mininet's shell, so that start,
readiness and stop each have a timeout; it runs in its own session with the
run's environment marker, and its stdout/stderr go to the switch's log file.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from checkmate.address import parse_host_port
from checkmate.p4.program import Target
from topologies.hosts import configure_switch_interface
from topologies.mininet_import import import_mininet
from topologies.targets import SwitchProcessConfig

import_mininet()
from mininet.node import Switch  # noqa: E402  (needs import_mininet first)

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
LOG_TAIL_LINES = 15


class SwitchStartError(RuntimeError):
    """A switch process did not come up; the message carries the end of its log."""


def log_tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    if path is None:
        return ""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def tcp_accepts(address: str, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections at ``HOST:PORT``."""
    host, port = parse_host_port(address, default_host="")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class P4Switch(Switch):  # Mininet is untyped (mypy sees it as Any)
    """A Mininet switch backed by one P4 target process."""

    def __init__(
        self,
        name: str,
        config: SwitchProcessConfig | None = None,
        binary: str = "",
        target: Target = Target.EMBEDDED,
        env: dict[str, str] | None = None,
        **params: Any,
    ) -> None:
        if config is None:
            raise ValueError(f"switch {name}: P4Switch needs a SwitchProcessConfig")
        if env is None:
            raise ValueError(f"switch {name}: P4Switch needs env, the environment its process runs in")
        params.setdefault("inNamespace", False)
        super().__init__(name, dpid=f"{config.device_id + 1:016x}", **params)
        self.config = config
        self.binary = binary
        self.target = target
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None

    # ---- Mininet interface ----------------------------------------------------
    def start(self, controllers: list[Any]) -> None:
        """Mininet's start hook: start the process (readiness is :meth:`wait_ready`)."""
        self.start_process()

    def stop(self, deleteIntfs: bool = True) -> None:  # noqa: N803  (Mininet's name)
        self.stop_process()
        super().stop(deleteIntfs)

    # ---- the process ------------------------------------------------------------
    @property
    def command(self) -> list[str]:
        return self.config.command(self.binary)

    def configure_interfaces(self) -> None:
        for interface in self.config.ports.values():
            configure_switch_interface(interface)

    def start_process(self) -> subprocess.Popen[bytes]:
        if self.process is not None and self.process.poll() is None:
            return self.process
        log_file = self.config.log_file
        if log_file is None:
            raise ValueError(f"switch {self.name}: no log file configured")
        log_file.parent.mkdir(parents=True, exist_ok=True)
        if self.config.pcap_dir is not None:
            self.config.pcap_dir.mkdir(parents=True, exist_ok=True)
        logger.info("switch %s: %s", self.name, " ".join(self.command))
        with open(log_file, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        return self.process

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait until the P4Runtime port accepts; SwitchStartError if the process dies or time runs out."""
        if self.process is None:
            raise SwitchStartError(f"switch {self.name} was never started")
        deadline = time.monotonic() + timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise SwitchStartError(
                    f"switch {self.name} ({self.target.value}) exited with status {code} while starting; "
                    f"end of {self.config.log_file}:\n{log_tail(self.config.log_file)}"
                )
            if tcp_accepts(self.config.grpc_address):
                logger.info("switch %s: P4Runtime accepts on %s", self.name, self.config.grpc_address)
                return
            if time.monotonic() >= deadline:
                raise SwitchStartError(
                    f"switch {self.name}: P4Runtime on {self.config.grpc_address} did not accept within "
                    f"{timeout:.0f} s; end of {self.config.log_file}:\n{log_tail(self.config.log_file)}"
                )
            time.sleep(0.1)

    def stop_process(self, timeout: float = STOP_TIMEOUT_S) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logger.warning("switch %s did not stop within %.0f s; killing it", self.name, timeout)
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=timeout)
