"""Planning without switches: what a job needs, id allocation, write order, names, registry."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from checkmate.job import JobSpec
from checkmate.network import Network
from checkmate.p4.p4info import P4InfoIndex, P4InfoNameError, load_p4info
from checkmate.p4.program import P4INFO_PATH
from controller.entities import EntityCodec, MulticastGroup, TableEntry, Update, UpdateKind, diff
from controller.errors import CapacityError, JobError
from controller.jobs import Taken, allocate, job_updates, plan_entities
from controller.pipeline import pack_tofino_config
from controller.registry import JobRecord, Registry
from tests.controller.conftest import TOPOLOGIES

NOTHING = Taken(groups={}, rids={}, slots=())


@pytest.fixture(scope="module")
def single() -> Network:
    return Network.load(TOPOLOGIES / "single.json")


@pytest.fixture(scope="module")
def leafspine() -> Network:
    return Network.load(TOPOLOGIES / "leafspine.json")


def test_single_switch_plan(single: Network) -> None:
    spec = JobSpec(7, ("h1", "h2", "h3", "h4"), ("sh1", "sh2"))
    record = allocate(single, spec, NOTHING)
    assert record.slot == 1
    assert record.rids == {("s1", "sh1"): 1, ("s1", "sh2"): 2}
    # One group per (next hop, shadow): next hops are the ring neighbours' ports 2, 3, 4, 1.
    assert sorted(record.groups) == [("s1", p, sh) for p in (1, 2, 3, 4) for sh in ("sh1", "sh2")]
    assert sorted(record.groups.values()) == list(range(1, 9))
    plan = plan_entities(single, record)["s1"]
    group = record.groups[("s1", 2, "sh1")]
    assert plan[("group", group)] == MulticastGroup.make(group, [(2, 0), (5, 1)])
    entry = TableEntry.make(
        "replicate_to_shadow",
        {"job_id": 7, "ingress_port": 1, "shard_key": 0, "next_hop_port": 2},
        "set_multicast_group",
        {"group": group},
    )
    assert plan[entry.key] == entry
    rewrite = next(e for e in plan.values() if isinstance(e, TableEntry) and e.table == "rewrite_shadow_copy")
    assert rewrite.param("dst_addr") == int(single.hosts["sh1"].address)
    counts: dict[str, int] = {}
    for e in plan.values():
        name = "group" if isinstance(e, MulticastGroup) else e.table
        counts[name] = counts.get(name, 0) + 1
    assert counts == {"lookup_job": 1, "rewrite_shadow_copy": 2, "group": 8, "replicate_to_shadow": 8}


def test_leafspine_replicates_only_at_the_workers_leaves(leafspine: Network) -> None:
    spec = JobSpec(7, ("h1", "h2", "h3", "h4"), ("sh1", "sh2"))
    plan = plan_entities(leafspine, allocate(leafspine, spec, NOTHING))
    for switch, entities in plan.items():
        kinds = {("group" if isinstance(e, MulticastGroup) else e.table) for e in entities.values()}
        if switch in ("s1", "s2"):
            assert kinds == {"lookup_job", "rewrite_shadow_copy", "group", "replicate_to_shadow"}
        else:  # the shadows' leaf and the spine only count: they never replicate
            assert kinds == {"lookup_job"}
    # h2 -> h3 and the copy to sh1 both leave s1 through the uplink (port 3), as two instances.
    record = allocate(leafspine, spec, NOTHING)
    group = plan["s1"][("group", record.groups[("s1", 3, "sh1")])]
    assert group.replicas == ((3, 0), (3, record.rids[("s1", "sh1")]))


def test_two_jobs_never_share_ids_and_a_move_keeps_what_it_can(single: Network) -> None:
    first = allocate(single, JobSpec(7, ("h1", "h2"), ("sh1",)), NOTHING)
    taken = Taken(
        groups={"s1": set(first.groups.values())}, rids={"s1": set(first.rids.values())}, slots={first.slot}
    )
    second = allocate(single, JobSpec(8, ("h3", "h4"), ("sh1", "sh2")), taken)
    assert not set(first.groups.values()) & set(second.groups.values())
    assert not set(first.rids.values()) & set(second.rids.values())
    assert first.slot != second.slot
    moved = allocate(single, second.spec.with_shard_moved(1, "sh1"), taken, previous=second)
    assert moved.slot == second.slot
    for key, group in moved.groups.items():
        assert second.groups.get(key, group) == group  # kept groups keep their ids
    updates = job_updates(single, second, moved)["s1"]
    kinds = [(u.kind, "group" if isinstance(u.entity, MulticastGroup) else u.entity.table) for u in updates]
    # New groups before re-pointed entries; unused groups and rewrites deleted last.
    assert kinds[-1][0] is UpdateKind.DELETE
    assert [k for k in kinds if k[1] == "replicate_to_shadow"] == [
        (UpdateKind.MODIFY, "replicate_to_shadow")
    ] * 2


def test_capacity_and_bad_jobs(single: Network) -> None:
    spec = JobSpec(7, ("h1", "h2", "h3", "h4"), ("sh1", "sh2"))
    with pytest.raises(
        CapacityError, match="too many multicast groups for switch s1: job 7 needs 8.*allows 4"
    ):
        allocate(single, spec, NOTHING, max_groups=4)
    with pytest.raises(CapacityError, match="no free job slot"):
        allocate(single, spec, Taken(groups={}, rids={}, slots=range(1, 256)))
    with pytest.raises(JobError, match=r"unknown host\(s\) \['h9'\]"):
        allocate(single, JobSpec(7, ("h1", "h9"), ("sh1",)), NOTHING)
    with pytest.raises(JobError, match="sh2 is a shadow in the network description, not a worker"):
        allocate(single, JobSpec(7, ("h1", "sh2"), ("sh1",)), NOTHING)
    with pytest.raises(JobError, match="h3 is a worker in the network description, not a shadow"):
        allocate(single, JobSpec(7, ("h1", "h2"), ("h3",)), NOTHING)


def test_diff_and_inverse_order() -> None:
    group = MulticastGroup.make(1, [(2, 0), (5, 1)])
    entry = TableEntry.make("replicate_to_shadow", {"job_id": 7}, "set_multicast_group", {"group": 1})
    slot = TableEntry.make("lookup_job", {"job_id": 7}, "set_job_slot", {"slot": 1})
    inserts = diff({e.key: e for e in (entry, slot, group)}, {})
    assert [u.entity for u in inserts] == [group, slot, entry]
    deletes = diff({}, {e.key: e for e in (entry, group, slot)})
    assert [u.entity for u in deletes] == [entry, slot, group]
    changed = MulticastGroup.make(1, [(3, 0), (5, 1)])
    (modify,) = diff({group.key: changed}, {group.key: group})
    assert modify.inverse() == Update(UpdateKind.MODIFY, group, changed)


def test_names_resolve_unqualified_also_for_tna_p4info() -> None:
    """TNA's P4Info says pipe.CheckmateIngress.route_ipv4 and may carry no alias."""
    info = load_p4info(P4INFO_PATH)
    for obj in (*info.tables, *info.actions, *info.counters):
        obj.preamble.name = "pipe." + obj.preamble.name
        obj.preamble.alias = ""
    names = P4InfoIndex(info)
    reference = P4InfoIndex(load_p4info(P4INFO_PATH))
    for table in ("route_ipv4", "lookup_job", "replicate_to_shadow", "rewrite_shadow_copy"):
        assert names.table_id(table) == reference.table_id(table)
    assert names.counter_id("shadow_copies") == reference.counter_id("shadow_copies")
    assert names.table_name(names.table_id("route_ipv4")) == "route_ipv4"
    with pytest.raises(P4InfoNameError, match="no table named 'nope'"):
        names.table_id("nope")
    entry = TableEntry.make(
        "route_ipv4", {"dst_addr": (0x0A000101, 32)}, "forward", {"port": 1, "src_mac": 2, "dst_mac": 3}
    )
    codec = EntityCodec(names)
    assert codec.from_entity(codec.to_entity(entry)) == entry


