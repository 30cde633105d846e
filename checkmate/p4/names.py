"""The Checkmate program's P4Info names as Python constants: GENERATED, do not edit.

Written by ``python -m checkmate.p4.generate_names`` from p4src/checkmate.p4info.txtpb,
the P4Info p4c writes for p4src/v1model/checkmate.p4; tests/test_p4_names.py fails when
this file is stale. Each class is one table, action or counter; ``NAME`` is its short
name (its P4Info alias), which the v1model and TNA P4Infos share and which
:class:`checkmate.p4.p4info.P4InfoIndex` resolves in either. The ids in the docstrings
are the v1model P4Info's (TNA's differ: its names carry the ``pipe.`` prefix).
:func:`checkmate.p4.conformance.check_names` checks that a P4Info defines all of them.
"""

from __future__ import annotations

from typing import Final

# ---- actions -------------------------------------------------------------------------------------


class Drop:
    """Action ``CheckmateIngress.drop`` (id 22661560)."""

    NAME: Final = "drop"
    PARAMS: Final[tuple[str, ...]] = ()


class Forward:
    """Action ``CheckmateIngress.forward`` (id 29197385)."""

    NAME: Final = "forward"
    PORT: Final = "port"
    """Parameter 1: 9 bits."""
    SRC_MAC: Final = "src_mac"
    """Parameter 2: 48 bits."""
    DST_MAC: Final = "dst_mac"
    """Parameter 3: 48 bits."""
    PARAMS: Final[tuple[str, ...]] = (PORT, SRC_MAC, DST_MAC)


class ExpectPort:
    """Action ``CheckmateIngress.expect_port`` (id 29663861)."""

    NAME: Final = "expect_port"
    PORT: Final = "port"
    """Parameter 1: 9 bits."""
    PARAMS: Final[tuple[str, ...]] = (PORT,)


class SourceUnknown:
    """Action ``CheckmateIngress.source_unknown`` (id 29379340)."""

    NAME: Final = "source_unknown"
    PARAMS: Final[tuple[str, ...]] = ()


class DropNoRoute:
    """Action ``CheckmateIngress.drop_no_route`` (id 23086960)."""

    NAME: Final = "drop_no_route"
    PARAMS: Final[tuple[str, ...]] = ()


class SetJobSlot:
    """Action ``CheckmateIngress.set_job_slot`` (id 26650443)."""

    NAME: Final = "set_job_slot"
    SLOT: Final = "slot"
    """Parameter 1: 8 bits."""
    PARAMS: Final[tuple[str, ...]] = (SLOT,)


class JobUnknown:
    """Action ``CheckmateIngress.job_unknown`` (id 29628505)."""

    NAME: Final = "job_unknown"
    PARAMS: Final[tuple[str, ...]] = ()


class SetMulticastGroup:
    """Action ``CheckmateIngress.set_multicast_group`` (id 32056371)."""

    NAME: Final = "set_multicast_group"
    GROUP: Final = "group"
    """Parameter 1: 16 bits."""
    PARAMS: Final[tuple[str, ...]] = (GROUP,)


class RejectReplication:
    """Action ``CheckmateIngress.reject_replication`` (id 25333067)."""

    NAME: Final = "reject_replication"
    PARAMS: Final[tuple[str, ...]] = ()


class SetShadowDestination:
    """Action ``CheckmateEgress.set_shadow_destination`` (id 24051914)."""

    NAME: Final = "set_shadow_destination"
    SRC_MAC: Final = "src_mac"
    """Parameter 1: 48 bits."""
    DST_MAC: Final = "dst_mac"
    """Parameter 2: 48 bits."""
    DST_ADDR: Final = "dst_addr"
    """Parameter 3: 32 bits."""
    DST_PORT: Final = "dst_port"
    """Parameter 4: 16 bits."""
    PARAMS: Final[tuple[str, ...]] = (SRC_MAC, DST_MAC, DST_ADDR, DST_PORT)


class DropShadowCopy:
    """Action ``CheckmateEgress.drop_shadow_copy`` (id 23186720)."""

    NAME: Final = "drop_shadow_copy"
    PARAMS: Final[tuple[str, ...]] = ()


# ---- tables --------------------------------------------------------------------------------------


class CheckSource:
    """Table ``CheckmateIngress.check_source`` (id 44646064), 1024 entries."""

    NAME: Final = "check_source"
    SRC_ADDR: Final = "src_addr"
    """Match field 1: lpm, 32 bits."""
    MATCH_FIELDS: Final[tuple[str, ...]] = (SRC_ADDR,)
    ACTIONS: Final[tuple[str, ...]] = (ExpectPort.NAME, SourceUnknown.NAME)
    DEFAULT_ACTION: Final = SourceUnknown.NAME


class RouteIpv4:
    """Table ``CheckmateIngress.route_ipv4`` (id 41436398), 1024 entries."""

    NAME: Final = "route_ipv4"
    DST_ADDR: Final = "dst_addr"
    """Match field 1: lpm, 32 bits."""
    MATCH_FIELDS: Final[tuple[str, ...]] = (DST_ADDR,)
    ACTIONS: Final[tuple[str, ...]] = (Forward.NAME, DropNoRoute.NAME)
    DEFAULT_ACTION: Final = DropNoRoute.NAME


