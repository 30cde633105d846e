"""The Checkmate wire format: a 32-byte header in front of a slice of a tensor.

Frames are Ethernet / IPv4 / UDP (port ``CHECKMATE_UDP_PORT``) / Checkmate
header / payload. The header is fixed-size, 4-byte aligned and big-endian
(network order); the payload is the raw element bytes in little-endian order,
exactly as they lie in a CPU tensor's memory. docs/protocol.md is the
specification; p4src/shared/headers.p4 declares the same layout for the switch.

This module is the only implementation of the format. It never copies a
payload more than once: :func:`encode` makes one contiguous datagram with a
single copy, :func:`datagram_parts` hands header and payload to
``socket.sendmsg`` with no copy at all, and :func:`decode` returns a
memoryview into the received buffer. Every malformed datagram raises
:class:`WireFormatError` and nothing else, so a receive loop needs one
``except``.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, replace
from typing import Final

CHECKMATE_UDP_PORT: Final = 48879
"""UDP port of all Checkmate traffic (0xBEEF), source and destination."""

WIRE_VERSION: Final = 1
HEADER_BYTES: Final = 32
UDP_HEADER_BYTES: Final = 8
IPV4_HEADER_BYTES: Final = 20
JUMBO_MTU: Final = 9000
MAX_PAYLOAD_BYTES: Final = JUMBO_MTU - IPV4_HEADER_BYTES - UDP_HEADER_BYTES - HEADER_BYTES
"""Largest payload a datagram may carry: one jumbo frame, never an IP fragment."""

_HEADER = struct.Struct("!BBBBIIHHHHIII")
assert _HEADER.size == HEADER_BYTES
_FLAGS_OFFSET: Final = 2
_SEQUENCE_OFFSET: Final = 28
_SEQUENCE = struct.Struct("!I")

Buffer = bytes | bytearray | memoryview


class MessageType(enum.IntEnum):
    """What a datagram is for (header byte 1)."""

    DATA = 1
    """Elements of a gradient bucket; the only type the switch may copy."""
    ACK = 2
    """Receiver -> sender: ``sequence`` is the cumulative ack; payload carries SACK ranges."""
    NACK = 3
    """Receiver -> sender: the ranges in the payload are missing, resend them now."""
    REPAIR_REQUEST = 4
    """Shadow -> worker: resend ``element_count`` elements at ``element_offset``."""
    REPAIR_DATA = 5
    """Worker -> shadow: the answer to a repair request (never copied)."""


class Flags(enum.IntFlag):
    """Header byte 2. Bits not named here must be zero."""

    NONE = 0
    REPLICATE = 0x01
    """Copy this packet to the job's shadow for ``shard_key`` (fully reduced data only)."""
    RETRANSMIT = 0x02
    """A retransmission; a tagged packet stays tagged when resent."""
    LAST = 0x04
    """Last datagram of this sender's chunk of the bucket for this iteration."""


KNOWN_FLAGS: Final = int(Flags.REPLICATE | Flags.RETRANSMIT | Flags.LAST)


class DType(enum.IntEnum):
    """Element type of the payload (header byte 3)."""

    NONE = 0
    """No elements: ACK, NACK and REPAIR_REQUEST datagrams."""
    FP32 = 1
    BF16 = 2
    FP16 = 3

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE: Final = {DType.NONE: 0, DType.FP32: 4, DType.BF16: 2, DType.FP16: 2}
# Lookups by wire value for the receive path (an Enum call costs a microsecond per field).
_MESSAGE_TYPES: Final = {int(m): m for m in MessageType}
_DTYPES: Final = {int(d): d for d in DType}
_FLAG_VALUES: Final = {v: Flags(v) for v in range(KNOWN_FLAGS + 1) if not v & ~KNOWN_FLAGS}


class WireFormatError(ValueError):
    """A datagram that is not a valid Checkmate message; the message says why."""