def test_tofino_packed_config_layout() -> None:
    packed = pack_tofino_config("checkmate", b"BIN", b"{}")
    assert (
        packed
        == struct.pack("<I", 9) + b"checkmate" + struct.pack("<I", 3) + b"BIN" + struct.pack("<I", 2) + b"{}"
    )


def test_registry_round_trip_and_uniqueness(tmp_path: Path) -> None:
    spec = JobSpec(7, ("h1", "h2"), ("sh1",))
    record = JobRecord(
        spec, 1, {("s1", 2, "sh1"): 5}, {("s1", "sh1"): 1}, {("s1", "shadow_copies"): (3, 300)}
    )
    with Registry(tmp_path) as registry:
        registry.put_job(record)
        assert registry.job(7) == record
        before = registry.dump()
        clash = JobRecord(JobSpec(8, ("h3", "h4"), ("sh1",)), 2, {("s1", 2, "sh1"): 5}, {("s1", "sh1"): 2})
        with pytest.raises(Exception, match="cannot record job 8"):
            registry.put_job(clash)  # group 5 at s1 already belongs to job 7
        assert registry.dump() == before
    with Registry(tmp_path) as again:
        assert again.jobs() == [record]
        again.remove_job(7)
        assert again.job_ids() == [] and again.dump()["groups"] == []
