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

from controller.entities import TableEntry

logger = logging.getLogger(__name__)

LOOKUP_TABLE = "lookup_job"
REPLICATION_TABLE = "replicate_to_shadow"
UNKNOWN_JOB_SLOT = 0
MAX_JOB_SLOT = 255


def lookup_job_entry(job_id: int, slot: int) -> TableEntry:
    if not 1 <= slot <= MAX_JOB_SLOT:
        raise ValueError(f"job slot {slot} is outside 1..{MAX_JOB_SLOT} (slot 0 is for unknown jobs)")
    return TableEntry.make(LOOKUP_TABLE, {"job_id": job_id}, "set_job_slot", {"slot": slot})


def replication_entry(
    job_id: int, ingress_port: int, shard_key: int, next_hop_port: int, group_id: int
) -> TableEntry:
    return TableEntry.make(
        REPLICATION_TABLE,
        {
            "job_id": job_id,
            "ingress_port": ingress_port,
            "shard_key": shard_key,
            "next_hop_port": next_hop_port,
        },
        "set_multicast_group",
        {"group": group_id},
    )
