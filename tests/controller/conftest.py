"""Fixtures for the controller tests: embedded switches in-process, and a tiny wire between them.

Each topology gets one P4RuntimeServer per switch on 127.0.0.1 (port 0), started
once per test session. A test asks for ``fabric("single")`` or
``fabric("leafspine")``: every switch gets a fresh pipeline (empty tables, zero
counters) and the test gets the network description pointing at those servers,
a state directory, and :meth:`Fabric.send`, which carries a frame from a host
through the switches' data paths (``Pipeline(server.state).process``) along
the links until it reaches hosts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw

from checkmate.network import Network
from checkmate.scapy_layer import Checkmate
from checkmate.wire import CHECKMATE_UDP_PORT, Flags
from controller.controller import Controller
from embedded_switch.p4runtime_server import P4RuntimeServer
from embedded_switch.pipeline import Pipeline

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = REPO / "topologies"
TIMEOUT_S = 2.0


def topology_json(name: str) -> dict[str, Any]:
    return json.loads((TOPOLOGIES / f"{name}.json").read_text())


@dataclass
class Fabric:
    network: Network
    servers: dict[str, P4RuntimeServer]
    state_dir: Path
    controllers: list[Controller] = field(default_factory=list)

    def controller(self, **kwargs: Any) -> Controller:
        kwargs.setdefault("timeout", TIMEOUT_S)
        ctl = Controller(self.network, self.state_dir, **kwargs)
        self.controllers.append(ctl)
        return ctl

    def send(self, host: str, frame: Packet | bytes, max_hops: int = 8) -> dict[str, list[Packet]]:
        """Deliver ``frame`` from ``host``; return the frames each host received."""
        switch, port = self.network.attachment(host)
        pipelines = {name: Pipeline(server.state) for name, server in self.servers.items()}
        pending = [(switch, port, bytes(frame), 0)]
        delivered: dict[str, list[Packet]] = {}
        while pending:
            switch, port, data, hops = pending.pop(0)
            assert hops < max_hops, "forwarding loop"
            for out_port, out in pipelines[switch].process(data, port):
                peer = self.network.peer(switch, out_port)
                assert peer is not None, f"{switch} sent a frame out of unlinked port {out_port}"
                if peer.port is None:
                    delivered.setdefault(peer.node, []).append(Ether(bytes(out)))
                else:
                    pending.append((peer.node, peer.port, bytes(out), hops + 1))
        return delivered

    def full_read(self, switch: str) -> list[bytes]:
        """Every table entry, multicast group and counter cell of ``switch``, serialized and sorted.

        A Read needs no stream, so this uses a bare stub and leaves arbitration alone.
        """
        spec = self.network.switches[switch]
        request = p4runtime_pb2.ReadRequest(device_id=spec.device_id)
        for _ in range(3):
            request.entities.add()
        request.entities[0].table_entry.table_id = 0
        request.entities[1].packet_replication_engine_entry.multicast_group_entry.multicast_group_id = 0
        request.entities[2].counter_entry.counter_id = 0
        with grpc.insecure_channel(spec.grpc) as channel:
            replies = p4runtime_pb2_grpc.P4RuntimeStub(channel).Read(request, timeout=TIMEOUT_S)
            return sorted(e.SerializeToString(deterministic=True) for r in replies for e in r.entities)

    def snapshot(self) -> dict[str, list[bytes]]:
        return {switch: self.full_read(switch) for switch in sorted(self.servers)}


@pytest.fixture(scope="session")
def _servers() -> Iterator[dict[str, tuple[dict[str, Any], dict[str, P4RuntimeServer]]]]:
    started: dict[str, tuple[dict[str, Any], dict[str, P4RuntimeServer]]] = {}
    for topology in ("single", "leafspine"):
        data = topology_json(topology)
        servers: dict[str, P4RuntimeServer] = {}
        for name, spec in data["switches"].items():
            server = P4RuntimeServer(spec["device_id"], "127.0.0.1:0")
            spec["grpc"] = f"127.0.0.1:{server.start()}"
            servers[name] = server
        started[topology] = (data, servers)
    yield started
    for _, servers in started.values():
        for server in servers.values():
            server.stop(grace=0.1)


@pytest.fixture
def fabric(
    _servers: dict[str, tuple[dict[str, Any], dict[str, P4RuntimeServer]]], tmp_path: Path
) -> Iterator[Callable[..., Fabric]]:
    made: list[Fabric] = []

    def make(topology: str = "single", **overrides: Any) -> Fabric:
        data, servers = _servers[topology]
        data = json.loads(json.dumps(data))
        for name, extra in overrides.items():
            data["switches"][name].update(extra)
        for server in servers.values():
            server.load_default_pipeline()
        f = Fabric(Network.from_json(data), servers, tmp_path / f"state-{topology}")
        made.append(f)
        return f

    yield make
    for f in made:
        for ctl in f.controllers:
            ctl.close()


def cli_session(f: Fabric, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Callable[..., str]:
    """``checkmate-ctl`` on ``f``'s network and state: ``ctl(*argv, status=0)`` asserts the exit
    status and returns what the command printed (stderr when ``status`` is not 0)."""
    from controller.cli import main

    net = tmp_path / "net.json"
    net.write_text(json.dumps(f.network.to_json()))
    base = ["--network", str(net), "--state-dir", str(f.state_dir), "--timeout", "2"]

    def ctl(*argv: str, status: int = 0) -> str:
        code = main([*base, *argv])
        out, err = capsys.readouterr()
        assert code == status, (out, err)
        return out if status == 0 else err

    return ctl


def gradient(
    src: str,
    dst: str,
    network: Network,
    job_id: int = 7,
    shard_key: int = 0,
    flags: Flags = Flags.REPLICATE,
    elements: int = 4,
) -> Packet:
    """A tagged DATA packet from host ``src`` to host ``dst`` (as a worker's host agent sends it)."""
    s, d = network.host(src), network.host(dst)
    switch, port = network.attachment(src)
    return (
        Ether(src=s.mac, dst=network.port_mac(switch, port))
        / IP(src=str(s.address), dst=str(d.address), ttl=64)
        / UDP(sport=CHECKMATE_UDP_PORT, dport=CHECKMATE_UDP_PORT)
        / Checkmate(job_id=job_id, shard_key=shard_key, flags=int(flags), element_count=elements)
        / Raw(b"\x00" * 4 * elements)
    )
