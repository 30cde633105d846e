"""The network description: hosts, switches and links, as the controller and the emulator see them.

The JSON shape is the one P4 users know from p4lang/tutorials' ``topology.json``,
extended with host roles, switch P4Runtime addresses and link options::

    {
      "hosts": {
        "h1":  {"ip": "10.0.1.1/8", "mac": "08:00:00:00:01:11", "role": "worker"},
        "sh1": {"ip": "10.0.3.1/8", "mac": "08:00:00:00:03:11", "role": "shadow"}
      },
      "switches": {
        "s1": {"grpc": "127.0.0.1:50001", "device_id": 0, "cpu_port": 510}
      },
      "links": [["h1", "s1-p1"], ["sh1", "s1-p2", {"bw": 1000}], ["s1-p4", "s2-p1", "0ms", 100]]
    }

A host end of a link is the bare host name (a host has one interface); a
switch end is ``SWITCH-pPORT``. The optional third element is either an
object of link options or, as in the tutorials, a latency string followed by
a bandwidth in Mbit/s.

Every switch acts as an IPv4 router. Its ports have deterministic MAC addresses
(:meth:`Network.port_mac`), and :meth:`Network.routes_for` gives the /32 route
to every host at a switch: the next-hop port on a shortest path (BFS over the
switches, ties broken by the lowest port number), the port's MAC as source and
the host's MAC (last hop) or the neighbour switch port's MAC as destination.
Validation is strict: anything the description cannot mean raises
:class:`NetworkError` naming the offending entry, before anything is built.

This module is the public face of the network description: import everything from here
(``from checkmate.network import Network, Host``). The parts live in
:mod:`checkmate.network_elements` and the JSON is read by :mod:`checkmate.network_parse`.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkmate.network_elements import (
    BMV2_MAX_MULTICAST_GROUPS,
    MAX_DEVICE_ID,
    MAX_MULTICAST_GROUP_ID,
    MAX_PORT,
    ROLES,
    Addr,
    Endpoint,
    Hop,
    Host,
    Link,
    LinkOptions,
    NetworkError,
    Route,
    Switch,
    format_mac,
    mac_to_int,
)
from checkmate.network_parse import parse_description

__all__ = [
    "BMV2_MAX_MULTICAST_GROUPS",
    "MAX_DEVICE_ID",
    "MAX_MULTICAST_GROUP_ID",
    "MAX_PORT",
    "ROLES",
    "Addr",
    "Endpoint",
    "Hop",
    "Host",
    "Link",
    "LinkOptions",
    "Network",
    "NetworkError",
    "Route",
    "Switch",
    "format_mac",
    "mac_to_int",
    "parse_description",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Network:
    """A validated network description. Build it with :meth:`load` or :meth:`from_json`."""

    hosts: Mapping[str, Host]
    switches: Mapping[str, Switch]
    links: tuple[Link, ...]
    description: str = ""
    _peer: dict[tuple[str, int], Endpoint] = field(default_factory=dict, repr=False, compare=False)
    _attached: dict[str, tuple[str, int]] = field(default_factory=dict, repr=False, compare=False)
    _toward: dict[str, dict[str, int]] = field(default_factory=dict, repr=False, compare=False)

    # ---- construction -----------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> Network:
        """Read and validate a description file."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise NetworkError(f"cannot read network description {path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise NetworkError(
                f"{path} is not valid JSON: not UTF-8 text ({exc.reason} at byte {exc.start})"
            ) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise NetworkError(f"{path} is not valid JSON: {exc}") from None
        try:
            return cls.from_json(data)
        except NetworkError as exc:
            raise NetworkError(f"{path}: {exc}") from None

    @classmethod
    def from_json(cls, data: Any) -> Network:
        """Validate a parsed description; raise NetworkError naming the first problem."""
        hosts, switches, links, description = parse_description(data)
        network = cls(hosts=hosts, switches=switches, links=tuple(links), description=description)
        network._index()
        return network

    def _index(self) -> None:
        for link in self.links:
            for end, other in ((link.a, link.b), (link.b, link.a)):
                if end.port is None:
                    if end.node in self._attached:
                        raise NetworkError(
                            f"link {_link_str(link)}: host {end.node} is already linked "
                            f"(a host has exactly one interface)"
                        )
                    assert other.port is not None
                    self._attached[end.node] = (other.node, other.port)
                    continue
                key = (end.node, end.port)
                if key in self._peer:
                    raise NetworkError(f"link {_link_str(link)}: port {end} is used by two links")
                self._peer[key] = other
        unattached = sorted(set(self.hosts) - set(self._attached))
        if unattached:
            raise NetworkError(f"host(s) {unattached} are not linked to any switch")
        for name, switch in self.switches.items():
            if switch.cpu_port is not None and (name, switch.cpu_port) in self._peer:
                raise NetworkError(f"switch {name}: cpu_port {switch.cpu_port} is also used by a link")
        self._check_connected()
        for name in self.switches:
            self._toward[name] = self._bfs_next_ports(name)
        macs: dict[str, str] = {h.mac: f"host {h.name}" for h in self.hosts.values()}
        for node, port in sorted(self._peer):
            mac = self.port_mac(node, port)
            if mac in macs:
                raise NetworkError(f"port {node}-p{port} MAC {mac} collides with {macs[mac]}")
            macs[mac] = f"port {node}-p{port}"

    def _switch_neighbours(self, switch: str) -> list[tuple[int, str]]:
        """(local port, neighbour switch) for the switch's inter-switch links, by port."""
        return sorted(
            (port, peer.node)
            for (node, port), peer in self._peer.items()
            if node == switch and peer.port is not None
        )

    def _check_connected(self) -> None:
        names = sorted(self.switches)
        seen = {names[0]}
        queue = deque([names[0]])
        while queue:
            current = queue.popleft()
            for _, peer in self._switch_neighbours(current):
                if peer not in seen:
                    seen.add(peer)
                    queue.append(peer)
        apart = sorted(set(names) - seen)
        if apart:
            raise NetworkError(f"switch(es) {apart} are not connected to {names[0]}")

    def _bfs_next_ports(self, destination: str) -> dict[str, int]:
        """For every other switch, the port of its shortest path toward ``destination``.

        Distances come from a BFS outward from the destination; among the
        neighbours one hop closer, the switch takes its lowest-numbered port.
        """
        distance = {destination: 0}
        queue = deque([destination])
        while queue:
            current = queue.popleft()
            for _, peer in self._switch_neighbours(current):
                if peer not in distance:
                    distance[peer] = distance[current] + 1
                    queue.append(peer)
        next_port: dict[str, int] = {}
        for switch in self.switches:
            if switch == destination:
                continue
            closer = [
                p for p, peer in self._switch_neighbours(switch) if distance[peer] == distance[switch] - 1
            ]
            next_port[switch] = min(closer)
        return next_port

    # ---- queries ----------------------------------------------------------------
    def host(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise NetworkError(f"unknown host {name!r}; hosts: {sorted(self.hosts)}") from None

    def switch(self, name: str) -> Switch:
        try:
            return self.switches[name]
        except KeyError:
            raise NetworkError(f"unknown switch {name!r}; switches: {sorted(self.switches)}") from None

    def hosts_with_role(self, role: str) -> list[str]:
        return [name for name, h in self.hosts.items() if h.role == role]

    def attachment(self, host: str) -> tuple[str, int]:
        """The (switch, port) a host is linked to."""
        self.host(host)
        return self._attached[host]

    def peer(self, switch: str, port: int) -> Endpoint | None:
        """What is at the other end of a switch port (None if the port is unused)."""
        return self._peer.get((switch, port))

    def ports(self, switch: str) -> list[int]:
        self.switch(switch)
        return sorted(port for node, port in self._peer if node == switch)

    def port_mac(self, switch: str, port: int) -> str:
        """The MAC a switch port uses as source when it routes: ``02:00:DD:DD:PP:PP``.

        DDDD is the device id and PPPP the port, so the address is the same on
        every run and unique in the network.
        """
        device_id = self.switch(switch).device_id
        return format_mac(0x02_00_0000_0000 | (device_id << 16) | port)

    def next_hop_port(self, switch: str, host: str) -> int:
        """The port ``switch`` sends packets for ``host`` out of."""
        attached_switch, attached_port = self.attachment(host)
        self.switch(switch)
        if attached_switch == switch:
            return attached_port
        return self._toward[attached_switch][switch]

    def next_hop_mac(self, switch: str, port: int) -> str:
        """The destination MAC of frames a switch routes out of ``port``."""
        peer = self.peer(switch, port)
        if peer is None:
            raise NetworkError(f"port {switch}-p{port} is not linked")
        if peer.port is None:
            return self.hosts[peer.node].mac
        return self.port_mac(peer.node, peer.port)

    def route(self, switch: str, host: str) -> Route:
        port = self.next_hop_port(switch, host)
        return Route(
            switch=switch,
            host=host,
            dst_addr=self.hosts[host].address,
            port=port,
            src_mac=self.port_mac(switch, port),
            dst_mac=self.next_hop_mac(switch, port),
        )

    def routes_for(self, switch: str) -> list[Route]:
        """The /32 route to every host at ``switch``, in host-name order."""
        self.switch(switch)
        return [self.route(switch, host) for host in sorted(self.hosts)]

    def path(self, src: str, dst: str) -> list[Hop]:
        """The switches a packet from host ``src`` to host ``dst`` crosses, in order."""
        if src == dst:
            raise NetworkError(f"no path from {src} to itself")
        switch, in_port = self.attachment(src)
        self.host(dst)
        hops: list[Hop] = []
        while True:
            out_port = self.next_hop_port(switch, dst)
            hops.append(Hop(switch, in_port, out_port))
            peer = self._peer[(switch, out_port)]
            if peer.port is None:
                return hops
            switch, in_port = peer.node, peer.port

    def arp_entries(self, host: str) -> dict[str, str]:
        """IP -> MAC for every other host, as static ARP entries in ``host``.

        Every host reaches every other through the switch port it is linked to
        (the switches route), so each entry carries that port's MAC.
        """
        switch, port = self.attachment(host)
        gateway = self.port_mac(switch, port)
        return {str(h.address): gateway for name, h in sorted(self.hosts.items()) if name != host}

    # ---- JSON -------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        hosts: dict[str, Any] = {}
        for name, h in self.hosts.items():
            entry: dict[str, Any] = {"ip": str(h.ip), "mac": h.mac, "role": h.role}
            if h.commands:
                entry["commands"] = list(h.commands)
            hosts[name] = entry
        switches: dict[str, Any] = {}
        for name, s in self.switches.items():
            sentry: dict[str, Any] = {"grpc": s.grpc, "device_id": s.device_id}
            if s.cpu_port is not None:
                sentry["cpu_port"] = s.cpu_port
            if s.thrift_port is not None:
                sentry["thrift_port"] = s.thrift_port
            if s.max_multicast_groups != BMV2_MAX_MULTICAST_GROUPS:
                sentry["max_multicast_groups"] = s.max_multicast_groups
            switches[name] = sentry
        links: list[list[Any]] = []
        for link in self.links:
            item: list[Any] = [str(link.a), str(link.b)]
            options = link.options.to_json()
            if options:
                item.append(options)
            links.append(item)
        out: dict[str, Any] = {"hosts": hosts, "switches": switches, "links": links}
        if self.description:
            out["description"] = self.description
        return out


def _link_str(link: Link) -> str:
    return f"[{link.a}, {link.b}]"
