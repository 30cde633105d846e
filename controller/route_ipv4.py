"""Fills ``route_ipv4``: a /32 route to every host at every switch.

The routes come from the network description (:meth:`Network.routes_for`):
next-hop port on the shortest path, the port's MAC as source, and the host's
MAC (last hop) or the next switch port's MAC as destination.
"""

from __future__ import annotations

import logging

from checkmate.network import Network, Route, mac_to_int
from controller.entities import TableEntry

logger = logging.getLogger(__name__)

TABLE = "route_ipv4"


def route_entry(route: Route) -> TableEntry:
    return TableEntry.make(
        TABLE,
        {"dst_addr": (int(route.dst_addr), route.prefix_len)},
        "forward",
        {"port": route.port, "src_mac": mac_to_int(route.src_mac), "dst_mac": mac_to_int(route.dst_mac)},
    )


def route_entries(network: Network, switch: str) -> list[TableEntry]:
    """Every route ``switch`` needs, in host-name order."""
    return [route_entry(route) for route in network.routes_for(switch)]
