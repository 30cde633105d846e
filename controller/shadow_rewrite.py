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
from checkmate.p4 import names
from controller.entities import TableEntry

logger = logging.getLogger(__name__)

TABLE = names.RewriteShadowCopy.NAME


def shadow_rewrite_entry(
    network: Network, switch: str, rid: int, shadow: str, shadow_port: int
) -> TableEntry:
    route = network.route(switch, shadow)
    return TableEntry.make(
        TABLE,
        {names.RewriteShadowCopy.EGRESS_RID: rid},
        names.SetShadowDestination.NAME,
        {
            names.SetShadowDestination.SRC_MAC: mac_to_int(route.src_mac),
            names.SetShadowDestination.DST_MAC: mac_to_int(route.dst_mac),
            names.SetShadowDestination.DST_ADDR: int(route.dst_addr),
            names.SetShadowDestination.DST_PORT: shadow_port,
        },
    )
