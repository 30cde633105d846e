"""The parts of a network description: hosts, switches, link ends, links, routes and hops.

Frozen dataclasses built by :mod:`checkmate.network_parse` from the JSON and used by
:class:`checkmate.network.Network`, with the limits they are checked against and the
MAC address helpers. Import them from :mod:`checkmate.network`, the public face.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

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
