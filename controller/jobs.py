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

from checkmate.job import MAX_JOB_ID, JobSpec
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


# ---- tensor-parallel lanes ----------------------------------------------------------------------
# A TP x DP job is one Checkmate job per TP index, a *lane* (checkmate/job.py): lane t of a job
# whose first lane is job J is job J + t (what the workers compute from CHECKMATE_JOB_ID), its
# workers are the ranks of TP index t (rank = dp_index * T + t), and it has its own shadows and
# its own secret (controller/job_secrets.py).
def first_lane_id(spec: JobSpec) -> int:
    """The job id of lane 0 of the TP job ``spec`` is a lane of (``spec.job_id`` without TP)."""
    return spec.job_id - spec.tp_index


def lane_job_ids(spec: JobSpec) -> list[int]:
    """The job ids of every lane of ``spec``'s TP job, in TP index order (``[job_id]`` without TP)."""
    first = first_lane_id(spec)
    return [first + t for t in range(spec.tp_degree)]


def split_lanes(spec: JobSpec, tp_degree: int) -> list[JobSpec]:
    """The lanes of a TP x DP job given as one: ``spec.workers`` are its ranks in order
    (rank = dp_index * ``tp_degree`` + tp_index), ``spec.shadows`` are dealt to the lanes the same
    way (lane t gets ``shadows[t::tp_degree]``); lane t is job ``spec.job_id + t``.

    JobError naming what does not divide or fit (a lane needs 2 workers and a shadow).
    """
    if tp_degree < 1:
        raise JobError(
            f"tp degree {tp_degree}: a tensor-parallel degree is at least 1 (1: no tensor parallelism)"
        )
    if tp_degree == 1:
        return [spec]
    if spec.tp_degree != 1:
        raise JobError(
            f"job {spec.job_id} is already lane {spec.tp_index} of {spec.tp_degree}; it cannot be split"
        )
    workers, shadows = len(spec.workers), len(spec.shadows)
    if workers % tp_degree or workers // tp_degree < 2:
        raise JobError(
            f"tp degree {tp_degree}: the {workers} workers must be the job's ranks, a multiple of "
            f"{tp_degree} with at least 2 per lane (DP degree >= 2); got {list(spec.workers)}"
        )
    if shadows % tp_degree:
        raise JobError(
            f"tp degree {tp_degree}: the {shadows} shadows are dealt to the lanes (lane t gets every "
            f"{tp_degree}th from the t-th), so their number must be a multiple of {tp_degree}; "
            f"got {list(spec.shadows)}"
        )
    if len(spec.shard_to_shadow) != shadows or any(
        spec.shard_to_shadow.get(k) != s for k, s in enumerate(spec.shadows)
    ):
        raise JobError(
            "a shard map (--shard) cannot be dealt to lanes: add each lane with --tp-index and its own map"
        )
    if spec.job_id + tp_degree - 1 > MAX_JOB_ID:
        raise JobError(
            f"job ids {spec.job_id}..{spec.job_id + tp_degree - 1}: past the largest, {MAX_JOB_ID}"
        )
    return [
        JobSpec(
            job_id=spec.job_id + t,
            workers=spec.workers[t::tp_degree],
            shadows=spec.shadows[t::tp_degree],
            shadow_port=spec.shadow_port,
            tp_degree=tp_degree,
            tp_index=t,
        )
        for t in range(tp_degree)
    ]


def check_lanes(lanes: Collection[JobSpec], registered: Collection[JobSpec]) -> None:
    """Refuse (JobError naming both jobs) lanes that do not match each other or the registered ones.

    Lanes of one TP job agree on the TP degree, on their TP index (job id - index is the first
    lane's id), on the DP degree (their number of workers), and share no worker. A registered
    job at a lane's id that is not that lane (no TP, another degree or index) is a mismatch too:
    the workers would take it for the lane.
    """
    known = {spec.job_id: spec for spec in registered}
    for lane in lanes:
        known[lane.job_id] = lane
    for lane in lanes:
        if lane.tp_degree == 1:
            continue
        first = first_lane_id(lane)
        if first < 1:
            raise JobError(
                f"job {lane.job_id} as lane {lane.tp_index} of {lane.tp_degree} puts lane 0 at job {first}; "
                "lane t of a TP job is job <first lane's id> + t, and job ids start at 1"
            )
        where = f"job {lane.job_id} (lane {lane.tp_index} of {lane.tp_degree})"
        for t, job_id in enumerate(lane_job_ids(lane)):
            other = known.get(job_id)
            if other is None or other is lane:
                continue
            if (other.tp_degree, other.tp_index) != (lane.tp_degree, t):
                said = (
                    "is registered without tensor parallelism"
                    if other.tp_degree == 1
                    else f"is lane {other.tp_index} of {other.tp_degree}"
                )
                raise JobError(
                    f"{where} makes job {job_id} its lane {t}, but job {job_id} {said}: the lanes do not "
                    f"match (lane t of a TP job is job {first} + t, every lane with the same TP degree)"
                )
            if len(other.workers) != len(lane.workers):
                raise JobError(
                    f"{where} has {len(lane.workers)} workers but its lane {t} (job {job_id}) has "
                    f"{len(other.workers)}: every lane of a TP job has the DP degree's number of workers"
                )
            shared = sorted(set(other.workers) & set(lane.workers))
            if shared:
                raise JobError(
                    f"{where} and its lane {t} (job {job_id}) share worker(s) {shared}: a rank is in one lane"
                )
