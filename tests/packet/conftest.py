"""Fixtures of the packet-test suite: a switch in a network namespace, host ports, P4Runtime.

``switch`` (one per module and target) creates the namespaces and veth pairs of
embedded_switch.testbed, starts the target — ``checkmate-switch`` always, once per
data path (``native`` when the extension is built, and ``python``, the reference),
``simple_switch_grpc`` when it and build/v1model/checkmate.json exist — on the
switch ends, and opens raw sockets on the host ends. ``p4rt`` gives each test a
fresh program state (the switch's multicast groups deleted, then the pipeline
pushed again: BMv2 keeps the replicas of groups that exist at a push, see
docs/controller.md) with the entries and groups of tests/switch_cases.py
installed over P4Runtime. Namespaces, processes and
sockets are always removed, also when a test fails.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from scapy.packet import Packet

from embedded_switch import native, testbed
from embedded_switch.testbed import SwitchProcess, Testbed
from tests import switch_cases as sc
from tests.packet.p4rt import P4RuntimeTestClient, device_config_for

REPO_ROOT = Path(__file__).resolve().parents[2]
BMV2_JSON = REPO_ROOT / "build" / "v1model" / "checkmate.json"
NATIVE = pytest.mark.skipif(not native.available(), reason=f"native path not built: {native.IMPORT_ERROR}")
DATAPATHS = [pytest.param("native", marks=NATIVE), "python"]
"""The embedded target's data paths (``checkmate-switch --datapath``)."""
TARGETS = [
    pytest.param(("embedded", "native"), marks=NATIVE, id="embedded-native"),
    pytest.param(("embedded", "python"), id="embedded-python"),
    pytest.param(("bmv2", ""), marks=pytest.mark.bmv2, id="bmv2"),
]
QUIET_S = 0.25
"""How long no further frame may arrive after the expected ones (nothing elsewhere)."""
EXPECT_TIMEOUT_S = 3.0


def skip_reason(kind: str) -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, AF_PACKET)"
    for tool in ("ip", "ethtool"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if kind == "bmv2":
        if shutil.which("simple_switch_grpc") is None:
            return "simple_switch_grpc (BMv2) is not installed"
        if not BMV2_JSON.exists():
            return f"{BMV2_JSON.relative_to(REPO_ROOT)} does not exist (run make p4 with p4c installed)"
    return None


Expected = Mapping[int, Sequence[bytes | Packet]]


@dataclass
class Rig:
    """A running switch and one raw socket per host port."""

    kind: str
    bed: Testbed
    switch: SwitchProcess
    sockets: dict[int, socket.socket] = field(default_factory=dict)
    datapath: str = ""
    """The embedded target's data path (``native`` or ``python``); empty for BMv2."""

    def send(self, port: int, *frames: bytes | Packet) -> None:
        for frame in frames:
            self.sockets[port].send(bytes(frame))

    def drain(self) -> None:
        """Discard whatever is queued on the host sockets."""
        for sock in self.sockets.values():
            while True:
                try:
                    sock.recv(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break

    def collect(
        self, count: int, timeout: float = EXPECT_TIMEOUT_S, quiet: float = QUIET_S
    ) -> dict[int, list[bytes]]:
        """Frames arriving on every host port until ``count`` came and then ``quiet`` s passed in silence."""
        poller = select.poll()
        by_fd = {s.fileno(): (port, s) for port, s in self.sockets.items()}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        got: dict[int, list[bytes]] = {port: [] for port in self.sockets}
        received = 0
        deadline = time.monotonic() + timeout
        last = time.monotonic()
        while True:
            now = time.monotonic()
            if received >= count and now - last >= quiet:
                break
            if received < count and now >= deadline:
                break
            wait = quiet - (now - last) if received >= count else min(deadline - now, quiet)
            for fd, _ in poller.poll(max(1, int(wait * 1000))):
                port, sock = by_fd[fd]
                while True:
                    try:
                        got[port].append(sock.recv(65536, socket.MSG_DONTWAIT))
                    except BlockingIOError:
                        break
                    received += 1
                    last = time.monotonic()
        return got

    def expect(self, expected: Expected, timeout: float = EXPECT_TIMEOUT_S) -> None:
        """Exactly these frames on these ports, in order per port, and nothing on any other port."""
        want = {port: [bytes(f) for f in expected.get(port, ())] for port in self.sockets}
        got = self.collect(sum(len(v) for v in want.values()), timeout)
        for port in self.sockets:
            assert len(got[port]) == len(want[port]), (
                f"port {port}: expected {len(want[port])} frame(s), got {len(got[port])}"
            )
            for i, (g, w) in enumerate(zip(got[port], want[port], strict=True)):
                assert g == w, f"port {port} frame {i} differs:\n got  {g.hex()}\n want {w.hex()}"

    def expect_nothing(self, wait: float = 0.4) -> None:
        self.expect({}, timeout=wait)


def open_rig(kind: str, bed: Testbed, switch: SwitchProcess, datapath: str = "") -> Rig:
    rig = Rig(kind, bed, switch, datapath=datapath)
    try:
        for port in bed.host_ifaces:
            rig.sockets[port] = testbed.host_socket(bed, port)
    except BaseException:
        for s in rig.sockets.values():
            s.close()
        raise
    return rig


@pytest.fixture(scope="module", params=TARGETS)
def switch(request: pytest.FixtureRequest) -> Iterator[Rig]:
    """A running switch (module scope, per target and data path) with ports 1-4 and CPU port 255."""
    kind, datapath = request.param
    reason = skip_reason(kind)
    if reason is not None:
        pytest.skip(reason)
    with testbed.testbed(sc.PORTS) as bed:
        process = testbed.start_switch(kind, bed, ["--datapath", datapath] if datapath else [])
        try:
            rig = open_rig(kind, bed, process, datapath)
            try:
                yield rig
            finally:
                for s in rig.sockets.values():
                    s.close()
        finally:
            process.stop()


@pytest.fixture
def p4rt(switch: Rig) -> Iterator[P4RuntimeTestClient]:
    """A primary P4Runtime client; the pipeline freshly pushed and the scenario's entries installed."""
    client = P4RuntimeTestClient(switch.switch.address)
    try:
        client.push_pipeline(device_config_for(switch.kind, REPO_ROOT))
        client.insert(*sc.ENTRIES)
        client.insert_group(*sc.GROUPS)
        switch.drain()
        yield client
    finally:
        client.close()
