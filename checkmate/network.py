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
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from checkmate.address import AddressError, parse_host_port

logger = logging.getLogger(__name__)

Addr = tuple[str, int]
"""A socket address, (host, port): a worker's data address, a shadow's control address."""

ROLES = ("worker", "shadow", "host")
"""Host roles: job workers, shadow nodes, and plain hosts that take part in no job."""

MAX_PORT = 510
"""Highest usable switch port: ports are 9 bits and BMv2 reserves 511 as its drop port."""
MAX_DEVICE_ID = 0xFFFF
"""Device ids are kept to 16 bits so that they fit in the port MAC addresses."""
BMV2_MAX_MULTICAST_GROUPS = 4096
"""BMv2's default limit on multicast groups (and L1 nodes); the default for every switch."""
MAX_MULTICAST_GROUP_ID = 32767
"""User multicast group ids must stay below 32768 (BMv2 reserves the rest)."""

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,9}$")
_MAC = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")
_SWITCH_PORT = re.compile(r"^(?P<node>[A-Za-z][A-Za-z0-9_]*)-p(?P<port>[0-9]+)$")
_DELAY = re.compile(r"^[0-9]+(\.[0-9]+)?(us|ms|s)$")

_TOP_FIELDS = {"hosts", "switches", "links", "description"}
_HOST_FIELDS = {"ip", "mac", "role", "commands"}
_SWITCH_FIELDS = {"grpc", "device_id", "cpu_port", "thrift_port", "max_multicast_groups"}
_LINK_OPTIONS = {"bw", "delay", "loss", "max_queue_size"}


class NetworkError(ValueError):
    """A network description that cannot be used; the message names the entry at fault."""


@dataclass(frozen=True)
class Host:
    name: str
    ip: ipaddress.IPv4Interface
    """Address with its prefix length, e.g. 10.0.1.1/8."""
    mac: str
    """Lower-case, colon-separated."""
    role: str = "host"
    commands: tuple[str, ...] = ()
    """Shell commands to run in the host after it is up (tutorials compatibility)."""

    @property
    def address(self) -> ipaddress.IPv4Address:
        return self.ip.ip


@dataclass(frozen=True)
class Switch:
    name: str
    grpc: str
    """P4Runtime address, ``HOST:PORT``."""
    device_id: int
    cpu_port: int | None = None
    thrift_port: int | None = None
    """BMv2's runtime CLI port, when the switch is BMv2."""
    max_multicast_groups: int = BMV2_MAX_MULTICAST_GROUPS


@dataclass(frozen=True, order=True)
class Endpoint:
    """One end of a link: a host (``port`` is None) or a switch port."""

    node: str
    port: int | None = None

    def __str__(self) -> str:
        return self.node if self.port is None else f"{self.node}-p{self.port}"


@dataclass(frozen=True)
class LinkOptions:
    bw: float | None = None
    """Bandwidth in Mbit/s."""
    delay: str | None = None
    """Latency such as ``"1ms"`` (needs netem, which this machine's kernel lacks)."""
    loss: float | None = None
    """Loss in percent (needs netem)."""
    max_queue_size: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class Link:
    a: Endpoint
    b: Endpoint
    options: LinkOptions = field(default_factory=LinkOptions)


@dataclass(frozen=True)
class Route:
    """A /32 route to one host as installed at one switch (the ``forward`` action's arguments)."""

    switch: str
    host: str
    dst_addr: ipaddress.IPv4Address
    port: int
    src_mac: str
    dst_mac: str

    @property
    def prefix_len(self) -> int:
        return 32


@dataclass(frozen=True)
class Hop:
    """A packet's passage through one switch: in one port, out another."""

    switch: str
    in_port: int
    out_port: int


def format_mac(value: int) -> str:
    return ":".join(f"{(value >> s) & 0xFF:02x}" for s in range(40, -1, -8))


def mac_to_int(mac: str) -> int:
    return int(mac.replace(":", ""), 16)


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
        if not isinstance(data, Mapping):
            raise NetworkError(f"a network description is a JSON object, got {type(data).__name__}")
        _no_unknown(data, _TOP_FIELDS, "the description")
        for required in ("hosts", "switches", "links"):
            if required not in data:
                raise NetworkError(f"the description lacks {required!r}")
        description = data.get("description", "")
        if not isinstance(description, str):
            raise NetworkError("description must be a string")
        hosts = _parse_hosts(data["hosts"])
        switches = _parse_switches(data["switches"])
        both = sorted(set(hosts) & set(switches))
        if both:
            raise NetworkError(f"name(s) {both} are used for both a host and a switch")
        links = _parse_links(data["links"], hosts, switches)
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


