"""Fills ``rewrite_shadow_copy`` (egress): re-address a shadow copy by its rid.

Each (job, shadow) pair at a replicating switch gets its own rid; the entry
sets the copy's source MAC to the port toward the shadow, its destination MAC
to the next hop toward it (the shadow itself, or the next switch port), its
IPv4 destination to the shadow and its UDP destination port to the job's
shadow port. Later switches forward the copy as any other packet.
"""

from __future__ import annotations

import logging

from checkmate.network import Network, mac_to_int
from controller.entities import TableEntry

logger = logging.getLogger(__name__)

TABLE = "rewrite_shadow_copy"


def shadow_rewrite_entry(
    network: Network, switch: str, rid: int, shadow: str, shadow_port: int
) -> TableEntry:
    route = network.route(switch, shadow)
    return TableEntry.make(
        TABLE,
        {"egress_rid": rid},
        "set_shadow_destination",
        {
            "src_mac": mac_to_int(route.src_mac),
            "dst_mac": mac_to_int(route.dst_mac),
            "dst_addr": int(route.dst_addr),
            "dst_port": shadow_port,
        },
    )
