"""The switch hands the next worker and the shadow UDP checksum 0, and the transport takes those bytes.

The switch clears REPLICATE (and re-addresses the shadow copy), which makes the
sender's UDP checksum wrong; it writes 0 instead (no checksum, allowed for UDP over
IPv4). This test runs a tagged packet with a valid, non-zero UDP checksum through the
embedded switch's pipeline and delivers the UDP segment it emits, byte for byte, to
the project's transport on loopback: the payload must arrive. The same segment with
the sender's stale checksum (what a switch that forgot the zero would emit) must not
arrive: the kernel discards it, which is why the switch's zero matters.
"""

from __future__ import annotations

import socket
import struct
import time

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from checkmate.p4.p4info import load_p4info
from checkmate.wire import CHECKMATE_UDP_PORT
from embedded_switch.pipeline import Pipeline
from embedded_switch.program import build_state
from hosts.transport import Transport, TransportConfig
from tests import switch_cases as sc

pytestmark = pytest.mark.root

SENDER, RECEIVER = "127.0.0.10", "127.0.0.11"
_UDP_CHECKSUM = slice(14 + 20 + 6, 14 + 20 + 8)


def _switch_outputs(frame: bytes) -> dict[int, bytes]:
    state = build_state(load_p4info())
    sc.install(state)
    return {port: bytes(out) for port, out in Pipeline(state).process(frame, sc.W0_PORT)}


def _to_loopback(frame: bytes, udp_checksum: bytes | None = None) -> bytes:
    """The frame's UDP segment exactly as the switch wrote it, in an IPv4 header from SENDER to RECEIVER.

    ``udp_checksum``: put these two bytes in place of the switch's checksum.
    """
    udp = bytearray(bytes(Ether(frame)[UDP]))
    if udp_checksum is not None:
        udp[6:8] = udp_checksum
    udp[2:4] = struct.pack("!H", CHECKMATE_UDP_PORT)  # the shadow copy was re-addressed to its own port
    return bytes(IP(src=SENDER, dst=RECEIVER, ttl=64, proto=17) / bytes(udp))


def _deliver(packet: bytes) -> list[bytes]:
    """Send ``packet`` (an IPv4 datagram) to a transport bound on RECEIVER; the payloads it delivers."""
    got: list[bytes] = []
    receiver = Transport(TransportConfig(bind=(RECEIVER, CHECKMATE_UDP_PORT)))
    receiver.add_job(
        sc.JOB_ID, 1, {0: (SENDER, CHECKMATE_UDP_PORT)}, on_data=lambda h, p, a: got.append(bytes(p))
    )
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    try:
        raw.sendto(packet, (RECEIVER, 0))
        deadline = time.monotonic() + 2
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # a duplicate delivery would show up here
    finally:
        raw.close()
        receiver.close()
    return got


def test_both_replicas_leave_the_switch_with_udp_checksum_zero_and_the_transport_delivers_them() -> None:
    sent = sc.checkmate_packet(shard_key=sc.SHARD_SHADOW1)
    frame = bytes(sent)
    sender_checksum = frame[_UDP_CHECKSUM]
    assert sender_checksum != b"\x00\x00"  # scapy computed a real one
    outputs = _switch_outputs(frame)
    assert sorted(outputs) == [sc.W1_PORT, sc.SH1_PORT]
    payload = bytes(sent[UDP].payload)
    for port, out in outputs.items():
        assert out[_UDP_CHECKSUM] == b"\x00\x00", f"port {port}"
        delivered = _deliver(_to_loopback(out))
        assert [len(p) for p in delivered] == [len(payload) - 32], f"port {port}: {delivered}"
        assert delivered[0] == payload[32:], f"port {port}"


def test_a_replica_with_the_senders_stale_checksum_never_reaches_the_transport() -> None:
    frame = bytes(sc.checkmate_packet(shard_key=sc.SHARD_SHADOW1))
    out = _switch_outputs(frame)[sc.W1_PORT]
    assert _deliver(_to_loopback(out, udp_checksum=frame[_UDP_CHECKSUM])) == []
