"""Fills ``route_ipv4`` and ``check_source`` from the network's routes.

``route_ipv4``: a /32 route to every host at every switch (:meth:`Network.routes_for`):
next-hop port on the shortest path, the port's MAC as source, and the host's MAC (last
hop) or the next switch port's MAC as destination.

``check_source``: source-address validation of Checkmate packets (strict uRPF, as a
switch's IP source guard; issue 29). For every route "dst S/32 out port P" at a switch,
``check_source(S/32) -> expect_port(P)``: a packet from S must come in on the port that
leads back to S, so no other host can inject ring traffic under S's address. Routes are
shortest paths toward each destination, so the port a packet from S arrives on is P
whenever paths are symmetric (every tree, e.g. topologies/single.json and leafspine.json).
Where some path from S reaches a switch on another port (equal-cost cycles), that switch
gets no entry for S (logged): a strict check there would drop S's real traffic, and S
stays checked at the switches where its arrival port is unambiguous, its own leaf first.
"""

from __future__ import annotations

import logging

from checkmate.network import Network, Route, mac_to_int
from checkmate.p4 import names
from controller.entities import TableEntry

logger = logging.getLogger(__name__)

TABLE = names.RouteIpv4.NAME
SOURCE_TABLE = names.CheckSource.NAME
TABLES = (TABLE, SOURCE_TABLE)
"""What :meth:`Controller.install_forwarding` reconciles: both are derived from the routes."""


def route_entry(route: Route) -> TableEntry:
    return TableEntry.make(
        TABLE,
        {names.RouteIpv4.DST_ADDR: (int(route.dst_addr), route.prefix_len)},
        names.Forward.NAME,
        {
            names.Forward.PORT: route.port,
            names.Forward.SRC_MAC: mac_to_int(route.src_mac),
            names.Forward.DST_MAC: mac_to_int(route.dst_mac),
        },
    )


def route_entries(network: Network, switch: str) -> list[TableEntry]:
    """Every route ``switch`` needs, in host-name order."""
    return [route_entry(route) for route in network.routes_for(switch)]


def source_entry(route: Route) -> TableEntry:
    """``check_source``: packets from the route's host must come in on the route's port."""
    return TableEntry.make(
        SOURCE_TABLE,
        {names.CheckSource.SRC_ADDR: (int(route.dst_addr), route.prefix_len)},
        names.ExpectPort.NAME,
        {names.ExpectPort.PORT: route.port},
    )


def arrival_ports(network: Network, switch: str) -> dict[str, set[int]]:
    """Per host, the ports of ``switch`` its packets come in on, over paths to every other host.

    A path depends only on the destination's switch, so one destination per switch is enough.
    """
    by_switch: dict[str, list[str]] = {}
    for host in sorted(network.hosts):
        by_switch.setdefault(network.attachment(host)[0], []).append(host)
    arrivals: dict[str, set[int]] = {}
    for source in sorted(network.hosts):
        ports = arrivals.setdefault(source, set())
        for hosts in by_switch.values():
            destination = next((h for h in hosts if h != source), None)
            if destination is None:
                continue
            ports.update(hop.in_port for hop in network.path(source, destination) if hop.switch == switch)
    return arrivals


def source_entries(network: Network, switch: str) -> list[TableEntry]:
    """``check_source`` at ``switch``: one entry per route (host-name order), unless ambiguous."""
    arrivals = arrival_ports(network, switch)
    entries: list[TableEntry] = []
    for route in network.routes_for(switch):
        other = sorted(arrivals.get(route.host, set()) - {route.port})
        if other:
            logger.warning(
                "switch %s: packets from %s (%s) also arrive on port(s) %s, not only on its route's "
                "port %d (asymmetric paths); its source is not checked at this switch",
                switch,
                route.host,
                route.dst_addr,
                ", ".join(str(p) for p in other),
                route.port,
            )
            continue
        entries.append(source_entry(route))
    return entries


def forwarding_entries(network: Network, switch: str) -> list[TableEntry]:
    """Everything derived from the routes at ``switch``: ``route_ipv4`` and ``check_source``."""
    return route_entries(network, switch) + source_entries(network, switch)
