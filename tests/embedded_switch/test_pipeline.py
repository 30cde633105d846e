"""Pipeline.process on bytes: the P4 program's behaviour, packet by packet, without root.

Each test states the input frame and ingress port, relies on the entries of
tests/switch_cases.py, and expects exact frames on exact ports and exact
counter values. Every case runs twice (cold, then from the decision cache), and
on both data paths: the Python reference and the native one (the compiled flow
cache of embedded_switch.native, skipped when the extension is not built).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Packet

from checkmate.p4.p4info import load_p4info
from checkmate.scapy_layer import Checkmate
from embedded_switch import native
from embedded_switch.pipeline import DropReason, Pipeline, ipv4_checksum
from embedded_switch.program import build_state
from embedded_switch.state import ActionCall, FieldMatch, MatchKind, Replica, SwitchState
from tests import switch_cases as sc
from tests.p4_source import read_program


@pytest.fixture
def state() -> SwitchState:
    s = build_state(load_p4info())
    sc.install(s)
    return s


NATIVE = pytest.mark.skipif(
    not native.available(), reason=f"native data path not built: {native.IMPORT_ERROR}"
)
DATAPATHS = ["python", pytest.param("native", marks=NATIVE)]


def make(datapath: str, state: SwitchState, cache: bool = True) -> Pipeline:
    if datapath == "native":
        return native.NativePipeline(state, cache=cache)
    return Pipeline(state, cache=cache)


@pytest.fixture(params=DATAPATHS)
def pipeline(state: SwitchState, request: pytest.FixtureRequest) -> Pipeline:
    return make(request.param, state)


def run(pipeline: Pipeline, pkt: Packet | bytes, port: int = sc.W0_PORT) -> list[tuple[int, bytes]]:
    """Process the frame twice (cold and cached); both runs must agree. Returns the outputs once."""
    frame = bytes(pkt)
    first = [(p, bytes(f)) for p, f in pipeline.process(frame, port)]
    second = [(p, bytes(f)) for p, f in pipeline.process(memoryview(frame), port)]
    assert first == second
    return first


def counter(state: SwitchState, name: str, index: int) -> tuple[int, int]:
    return state.counter(name).read(index)


# ---- the constants ---------------------------------------------------------------------------------
def test_drop_reasons_equal_the_p4_constants() -> None:
    constants = read_program("v1model").constants
    p4_reasons = {
        name[len("DROP_") :]: value
        for name, value in constants.items()
        if name.startswith("DROP_") and name != "DROP_REASON_COUNT"
    }
    assert p4_reasons, "no DROP_ constants found in p4src"
    for name, value in p4_reasons.items():
        assert DropReason[name] == value
    assert all(r.value >= constants["DROP_REASON_COUNT"] for r in DropReason if r.name not in p4_reasons)


def test_ipv4_checksum_matches_scapy() -> None:
    rng = random.Random(1)
    for _ in range(200):
        pkt = IP(
            src=f"10.{rng.randrange(256)}.0.1",
            dst="10.0.0.2",
            ttl=rng.randrange(256),
            id=rng.randrange(65536),
        )
        raw = bytes(pkt)
        assert ipv4_checksum(raw) == int.from_bytes(raw[10:12], "big")


# ---- forwarding ------------------------------------------------------------------------------------
def test_plain_udp_is_routed_with_mac_rewrite_and_ttl_decrement(pipeline: Pipeline) -> None:
    pkt = sc.udp_packet(size=300)
    assert run(pipeline, pkt) == [(sc.W1_PORT, sc.routed(pkt, sc.W1_MAC))]
    out = Ether(run(pipeline, pkt)[0][1])
    assert out[IP].ttl == 63 and out[Ether].src == sc.SWITCH_MAC
    assert pipeline.drops.total() == 0


def test_longest_prefix_wins(pipeline: Pipeline) -> None:
    pkt = sc.udp_packet(dst_ip=sc.SH1_IP)
    assert run(pipeline, pkt) == [(sc.SH1_PORT, sc.routed(pkt, sc.SH1_MAC))]


def test_non_udp_ipv4_keeps_its_bytes_past_the_ip_header(pipeline: Pipeline) -> None:
    pkt = sc.icmp_packet()
    [(port, out)] = run(pipeline, pkt)
    assert port == sc.W1_PORT and out == sc.routed(pkt, sc.W1_MAC)
    assert out[34:] == bytes(pkt)[34:]


def test_checkmate_without_replicate_is_forwarded_untouched(pipeline: Pipeline, state: SwitchState) -> None:
    pkt = sc.checkmate_packet(flags=0x04)
    assert run(pipeline, pkt) == [(sc.W1_PORT, sc.routed(pkt, sc.W1_MAC))]
    assert counter(state, "shadow_copies", sc.JOB_SLOT) == (0, 0)


@pytest.mark.parametrize(
    "frame, reason",
    [
        (Ether(src=sc.W0_MAC, dst="ff:ff:ff:ff:ff:ff") / ARP(pdst=sc.W1_IP), DropReason.NOT_IPV4),
        (Ether(src=sc.W0_MAC, dst=sc.SWITCH_MAC) / IPv6() / UDP(), DropReason.NOT_IPV4),
        (sc.udp_packet(dst_ip="192.168.9.9"), DropReason.NO_ROUTE),
        (bytes(sc.udp_packet())[:13], DropReason.MALFORMED_PACKET),
        (bytes(sc.udp_packet())[:30], DropReason.MALFORMED_PACKET),
        (bytes(sc.udp_packet())[:40], DropReason.MALFORMED_PACKET),
    ],
    ids=["arp", "ipv6", "no-route", "runt", "truncated-ipv4", "truncated-udp"],
)
def test_dropped_at_ingress(
    pipeline: Pipeline, state: SwitchState, frame: Packet | bytes, reason: DropReason
) -> None:
    assert run(pipeline, frame) == []
    assert counter(state, "ingress_drops", reason)[0] == 2
    assert pipeline.drops.snapshot() == {(reason, sc.W0_PORT): 2}


@pytest.mark.parametrize("ttl", [0, 1])
def test_ttl_expired(pipeline: Pipeline, state: SwitchState, ttl: int) -> None:
    assert run(pipeline, sc.checkmate_packet(ttl=ttl)) == []
    assert counter(state, "ingress_drops", DropReason.TTL_EXPIRED)[0] == 2


def test_bad_ipv4_checksum_is_dropped_even_after_a_good_packet_of_the_same_flow(
    pipeline: Pipeline, state: SwitchState
) -> None:
    good = sc.checkmate_packet()
    assert len(run(pipeline, good)) == 2
    bad = bytearray(bytes(good))
    bad[24] ^= 0xFF
    assert pipeline.process(bytes(bad), sc.W0_PORT) == []
    assert counter(state, "ingress_drops", DropReason.BAD_IPV4_CHECKSUM)[0] == 1
    assert len(pipeline.process(bytes(good), sc.W0_PORT)) == 2


def test_ip_options_fail_the_20_byte_checksum_as_in_bmv2(pipeline: Pipeline, state: SwitchState) -> None:
    # verify_checksum covers the fixed fields only, so a header with options fails it.
    pkt = Ether(src=sc.W0_MAC, dst=sc.SWITCH_MAC) / IP(dst=sc.W1_IP, options=b"\x94\x04\x00\x00") / UDP()
    assert run(pipeline, pkt) == []
    assert counter(state, "ingress_drops", DropReason.BAD_IPV4_CHECKSUM)[0] == 2


def test_fragment_is_not_parsed_as_udp_so_never_copied(pipeline: Pipeline, state: SwitchState) -> None:
    pkt = sc.checkmate_packet()
    pkt[IP].flags = "MF"
    assert run(pipeline, pkt) == [(sc.W1_PORT, sc.routed(pkt, sc.W1_MAC))]
    assert counter(state, "shadow_copies", sc.JOB_SLOT) == (0, 0)


# ---- replication -----------------------------------------------------------------------------------
def test_replicate_to_one_shadow(pipeline: Pipeline, state: SwitchState) -> None:
    pkt = sc.checkmate_packet(shard_key=sc.SHARD_SHADOW1)
    out = run(pipeline, pkt)
    assert out == [(sc.W1_PORT, sc.primary_copy(pkt)), (sc.SH1_PORT, sc.shadow1_copy(pkt))]
    shadow = Ether(out[1][1])
    assert shadow[IP].dst == sc.SH1_IP and shadow[UDP].dport == sc.SH1_UDP_PORT and shadow[UDP].chksum == 0
    assert shadow[Checkmate].flags == 0 and ipv4_checksum(out[1][1][14:34]) == shadow[IP].chksum
    n = len(bytes(pkt))
    assert counter(state, "shadow_copies", sc.JOB_SLOT) == (2, 2 * n)
    assert counter(state, "rejected_replications", sc.JOB_SLOT) == (0, 0)


def test_two_shard_keys_go_to_two_shadows(pipeline: Pipeline) -> None:
    a = sc.checkmate_packet(shard_key=sc.SHARD_SHADOW1)
    b = sc.checkmate_packet(shard_key=sc.SHARD_SHADOW2)
    assert run(pipeline, a) == [(sc.W1_PORT, sc.primary_copy(a)), (sc.SH1_PORT, sc.shadow1_copy(a))]
    assert run(pipeline, b) == [(sc.W1_PORT, sc.primary_copy(b)), (sc.SH2_PORT, sc.shadow2_copy(b))]


def test_one_group_with_two_shadows(pipeline: Pipeline, state: SwitchState) -> None:
    pkt = sc.checkmate_packet(shard_key=sc.SHARD_BOTH, dtype=2, count=10)
    assert run(pipeline, pkt) == [
        (sc.W1_PORT, sc.primary_copy(pkt)),
        (sc.SH1_PORT, sc.shadow1_copy(pkt)),
        (sc.SH2_PORT, sc.shadow2_copy(pkt)),
    ]
    assert counter(state, "shadow_copies", sc.JOB_SLOT)[0] == 4


def test_jumbo_frame_is_replicated_byte_exact(pipeline: Pipeline) -> None:
    pkt = sc.sized_checkmate_packet(9014)
    assert len(bytes(pkt)) == 9014
    assert run(pipeline, pkt) == [(sc.W1_PORT, sc.primary_copy(pkt)), (sc.SH1_PORT, sc.shadow1_copy(pkt))]


def test_non_enrolled_port_is_forwarded_not_copied_and_counted(
    pipeline: Pipeline, state: SwitchState
) -> None:
    pkt = sc.checkmate_packet(dst_ip=sc.W1_IP)
    # Shadow 2's port is not enrolled for job 7: forwarded as is, REPLICATE still set.
    assert run(pipeline, pkt, port=sc.SH2_PORT) == [(sc.W1_PORT, sc.routed(pkt, sc.W1_MAC))]
    assert counter(state, "rejected_replications", sc.JOB_SLOT) == (2, 2 * len(bytes(pkt)))
    assert counter(state, "shadow_copies", sc.JOB_SLOT) == (0, 0)


def test_unknown_job_is_counted_at_slot_zero(pipeline: Pipeline, state: SwitchState) -> None:
    pkt = sc.checkmate_packet(job_id=sc.UNKNOWN_JOB_ID)
    assert run(pipeline, pkt) == [(sc.W1_PORT, sc.routed(pkt, sc.W1_MAC))]
    assert counter(state, "rejected_replications", 0)[0] == 2


def test_missing_shadow_rewrite_drops_only_the_copy(pipeline: Pipeline, state: SwitchState) -> None:
    pkt = sc.checkmate_packet(shard_key=sc.SHARD_NO_REWRITE)
    assert run(pipeline, pkt) == [(sc.W1_PORT, sc.primary_copy(pkt))]
    assert counter(state, "egress_drops", DropReason.NO_SHADOW_DESTINATION)[0] == 2
    assert pipeline.drops.snapshot() == {(DropReason.NO_SHADOW_DESTINATION, sc.SH1_PORT): 2}


def test_missing_multicast_group_drops_and_counts(pipeline: Pipeline) -> None:
    assert run(pipeline, sc.checkmate_packet(shard_key=sc.SHARD_NO_GROUP)) == []
    assert pipeline.drops.by_reason() == {DropReason.UNKNOWN_MULTICAST_GROUP: 2}


# ---- malformed Checkmate ---------------------------------------------------------------------------
def _truncated_checkmate() -> bytes:
    return bytes(sc.checkmate_packet())[:60]


@pytest.mark.parametrize(
    "frame",
    [
        sc.checkmate_packet(version=2),
        _truncated_checkmate(),
        sc.checkmate_packet(udp_len=20),
        sc.checkmate_packet(count=9, payload=sc.payload_for(8)),
        sc.checkmate_packet(dtype=7),
        sc.checkmate_packet(msg_type=2),
        sc.checkmate_packet(count=1 << 16, payload=b""),
    ],
    ids=[
        "bad-version",
        "truncated",
        "udp-length-too-small",
        "inconsistent-length",
        "unknown-dtype",
        "replicate-on-ack",
        "count-too-large",
    ],
)
def test_malformed_checkmate_is_dropped_and_counted(
    pipeline: Pipeline, state: SwitchState, frame: Packet | bytes
) -> None:
    assert run(pipeline, frame) == []
    assert counter(state, "ingress_drops", DropReason.MALFORMED_CHECKMATE)[0] == 2
    assert pipeline.drops.by_reason() == {DropReason.MALFORMED_CHECKMATE: 2}


def test_length_is_not_checked_without_replicate(pipeline: Pipeline) -> None:
    pkt = sc.checkmate_packet(flags=0, count=9, payload=sc.payload_for(8))
    assert run(pipeline, pkt) == [(sc.W1_PORT, sc.routed(pkt, sc.W1_MAC))]


# ---- the control plane changes under the cache ------------------------------------------------------
def test_table_and_group_changes_take_effect_at_once(pipeline: Pipeline, state: SwitchState) -> None:
    pkt = bytes(sc.checkmate_packet())
    assert [p for p, _ in pipeline.process(pkt, sc.W0_PORT)] == [sc.W1_PORT, sc.SH1_PORT]
    state.multicast_groups[sc.GROUP_SHADOW1] = (Replica(sc.W1_PORT, 0), Replica(sc.SH2_PORT, sc.RID_SHADOW2))
    assert [p for p, _ in pipeline.process(pkt, sc.W0_PORT)] == [sc.W1_PORT, sc.SH2_PORT]
    del state.multicast_groups[sc.GROUP_SHADOW1]
    assert pipeline.process(pkt, sc.W0_PORT) == []
    state.multicast_groups[sc.GROUP_SHADOW1] = (Replica(sc.W1_PORT, 0),)
    assert [p for p, _ in pipeline.process(pkt, sc.W0_PORT)] == [sc.W1_PORT]
    route = state.table("route_ipv4")
    route.delete((FieldMatch(MatchKind.LPM, value=sc.ip("10.0.2.0"), prefix_len=24),), 0)
    assert pipeline.process(pkt, sc.W0_PORT) == []
    assert state.counter("ingress_drops").read(DropReason.NO_ROUTE)[0] == 1


def test_a_new_state_replaces_the_old(pipeline: Pipeline) -> None:
    pkt = bytes(sc.checkmate_packet())
    assert len(pipeline.process(pkt, sc.W0_PORT)) == 2
    pipeline.state = build_state(load_p4info())
    assert pipeline.process(pkt, sc.W0_PORT) == []
    assert pipeline.state.counter("ingress_drops").read(DropReason.NO_ROUTE)[0] == 1


def test_default_action_and_counter_writes_under_the_cache(pipeline: Pipeline, state: SwitchState) -> None:
    pkt = bytes(sc.udp_packet(dst_ip="192.168.9.9"))
    assert pipeline.process(pkt, sc.W0_PORT) == []
    route = state.table("route_ipv4")
    route.default_action = ActionCall("forward", (sc.W1_PORT, sc.mac(sc.SWITCH_MAC), sc.mac(sc.W1_MAC)))
    assert [p for p, _ in pipeline.process(pkt, sc.W0_PORT)] == [sc.W1_PORT]
    drops = state.counter("ingress_drops")
    drops.packets, drops.bytes = [5] * drops.size, [7] * drops.size  # as a P4Runtime counter write does
    route.default_action = ActionCall("drop_no_route")
    assert pipeline.process(pkt, sc.W0_PORT) == []
    assert drops.read(DropReason.NO_ROUTE) == (6, 7 + len(pkt))


def test_many_flows_overflow_the_cache_and_still_count(pipeline: Pipeline, state: SwitchState) -> None:
    frames = [bytes(sc.checkmate_packet(job_id=100_000 + i, sequence=i)) for i in range(5000)]
    outs = pipeline.process_batch(frames, sc.W0_PORT)
    assert len(outs) == 5000 and all(p == sc.W1_PORT for p, _ in outs)
    assert state.counter("rejected_replications").read(0)[0] == 5000


# ---- properties ------------------------------------------------------------------------------------
_BASES = [
    bytes(sc.checkmate_packet()),
    bytes(sc.checkmate_packet(shard_key=sc.SHARD_BOTH)),
    bytes(sc.udp_packet()),
    bytes(sc.icmp_packet()),
]


@settings(max_examples=300, deadline=None)
@given(
    base=st.sampled_from(_BASES),
    edits=st.lists(st.tuples(st.integers(0, 80), st.integers(0, 255)), max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 120)),
    port=st.sampled_from(sc.PORTS),
)
def test_cached_and_interpreted_paths_agree(
    base: bytes, edits: list[tuple[int, int]], cut: int | None, port: int
) -> None:
    frame = bytearray(base)
    for offset, value in edits:
        if offset < len(frame):
            frame[offset] = value
    data = bytes(frame[:cut] if cut is not None else frame)
    states = []
    outputs = []
    variants = [("python", True), ("python", False)] + [("native", True)] * native.available()
    for datapath, cache in variants:
        s = build_state(load_p4info())
        sc.install(s)
        p = make(datapath, s, cache)
        outputs.append([[(q, bytes(f)) for q, f in p.process(data, port)] for _ in range(3)])
        states.append(({a: (c.packets[:], c.bytes[:]) for a, c in s.counters.items()}, p.drops.snapshot()))
    assert all(o == outputs[0] for o in outputs)
    assert all(st == states[0] for st in states)


@pytest.mark.parametrize("datapath", DATAPATHS)
@settings(max_examples=200, deadline=None)
@given(frame=st.binary(max_size=200))
def test_garbage_never_raises_and_forwarding_goes_on(datapath: str, frame: bytes) -> None:
    s = build_state(load_p4info())
    sc.install(s)
    p = make(datapath, s)
    for out_port, out in p.process(frame, sc.W0_PORT):
        assert 0 <= out_port < 512 and len(out) == len(frame)
    pkt = sc.udp_packet()
    assert p.process(bytes(pkt), sc.W0_PORT) == [(sc.W1_PORT, bytearray(sc.routed(pkt, sc.W1_MAC)))]
