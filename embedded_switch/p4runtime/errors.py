"""P4Runtime errors and wire values of the embedded switch's server.

:class:`Failure` is a canonical error for one update, one read or a whole request; it
reaches the client as a ``google.rpc.Status`` in the ``grpc-status-details-bin`` trailer
(:func:`set_failure`). A failed Write batch ends with UNKNOWN and one packed
``p4.v1.Error`` per update (:func:`batch_failure`), as PI does. Bytestrings are decoded
with the shared codec (:mod:`checkmate.p4.bytestrings`); a value that does not fit its
field is INVALID_ARGUMENT. No lock: everything here is pure.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, status_pb2
from p4.v1 import p4runtime_pb2

from checkmate.p4.bytestrings import BytestringError, decode_bytestring

logger = logging.getLogger(__name__)

MAX_ERROR_DETAILS_BYTES = 6000
"""Budget for a failed Write's per-update details: gRPC clients reject trailers above 8 KiB
(soft) / 16 KiB (hard) by default, and each update costs about 35 bytes even when OK."""

OK = code_pb2.OK
INVALID = code_pb2.INVALID_ARGUMENT
NOT_FOUND = code_pb2.NOT_FOUND
GRPC_CODES = {c.value[0]: c for c in grpc.StatusCode}
_M = TypeVar("_M", bound=Message)


def code_name(code: int) -> str:
    return str(code_pb2.Code.Name(code)) if code in code_pb2.Code.values() else str(code)


class Failure(Exception):
    """A canonical P4Runtime error: for one update, one read, or a whole request."""

    def __init__(self, code: int, message: str, details: Sequence[p4runtime_pb2.Error] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = tuple(details)


def decode_value(value: bytes, bitwidth: int, what: str) -> int:
    """The integer a P4Runtime bytestring encodes; INVALID_ARGUMENT unless it fits ``bitwidth``.

    Accepts the canonical form and any form padded up to the field's full byte width.
    """
    try:
        return decode_bytestring(value, bitwidth, what)
    except BytestringError as e:
        raise Failure(INVALID, str(e)) from None


def batch_failure(results: Sequence[p4runtime_pb2.Error]) -> Failure:
    """The UNKNOWN status of a failed Write: one p4.v1.Error per update, in order.

    Past MAX_ERROR_DETAILS_BYTES the details stop (a prefix, so each keeps its update's
    index) and the message names the failed updates instead; a client would otherwise
    drop the whole trailer and see no error detail at all.
    """
    failed = [i for i, r in enumerate(results) if r.canonical_code != OK]
    kept, size = 0, 0
    for r in results:
        size += r.ByteSize() + 40  # Any framing and type URL
        if size > MAX_ERROR_DETAILS_BYTES:
            break
        kept += 1
    message = f"{len(failed)} of {len(results)} updates failed"
    if kept == len(results):
        return Failure(code_pb2.UNKNOWN, message, details=results)
    # the cause first: in a rolled-back batch every other update is merely ABORTED
    failed.sort(key=lambda i: (results[i].canonical_code == code_pb2.ABORTED, i))
    shown = ", ".join(f"{i} {code_name(results[i].canonical_code)}" for i in failed[:10])
    more = ", ..." if len(failed) > 10 else ""
    message += (
        f" (updates {shown}{more}); per-update details cover updates 0..{kept - 1} only, "
        f"to keep the gRPC trailer within the clients' metadata limit"
    )
    logger.warning("Write: %s; first failure: %s", message, results[failed[0]].message)
    return Failure(code_pb2.UNKNOWN, message, details=results[:kept])


def uint128(value: p4runtime_pb2.Uint128) -> int:
    return (value.high << 64) | value.low


def set_uint128(out: p4runtime_pb2.Uint128, number: int) -> None:
    out.high = number >> 64
    out.low = number & ((1 << 64) - 1)


def parse(cls: type[_M], raw: bytes, what: str) -> _M:
    try:
        return cls.FromString(raw)
    except (DecodeError, UnicodeDecodeError) as e:
        raise Failure(INVALID, f"malformed {what}: {e}") from None


def set_failure(context: grpc.ServicerContext, failure: Failure) -> None:
    """End an RPC with ``failure``: its code, message, and a ``google.rpc.Status`` trailer."""
    status = status_pb2.Status(code=failure.code, message=failure.message)
    for detail in failure.details:
        status.details.add().Pack(detail)
    context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
    context.set_code(GRPC_CODES.get(failure.code, grpc.StatusCode.UNKNOWN))
    context.set_details(failure.message)
