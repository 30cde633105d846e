"""Fills ``lookup_job`` and ``replicate_to_shadow`` (ingress).

``lookup_job`` maps a job id to its counter slot (1..255; slot 0 counts jobs
nobody registered). ``replicate_to_shadow`` says, for a tagged packet of a
job arriving on one of the job's worker ports with a given shard key and
routed out of a given next-hop port, which multicast group copies it. Only
the switch a worker is attached to gets that worker's entries: every replica
leaves with REPLICATE cleared, so later switches never copy again.
"""

from __future__ import annotations

import logging

from checkmate.p4 import names
from controller.entities import TableEntry

logger = logging.getLogger(__name__)

LOOKUP_TABLE = names.LookupJob.NAME
REPLICATION_TABLE = names.ReplicateToShadow.NAME
UNKNOWN_JOB_SLOT = 0
MAX_JOB_SLOT = 255


def lookup_job_entry(job_id: int, slot: int) -> TableEntry:
    if not 1 <= slot <= MAX_JOB_SLOT:
        raise ValueError(f"job slot {slot} is outside 1..{MAX_JOB_SLOT} (slot 0 is for unknown jobs)")
    return TableEntry.make(
        LOOKUP_TABLE, {names.LookupJob.JOB_ID: job_id}, names.SetJobSlot.NAME, {names.SetJobSlot.SLOT: slot}
    )


def replication_entry(
    job_id: int, ingress_port: int, shard_key: int, next_hop_port: int, group_id: int
) -> TableEntry:
    return TableEntry.make(
        REPLICATION_TABLE,
        {
            names.ReplicateToShadow.JOB_ID: job_id,
            names.ReplicateToShadow.INGRESS_PORT: ingress_port,
            names.ReplicateToShadow.SHARD_KEY: shard_key,
            names.ReplicateToShadow.NEXT_HOP_PORT: next_hop_port,
        },
        names.SetMulticastGroup.NAME,
        {names.SetMulticastGroup.GROUP: group_id},
    )