@dataclass(frozen=True, slots=True)
class CheckmateHeader:
    """The 32-byte Checkmate header, field for field (docs/protocol.md)."""

    msg_type: MessageType
    job_id: int
    iteration: int
    bucket_id: int
    sender_rank: int
    element_offset: int
    element_count: int
    sequence: int
    dtype: DType = DType.FP32
    flags: Flags = Flags.NONE
    shard_key: int = 0
    version: int = WIRE_VERSION

    @property
    def payload_bytes(self) -> int:
        """Bytes of payload this header announces (0 for element-less types)."""
        if self.msg_type in _ELEMENT_TYPES:
            return self.element_count * DType(self.dtype).itemsize
        return 0

    @property
    def replicate(self) -> bool:
        return bool(self.flags & Flags.REPLICATE)

    def with_flags(self, flags: Flags) -> CheckmateHeader:
        return replace(self, flags=flags)

    def fields(self) -> tuple[int, ...]:
        """The 13 header fields as ints in wire order (what :func:`decode_data` returns)."""
        return (
            self.version,
            int(self.msg_type),
            int(self.flags),
            int(self.dtype),
            self.job_id,
            self.iteration,
            self.bucket_id,
            self.sender_rank,
            self.shard_key,
            0,
            self.element_offset,
            self.element_count,
            self.sequence,
        )

    def pack(self) -> bytes:
        """The header's 32 bytes. Raises WireFormatError if a field does not fit."""
        buf = bytearray(HEADER_BYTES)
        pack_header_into(buf, 0, self)
        return bytes(buf)


_ELEMENT_TYPES: Final = frozenset({MessageType.DATA, MessageType.REPAIR_DATA})

_FIELD_LIMITS: Final = (
    ("job_id", 32),
    ("iteration", 32),
    ("bucket_id", 16),
    ("sender_rank", 16),
    ("shard_key", 16),
    ("element_offset", 32),
    ("element_count", 32),
    ("sequence", 32),
)


def pack_header_into(buffer: bytearray | memoryview, offset: int, header: CheckmateHeader) -> None:
    """Write ``header`` into ``buffer`` at ``offset`` (no allocation)."""
    flags = int(header.flags)
    if flags & ~KNOWN_FLAGS:
        raise WireFormatError(f"flags 0x{flags:02x} has unknown bits")
    try:
        _HEADER.pack_into(buffer, offset, *header.fields())
    except struct.error:
        # struct rejects any field out of its range; name the field (the slow path, errors only)
        for name, bits in _FIELD_LIMITS:
            value = getattr(header, name)
            if not 0 <= value < (1 << bits):
                raise WireFormatError(f"{name}={value} does not fit in {bits} bits") from None
        raise WireFormatError(f"header field out of range: {header}") from None


def set_sequence(header_bytes: bytearray, sequence: int) -> None:
    """Overwrite the sequence field of packed header bytes (the transport numbers datagrams)."""
    if not 0 <= sequence <= 0xFFFFFFFF:
        raise WireFormatError(f"sequence={sequence} does not fit in 32 bits")
    _SEQUENCE.pack_into(header_bytes, _SEQUENCE_OFFSET, sequence)


def add_flags(header_bytes: bytearray, flags: Flags) -> None:
    """Set ``flags`` in packed header bytes (RETRANSMIT on a resend)."""
    header_bytes[_FLAGS_OFFSET] |= int(flags)


