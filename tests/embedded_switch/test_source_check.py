"""check_source in the embedded pipeline, on both data paths, cold and from the flow cache.

The decision for a flow is cached by (ingress port, header fields); the source address is
one of those fields because check_source decides on it, so two frames that differ only in
their source never share a decision, and a write to check_source drops cached decisions.
"""

from __future__ import annotations

import pytest
from scapy.layers.inet import IP

from checkmate.p4.p4info import load_p4info
from embedded_switch import native
from embedded_switch.pipeline import DropReason, Pipeline
from embedded_switch.program import build_state
from embedded_switch.state import FieldMatch, MatchKind, SwitchState
from tests import switch_cases as sc

DATAPATHS = [
    "python",
    pytest.param("native", marks=pytest.mark.skipif(not native.available(), reason="native path not built")),
]


def source_check(address: str, port: int) -> sc.Entry:
    return sc.Entry("check_source", {"src_addr": (sc.ip(address), 32)}, "expect_port", {"port": port})


def make(datapath: str) -> tuple[SwitchState, Pipeline]:
    state = build_state(load_p4info())
    sc.install(state)
    return state, native.make_pipeline(datapath, state)


def from_source(address: str) -> bytes:
    """Untagged ring DATA from worker 0 to worker 1, with ``address`` as its source."""
    pkt = sc.checkmate_packet(flags=0)
    pkt[IP].src = address
    return bytes(pkt)


def spoofed(state: SwitchState) -> int:
    return state.counter("ingress_drops").read(DropReason.SPOOFED_SOURCE)[0]


@pytest.mark.parametrize("datapath", DATAPATHS)
def test_frames_differing_only_in_source_do_not_share_a_cached_decision(datapath: str) -> None:
    state, pipeline = make(datapath)
    sc.install(state, (source_check(sc.W0_IP, sc.W0_PORT),), ())
    stranger, forged = from_source("10.0.9.9"), from_source(sc.W0_IP)
    for _ in range(3):  # cold, then cached: the stranger's flow must not answer for the forgery
        assert [p for p, _ in pipeline.process(stranger, sc.SH2_PORT)] == [sc.W1_PORT]
        assert pipeline.process(forged, sc.SH2_PORT) == []
    assert spoofed(state) == 3
    assert pipeline.drops.snapshot() == {(DropReason.SPOOFED_SOURCE, sc.SH2_PORT): 3}
    assert pipeline.process(forged, sc.W0_PORT) == [(sc.W1_PORT, bytearray(sc.routed(forged, sc.W1_MAC)))]


@pytest.mark.parametrize("datapath", DATAPATHS)
def test_writing_check_source_drops_cached_decisions(datapath: str) -> None:
    state, pipeline = make(datapath)
    forged = from_source(sc.W0_IP)
    for _ in range(2):
        assert [p for p, _ in pipeline.process(forged, sc.SH2_PORT)] == [sc.W1_PORT]  # no entry: unchecked
    sc.install(state, (source_check(sc.W0_IP, sc.W0_PORT),), ())
    for _ in range(2):
        assert pipeline.process(forged, sc.SH2_PORT) == []
    assert spoofed(state) == 2
    table = state.table("check_source")
    with state.write_lock:
        table.delete((FieldMatch(MatchKind.LPM, value=sc.ip(sc.W0_IP), prefix_len=32),), 0)
    assert [p for p, _ in pipeline.process(forged, sc.SH2_PORT)] == [sc.W1_PORT]
    assert spoofed(state) == 2


@pytest.mark.parametrize("datapath", DATAPATHS)
def test_longest_prefix_decides_and_other_traffic_is_not_checked(datapath: str) -> None:
    state, pipeline = make(datapath)
    sc.install(
        state,
        (
            sc.Entry(
                "check_source", {"src_addr": (sc.ip("10.0.0.0"), 16)}, "expect_port", {"port": sc.SH1_PORT}
            ),
            source_check(sc.W0_IP, sc.W0_PORT),
        ),
        (),
    )
    assert pipeline.process(from_source(sc.W0_IP), sc.SH1_PORT) == []  # the /32 wins over the /16
    assert [p for p, _ in pipeline.process(from_source(sc.W0_IP), sc.W0_PORT)] == [sc.W1_PORT]
    assert [p for p, _ in pipeline.process(from_source("10.0.7.7"), sc.SH1_PORT)] == [sc.W1_PORT]
    assert pipeline.process(from_source("10.0.7.7"), sc.W0_PORT) == []  # the /16 says port 3
    plain = sc.udp_packet()  # worker 0's address on a wrong port, but not a Checkmate datagram
    assert [p for p, _ in pipeline.process(bytes(plain), sc.SH1_PORT)] == [sc.W1_PORT]
    assert spoofed(state) == 2
