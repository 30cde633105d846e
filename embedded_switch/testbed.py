"""A throw-away network for packet tests and benchmarks: namespaces, veth pairs, a switch process.

:func:`testbed` creates two network namespaces with a unique suffix — one for the
switch, one for the hosts — and one veth pair per switch port between them
(MTU 9000, TX checksum offload off, IPv6 off so the kernel sends nothing of its
own). The switch (``checkmate-switch`` or ``simple_switch_grpc``) runs inside
the switch namespace and serves P4Runtime on a Unix socket in a private
folder, which every namespace can reach. Host-side raw sockets are opened from
the host namespace by the calling thread. Everything is removed on exit, also
after a failure. Needs root.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from checkmate.tls import PkiFiles, TlsFiles, channel_credentials, server_args

logger = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
SOL_PACKET = 263
PACKET_IGNORE_OUTGOING = 23
ETH_P_ALL = 0x0003
_COMMAND_TIMEOUT_S = 20.0


class TestbedError(RuntimeError):
    """Setting up the namespaces or the switch failed; the message says which step."""


def _run(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise TestbedError(f"{' '.join(args)}: {result.stderr.strip() or result.returncode}")


@dataclass
class Testbed:
    suffix: str
    switch_ns: str
    host_ns: str
    switch_ifaces: dict[int, str]
    """Switch port -> interface in the switch namespace."""
    host_ifaces: dict[int, str]
    """Switch port -> the peer interface in the host namespace."""
    workdir: Path
    mtu: int = 9000
    created: list[str] = field(default_factory=list)

    @property
    def grpc_address(self) -> str:
        return f"unix:{self.workdir / 'p4runtime.sock'}"

    def interface_args(self) -> list[str]:
        """``-i PORT@IFACE`` arguments for the switch."""
        out: list[str] = []
        for port, iface in sorted(self.switch_ifaces.items()):
            out += ["-i", f"{port}@{iface}"]
        return out


def create(ports: Sequence[int], mtu: int = 9000, prefix: str = "cm") -> Testbed:
    """Create the namespaces and veth pairs (see the module docstring). Call :func:`destroy` after."""
    if os.geteuid() != 0:
        raise TestbedError("network namespaces need root")
    suffix = secrets.token_hex(3)
    bed = Testbed(
        suffix=suffix,
        switch_ns=f"{prefix}s-{suffix}",
        host_ns=f"{prefix}h-{suffix}",
        switch_ifaces={p: f"s{suffix}p{p}" for p in ports},
        host_ifaces={p: f"h{suffix}p{p}" for p in ports},
        workdir=Path(tempfile.mkdtemp(prefix=f"{prefix}-{suffix}-")),
        mtu=mtu,
    )
    os.chmod(bed.workdir, 0o755)
    try:
        for ns in (bed.switch_ns, bed.host_ns):
            _run("ip", "netns", "add", ns)
            bed.created.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        for port in ports:
            s_if, h_if = bed.switch_ifaces[port], bed.host_ifaces[port]
            _run(
                "ip",
                "-n",
                bed.switch_ns,
                "link",
                "add",
                s_if,
                "mtu",
                str(mtu),
                "type",
                "veth",
                "peer",
                "name",
                h_if,
                "mtu",
                str(mtu),
                "netns",
                bed.host_ns,
            )
            for ns, iface in ((bed.switch_ns, s_if), (bed.host_ns, h_if)):
                _run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv6.conf.{iface}.disable_ipv6=1")
                _run("ip", "netns", "exec", ns, "ethtool", "-K", iface, "tx", "off")
        for port in ports:
            _run("ip", "-n", bed.switch_ns, "link", "set", bed.switch_ifaces[port], "up")
            _run("ip", "-n", bed.host_ns, "link", "set", bed.host_ifaces[port], "up")
    except BaseException:
        destroy(bed)
        raise
    logger.info("testbed %s: namespaces %s, %s; ports %s", suffix, bed.switch_ns, bed.host_ns, list(ports))
    return bed


def destroy(bed: Testbed) -> None:
    """Remove the namespaces (and with them the veth pairs) and the work folder."""
    for ns in reversed(bed.created):
        result = subprocess.run(
            ["ip", "netns", "del", ns],
            capture_output=True,
            text=True,
            timeout=_COMMAND_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0:
            logger.warning("could not delete namespace %s: %s", ns, result.stderr.strip())
    bed.created.clear()
    shutil.rmtree(bed.workdir, ignore_errors=True)


@contextlib.contextmanager
def testbed(ports: Sequence[int], mtu: int = 9000, prefix: str = "cm") -> Iterator[Testbed]:
    bed = create(ports, mtu, prefix)
    try:
        yield bed
    finally:
        destroy(bed)


# ---- sockets in the host namespace ----------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def in_namespace(name: str) -> Iterator[None]:
    """Run the body with the calling thread in network namespace ``name`` (sockets stay there)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({name})")
        try:
            yield
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the original namespace")
    finally:
        os.close(target)
        os.close(own)