# ---- parsing helpers -------------------------------------------------------------
def _no_unknown(data: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise NetworkError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")


def _check_name(name: Any, kind: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise NetworkError(
            f"{kind} name {name!r} must be a letter then up to 9 letters, digits or '_' "
            f"(it becomes part of interface names)"
        )
    return name


def _int_field(data: Mapping[str, Any], key: str, where: str, low: int, high: int) -> int | None:
    if key not in data:
        return None
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise NetworkError(f"{where}.{key}: {value!r} is not an integer in {low}..{high}")
    return value


def _parse_hosts(raw: Any) -> dict[str, Host]:
    if not isinstance(raw, Mapping):
        raise NetworkError("hosts must be an object {name: {ip, mac, role}}")
    if not raw:
        raise NetworkError("hosts is empty")
    hosts: dict[str, Host] = {}
    by_ip: dict[ipaddress.IPv4Address, str] = {}
    by_mac: dict[str, str] = {}
    for name, spec in raw.items():
        _check_name(name, "host")
        where = f"hosts.{name}"
        if not isinstance(spec, Mapping):
            raise NetworkError(f"{where} must be an object with ip and mac")
        _no_unknown(spec, _HOST_FIELDS, where)
        for required in ("ip", "mac"):
            if required not in spec:
                raise NetworkError(f"{where} lacks {required!r}")
        ip = _parse_interface(spec["ip"], f"{where}.ip")
        mac = _parse_mac(spec["mac"], f"{where}.mac")
        role = spec.get("role", "host")
        if role not in ROLES:
            raise NetworkError(f"{where}.role: {role!r} is not one of {list(ROLES)}")
        commands = spec.get("commands", [])
        if not isinstance(commands, list) or not all(isinstance(c, str) for c in commands):
            raise NetworkError(f"{where}.commands must be a list of strings")
        if ip.ip in by_ip:
            raise NetworkError(f"{where}.ip: address {ip.ip} is also used by host {by_ip[ip.ip]}")
        if mac in by_mac:
            raise NetworkError(f"{where}.mac: {mac} is also used by host {by_mac[mac]}")
        by_ip[ip.ip] = name
        by_mac[mac] = name
        hosts[name] = Host(name=name, ip=ip, mac=mac, role=role, commands=tuple(commands))
    return hosts


def _parse_interface(value: Any, where: str) -> ipaddress.IPv4Interface:
    if not isinstance(value, str) or "/" not in value:
        raise NetworkError(f"{where}: {value!r} must be ADDRESS/PREFIX, e.g. '10.0.1.1/8'")
    try:
        iface = ipaddress.IPv4Interface(value)
    except ValueError as exc:
        raise NetworkError(f"{where}: {value!r} is not an IPv4 address/prefix ({exc})") from None
    address = iface.ip
    if address.is_multicast or address.is_loopback or address.is_unspecified or address.is_reserved:
        raise NetworkError(f"{where}: {address} is not a unicast host address")
    if iface.network.prefixlen <= 30 and address in (
        iface.network.network_address,
        iface.network.broadcast_address,
    ):
        raise NetworkError(f"{where}: {address} is the network or broadcast address of {iface.network}")
    return iface


def _parse_mac(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _MAC.match(value):
        raise NetworkError(f"{where}: {value!r} is not a MAC address like '08:00:00:00:01:11'")
    mac = value.lower()
    as_int = mac_to_int(mac)
    if as_int == 0 or (as_int >> 40) & 1:
        raise NetworkError(f"{where}: {mac} is not a unicast MAC address")
    return mac


def _parse_switches(raw: Any) -> dict[str, Switch]:
    if not isinstance(raw, Mapping):
        raise NetworkError("switches must be an object {name: {grpc, device_id}}")
    if not raw:
        raise NetworkError("switches is empty")
    switches: dict[str, Switch] = {}
    by_grpc: dict[str, str] = {}
    by_device: dict[int, str] = {}
    for position, (name, spec) in enumerate(raw.items()):
        _check_name(name, "switch")
        where = f"switches.{name}"
        if not isinstance(spec, Mapping):
            raise NetworkError(f"{where} must be an object with grpc and device_id")
        _no_unknown(spec, _SWITCH_FIELDS, where)
        grpc_addr = spec.get("grpc")
        if not isinstance(grpc_addr, str):
            raise NetworkError(f"{where}.grpc: {grpc_addr!r} must be 'HOST:PORT', e.g. '127.0.0.1:50001'")
        try:
            parse_host_port(grpc_addr)
        except AddressError as exc:
            example = "e.g. '127.0.0.1:50001'"
            raise NetworkError(f"{where}.grpc: {exc}; it must be 'HOST:PORT', {example}") from None
        device_id = _int_field(spec, "device_id", where, 0, MAX_DEVICE_ID)
        device_id = position if device_id is None else device_id
        cpu_port = _int_field(spec, "cpu_port", where, 1, MAX_PORT)
        thrift_port = _int_field(spec, "thrift_port", where, 1, 65535)
        max_groups = _int_field(spec, "max_multicast_groups", where, 1, MAX_MULTICAST_GROUP_ID)
        if grpc_addr in by_grpc:
            raise NetworkError(f"{where}.grpc: {grpc_addr} is also used by switch {by_grpc[grpc_addr]}")
        if device_id in by_device:
            raise NetworkError(
                f"{where}.device_id: {device_id} is also used by switch {by_device[device_id]}"
            )
        by_grpc[grpc_addr] = name
        by_device[device_id] = name
        switches[name] = Switch(
            name=name,
            grpc=grpc_addr,
            device_id=device_id,
            cpu_port=cpu_port,
            thrift_port=thrift_port,
            max_multicast_groups=BMV2_MAX_MULTICAST_GROUPS if max_groups is None else max_groups,
        )
    return switches


def _parse_endpoint(
    value: Any, where: str, hosts: Mapping[str, Host], switches: Mapping[str, Switch]
) -> Endpoint:
    if not isinstance(value, str):
        raise NetworkError(f"{where}: endpoint {value!r} must be a string such as 'h1' or 's1-p1'")
    if value in hosts:
        return Endpoint(value)
    match = _SWITCH_PORT.match(value)
    if match is None:
        if value in switches:
            raise NetworkError(f"{where}: switch end {value!r} needs a port, e.g. '{value}-p1'")
        raise NetworkError(f"{where}: {value!r} names no host and no switch port (dangling link)")
    node, port = match["node"], int(match["port"])
    if node not in switches:
        if node in hosts:
            raise NetworkError(f"{where}: a host end is the bare host name {node!r}, not {value!r}")
        raise NetworkError(f"{where}: {value!r} names unknown switch {node!r} (dangling link)")
    if not 1 <= port <= MAX_PORT:
        raise NetworkError(f"{where}: port {port} of {node} is outside 1..{MAX_PORT}")
    return Endpoint(node, port)


def _parse_link_options(extra: Sequence[Any], where: str) -> LinkOptions:
    if not extra:
        return LinkOptions()
    if len(extra) == 1 and isinstance(extra[0], Mapping):
        options = dict(extra[0])
    elif len(extra) <= 2 and not isinstance(extra[0], Mapping):
        # p4lang/tutorials: [a, b, latency, bandwidth_mbps]
        options = {"delay": extra[0]}
        if len(extra) == 2:
            options["bw"] = extra[1]
    else:
        raise NetworkError(f"{where}: after the two ends comes one options object or 'latency', bandwidth")
    _no_unknown(options, _LINK_OPTIONS, f"{where} options")
    bw = options.get("bw")
    if bw is not None and (isinstance(bw, bool) or not isinstance(bw, (int, float)) or bw <= 0):
        raise NetworkError(f"{where}: bw {bw!r} must be a positive number of Mbit/s")
    delay = options.get("delay")
    if delay is not None and (not isinstance(delay, str) or not _DELAY.match(delay)):
        raise NetworkError(f"{where}: delay {delay!r} must look like '0ms', '150us' or '1s'")
    loss = options.get("loss")
    if loss is not None and (
        isinstance(loss, bool) or not isinstance(loss, (int, float)) or not 0 <= loss <= 100
    ):
        raise NetworkError(f"{where}: loss {loss!r} must be a percentage in 0..100")
    queue = options.get("max_queue_size")
    if queue is not None and (isinstance(queue, bool) or not isinstance(queue, int) or queue < 1):
        raise NetworkError(f"{where}: max_queue_size {queue!r} must be a positive integer")
    return LinkOptions(
        bw=None if bw is None else float(bw),
        delay=delay,
        loss=None if loss is None else float(loss),
        max_queue_size=queue,
    )


def _parse_links(raw: Any, hosts: Mapping[str, Host], switches: Mapping[str, Switch]) -> list[Link]:
    if not isinstance(raw, list):
        raise NetworkError("links must be a list such as [['h1', 's1-p1'], ['s1-p2', 's2-p1']]")
    links: list[Link] = []
    for index, item in enumerate(raw):
        where = f"links[{index}]"
        if not isinstance(item, list) or len(item) < 2:
            raise NetworkError(f"{where}: {item!r} must be a list [end, end, options?]")
        a = _parse_endpoint(item[0], where, hosts, switches)
        b = _parse_endpoint(item[1], where, hosts, switches)
        if a.port is None and b.port is None:
            raise NetworkError(f"{where}: links two hosts; hosts attach to switches")
        if a.node == b.node:
            raise NetworkError(f"{where}: links switch {a.node} to itself")
        links.append(Link(a, b, _parse_link_options(item[2:], where)))
    return links


def _link_str(link: Link) -> str:
    return f"[{link.a}, {link.b}]"
