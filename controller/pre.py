"""Programs the packet replication engine: one multicast group per (next hop, shadow).

A group copies a tagged packet twice: out of the next-hop port as instance 0
(the real packet, on its way to the ring neighbour) and out of the port
toward the shadow with instance = the shadow copy's rid, which
``rewrite_shadow_copy`` matches as ``egress_rid`` in egress.

Limits (docs/controller.md): BMv2 holds 4096 groups by default and user group
ids must stay below 32768; Tofino turns the instance into the RID and has no
exclusion ids, which these groups never use.
"""

from __future__ import annotations

import logging

from controller.entities import MulticastGroup

logger = logging.getLogger(__name__)

PRIMARY_INSTANCE = 0
"""Instance (egress_rid) of the copy that continues to the real next hop."""


def shadow_group(group_id: int, next_hop_port: int, shadow_port: int, rid: int) -> MulticastGroup:
    """The group for one (next hop, shadow) pair: the real packet plus the shadow copy."""
    if rid == PRIMARY_INSTANCE:
        raise ValueError("a shadow copy's rid must not be 0 (instance 0 is the primary copy)")
    return MulticastGroup.make(group_id, [(next_hop_port, PRIMARY_INSTANCE), (shadow_port, rid)])
