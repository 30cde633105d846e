"""Planning a job: what it needs at every switch, and the ids it is given.

For a job with workers in ring order, each worker ``w`` attached to switch
``S`` at port ``i`` sends its tagged packets to ``ring_next(w)`` out of port
``p`` (the route at ``S``). For every shard ``k`` owned by shadow ``sh``:

* ``S`` gets the multicast group for ``(p, sh)``: ``{(p, 0), (port toward sh, rid)}``,
  where ``rid`` is the job's rid for ``sh`` at ``S``;
* ``S`` gets ``rewrite_shadow_copy[rid]`` re-addressing the copy to ``sh``;
* ``S`` gets ``replicate_to_shadow[job, i, k, p] -> group``.

Every switch gets ``lookup_job[job] -> slot``, so per-job counters work
wherever the job's tagged packets show up. Nothing else replicates: copies
leave the first switch with REPLICATE cleared.

Group ids (1..32767, per switch), rids (1..65535, per switch) and the job's
counter slot (1..255, network-wide) are allocated lowest-free, never shared
between jobs, and kept for as long as the job needs them (a shard move only
allocates what the new shadow needs).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from checkmate.job import JobSpec
from checkmate.network import MAX_MULTICAST_GROUP_ID, Network, NetworkError
from controller.entities import Entity, Update, diff
from controller.errors import CapacityError, JobError
from controller.pre import shadow_group
from controller.registry import GroupKey, JobRecord, RidKey
from controller.replication import MAX_JOB_SLOT, lookup_job_entry, replication_entry
from controller.shadow_rewrite import shadow_rewrite_entry

logger = logging.getLogger(__name__)

MAX_RID = 0xFFFF
SHADOW_REWRITE_TABLE_SIZE = 1024
"""``rewrite_shadow_copy``'s size in p4src/shared/defines.p4: at most this many rids per switch."""

EntityMap = dict[tuple[object, ...], Entity]


@dataclass(frozen=True)
class Taken:
    """Ids other jobs hold: group ids and rids per switch, and counter slots."""

    groups: Mapping[str, Collection[int]]
    rids: Mapping[str, Collection[int]]
    slots: Collection[int]


def check_job(network: Network, spec: JobSpec) -> None:
    """Raise JobError unless every host exists and plays a role it may play."""
    unknown = [name for name in (*spec.workers, *spec.shadows) if name not in network.hosts]
    if unknown:
        raise JobError(
            f"job {spec.job_id}: unknown host(s) {unknown}; the network has {sorted(network.hosts)}"
        )
    for name in spec.workers:
        if network.hosts[name].role == "shadow":
            raise JobError(f"job {spec.job_id}: {name} is a shadow in the network description, not a worker")
    for name in spec.shadows:
        if network.hosts[name].role == "worker":
            raise JobError(f"job {spec.job_id}: {name} is a worker in the network description, not a shadow")


def required_ids(network: Network, spec: JobSpec) -> tuple[set[GroupKey], set[RidKey]]:
    """The (switch, next hop, shadow) groups and (switch, shadow) rids the job needs."""
    groups: set[GroupKey] = set()
    rids: set[RidKey] = set()
    used_shadows = set(spec.shard_to_shadow.values())
    for worker in spec.workers:
        switch, _ = network.attachment(worker)
        next_hop = network.next_hop_port(switch, spec.ring_next(worker))
        for shadow in used_shadows:
            groups.add((switch, next_hop, shadow))
            rids.add((switch, shadow))
    return groups, rids


def _lowest_free(taken: Collection[int], low: int, high: int) -> int | None:
    for value in range(low, high + 1):
        if value not in taken:
            return value
    return None


