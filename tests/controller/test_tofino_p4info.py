"""The controller drives the TNA program's P4Info as the Tofino compiler writes it.

p4src/tna/checkmate.tofino.p4info.txtpb is p4c-barefoot's own output (``make p4-tofino``;
tests/test_p4_tofino.py checks that it still is). Its tables and counters say
``pipe.CheckmateIngress...``, its actions ``CheckmateIngress...``, and its counters are
Tofino ``Counter`` externs, not P4Info ``counters``. Every entry and group the controller
plans for a job must encode against it with the same names and widths as against the
v1model P4Info.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from p4.config.v1 import p4info_pb2

from checkmate.job import JobSpec
from checkmate.network import Network
from checkmate.p4 import names
from checkmate.p4.p4info import P4InfoIndex, P4InfoNameError, load_p4info
from checkmate.p4.program import P4INFO_PATH
from checkmate.p4.tofino import tofino_counters
from controller.controller import checked_codec
from controller.counters import JOB_COUNTERS
from controller.entities import EntityCodec, MulticastGroup, TableEntry
from controller.errors import ControllerError
from controller.jobs import Taken, allocate, plan_entities
from tests.controller.conftest import TOPOLOGIES

TOFINO_P4INFO = Path(__file__).resolve().parents[2] / "p4src" / "tna" / "checkmate.tofino.p4info.txtpb"
DROP_COUNTERS = ("ingress_drops", "egress_drops")


@pytest.fixture(scope="module")
def tofino() -> P4InfoIndex:
    return P4InfoIndex(load_p4info(TOFINO_P4INFO))


@pytest.fixture(scope="module")
def v1model() -> P4InfoIndex:
    return P4InfoIndex(load_p4info(P4INFO_PATH))


def test_the_committed_file_is_the_tofino_compilers_form() -> None:
    info = load_p4info(TOFINO_P4INFO)
    assert info.pkg_info.arch == "tna"
    assert {t.preamble.name for t in info.tables} == {
        "pipe.CheckmateIngress.check_source",
        "pipe.CheckmateIngress.route_ipv4",
        "pipe.CheckmateIngress.lookup_job",
        "pipe.CheckmateIngress.replicate_to_shadow",
        "pipe.CheckmateEgress.rewrite_shadow_copy",
    }
    assert not info.counters  # counters are Tofino externs here
    assert {c.preamble.name: (c.size, c.unit) for c in tofino_counters(info)} == {
        "pipe.CheckmateIngress.ingress_drops": (8, "PACKETS"),
        "pipe.CheckmateIngress.rejected_replications": (256, "PACKETS_AND_BYTES"),
        "pipe.CheckmateEgress.shadow_copies": (256, "PACKETS_AND_BYTES"),
        "pipe.CheckmateEgress.egress_drops": (8, "PACKETS"),
    }


def test_every_name_and_width_the_controller_uses_matches_v1model(
    tofino: P4InfoIndex, v1model: P4InfoIndex
) -> None:
    for table in ("check_source", "route_ipv4", "lookup_job", "replicate_to_shadow", "rewrite_shadow_copy"):
        assert tofino.table_id(table) != v1model.table_id(table)  # other names, other ids
        assert [(f.short_name, f.bitwidth, f.kind) for f in tofino.match_fields(table)] == [
            (f.short_name, f.bitwidth, f.kind) for f in v1model.match_fields(table)
        ]
        assert tofino.table_size(table) == v1model.table_size(table)
    for action in ("expect_port", "forward", "set_job_slot", "set_multicast_group", "set_shadow_destination"):
        assert [(p, tofino.param(action, p).bitwidth) for p in tofino.param_names(action)] == [
            (p, v1model.param(action, p).bitwidth) for p in v1model.param_names(action)
        ]
    for counter in (*JOB_COUNTERS, *DROP_COUNTERS):
        assert tofino.counter_id(counter) >> 24 == 0x83  # barefoot P4Ids COUNTER prefix
        assert tofino.counter_size(counter) == v1model.counter_size(counter)
    # The Tofino-only tables are @hidden: nothing the controller could write by mistake.
    for hidden in ("verify_checkmate_header", "measure_payload"):
        with pytest.raises(P4InfoNameError, match=f"no table named '{hidden}'"):
            tofino.table_id(hidden)


@pytest.mark.parametrize("topology", ["single", "leafspine"])
def test_a_jobs_entries_and_groups_encode_against_the_tofino_p4info(
    topology: str, tofino: P4InfoIndex, v1model: P4InfoIndex
) -> None:
    network = Network.load(TOPOLOGIES / f"{topology}.json")
    record = allocate(
        network, JobSpec(7, ("h1", "h2", "h3", "h4"), ("sh1", "sh2")), Taken(groups={}, rids={}, slots=())
    )
    plan = plan_entities(network, record)
    tofino_codec, v1model_codec = EntityCodec(tofino), EntityCodec(v1model)
    tables: set[str] = set()
    groups = 0
    for entities in plan.values():
        for entity in entities.values():
            message = tofino_codec.to_entity(entity)
            assert tofino_codec.from_entity(message) == entity
            if isinstance(entity, MulticastGroup):
                groups += 1
                assert message == v1model_codec.to_entity(entity)
                continue
            assert isinstance(entity, TableEntry)
            tables.add(entity.table)
            reference = v1model_codec.to_entity(entity).table_entry
            entry = message.table_entry
            assert entry.table_id == tofino.table_id(entity.table)
            # Same match and parameter bytes; only the ids differ.
            assert [m.exact.value or m.lpm.value for m in entry.match] == [
                m.exact.value or m.lpm.value for m in reference.match
            ]
            assert [p.value for p in entry.action.action.params] == [
                p.value for p in reference.action.action.params
            ]
    assert tables == {"lookup_job", "replicate_to_shadow", "rewrite_shadow_copy"}
    assert groups == sum(1 for key in record.groups)


def test_a_value_too_wide_for_a_tofino_field_is_refused(tofino: P4InfoIndex) -> None:
    codec = EntityCodec(tofino)
    entry = TableEntry.make(
        "replicate_to_shadow",
        {"job_id": 7, "ingress_port": 512, "shard_key": 0, "next_hop_port": 2},
        "set_multicast_group",
        {"group": 1},
    )
    with pytest.raises(ValueError, match="does not fit in 9 bits"):
        codec.to_entity(entry)


def test_a_counter_extern_with_foreign_info_is_a_clear_error() -> None:
    info = load_p4info(TOFINO_P4INFO)
    counters = next(e for e in info.externs if e.extern_type_name == "Counter")
    counters.instances[0].info.Pack(p4info_pb2.PkgInfo(arch="tna"))
    with pytest.raises(ValueError, match="not barefoot.Counter"):
        P4InfoIndex(info)


def test_the_controller_takes_either_p4info_and_refuses_a_renamed_table_before_any_write() -> None:
    """checked_codec runs when the controller first meets a switch's P4Info (or before a push)."""
    assert checked_codec(load_p4info(TOFINO_P4INFO), "tofino").names.table_id(names.RouteIpv4.NAME)
    assert checked_codec(load_p4info(P4INFO_PATH), "v1model").names.table_id(names.RouteIpv4.NAME)
    info = load_p4info(P4INFO_PATH)
    route = next(t for t in info.tables if t.preamble.alias == names.RouteIpv4.NAME)
    route.preamble.name, route.preamble.alias = "CheckmateIngress.route_v4", "route_v4"
    with pytest.raises(
        ControllerError, match=r"switch s1's P4Info is not the Checkmate program's .* table route_ipv4"
    ):
        checked_codec(info, "switch s1's P4Info")
