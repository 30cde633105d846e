"""The wire format: round trips with real tensors, copies, and every malformed case."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkmate import wire
from checkmate.tensors import payload_tensor, tensor_payload, wire_dtype
from checkmate.wire import (
    HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    CheckmateHeader,
    DType,
    Flags,
    MessageType,
    WireFormatError,
)


def data_header(count: int, dtype: DType = DType.FP32, **overrides: object) -> CheckmateHeader:
    fields: dict[str, object] = dict(
        msg_type=MessageType.DATA,
        job_id=0xDEADBEEF,
        iteration=123456,
        bucket_id=7,
        sender_rank=3,
        element_offset=1 << 20,
        element_count=count,
        sequence=99,
        dtype=dtype,
        flags=Flags.REPLICATE | Flags.LAST,
        shard_key=513,
    )
    fields.update(overrides)
    return CheckmateHeader(**fields)  # type: ignore[arg-type]


def test_header_layout_is_big_endian_and_fixed() -> None:
    header = data_header(0, msg_type=MessageType.ACK, dtype=DType.NONE, flags=Flags.NONE)
    raw = header.pack()
    assert len(raw) == HEADER_BYTES == 32
    assert raw[0] == 1 and raw[1] == MessageType.ACK and raw[2] == 0 and raw[3] == DType.NONE
    assert raw[4:8] == bytes.fromhex("deadbeef")
    assert struct.unpack("!I", raw[8:12])[0] == 123456
    assert struct.unpack("!HHHH", raw[12:20]) == (7, 3, 513, 0)
    assert struct.unpack("!III", raw[20:32]) == (1 << 20, 0, 99)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_slice_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    bucket = torch.randn(10_000).to(dtype)
    bucket[5] = float("nan")
    bucket[6] = float("-inf")
    piece = bucket[1000 : 1000 + 1024]
    header = data_header(piece.numel(), wire_dtype(dtype))
    decoded, payload = wire.decode(wire.encode(header, tensor_payload(piece)))
    assert decoded == header
    restored = payload_tensor(payload, decoded.dtype)
    assert restored.dtype == dtype
    assert torch.equal(
        restored.view(torch.int16 if dtype != torch.float32 else torch.int32),
        piece.view(torch.int16 if dtype != torch.float32 else torch.int32),
    )


def test_encode_copies_payload_once_and_parts_copy_nothing() -> None:
    piece = torch.arange(256, dtype=torch.float32)
    header = data_header(256)
    head, view = wire.datagram_parts(header, tensor_payload(piece))
    piece[0] = 42.0  # the view still reads the tensor's memory: no copy was made
    assert struct.unpack_from("<f", view, 0)[0] == 42.0
    datagram = wire.encode(header, tensor_payload(piece))
    piece[0] = 7.0  # encode made its own (single) copy
    assert struct.unpack_from("<f", datagram, HEADER_BYTES)[0] == 42.0
    assert bytes(datagram[:HEADER_BYTES]) == head


def test_decode_returns_view_into_received_buffer() -> None:
    datagram = wire.encode(data_header(4), b"\x00" * 16)
    _, payload = wire.decode(datagram)
    datagram[HEADER_BYTES] = 0xFF
    assert payload[0] == 0xFF


def _good() -> bytearray:
    return wire.encode(data_header(4), b"\x01" * 16)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d[:31], "truncated"),
        (lambda d: d + b"\x00" * (MAX_PAYLOAD_BYTES + 1), "oversized"),
        (lambda d: b"\x02" + d[1:], "wire version 2"),
        (lambda d: d[:1] + b"\x09" + d[2:], "unknown message type 9"),
        (lambda d: d[:2] + b"\x80" + d[3:], "unknown bits"),
        (lambda d: d[:3] + b"\x07" + d[4:], "unknown dtype 7"),
        (lambda d: d[:18] + b"\x00\x01" + d[20:], "reserved"),
        (lambda d: d[:-1], "inconsistent"),
        (lambda d: d + b"\x00", "inconsistent"),
        (lambda d: d[:3] + b"\x00" + d[4:], "without an element dtype"),
        (lambda d: d[:1] + bytes([MessageType.ACK]) + d[2:32], "may not carry REPLICATE"),
    ],
)
def test_malformed_datagrams_raise_one_typed_error(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(WireFormatError, match=message):
        wire.decode(bytes(mutate(_good())))


def test_encoder_refuses_what_the_decoder_would_refuse() -> None:
    with pytest.raises(WireFormatError, match="does not fit in 16 bits"):
        data_header(0, bucket_id=1 << 16).pack()
    with pytest.raises(WireFormatError, match="announces 16"):
        wire.encode(data_header(4), b"\x00" * 15)
    count = MAX_PAYLOAD_BYTES // 4 + 1
    with pytest.raises(WireFormatError, match="exceeds"):
        wire.encode(data_header(count), b"\x00" * (count * 4))
    with pytest.raises(ValueError, match="not contiguous"):
        tensor_payload(torch.zeros(4, 4).t())
    with pytest.raises(WireFormatError, match="no wire encoding"):
        tensor_payload(torch.zeros(4, dtype=torch.int64))


headers = st.builds(
    CheckmateHeader,
    msg_type=st.sampled_from([MessageType.ACK, MessageType.NACK, MessageType.REPAIR_REQUEST]),
    job_id=st.integers(0, 2**32 - 1),
    iteration=st.integers(0, 2**32 - 1),
    bucket_id=st.integers(0, 2**16 - 1),
    sender_rank=st.integers(0, 2**16 - 1),
    element_offset=st.integers(0, 2**32 - 1),
    element_count=st.integers(0, 2**32 - 1),
    sequence=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from(list(DType)),
    flags=st.sampled_from([Flags.NONE, Flags.RETRANSMIT, Flags.LAST]),
    shard_key=st.integers(0, 2**16 - 1),
)


@given(headers, st.binary(max_size=64))
def test_control_headers_round_trip(header: CheckmateHeader, payload: bytes) -> None:
    decoded, body = wire.decode(header.pack() + payload)
    assert decoded == header
    assert bytes(body) == payload


@settings(max_examples=2000)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_as_other_errors(data: bytes) -> None:
    try:
        wire.decode(data)
    except WireFormatError:
        pass


@settings(max_examples=2000)
@given(
    st.lists(st.tuples(st.integers(0, 47), st.integers(0, 255)), min_size=1, max_size=6), st.integers(-20, 20)
)
def test_mutated_datagrams_decode_consistently_or_raise(edits: list[tuple[int, int]], resize: int) -> None:
    datagram = bytearray(_good())
    for index, value in edits:
        datagram[index] = value
    if resize < 0:
        datagram = datagram[:resize]
    else:
        datagram += bytes(resize)
    try:
        header, payload = wire.decode(bytes(datagram))
    except WireFormatError:
        return
    # Whatever decodes is self-consistent and re-encodes to the same bytes.
    assert len(payload) == header.payload_bytes or header.msg_type not in (
        MessageType.DATA,
        MessageType.REPAIR_DATA,
    )
    assert header.pack() == bytes(datagram[:HEADER_BYTES])


def test_a_read_only_payload_gives_no_warning_even_with_warnings_as_errors() -> None:
    """torch warns once per process about tensors over read-only buffers; payload_tensor's are read
    only, so a healthy run shows no such warning (checkmate.tensors spends it at import)."""
    import subprocess
    import sys

    code = (
        "from checkmate.tensors import payload_tensor\n"
        "from checkmate.wire import DType\n"
        "for d in (DType.FP32, DType.BF16, DType.FP16):\n"
        "    assert payload_tensor(bytes(8), d).numel() > 0\n"
        "    assert payload_tensor(memoryview(bytes(8)), d).numel() > 0\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
