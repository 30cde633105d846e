"""PTF-style packet tests, run against every switch target (embedded always, BMv2 when installed).

Each test: the entries of tests/switch_cases.py are installed over P4Runtime
(fixture ``p4rt``), a packet goes in on one port, and exactly the expected
packets must come out on exactly the expected ports — nothing elsewhere.
"""

from __future__ import annotations

import random
import time

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import ARP, Ether

from checkmate.p4 import names
from checkmate.p4.p4info import load_p4info
from checkmate.scapy_layer import Checkmate
from embedded_switch.pipeline import DropReason, Pipeline, ipv4_checksum
from embedded_switch.program import build_state
from tests import switch_cases as sc
from tests.packet.conftest import Rig
from tests.packet.p4rt import P4RuntimeTestClient

pytestmark = pytest.mark.root


def test_ipv4_forwarding_rewrites_macs_and_decrements_ttl(switch: Rig, p4rt: P4RuntimeTestClient) -> None:
    udp = sc.udp_packet(size=200)
    switch.send(sc.W0_PORT, udp)
    switch.expect({sc.W1_PORT: [sc.routed(udp, sc.W1_MAC)]})
    icmp = sc.icmp_packet(dst_ip=sc.W0_IP)
    switch.send(sc.W1_PORT, icmp)
    switch.expect({sc.W0_PORT: [sc.routed(icmp, sc.W0_MAC)]})


def test_replicate_to_shadow(switch: Rig, p4rt: P4RuntimeTestClient) -> None:
    pkt = sc.checkmate_packet(shard_key=sc.SHARD_SHADOW1)
    switch.send(sc.W0_PORT, pkt)
    switch.expect({sc.W1_PORT: [sc.primary_copy(pkt)], sc.SH1_PORT: [sc.shadow1_copy(pkt)]})
    shadow = Ether(sc.shadow1_copy(pkt))
    assert shadow[IP].dst == sc.SH1_IP and shadow[UDP].dport == sc.SH1_UDP_PORT
    assert shadow[UDP].chksum == 0 and int(shadow[Checkmate].flags) & 0x01 == 0
    assert ipv4_checksum(bytes(shadow[IP])) == shadow[IP].chksum
    n = len(bytes(pkt))
    assert p4rt.read_counter(names.ShadowCopies.NAME, sc.JOB_SLOT) == (1, n)


def test_two_shard_keys_reach_two_shadows(switch: Rig, p4rt: P4RuntimeTestClient) -> None:
    a = sc.checkmate_packet(shard_key=sc.SHARD_SHADOW1, sequence=1)
    b = sc.checkmate_packet(shard_key=sc.SHARD_SHADOW2, sequence=2)
    switch.send(sc.W0_PORT, a, b)
    switch.expect(
        {
            sc.W1_PORT: [sc.primary_copy(a), sc.primary_copy(b)],
            sc.SH1_PORT: [sc.shadow1_copy(a)],
            sc.SH2_PORT: [sc.shadow2_copy(b)],
        }
    )


def test_group_with_two_shadows(switch: Rig, p4rt: P4RuntimeTestClient) -> None:
    pkt = sc.checkmate_packet(shard_key=sc.SHARD_BOTH, dtype=3, count=6)
    switch.send(sc.W0_PORT, pkt)
    switch.expect(
        {
            sc.W1_PORT: [sc.primary_copy(pkt)],
            sc.SH1_PORT: [sc.shadow1_copy(pkt)],
            sc.SH2_PORT: [sc.shadow2_copy(pkt)],
        }
    )
    assert p4rt.read_counter(names.ShadowCopies.NAME, sc.JOB_SLOT)[0] == 2


def test_jumbo_frame_is_replicated_whole(switch: Rig, p4rt: P4RuntimeTestClient) -> None:
    pkt = sc.sized_checkmate_packet(9014)
    switch.send(sc.W0_PORT, pkt)
    switch.expect({sc.W1_PORT: [sc.primary_copy(pkt)], sc.SH1_PORT: [sc.shadow1_copy(pkt)]})


