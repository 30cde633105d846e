"""The P4 sources, the committed P4Info and the Python wire format agree."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from p4.config.v1 import p4info_pb2

from checkmate import wire
from checkmate.p4.p4info import load_p4info
from checkmate.p4.program import P4INFO_PATH
from tests.p4_source import P4SRC, parse_control, read_control, read_program

UNITS = {
    p4info_pb2.CounterSpec.PACKETS: "packets",
    p4info_pb2.CounterSpec.BYTES: "bytes",
    p4info_pb2.CounterSpec.BOTH: "packets_and_bytes",
}
KINDS = {
    p4info_pb2.MatchField.EXACT: "exact",
    p4info_pb2.MatchField.LPM: "lpm",
    p4info_pb2.MatchField.TERNARY: "ternary",
    p4info_pb2.MatchField.RANGE: "range",
}


def short(name: str) -> str:
    return name.split(".")[-1]


@pytest.fixture(scope="module")
def p4info() -> p4info_pb2.P4Info:
    return load_p4info()


def test_every_p4info_table_is_in_the_source_with_the_same_keys_actions_and_size(p4info) -> None:  # type: ignore[no-untyped-def]
    source = read_program("v1model")
    actions = {a.preamble.id: short(a.preamble.name) for a in p4info.actions}
    for table in p4info.tables:
        declared = source.tables[short(table.preamble.name)]
        assert [(m.name, KINDS[m.match_type], m.bitwidth) for m in table.match_fields] == declared.keys
        assert sorted(actions[r.id] for r in table.action_refs) == sorted(declared.actions)
        assert table.size == declared.size, table.preamble.name


def test_every_p4info_action_and_counter_is_in_the_source(p4info) -> None:  # type: ignore[no-untyped-def]
    source = read_program("v1model")
    in_tables = {r.id for t in p4info.tables for r in t.action_refs}
    for action in p4info.actions:
        params = [(p.name, p.bitwidth) for p in action.params]
        if action.preamble.id in in_tables:
            assert params == source.actions[short(action.preamble.name)]
        else:  # only called directly (drop): p4c lists it with the arguments bound at the call sites
            assert short(action.preamble.name) in source.actions and params == []
    for counter in p4info.counters:
        assert source.counters[short(counter.preamble.name)] == (UNITS[counter.spec.unit], counter.size)


def test_everything_the_source_declares_is_in_the_p4info(p4info) -> None:  # type: ignore[no-untyped-def]
    source = read_program("v1model")
    assert set(source.tables) == {short(t.preamble.name) for t in p4info.tables}
    used = {a for t in source.tables.values() for a in t.actions}
    in_tables = {r.id for t in p4info.tables for r in t.action_refs}
    assert used == {short(a.preamble.name) for a in p4info.actions if a.preamble.id in in_tables}
    assert set(source.counters) == {short(c.preamble.name) for c in p4info.counters}


def test_tna_declares_the_same_tables_actions_and_counters_as_v1model() -> None:
    v1model, tna = read_program("v1model"), read_program("tna")
    assert {n: (t.keys, sorted(t.actions), t.size) for n, t in tna.tables.items()} == {
        n: (t.keys, sorted(t.actions), t.size) for n, t in v1model.tables.items()
    }
    used = {a for t in v1model.tables.values() for a in t.actions}
    assert {a: tna.actions[a] for a in used} == {a: v1model.actions[a] for a in used}
    assert tna.counters == v1model.counters


def test_p4_constants_and_header_match_the_python_wire_format() -> None:
    source = read_program("v1model")
    constants = source.constants
    assert constants["CHECKMATE_UDP_PORT"] == wire.CHECKMATE_UDP_PORT
    assert constants["CHECKMATE_VERSION"] == wire.WIRE_VERSION
    assert constants["CHECKMATE_HEADER_BYTES"] == wire.HEADER_BYTES
    assert constants["UDP_HEADER_BYTES"] == wire.UDP_HEADER_BYTES
    assert constants["CHECKMATE_MSG_DATA"] == wire.MessageType.DATA
    assert constants["CHECKMATE_FLAG_REPLICATE"] == wire.Flags.REPLICATE
    assert constants["CHECKMATE_DTYPE_FP32"] == wire.DType.FP32
    assert constants["CHECKMATE_DTYPE_BF16"] == wire.DType.BF16
    assert constants["CHECKMATE_DTYPE_FP16"] == wire.DType.FP16
    fields = source.header_fields["checkmate_h"]
    assert [name for name, _ in fields] == [
        "version",
        "msg_type",
        "flags",
        "dtype",
        "job_id",
        "iteration",
        "bucket_id",
        "sender_rank",
        "shard_key",
        "reserved",
        "element_offset",
        "element_count",
        "sequence",
    ]
    struct_widths = {"B": 8, "H": 16, "I": 32}
    assert [w for _, w in fields] == [struct_widths[c] for c in wire._HEADER.format.lstrip("!")]
    assert sum(w for _, w in fields) == 8 * wire.HEADER_BYTES


@pytest.mark.parametrize("arch", ["v1model", "tna"])
def test_sources_never_drop_after_choosing_a_multicast_group(arch: str) -> None:
    """On every path through the ingress apply block, nothing drops once a group may have been chosen.

    (v1model's mark_to_drop would clear mcast_grp; on Tofino a drop_ctl would drop every replica.)
    """
    choosing, violations = read_control(arch, "CheckmateIngress").drops_after_choosing_a_group()
    assert choosing == ["replicate_to_shadow.apply();"]
    assert violations == []


_GROUP_THEN_DROP = """
control CheckmateIngress(inout headers_t hdr, inout standard_metadata_t standard_metadata) {
    action drop(bit<8> reason) { mark_to_drop(standard_metadata); }
    action set_multicast_group(bit<16> group) { standard_metadata.mcast_grp = group; }
    action reject_replication() { }
    table replicate_to_shadow {
        key = { hdr.checkmate.job_id : exact @name("job_id"); }
        actions = { set_multicast_group; reject_replication; }
        default_action = reject_replication();
        size = 4;
    }
    apply {
        if (hdr.ipv4.isValid()) {
            replicate_to_shadow.apply();
        } else {
            drop(1);
        }
        %s
    }
}
"""


@pytest.mark.parametrize(
    "after, caught",
    [
        ("if (hdr.ipv4.ttl <= 1) { drop(2); }", ["drop(2);"]),
        ("if (hdr.ipv4.ttl <= 1) { mark_to_drop(standard_metadata); }", ["mark_to_drop(standard_metadata);"]),
        ("if (hdr.ipv4.ttl <= 1) { } else { ig_dprsr_md.drop_ctl = 1; }", ["ig_dprsr_md.drop_ctl = 1;"]),
        ("hdr.ipv4.ttl = 3;", []),
    ],
)
def test_the_drop_after_group_check_catches_a_drop_on_any_later_path(after: str, caught: list[str]) -> None:
    _, violations = parse_control(_GROUP_THEN_DROP % after, "CheckmateIngress").drops_after_choosing_a_group()
    assert violations == caught


@pytest.mark.p4c
def test_p4c_output_matches_the_committed_p4info(tmp_path: Path) -> None:
    """Byte for byte: the committed file is p4c's own output (regenerate it with make p4)."""
    assert shutil.which("p4c")
    out = tmp_path / "checkmate.p4info.txtpb"
    subprocess.run(
        [
            "p4c",
            "--target",
            "bmv2",
            "--arch",
            "v1model",
            "--p4runtime-files",
            str(out),
            "-o",
            str(tmp_path),
            str(P4SRC / "v1model" / "checkmate.p4"),
        ],
        check=True,
        timeout=300,
    )
    assert out.read_text() == P4INFO_PATH.read_text(), (
        f"p4c's P4Info differs from {P4INFO_PATH.name}: make p4 && cp build/v1model/{out.name} p4src/"
    )
