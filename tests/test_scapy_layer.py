"""The scapy layer dissects what checkmate.wire writes, byte for byte."""

from __future__ import annotations

from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether

from checkmate import wire
from checkmate.scapy_layer import Checkmate
from checkmate.wire import CHECKMATE_UDP_PORT, CheckmateHeader, DType, Flags, MessageType

HEADER = CheckmateHeader(
    msg_type=MessageType.DATA,
    job_id=42,
    iteration=9,
    bucket_id=2,
    sender_rank=1,
    element_offset=4096,
    element_count=3,
    sequence=17,
    dtype=DType.FP32,
    flags=Flags.REPLICATE | Flags.RETRANSMIT,
    shard_key=1,
)
PAYLOAD = bytes(range(12))


def frame(dport: int = CHECKMATE_UDP_PORT, sport: int = CHECKMATE_UDP_PORT) -> bytes:
    return bytes(
        Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
        / IP(src="10.0.0.1", dst="10.0.0.2")
        / UDP(sport=sport, dport=dport)
        / wire.encode(HEADER, PAYLOAD)
    )


def test_ether_dissects_checkmate_fields() -> None:
    packet = Ether(frame())
    layer = packet[Checkmate]
    assert (layer.job_id, layer.iteration, layer.bucket_id, layer.sender_rank) == (42, 9, 2, 1)
    assert (layer.element_offset, layer.element_count, layer.sequence, layer.shard_key) == (4096, 3, 17, 1)
    assert layer.flags.REPLICATE and layer.flags.RETRANSMIT and not layer.flags.LAST
    assert layer.msg_type == MessageType.DATA and layer.dtype == DType.FP32
    assert bytes(layer.payload) == PAYLOAD


def test_scapy_builds_the_same_bytes_as_the_codec() -> None:
    built = bytes(
        Checkmate(
            job_id=42,
            iteration=9,
            bucket_id=2,
            sender_rank=1,
            element_offset=4096,
            element_count=3,
            sequence=17,
            flags="REPLICATE+RETRANSMIT",
            shard_key=1,
        )
    )
    assert built == HEADER.pack()


def test_shadow_copy_with_rewritten_port_still_dissects() -> None:
    packet = Ether(frame(dport=50000))
    assert packet.haslayer(Checkmate)
    assert packet[Checkmate].job_id == 42


def test_other_udp_is_not_dissected_as_checkmate() -> None:
    assert not Ether(frame(dport=53, sport=5353)).haslayer(Checkmate)