def test_non_enrolled_port_is_forwarded_not_copied_and_counted(
    switch: Rig, p4rt: P4RuntimeTestClient
) -> None:
    pkt = sc.checkmate_packet()
    pkt[Ether].src = sc.SH2_MAC
    switch.send(sc.SH2_PORT, pkt)
    switch.expect({sc.W1_PORT: [sc.routed(pkt, sc.W1_MAC)]})
    assert p4rt.read_counter(names.RejectedReplications.NAME, sc.JOB_SLOT) == (1, len(bytes(pkt)))
    assert p4rt.read_counter(names.ShadowCopies.NAME, sc.JOB_SLOT) == (0, 0)


@pytest.mark.parametrize("case", sc.SPOOFED, ids=[c.name for c in sc.SPOOFED])
def test_spoofed_tagged_packet_reaches_no_shadow(
    switch: Rig, p4rt: P4RuntimeTestClient, case: sc.Spoofed
) -> None:
    switch.send(case.ingress_port, case.packet)
    switch.expect({case.out_port: [sc.routed(case.packet, case.out_mac)]})
    assert p4rt.read_counter(names.RejectedReplications.NAME, sc.JOB_SLOT) == (1, len(bytes(case.packet)))
    assert p4rt.read_counter(names.ShadowCopies.NAME, sc.JOB_SLOT) == (0, 0)


def source_check(address: str, port: int) -> sc.Entry:
    """check_source: packets from ``address`` must come in on ``port`` (what the controller installs)."""
    return sc.Entry(
        names.CheckSource.NAME,
        {names.CheckSource.SRC_ADDR: (sc.ip(address), 32)},
        names.ExpectPort.NAME,
        {names.ExpectPort.PORT: port},
    )


def test_spoofed_source_is_dropped_and_counted(switch: Rig, p4rt: P4RuntimeTestClient) -> None:
    """A known host's address is accepted on that host's port only (issue 29: ring injection)."""
    p4rt.insert(source_check(sc.W0_IP, sc.W0_PORT), source_check(sc.W1_IP, sc.W1_PORT))
    tagged = sc.checkmate_packet(shard_key=sc.SHARD_SHADOW1)
    ring = sc.checkmate_packet(flags=0, sequence=3)  # untagged ring DATA, as a worker sends it
    ack = sc.checkmate_packet(flags=0, msg_type=2, count=0, dtype=0, payload=b"")  # a control datagram
    # worker 0's address from the shadow ports: nothing leaves, each counted as spoofed
    switch.send(sc.SH2_PORT, tagged, ring)
    switch.send(sc.SH1_PORT, ack)
    switch.expect_nothing()
    assert p4rt.read_counter(names.IngressDrops.NAME, DropReason.SPOOFED_SOURCE)[0] == 3
    assert p4rt.read_counter(names.ShadowCopies.NAME, sc.JOB_SLOT) == (0, 0)
    assert p4rt.read_counter(names.RejectedReplications.NAME, sc.JOB_SLOT) == (0, 0)
    # the same frames on worker 0's own port are forwarded (and the tagged one copied)
    switch.send(sc.W0_PORT, tagged, ring, ack)
    switch.expect(
        {
            sc.W1_PORT: [sc.primary_copy(tagged), sc.routed(ring, sc.W1_MAC), sc.routed(ack, sc.W1_MAC)],
            sc.SH1_PORT: [sc.shadow1_copy(tagged)],
        }
    )
    # a source with no entry is not checked; neither is traffic other than Checkmate's
    stranger = sc.checkmate_packet(flags=0, sequence=4)
    stranger[IP].src = "10.0.9.9"
    plain = sc.udp_packet()  # worker 0's address, not a Checkmate datagram
    switch.send(sc.SH2_PORT, stranger, plain)
    switch.expect({sc.W1_PORT: [sc.routed(stranger, sc.W1_MAC), sc.routed(plain, sc.W1_MAC)]})
    assert p4rt.read_counter(names.IngressDrops.NAME, DropReason.SPOOFED_SOURCE)[0] == 3