class LookupJob:
    """Table ``CheckmateIngress.lookup_job`` (id 47161315), 255 entries."""

    NAME: Final = "lookup_job"
    JOB_ID: Final = "job_id"
    """Match field 1: exact, 32 bits."""
    MATCH_FIELDS: Final[tuple[str, ...]] = (JOB_ID,)
    ACTIONS: Final[tuple[str, ...]] = (SetJobSlot.NAME, JobUnknown.NAME)
    DEFAULT_ACTION: Final = JobUnknown.NAME


class ReplicateToShadow:
    """Table ``CheckmateIngress.replicate_to_shadow`` (id 37612174), 4096 entries."""

    NAME: Final = "replicate_to_shadow"
    JOB_ID: Final = "job_id"
    """Match field 1: exact, 32 bits."""
    INGRESS_PORT: Final = "ingress_port"
    """Match field 2: exact, 9 bits."""
    SHARD_KEY: Final = "shard_key"
    """Match field 3: exact, 16 bits."""
    NEXT_HOP_PORT: Final = "next_hop_port"
    """Match field 4: exact, 9 bits."""
    MATCH_FIELDS: Final[tuple[str, ...]] = (JOB_ID, INGRESS_PORT, SHARD_KEY, NEXT_HOP_PORT)
    ACTIONS: Final[tuple[str, ...]] = (SetMulticastGroup.NAME, RejectReplication.NAME)
    DEFAULT_ACTION: Final = RejectReplication.NAME


class RewriteShadowCopy:
    """Table ``CheckmateEgress.rewrite_shadow_copy`` (id 42721321), 1024 entries."""

    NAME: Final = "rewrite_shadow_copy"
    EGRESS_RID: Final = "egress_rid"
    """Match field 1: exact, 16 bits."""
    MATCH_FIELDS: Final[tuple[str, ...]] = (EGRESS_RID,)
    ACTIONS: Final[tuple[str, ...]] = (SetShadowDestination.NAME, DropShadowCopy.NAME)
    DEFAULT_ACTION: Final = DropShadowCopy.NAME


# ---- counters ------------------------------------------------------------------------------------


class IngressDrops:
    """Counter ``CheckmateIngress.ingress_drops`` (id 307843185): packets, 8 cells."""

    NAME: Final = "ingress_drops"


class RejectedReplications:
    """Counter ``CheckmateIngress.rejected_replications`` (id 314193510): packets and bytes, 256 cells."""

    NAME: Final = "rejected_replications"


class ShadowCopies:
    """Counter ``CheckmateEgress.shadow_copies`` (id 317267274): packets and bytes, 256 cells."""

    NAME: Final = "shadow_copies"


class EgressDrops:
    """Counter ``CheckmateEgress.egress_drops`` (id 305623128): packets, 8 cells."""

    NAME: Final = "egress_drops"


# ---- the whole program ---------------------------------------------------------------------------


TABLES: Final[dict[str, tuple[str, ...]]] = {
    CheckSource.NAME: CheckSource.MATCH_FIELDS,
    RouteIpv4.NAME: RouteIpv4.MATCH_FIELDS,
    LookupJob.NAME: LookupJob.MATCH_FIELDS,
    ReplicateToShadow.NAME: ReplicateToShadow.MATCH_FIELDS,
    RewriteShadowCopy.NAME: RewriteShadowCopy.MATCH_FIELDS,
}
"""Every table, by name: its match fields in P4Info order."""
TABLE_ACTIONS: Final[dict[str, tuple[str, ...]]] = {
    CheckSource.NAME: CheckSource.ACTIONS,
    RouteIpv4.NAME: RouteIpv4.ACTIONS,
    LookupJob.NAME: LookupJob.ACTIONS,
    ReplicateToShadow.NAME: ReplicateToShadow.ACTIONS,
    RewriteShadowCopy.NAME: RewriteShadowCopy.ACTIONS,
}
"""Every table, by name: the actions it may run."""
ACTIONS: Final[dict[str, tuple[str, ...]]] = {
    Drop.NAME: Drop.PARAMS,
    Forward.NAME: Forward.PARAMS,
    ExpectPort.NAME: ExpectPort.PARAMS,
    SourceUnknown.NAME: SourceUnknown.PARAMS,
    DropNoRoute.NAME: DropNoRoute.PARAMS,
    SetJobSlot.NAME: SetJobSlot.PARAMS,
    JobUnknown.NAME: JobUnknown.PARAMS,
    SetMulticastGroup.NAME: SetMulticastGroup.PARAMS,
    RejectReplication.NAME: RejectReplication.PARAMS,
    SetShadowDestination.NAME: SetShadowDestination.PARAMS,
    DropShadowCopy.NAME: DropShadowCopy.PARAMS,
}
"""Every action, by name: its parameters in P4Info order."""
COUNTERS: Final[tuple[str, ...]] = (
    IngressDrops.NAME,
    RejectedReplications.NAME,
    ShadowCopies.NAME,
    EgressDrops.NAME,
)
"""Every counter, by name."""
