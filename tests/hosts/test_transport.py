"""The host transport: bit-exact delivery under loss, duplication and reordering; bad input; dead peers."""

from __future__ import annotations

import functools
import socket
import struct
import sys
import threading
import time

import numpy as np
import pytest

from checkmate.wire import (
    CHECKMATE_UDP_PORT,
    MAX_PAYLOAD_BYTES,
    CheckmateHeader,
    DType,
    Flags,
    MessageType,
    encode,
)
from hosts.faults import FaultConfig
from hosts.transport import PeerTimeoutError, Transport, TransportConfig
from tests.hosts.datapaths import datapath_params

JOB = 77
A = ("127.0.0.10", CHECKMATE_UDP_PORT)
B = ("127.0.0.11", CHECKMATE_UDP_PORT)
PER = MAX_PAYLOAD_BYTES // 4


@pytest.fixture(autouse=True, params=datapath_params)
def datapath(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on each data path: this module's TransportConfig defaults to it."""
    monkeypatch.setattr(
        sys.modules[__name__], "TransportConfig", functools.partial(TransportConfig, datapath=request.param)
    )
    return str(request.param)


class Sink:
    """Collects delivered DATA payloads by element offset (copying them)."""

    def __init__(self) -> None:
        self.got: dict[int, bytes] = {}
        self.flags: dict[int, Flags] = {}
        self.deliveries = 0
        self.lock = threading.Lock()

    def __call__(self, header: CheckmateHeader, payload: memoryview, addr: tuple[str, int]) -> None:
        with self.lock:
            self.deliveries += 1
            self.got[header.element_offset] = bytes(payload)
            self.flags[header.element_offset] = header.flags


def _header(offset: int, count: int, flags: Flags = Flags.NONE, rank: int = 0) -> CheckmateHeader:
    return CheckmateHeader(
        msg_type=MessageType.DATA,
        job_id=JOB,
        iteration=3,
        bucket_id=1,
        sender_rank=rank,
        element_offset=offset,
        element_count=count,
        sequence=0,
        dtype=DType.FP32,
        flags=flags,
        shard_key=0,
    )


def _pair(faults_a: FaultConfig, faults_b: FaultConfig, **kw: float) -> tuple[Transport, Transport, Sink]:
    sink = Sink()
    a = Transport(TransportConfig(bind=A, faults=faults_a, **kw))  # type: ignore[arg-type]
    b = Transport(TransportConfig(bind=B, faults=faults_b, **kw))  # type: ignore[arg-type]
    a.add_job(JOB, 0, {1: B}, on_data=lambda h, p, s: None)
    b.add_job(JOB, 1, {0: A}, on_data=sink)
    return a, b, sink


def _stream(a: Transport, n: int, rng: np.random.Generator) -> np.ndarray:
    data = rng.standard_normal(n * PER, dtype=np.float32)
    for i in range(n):
        flags = Flags.REPLICATE if i % 2 else Flags.NONE
        a.send(B, _header(i * PER, PER, flags), data[i * PER : (i + 1) * PER].data.cast("B"))
    return data


@pytest.mark.parametrize(
    "faults",
    [
        FaultConfig(),
        FaultConfig(seed=1, send_drop=0.01, recv_drop=0.01),
        FaultConfig(seed=2, send_drop=0.05, recv_drop=0.05),
        FaultConfig(seed=3, duplicate=0.05, reorder=0.1),
        FaultConfig(seed=4, send_drop=0.05, duplicate=0.05, reorder=0.1, recv_drop=0.02),
    ],
    ids=["clean", "loss1", "loss5", "dup-reorder", "all"],
)
def test_bit_exact_delivery_under_faults(faults: FaultConfig) -> None:
    n = 600
    other = FaultConfig(seed=faults.seed + 100, send_drop=faults.send_drop, duplicate=faults.duplicate)
    a, b, sink = _pair(faults, other)
    with a, b:
        data = _stream(a, n, np.random.default_rng(faults.seed))
        assert a.wait_idle(15.0), a.stats()
        deadline = time.monotonic() + 2
        while len(sink.got) < n and time.monotonic() < deadline:
            time.sleep(0.005)
        assert sorted(sink.got) == [i * PER for i in range(n)]
        assert sink.deliveries == n, "a datagram was delivered twice"
        got = np.frombuffer(b"".join(sink.got[i * PER] for i in range(n)), dtype=np.float32)
        assert np.array_equal(got.view(np.uint32), data.view(np.uint32))
        sa, sb = a.stats(), b.stats()
        assert sb["data_received"] == n
        if faults.send_drop or faults.recv_drop:
            assert sum(v for k, v in sa.items() if k.startswith("retransmit.")) > 0
        if faults.duplicate:
            assert sb.get("drop.duplicate", 0) > 0
        # retransmissions keep REPLICATE and add RETRANSMIT
        for offset, flags in sink.flags.items():
            assert bool(flags & Flags.REPLICATE) == bool((offset // PER) % 2)


def test_retransmission_keeps_replicate_and_adds_retransmit() -> None:
    seen: list[tuple[Flags, bool]] = []
    a, b, sink = _pair(FaultConfig(seed=9, send_drop=0.3), FaultConfig())
    a.tap = lambda h, addr, re: seen.append((h.flags, re))
    with a, b:
        _stream(a, 50, np.random.default_rng(0))
        assert a.wait_idle(10.0)
    retrans = [f for f, re in seen if re]
    assert retrans and all(f & Flags.RETRANSMIT for f in retrans)
    assert any(f & Flags.REPLICATE for f in retrans)
    assert all(not f & Flags.RETRANSMIT for f, re in seen if not re)


def test_bad_datagrams_are_counted_and_not_delivered() -> None:
    a, b, sink = _pair(FaultConfig(), FaultConfig())
    with a, b:
        raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        raw.bind(("127.0.0.12", 0))
        good = encode(_header(0, 4), bytes(16))
        raw.sendto(good[:20], B)  # truncated
        bad_version = bytearray(good)
        bad_version[0] = 9
        raw.sendto(bad_version, B)
        unknown_job = encode(CheckmateHeader(MessageType.DATA, 999, 0, 0, 0, 0, 4, 0), bytes(16))
        raw.sendto(unknown_job, B)
        raw.sendto(good, B)  # right job, rank 0, but not rank 0's address
        unknown_rank = encode(_header(0, 4, rank=5), bytes(16))
        raw.sendto(unknown_rank, B)
        bogus_ack = CheckmateHeader(MessageType.ACK, JOB, 0, 0, 0, 0, 1, 0, dtype=DType.NONE).pack()
        raw.sendto(bogus_ack + struct.pack("!II", 0, 1), B)  # well formed, but no MAC (checkmate.auth)
        raw.close()
        deadline = time.monotonic() + 2
        while sum(b.drops().values()) < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        drops = b.drops()
        assert drops.get("malformed") == 2
        assert drops.get("unknown_job") == 1
        assert drops.get("unknown_rank") == 2
        assert drops.get("unauthenticated") == 1
        assert sink.deliveries == 0


def test_dead_peer_raises_peer_timeout_naming_it() -> None:
    failures: list[PeerTimeoutError] = []
    done = threading.Event()
    a = Transport(TransportConfig(bind=A, peer_timeout=0.5))

    def on_failure(err: PeerTimeoutError) -> None:
        failures.append(err)
        done.set()

    with a:
        a.add_job(JOB, 0, {1: B}, on_data=lambda h, p, s: None, on_failure=on_failure)
        start = time.monotonic()
        a.send(B, _header(0, 4), bytes(16))  # nobody listens on B
        assert done.wait(3.0)
        elapsed = time.monotonic() - start
        assert 0.4 < elapsed < 2.0
        assert "rank 1 at 127.0.0.11:48879" in str(failures[0])
        with pytest.raises(PeerTimeoutError):
            a.send(B, _header(0, 4), bytes(16))


def test_the_receive_fast_path_reads_and_refuses_exactly_what_decode_does() -> None:
    """checkmate.wire.decode_data / pack_data_header (the transport's per-datagram path) agree with decode."""
    from checkmate.wire import WireFormatError, decode, decode_data, pack_data_header

    header = _header(4470, 3, Flags.REPLICATE | Flags.LAST, rank=2)
    good = encode(header, np.arange(3, dtype=np.float32).tobytes())
    packed = bytearray(32)
    pack_data_header(packed, 0x05, 1, JOB, 3, 1, 2, 0, 4470, 3)
    assert bytes(packed) == header.pack()
    fields, payload = decode_data(memoryview(good))
    full, full_payload = decode(good)
    assert fields == (1, 1, 0x05, 1, JOB, 3, 1, 2, 0, 0, 4470, 3, 0)
    assert full.fields() == fields == header.fields()  # what the ring's header-object path hands on
    assert bytes(payload) == bytes(full_payload) and full.element_offset == fields[10]
    bad_version, bad_flags, bad_reserved = bytearray(good), bytearray(good), bytearray(good)
    bad_version[0], bad_flags[2], bad_reserved[19] = 9, 0x80, 1
    ack = CheckmateHeader(MessageType.ACK, JOB, 0, 0, 0, 0, 0, 0, dtype=DType.NONE).pack()
    for bad in (good[:20], good + b"\0", bytes(bad_version), bytes(bad_flags), bytes(bad_reserved), ack):
        with pytest.raises(WireFormatError):
            decode_data(memoryview(bad))
    with pytest.raises(WireFormatError):
        pack_data_header(bytearray(32), 0x80, 1, JOB, 0, 0, 0, 0, 0, 0)
    with pytest.raises(WireFormatError):
        pack_data_header(bytearray(32), 0, 1, JOB, 0, 1 << 16, 0, 0, 0, 0)