def test_unknown_job_is_counted_at_slot_zero(switch: Rig, p4rt: P4RuntimeTestClient) -> None:
    pkt = sc.checkmate_packet(job_id=sc.UNKNOWN_JOB_ID)
    switch.send(sc.W0_PORT, pkt)
    switch.expect({sc.W1_PORT: [sc.routed(pkt, sc.W1_MAC)]})
    assert p4rt.read_counter(names.RejectedReplications.NAME, 0)[0] == 1
    assert p4rt.read_counter(names.RejectedReplications.NAME, sc.JOB_SLOT)[0] == 0


@pytest.mark.parametrize(
    "frame",
    [
        sc.checkmate_packet(version=9),
        bytes(sc.checkmate_packet())[:64],
        sc.checkmate_packet(count=100, payload=sc.payload_for(8)),
        sc.checkmate_packet(udp_len=30),
    ],
    ids=["bad-version", "truncated", "inconsistent-length", "udp-length-too-small"],
)
def test_malformed_checkmate_is_dropped_and_counted(
    switch: Rig, p4rt: P4RuntimeTestClient, frame: object
) -> None:
    switch.send(sc.W0_PORT, frame)  # type: ignore[arg-type]
    switch.expect_nothing()
    assert p4rt.read_counter(names.IngressDrops.NAME, DropReason.MALFORMED_CHECKMATE)[0] == 1


def test_non_checkmate_udp_is_forwarded_and_non_ipv4_dropped(switch: Rig, p4rt: P4RuntimeTestClient) -> None:
    other = sc.udp_packet(dport=9999)
    switch.send(sc.W0_PORT, other)
    switch.expect({sc.W1_PORT: [sc.routed(other, sc.W1_MAC)]})
    switch.send(sc.W0_PORT, Ether(src=sc.W0_MAC, dst="ff:ff:ff:ff:ff:ff") / ARP(pdst=sc.W1_IP))
    switch.expect_nothing()
    assert p4rt.read_counter(names.IngressDrops.NAME, DropReason.NOT_IPV4)[0] == 1


def test_no_route_and_ttl_expiry_are_counted(switch: Rig, p4rt: P4RuntimeTestClient) -> None:
    switch.send(sc.W0_PORT, sc.udp_packet(dst_ip="192.0.2.1"), sc.checkmate_packet(ttl=1))
    switch.expect_nothing()
    assert p4rt.read_counter(names.IngressDrops.NAME, DropReason.NO_ROUTE)[0] == 1
    assert p4rt.read_counter(names.IngressDrops.NAME, DropReason.TTL_EXPIRED)[0] == 1


def test_counters_count_every_copy(switch: Rig, p4rt: P4RuntimeTestClient) -> None:
    packets = [sc.checkmate_packet(sequence=i) for i in range(20)]
    switch.send(sc.W0_PORT, *packets)
    switch.expect(
        {
            sc.W1_PORT: [sc.primary_copy(p) for p in packets],
            sc.SH1_PORT: [sc.shadow1_copy(p) for p in packets],
        }
    )
    n = len(bytes(packets[0]))
    assert p4rt.read_counter(names.ShadowCopies.NAME, sc.JOB_SLOT) == (20, 20 * n)
    assert p4rt.read_counter(names.RejectedReplications.NAME, sc.JOB_SLOT) == (0, 0)