def host_socket(bed: Testbed, port: int, buffer_bytes: int = 8 << 20) -> socket.socket:
    """A raw socket on the host end of ``port``'s veth: sends into the switch, sees what it sends."""
    with in_namespace(bed.host_ns):
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # receives nothing until bound
    iface = bed.host_ifaces[port]
    try:
        sock.bind((iface, ETH_P_ALL))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"testbed host socket cannot bind {iface!r}: {exc.strerror}") from None
    try:
        sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        sock.setsockopt(socket.SOL_SOCKET, 33, buffer_bytes)  # SO_RCVBUFFORCE
        sock.setsockopt(socket.SOL_SOCKET, 32, buffer_bytes)  # SO_SNDBUFFORCE
    except OSError:
        sock.close()
        raise
    return sock


# ---- the switch process ---------------------------------------------------------------------------
@dataclass
class SwitchProcess:
    """A switch running in the testbed's switch namespace, serving P4Runtime on a Unix socket."""

    kind: str
    """"embedded" (checkmate-switch) or "bmv2" (simple_switch_grpc)."""
    process: subprocess.Popen[bytes]
    address: str
    log_path: Path

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("switch did not stop within %.1f s; killing it", timeout)
                self.process.kill()
                self.process.wait(timeout)
        return self.process.returncode


def switch_program() -> list[str]:
    """How to start ``checkmate-switch``: the console script on PATH or beside this Python, else
    ``python -m embedded_switch.cli`` (no checkout or ``.venv`` assumed)."""
    found = shutil.which("checkmate-switch") or shutil.which(
        "checkmate-switch", path=str(Path(sys.executable).parent)
    )
    return [found] if found else [sys.executable, "-m", "embedded_switch.cli"]


def switch_command(
    kind: str,
    bed: Testbed,
    extra: Sequence[str] = (),
    cpu_port: int | None = 255,
    grpc_args: Sequence[str] = (),
) -> list[str]:
    """The command line that starts switch ``kind`` on the testbed's ports.

    ``grpc_args``: the gRPC server's options (TLS), given where the target takes them."""
    cpu = ["--cpu-port", str(cpu_port)] if cpu_port is not None else []
    if kind == "embedded":
        return [
            *switch_program(),
            "--no-p4",
            *bed.interface_args(),
            "--grpc-server-addr",
            bed.grpc_address,
            *grpc_args,
            "--device-id",
            "0",
            *cpu,
            *extra,
        ]
    if kind == "bmv2":
        return [
            # BMv2's own options (--device-id, -i, --no-p4) go before "--"; the target's
            # (--grpc-server-addr, --cpu-port) after it, or simple_switch_grpc refuses them.
            "simple_switch_grpc",
            "--no-p4",
            "--device-id",
            "0",
            *bed.interface_args(),
            *extra,
            "--",
            "--grpc-server-addr",
            bed.grpc_address,
            *grpc_args,
            *cpu,
        ]
    raise ValueError(f"unknown switch kind {kind!r}")


TLS_TARGET_NAME = "localhost"
"""The name a TLS client checks the switch's certificate for on the testbed's unix socket
(:func:`checkmate.tls.make_test_pki` certificates name it)."""


def channel_options(tls: TlsFiles | None) -> list[tuple[str, str]]:
    """gRPC channel options for the testbed's socket: with TLS, the name its certificate carries."""
    return [("grpc.ssl_target_name_override", TLS_TARGET_NAME)] if tls is not None else []


def open_channel(address: str, tls: TlsFiles | None = None) -> grpc.Channel:
    """A channel to the testbed's P4Runtime server: plaintext, or TLS with ``tls`` (mutual with a
    client certificate)."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, channel_credentials(tls), options=channel_options(tls))


def start_switch(
    kind: str,
    bed: Testbed,
    extra: Sequence[str] = (),
    timeout: float = 20.0,
    cpu_port: int | None = 255,
    tls: PkiFiles | None = None,
) -> SwitchProcess:
    """Start the switch and wait until its P4Runtime socket answers.

    ``tls``: serve P4Runtime over mutual TLS with this PKI (the switch's certificate and the CA
    that signs clients; :func:`checkmate.tls.server_args`), as ``checkmate-net up --tls`` does;
    the readiness check then connects with the PKI's client certificate.
    """
    log_path = bed.workdir / f"{kind}-switch.log"
    grpc_args = server_args(tls.switch) if tls is not None else []
    command = ["ip", "netns", "exec", bed.switch_ns, *switch_command(kind, bed, extra, cpu_port, grpc_args)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=bed.workdir)
    switch = SwitchProcess(kind, process, bed.grpc_address, log_path)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise TestbedError(f"{kind} switch exited with {process.returncode}:\n{switch.log()}")
        sock_path = Path(bed.grpc_address.removeprefix("unix:"))
        if sock_path.exists():
            channel = open_channel(bed.grpc_address, tls.controller if tls is not None else None)
            try:
                grpc.channel_ready_future(channel).result(timeout=max(0.1, deadline - time.monotonic()))
                break
            except grpc.FutureTimeoutError:
                pass
            finally:
                channel.close()
        if time.monotonic() > deadline:
            switch.stop()
            raise TestbedError(f"{kind} switch did not serve P4Runtime within {timeout} s:\n{switch.log()}")
        time.sleep(0.05)
    logger.info("%s switch running (pid %d) on %s", kind, process.pid, bed.grpc_address)
    return switch