def _check_payload(header: CheckmateHeader, payload: Buffer) -> memoryview:
    view = memoryview(payload).cast("B")
    if len(view) != header.payload_bytes:
        raise WireFormatError(
            f"payload is {len(view)} bytes but the header announces {header.payload_bytes} "
            f"({header.element_count} x {DType(header.dtype).name})"
        )
    if len(view) > MAX_PAYLOAD_BYTES:
        raise WireFormatError(f"payload of {len(view)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    return view


def encode(header: CheckmateHeader, payload: Buffer = b"") -> bytearray:
    """One datagram (header + payload) with exactly one copy of the payload."""
    view = _check_payload(header, payload)
    datagram = bytearray(HEADER_BYTES + len(view))
    pack_header_into(datagram, 0, header)
    datagram[HEADER_BYTES:] = view
    return datagram


def datagram_parts(header: CheckmateHeader, payload: Buffer = b"") -> tuple[bytes, memoryview]:
    """Header bytes and a view of the payload, for ``socket.sendmsg`` (zero copies)."""
    view = _check_payload(header, payload)
    return header.pack(), view


def decode(datagram: Buffer) -> tuple[CheckmateHeader, memoryview]:
    """Parse one UDP payload into its header and a view of its element bytes.

    Raises WireFormatError for a truncated, oversized, wrong-version or
    inconsistent datagram; never anything else.
    """
    view = memoryview(datagram)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    if len(view) < HEADER_BYTES:
        raise WireFormatError(f"truncated: {len(view)} bytes, the header alone is {HEADER_BYTES}")
    if len(view) > HEADER_BYTES + MAX_PAYLOAD_BYTES:
        raise WireFormatError(f"oversized: {len(view)} bytes, at most {HEADER_BYTES + MAX_PAYLOAD_BYTES}")
    (
        version,
        msg_type,
        flags,
        dtype,
        job_id,
        iteration,
        bucket_id,
        sender_rank,
        shard_key,
        reserved,
        element_offset,
        element_count,
        sequence,
    ) = _HEADER.unpack_from(view, 0)
    if version != WIRE_VERSION:
        raise WireFormatError(f"wire version {version}, this build speaks {WIRE_VERSION}")
    kind = _MESSAGE_TYPES.get(msg_type)
    if kind is None:
        raise WireFormatError(f"unknown message type {msg_type}")
    element_type = _DTYPES.get(dtype)
    if element_type is None:
        raise WireFormatError(f"unknown dtype {dtype}")
    header_flags = _FLAG_VALUES.get(flags)
    if header_flags is None:
        raise WireFormatError(f"flags 0x{flags:02x} has unknown bits")
    if reserved != 0:
        raise WireFormatError(f"reserved field is 0x{reserved:04x}, must be 0")
    header = CheckmateHeader(
        msg_type=kind,
        job_id=job_id,
        iteration=iteration,
        bucket_id=bucket_id,
        sender_rank=sender_rank,
        element_offset=element_offset,
        element_count=element_count,
        sequence=sequence,
        dtype=element_type,
        flags=header_flags,
        shard_key=shard_key,
        version=version,
    )
    payload = view[HEADER_BYTES:]
    if kind in _ELEMENT_TYPES:
        if element_type is DType.NONE:
            raise WireFormatError(f"{kind.name} datagram without an element dtype")
        needed = element_count * _ITEMSIZE[element_type]
        if len(payload) != needed:
            raise WireFormatError(
                f"inconsistent: {element_count} x {element_type.name} needs {needed} "
                f"payload bytes, datagram has {len(payload)}"
            )
    elif flags & Flags.REPLICATE:
        raise WireFormatError(f"{kind.name} datagram may not carry REPLICATE")
    return header, payload


# ---- per-datagram hot paths: the same format as ints, no CheckmateHeader ----------------------
# A transport forwarding thousands of datagrams per all-reduce spends most of its time
# building and taking apart header objects (a frozen dataclass and its enums: ~6 us each);
# these two functions read and write the same 32 bytes as plain integers. Field order is the
# wire's: (version, msg_type, flags, dtype, job_id, iteration, bucket_id, sender_rank,
# shard_key, reserved, element_offset, element_count, sequence).
_DATA: Final = int(MessageType.DATA)
_ITEMSIZE_BY_VALUE: Final = {int(d): size for d, size in _ITEMSIZE.items() if size}


def decode_data(datagram: memoryview) -> tuple[tuple[int, ...], memoryview]:
    """:func:`decode` for a DATA datagram, as the 13 header fields (ints, wire order) and the payload.

    Checks exactly what :func:`decode` checks and raises the same WireFormatError; a
    well-formed datagram of another type raises WireFormatError too (use :func:`decode`).
    """
    n = len(datagram)
    if HEADER_BYTES <= n <= HEADER_BYTES + MAX_PAYLOAD_BYTES:
        fields = _HEADER.unpack_from(datagram, 0)
        size = _ITEMSIZE_BY_VALUE.get(fields[3], 0)
        if (
            fields[0] == WIRE_VERSION
            and fields[1] == _DATA
            and size
            and not fields[2] & ~KNOWN_FLAGS
            and fields[9] == 0
            and n - HEADER_BYTES == fields[11] * size
        ):
            return fields, datagram[HEADER_BYTES:]
    header, _ = decode(datagram)  # raises the precise error
    raise WireFormatError(f"a {header.msg_type.name} datagram, not DATA")


def pack_data_header(
    buffer: bytearray,
    flags: int,
    dtype: int,
    job_id: int,
    iteration: int,
    bucket_id: int,
    sender_rank: int,
    shard_key: int,
    element_offset: int,
    element_count: int,
    sequence: int = 0,
) -> None:
    """Write a DATA header into the first 32 bytes of ``buffer`` (what ``CheckmateHeader.pack`` writes)."""
    if flags & ~KNOWN_FLAGS or dtype not in _ITEMSIZE_BY_VALUE:
        raise WireFormatError(f"flags 0x{flags:02x} or dtype {dtype} is not valid for DATA")
    try:
        _HEADER.pack_into(
            buffer,
            0,
            WIRE_VERSION,
            _DATA,
            flags,
            dtype,
            job_id,
            iteration,
            bucket_id,
            sender_rank,
            shard_key,
            0,
            element_offset,
            element_count,
            sequence,
        )
    except struct.error as exc:
        raise WireFormatError(f"DATA header field out of range: {exc}") from None