def allocate(
    network: Network,
    spec: JobSpec,
    taken: Taken,
    previous: JobRecord | None = None,
    max_groups: int | None = None,
) -> JobRecord:
    """Give ``spec`` a slot, group ids and rids; keep what ``previous`` held where still needed.

    ``max_groups`` caps the groups per switch below each switch's own
    ``max_multicast_groups``. Raises CapacityError naming the switch and limit.
    """
    check_job(network, spec)
    need_groups, need_rids = required_ids(network, spec)
    prev_groups = dict(previous.groups) if previous else {}
    prev_rids = dict(previous.rids) if previous else {}

    if previous is not None:
        slot = previous.slot
    else:
        free_slot = _lowest_free(set(taken.slots), 1, MAX_JOB_SLOT)
        if free_slot is None:
            raise CapacityError(f"job {spec.job_id}: no free job slot; {MAX_JOB_SLOT} jobs are registered")
        slot = free_slot

    groups: dict[GroupKey, int] = {}
    for switch in sorted({key[0] for key in need_groups}):
        limit = network.switch(switch).max_multicast_groups
        if max_groups is not None:
            limit = min(limit, max_groups)
        others = set(taken.groups.get(switch, ()))
        mine = sorted(key for key in need_groups if key[0] == switch)
        if len(others) + len(mine) > limit:
            raise CapacityError(
                f"too many multicast groups for switch {switch}: job {spec.job_id} needs {len(mine)} "
                f"(one per next hop and shadow), other jobs hold {len(others)}, the target allows {limit}"
            )
        # Never hand out an id this job is giving up in the same change: a batch
        # must not delete and insert the same group.
        blocked = others | {g for (s, _, _), g in prev_groups.items() if s == switch}
        for key in mine:
            if key in prev_groups:
                groups[key] = prev_groups[key]
                continue
            group_id = _lowest_free(blocked, 1, MAX_MULTICAST_GROUP_ID)
            if group_id is None:
                raise CapacityError(
                    f"switch {switch}: all multicast group ids 1..{MAX_MULTICAST_GROUP_ID} are in use"
                )
            groups[key] = group_id
            blocked.add(group_id)

    rids: dict[RidKey, int] = {}
    for switch in sorted({key[0] for key in need_rids}):
        others = set(taken.rids.get(switch, ()))
        mine_rids = sorted(key for key in need_rids if key[0] == switch)
        if len(others) + len(mine_rids) > SHADOW_REWRITE_TABLE_SIZE:
            raise CapacityError(
                f"too many shadow rewrites for switch {switch}: job {spec.job_id} needs {len(mine_rids)}, "
                f"other jobs hold {len(others)}, rewrite_shadow_copy holds {SHADOW_REWRITE_TABLE_SIZE}"
            )
        blocked = others | {r for (s, _), r in prev_rids.items() if s == switch}
        for rkey in mine_rids:
            if rkey in prev_rids:
                rids[rkey] = prev_rids[rkey]
                continue
            rid = _lowest_free(blocked, 1, MAX_RID)
            if rid is None:
                raise CapacityError(f"switch {switch}: all rids 1..{MAX_RID} are in use")
            rids[rkey] = rid
            blocked.add(rid)

    baselines = dict(previous.baselines) if previous else {}
    return JobRecord(spec, slot, groups, rids, baselines)


def plan_entities(network: Network, record: JobRecord | None) -> dict[str, EntityMap]:
    """Every entity the job needs, per switch (empty maps for switches it does not use)."""
    plan: dict[str, EntityMap] = {name: {} for name in network.switches}
    if record is None:
        return plan
    spec = record.spec

    def add(switch: str, entity: Entity) -> None:
        plan[switch][entity.key] = entity

    try:
        for switch in network.switches:
            add(switch, lookup_job_entry(spec.job_id, record.slot))
        for (switch, shadow), rid in record.rids.items():
            add(switch, shadow_rewrite_entry(network, switch, rid, shadow, spec.shadow_port))
        for (switch, next_hop, shadow), group_id in record.groups.items():
            shadow_port = network.next_hop_port(switch, shadow)
            add(switch, shadow_group(group_id, next_hop, shadow_port, record.rids[(switch, shadow)]))
        for worker in spec.workers:
            switch, ingress_port = network.attachment(worker)
            next_hop = network.next_hop_port(switch, spec.ring_next(worker))
            for shard_key, shadow in sorted(spec.shard_to_shadow.items()):
                group_id = record.groups[(switch, next_hop, shadow)]
                add(switch, replication_entry(spec.job_id, ingress_port, shard_key, next_hop, group_id))
    except (NetworkError, KeyError) as exc:
        raise JobError(
            f"job {spec.job_id} does not fit the network description ({exc}); "
            f"remove it with `checkmate-ctl job remove {spec.job_id}`"
        ) from None
    return plan


def job_updates(
    network: Network, before: JobRecord | None, after: JobRecord | None
) -> dict[str, list[Update]]:
    """Per switch, the ordered updates that take the switch from ``before`` to ``after``."""
    old = plan_entities(network, before)
    new = plan_entities(network, after)
    updates = {switch: diff(new[switch], old[switch]) for switch in network.switches}
    return {switch: u for switch, u in updates.items() if u}
