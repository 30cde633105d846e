"""The controller against embedded switches: jobs, packets, reconciliation, rollback, bad input."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest

from checkmate.job import JobSpec
from checkmate.network import Network
from checkmate.p4.p4info import P4InfoIndex, load_p4info
from checkmate.p4.program import P4INFO_PATH
from checkmate.scapy_layer import Checkmate
from checkmate.wire import CHECKMATE_UDP_PORT, Flags
from controller.controller import Controller
from controller.entities import EntityCodec, TableEntry, Update, UpdateKind
from controller.errors import (
    CapacityError,
    JobError,
    NotPrimaryError,
    SwitchRpcError,
    SwitchUnreachableError,
    WriteRejectedError,
)
from controller.switch_connection import SwitchConnection
from tests.controller.conftest import TIMEOUT_S, Fabric, gradient

RING = ("h1", "h2", "h3", "h4")
JOB = JobSpec(7, RING, ("sh1", "sh2"))


def ready(
    fabric: Callable[..., Fabric], topology: str = "single", **kwargs: object
) -> tuple[Fabric, Controller]:
    """A fabric with forwarding installed by a fresh controller."""
    f = fabric(topology)
    ctl = f.controller(**kwargs)
    ctl.install_forwarding()
    return f, ctl


def behind_the_back(f: Fabric, switch: str, *updates: Update) -> None:
    """Write with another P4Runtime client (a higher election id makes it primary meanwhile)."""
    spec = f.network.switches[switch]
    with SwitchConnection(switch, spec.grpc, spec.device_id, election_id=50, timeout=TIMEOUT_S) as other:
        codec = EntityCodec(P4InfoIndex(load_p4info(P4INFO_PATH)))
        assert other.write([codec.to_update(u) for u in updates]) == [None] * len(updates)


def copies(delivered: dict[str, list[object]], network: Network, host: str) -> list[Checkmate]:
    return [p for p in delivered.get(host, []) if Checkmate in p]  # type: ignore[operator]


def test_forwarding_routes_plain_packets(fabric: Callable[..., Fabric]) -> None:
    f, ctl = ready(fabric, "leafspine")
    for src, dst in (("h1", "h2"), ("h2", "h3"), ("h4", "sh2")):
        delivered = f.send(src, gradient(src, dst, f.network, flags=Flags.NONE))
        assert list(delivered) == [dst]
        (pkt,) = delivered[dst]
        assert pkt.dst == f.network.hosts[dst].mac
        assert pkt["IP"].ttl == 64 - len(f.network.path(src, dst))
    assert ctl.install_forwarding().changes == 0


def test_add_list_show_and_remove_restores_the_switch_exactly(fabric: Callable[..., Fabric]) -> None:
    f, ctl = ready(fabric)
    before = f.snapshot()
    record = ctl.add_job(JOB)
    assert [r.job_id for r in ctl.jobs()] == [7] and record.slot == 1
    # routes, source checks, slot, rewrites, groups, entries
    assert len(ctl.read_installed("s1")) == 6 + 6 + 1 + 2 + 8 + 8

    # h1 -> h2 (its ring neighbour), shard 1: the packet goes on, a copy goes to sh2.
    delivered = f.send("h1", gradient("h1", "h2", f.network, shard_key=1))
    assert sorted(delivered) == ["h2", "sh2"]
    (original,) = delivered["h2"]
    assert original[Checkmate].flags == 0 and original["IP"].dst == "10.0.1.2"
    (copy,) = delivered["sh2"]
    assert (copy.src, copy.dst) == (f.network.port_mac("s1", 6), "08:00:00:00:09:02")
    assert (copy["IP"].dst, copy["UDP"].dport, copy[Checkmate].flags) == ("10.0.9.2", CHECKMATE_UDP_PORT, 0)
    status = ctl.job_status(7)
    assert status.total("shadow_copies").packets == 1
    assert status.total("rejected_replications").packets == 0
    # A tagged packet from a port not enrolled (a shadow sending as job 7) is forwarded, not copied.
    assert sorted(f.send("sh1", gradient("sh1", "h1", f.network))) == ["h1"]
    assert ctl.job_status(7).total("rejected_replications").packets == 1

    ctl.remove_job(7)
    assert ctl.jobs() == []
    after = f.snapshot()
    assert after["s1"] != before["s1"]  # only the counters moved (packets were sent)
    ctl.add_job(JOB)
    ctl.remove_job(7)
    assert f.snapshot() == after


def test_remove_leaves_every_switch_as_before(fabric: Callable[..., Fabric]) -> None:
    f, ctl = ready(fabric, "leafspine")
    ctl.add_job(JobSpec(3, ("h3", "h4"), ("sh1",)))
    before = f.snapshot()
    ctl.add_job(JOB)
    assert f.snapshot() != before
    ctl.remove_job(7)
    assert f.snapshot() == before
    assert [r.job_id for r in ctl.jobs()] == [3]


def test_two_jobs_side_by_side_share_nothing(fabric: Callable[..., Fabric]) -> None:
    f, ctl = ready(fabric)
    a = ctl.add_job(JobSpec(7, ("h1", "h2"), ("sh1",)))
    b = ctl.add_job(JobSpec(8, ("h3", "h4"), ("sh2",), shadow_port=50000))
    assert not set(a.groups.values()) & set(b.groups.values())
    assert not set(a.rids.values()) & set(b.rids.values())
    assert a.slot != b.slot
    # Each job's packets reach its own shadow, and are counted against its own slot.
    assert sorted(f.send("h1", gradient("h1", "h2", f.network, job_id=7))) == ["h2", "sh1"]
    delivered = f.send("h3", gradient("h3", "h4", f.network, job_id=8))
    assert sorted(delivered) == ["h4", "sh2"] and delivered["sh2"][0]["UDP"].dport == 50000
    assert ctl.job_status(7).total("shadow_copies").packets == 1
    assert ctl.job_status(8).total("shadow_copies").packets == 1
    # Job 8's packet from h1's port is not job 8's: no copy.
    assert sorted(f.send("h1", gradient("h1", "h2", f.network, job_id=8))) == ["h2"]


def test_shadow_move_changes_where_copies_go(fabric: Callable[..., Fabric]) -> None:
    f, ctl = ready(fabric, "leafspine")
    ctl.add_job(JOB)

    def copy_of_shard_0_from_h2() -> tuple[str, str, str]:
        delivered = f.send("h2", gradient("h2", "h3", f.network, shard_key=0))
        shadows = [h for h in delivered if h.startswith("sh")]
        assert sorted(delivered) == sorted(["h3", *shadows]) and len(shadows) == 1
        (copy,) = delivered[shadows[0]]
        return shadows[0], copy["IP"].dst, copy.dst

    assert copy_of_shard_0_from_h2() == ("sh1", "10.0.9.1", "08:00:00:00:09:01")
    ctl.move_shard(7, 0, "sh2")
    assert copy_of_shard_0_from_h2() == ("sh2", "10.0.9.2", "08:00:00:00:09:02")
    assert ctl.job(7).spec.shard_to_shadow == {0: "sh2", 1: "sh2"}
    assert ctl.reconcile().changes == 0
    # Only s1 (h2's leaf) copied: two copies there, none anywhere else.
    counters = ctl.job_status(7).counters
    assert {s: v["shadow_copies"].packets for s, v in counters.items()} == {
        "s1": 2,
        "s2": 0,
        "s3": 0,
        "s4": 0,
    }
    with pytest.raises(JobError, match="no shard 5"):
        ctl.move_shard(7, 5, "sh1")


def test_resize_rewires_the_ring_and_copies_only_on_its_links(fabric: Callable[..., Fabric]) -> None:
    f, ctl = ready(fabric)
    ctl.add_job(JOB)  # ring h1 -> h2 -> h3 -> h4 -> h1
    assert sorted(f.send("h1", gradient("h1", "h2", f.network, shard_key=1))) == ["h2", "sh2"]
    assert sorted(f.send("h1", gradient("h1", "h3", f.network, shard_key=1))) == ["h3"]

    record = ctl.resize_job(7, ("h1", "h3", "h4"))  # h2 failed: the job restarts with three
    assert record.spec.workers == ("h1", "h3", "h4") and record.spec.shadows == JOB.shadows
    assert sorted(f.send("h1", gradient("h1", "h3", f.network, shard_key=1))) == ["h3", "sh2"]
    assert sorted(f.send("h4", gradient("h4", "h1", f.network, shard_key=0))) == ["h1", "sh1"]
    assert sorted(f.send("h1", gradient("h1", "h2", f.network, shard_key=1))) == ["h2"]  # gone
    assert sorted(f.send("h2", gradient("h2", "h3", f.network, shard_key=1))) == ["h3"]
    assert ctl.reconcile().changes == 0
    # as many entries as adding the resized job afresh (ids may differ: resize keeps the old ones)
    installed = ctl.read_installed("s1")
    ctl.remove_job(7)
    ctl.add_job(JobSpec(7, ("h1", "h3", "h4"), ("sh1", "sh2")))
    assert sorted(k[:2] for k in ctl.read_installed("s1") if k[0] == "table") == sorted(
        k[:2] for k in installed if k[0] == "table"
    )
    assert len(ctl.read_installed("s1")) == len(installed)
    before, registry = f.snapshot(), ctl.registry.dump()
    for job_id, workers, message in [
        (7, ("h1",), "at least 2 workers"),
        (7, ("h1", "h9"), r"unknown host\(s\) \['h9'\]"),
        (7, ("h1", "sh1"), "cannot be both worker and shadow"),
        (9, ("h1", "h2"), "job 9 is not registered"),
    ]:
        with pytest.raises(JobError, match=message):
            ctl.resize_job(job_id, workers)
    assert f.snapshot() == before and ctl.registry.dump() == registry
    assert ctl.job(7).spec.workers == ("h1", "h3", "h4")


def test_reconcile_after_restart_and_after_deletions_behind_its_back(fabric: Callable[..., Fabric]) -> None:
    f, ctl = ready(fabric, "leafspine")
    ctl.add_job(JOB)
    ctl.add_job(JobSpec(8, ("h1", "h3"), ("sh2",)))
    installed = f.snapshot()
    ctl.close()

    restarted = f.controller()
    assert restarted.reconcile().changes == 0
    assert f.snapshot() == installed

    # Someone deletes a replication entry and a group on s1 and adds a stray route on s4.
    s1 = restarted.read_installed("s1")
    entry = next(e for e in s1.values() if isinstance(e, TableEntry) and e.table == "replicate_to_shadow")
    group = s1[("group", entry.param("group"))]
    stray = TableEntry.make("route_ipv4", {"dst_addr": (0x0B000001, 32)}, "drop_no_route")
    behind_the_back(f, "s1", Update(UpdateKind.DELETE, entry), Update(UpdateKind.DELETE, group))
    behind_the_back(f, "s4", Update(UpdateKind.INSERT, stray))
    report = restarted.reconcile()
    assert (report.inserted, report.deleted, report.modified) == ({"s1": 2}, {"s4": 1}, {})
    assert f.snapshot() == installed
    assert restarted.reconcile().changes == 0  # nothing duplicated, nothing left to do


def test_reconcile_removes_a_job_the_registry_forgot(fabric: Callable[..., Fabric]) -> None:
    f, ctl = ready(fabric)
    clean = f.snapshot()
    ctl.add_job(JOB)
    ctl.registry.remove_job(7)  # a crash between writing the switch and the registry
    assert ctl.reconcile().deleted == {"s1": 19}
    assert f.snapshot() == clean


def test_a_rejected_update_mid_batch_rolls_back_every_switch(fabric: Callable[..., Fabric]) -> None:
    f, ctl = ready(fabric, "leafspine")
    ctl.add_job(JobSpec(3, ("h3", "h4"), ("sh1",)))
    # Someone else put an entry on s2 with a key job 7 will need (h3 on s2-p1 -> h4 on s2-p2).
    conflict = TableEntry.make(
        "replicate_to_shadow",
        {"job_id": 7, "ingress_port": 1, "shard_key": 1, "next_hop_port": 2},
        "reject_replication",
    )
    behind_the_back(f, "s2", Update(UpdateKind.INSERT, conflict))
    before, registry = f.snapshot(), ctl.registry.dump()
    with pytest.raises(WriteRejectedError) as info:
        ctl.add_job(JOB)
    message = str(info.value)
    assert "switch s2 rejected INSERT replicate_to_shadow[" in message and "ALREADY_EXISTS" in message
    assert "were undone" in message and info.value.switch == "s2"
    assert f.snapshot() == before  # s1, written first, was rolled back too
    assert ctl.registry.dump() == registry


def test_a_rejected_shadow_move_is_undone(fabric: Callable[..., Fabric]) -> None:
    f, ctl = ready(fabric)
    ctl.add_job(JOB)
    record = ctl.job(7)
    # The move of shard 1 to sh1 deletes sh2's rewrite; make that delete fail.
    rewrite = ctl.read_installed("s1")[
        TableEntry.make(
            "rewrite_shadow_copy", {"egress_rid": record.rids[("s1", "sh2")]}, "drop_shadow_copy"
        ).key
    ]
    behind_the_back(f, "s1", Update(UpdateKind.DELETE, rewrite))
    before, registry = f.snapshot(), ctl.registry.dump()
    with pytest.raises(WriteRejectedError, match="rejected DELETE rewrite_shadow_copy.*NOT_FOUND"):
        ctl.move_shard(7, 1, "sh1")
    assert f.snapshot() == before and ctl.registry.dump() == registry
    ctl.reconcile()
    ctl.move_shard(7, 1, "sh1")
    assert sorted(f.send("h4", gradient("h4", "h1", f.network, shard_key=1))) == ["h1", "sh1"]


def test_bad_jobs_leave_switch_and_registry_alone(fabric: Callable[..., Fabric]) -> None:
    f, ctl = ready(fabric, max_groups=10)
    ctl.add_job(JOB)  # 8 groups
    before, registry = f.snapshot(), ctl.registry.dump()
    cases = [
        (JobSpec(7, ("h1", "h2"), ("sh1",)), JobError, "job 7 is already registered"),
        (JobSpec(8, ("h1", "h9"), ("sh1",)), JobError, r"unknown host\(s\) \['h9'\]"),
        (JobSpec(8, ("h1", "sh2"), ("sh1",)), JobError, "sh2 is a shadow in the network description"),
        (JobSpec(8, ("h1", "h2", "h3"), ("sh1",)), CapacityError, "too many multicast groups for switch s1"),
    ]
    for spec, error, message in cases:
        with pytest.raises(error, match=message):
            ctl.add_job(spec)
    with pytest.raises(JobError, match="job 9 is not registered"):
        ctl.remove_job(9)
    assert f.snapshot() == before and ctl.registry.dump() == registry


def test_unreachable_switch_is_named_and_nothing_is_written(fabric: Callable[..., Fabric]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    f = fabric("leafspine", s4={"grpc": f"127.0.0.1:{closed}"})
    ctl = f.controller(timeout=0.3)
    before = {s: f.full_read(s) for s in ("s1", "s2", "s3")}
    with pytest.raises(
        SwitchUnreachableError, match=rf"switch s4 \(127.0.0.1:{closed}, device 4\) is unreachable"
    ):
        ctl.add_job(JOB)
    assert {s: f.full_read(s) for s in ("s1", "s2", "s3")} == before
    assert ctl.jobs() == []


def test_another_primary_or_a_taken_election_id_is_named(fabric: Callable[..., Fabric]) -> None:
    f, ctl = ready(fabric)
    spec = f.network.switches["s1"]
    with SwitchConnection("s1", spec.grpc, spec.device_id, election_id=50, timeout=TIMEOUT_S):
        before, registry = f.snapshot(), ctl.registry.dump()
        with pytest.raises(NotPrimaryError, match=r"election id 1\) is not the primary client"):
            ctl.add_job(JOB)
        assert f.snapshot() == before and ctl.registry.dump() == registry
        with pytest.raises(SwitchRpcError, match="election id 50: INVALID_ARGUMENT"):
            f.controller(election_id=50).connect()
    ctl.add_job(JOB)  # primary again once the other client left


def test_a_switch_failing_a_whole_write_rolls_back_the_others(
    fabric: Callable[..., Fabric], monkeypatch: pytest.MonkeyPatch
) -> None:
    f, ctl = ready(fabric, "leafspine")
    before, registry = f.snapshot(), ctl.registry.dump()

    def dies(*_: object) -> None:
        raise SwitchRpcError("switch s2 (x): a write failed with UNAVAILABLE", "UNAVAILABLE")

    monkeypatch.setattr(ctl.connection("s2"), "write", dies)
    with pytest.raises(SwitchRpcError, match="undone; the registry is unchanged; switch s2 may hold part"):
        ctl.add_job(JOB)
    assert f.snapshot() == before and ctl.registry.dump() == registry