def test_garbage_frames_do_not_stop_forwarding(switch: Rig, p4rt: P4RuntimeTestClient) -> None:
    rng = random.Random(7)
    good = bytes(sc.checkmate_packet())
    for _ in range(200):
        kind = rng.randrange(3)
        if kind == 0:
            frame = bytes(rng.randrange(256) for _ in range(rng.randrange(14, 120)))
        else:  # a real frame with a few bytes trashed, or cut short
            frame = bytearray(good)
            for _ in range(4):
                frame[rng.randrange(12, 80)] = rng.randrange(256)
            frame = bytes(frame[: rng.randrange(14, len(frame) + 1)]) if kind == 2 else bytes(frame)
        switch.send(sc.W0_PORT, frame)
    switch.collect(10_000, timeout=1.0)  # whatever the garbage produced
    pkt = sc.checkmate_packet(sequence=4242)
    switch.send(sc.W0_PORT, pkt)
    switch.expect({sc.W1_PORT: [sc.primary_copy(pkt)], sc.SH1_PORT: [sc.shadow1_copy(pkt)]})


def test_mangled_frames_come_out_and_count_as_the_reference_pipeline_says(
    switch: Rig, p4rt: P4RuntimeTestClient
) -> None:
    """Both data paths of the embedded target, frame for frame and counter for counter, against
    the Python Pipeline run in this process on the same frames (the native path's bad-input check
    at the I/O layer: truncations and trashed header bytes of replicated, routed and other frames)."""
    if switch.kind != "embedded":
        pytest.skip("the reference is the embedded target's own Python pipeline")
    rng = random.Random(11)
    bases = [
        bytes(sc.checkmate_packet(shard_key=sc.SHARD_SHADOW1)),
        bytes(sc.checkmate_packet(shard_key=sc.SHARD_BOTH, dtype=2, count=10)),
        bytes(sc.udp_packet()),
        bytes(sc.icmp_packet()),
    ]
    frames = []
    for i in range(300):
        frame = bytearray(rng.choice(bases))
        for _ in range(rng.randrange(4)):
            frame[rng.randrange(12, 80)] = rng.randrange(256)
        if rng.random() < 0.3:
            frame = frame[: rng.randrange(14, len(frame) + 1)]
        frames.append(bytes(frame) if i % 3 else bytes(rng.choice(bases)))  # cached flows in between
    state = build_state(load_p4info())
    sc.install(state)
    reference = Pipeline(state)
    want: dict[int, list[bytes]] = {}
    for frame in frames:
        for port, out in reference.process(frame, sc.W0_PORT):
            want.setdefault(port, []).append(bytes(out))
    for start in range(0, len(frames), 50):
        switch.send(sc.W0_PORT, *frames[start : start + 50])
        time.sleep(0.01)
    switch.expect(want, timeout=10.0)
    for name, counter in state.counters.items():
        got = p4rt.read_counters(name)
        keep = {"packets": (1, 0), "bytes": (0, 1)}.get(counter.unit, (1, 1))  # what the unit reports
        expected = {
            i: tuple(v * k for v, k in zip(counter.read(i), keep, strict=True)) for i in range(counter.size)
        }
        assert {i: got.get(i, (0, 0)) for i in range(counter.size)} == expected, name


def test_packet_in_and_packet_out(switch: Rig, p4rt: P4RuntimeTestClient) -> None:
    # A route to the CPU port makes the switch send packet-ins; a packet-out enters on the CPU port.
    p4rt.insert(sc.route("10.9.9.9", 32, 255, sc.W0_MAC))
    pkt = sc.udp_packet(dst_ip="10.9.9.9")
    switch.send(sc.W0_PORT, pkt)
    packet_in = p4rt.packet_ins.get(timeout=5.0)
    assert packet_in.payload == sc.routed(pkt, sc.W0_MAC)
    switch.expect_nothing(0.2)
    out = sc.udp_packet(dst_ip=sc.W1_IP, size=100)
    p4rt.packet_out(bytes(out))
    switch.expect({sc.W1_PORT: [sc.routed(out, sc.W1_MAC)]})
