"""Replicated packets reach the next worker with UDP checksum 0; the transport must accept them."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from checkmate.wire import CHECKMATE_UDP_PORT, CheckmateHeader, DType, MessageType, encode
from hosts.transport import Transport, TransportConfig

pytestmark = pytest.mark.root


def _ipv4_udp(src: str, dst: str, payload: bytes) -> bytes:
    udp = struct.pack("!HHHH", CHECKMATE_UDP_PORT, CHECKMATE_UDP_PORT, 8 + len(payload), 0) + payload
    return udp  # IPPROTO_UDP raw socket: the kernel adds the IPv4 header


def test_datagram_with_udp_checksum_zero_is_delivered() -> None:
    got: list[int] = []
    receiver = Transport(TransportConfig(bind=("127.0.0.11", CHECKMATE_UDP_PORT)))
    receiver.add_job(
        4, 1, {0: ("127.0.0.10", CHECKMATE_UDP_PORT)}, on_data=lambda h, p, a: got.append(h.sequence)
    )
    raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
    raw.bind(("127.0.0.10", 0))
    try:
        header = CheckmateHeader(MessageType.DATA, 4, 0, 0, 0, 0, 2, 0, dtype=DType.FP32)
        raw.sendto(_ipv4_udp("127.0.0.10", "127.0.0.11", bytes(encode(header, bytes(8)))), ("127.0.0.11", 0))
        deadline = time.monotonic() + 2
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [0]
    finally:
        raw.close()
        receiver.close()
