"""The control channel's messages: what a job's rank 0 tells its shadows, besides the gradients.

Shared by the host agent (``hosts.control_channel``, the sender) and the
shadow (the receiver), like :mod:`checkmate.wire` is for the data path; the
format is specified in docs/protocol.md ("Control channel").

A TCP connection opens with the shadow's hello (its nonce and name) and then carries
frames authenticated with that connection's keys (:mod:`checkmate.control_frame`)::

    magic "CMC3" | json_len | blob_len | job | run | seq | head tag | JSON (UTF-8) | blob | tag

The JSON object has a ``"type"`` (``job_start``, ``bucket_layout``,
``commit``, ``certified``, ``goodbye``; and on a shadow's same TCP port,
``status_request``/``status``, ``restore_request``/``restore_refused``, a
restore being answered with a ``job_start``) and the message's fields. Tensors
travel in the blob as raw little-endian memory images; the JSON lists each as
``{"key", "dtype", "shape", "offset", "nbytes"}`` with its offset in the blob.
Every read and write takes a timeout; a malformed frame raises
:class:`ControlProtocolError`.

Importable without torch: the messages, their JSON, and :func:`query_status` (the one
client that asks a shadow for its status, used by ``checkmate-ctl job show``,
``checkmate-shadow status`` and the restore client) need none. Only a message that
carries tensors (``job_start``, a ``commit`` with a job state) imports torch, when it
is encoded or decoded.

This module is the public face of the control channel: import the messages, their
encoding and the status client from here (``from checkmate.control import Commit``).
They live in :mod:`checkmate.control_messages` (the dataclasses),
:mod:`checkmate.control_codec` (messages to and from frames, tensors in the blob) and
:mod:`checkmate.control_frame` (the framing and its authentication); this module adds
the socket calls and :func:`query_status`.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from checkmate.auth import AuthConfigError
from checkmate.control_codec import (
    attach_job_state,
    decode_message,
    dtype_name,
    encode_message,
    job_state_of,
    torch_dtype,
)
from checkmate.control_frame import (
    DEFAULT_CONTROL_PORT,
    MAGIC,
    MAX_BLOB_BYTES,
    MAX_JSON_BYTES,
    ControlAuth,
    ControlProtocolError,
    FrameAuthError,
    bind,
    recv_frame,
    send_frame,
)
from checkmate.control_messages import (
    MAX_DATA_POSITION_BYTES,
    BucketLayout,
    BucketSpec,
    Certified,
    Commit,
    Diverged,
    Goodbye,
    JobStart,
    Message,
    ParamSlice,
    ParamSpec,
    RestoreRefused,
    RestoreRequest,
    StatusReport,
    StatusRequest,
    validate_data_position,
)
from checkmate.network import Addr

__all__ = [
    "DEFAULT_CONTROL_PORT",
    "MAGIC",
    "MAX_BLOB_BYTES",
    "MAX_DATA_POSITION_BYTES",
    "MAX_JSON_BYTES",
    "MAX_STATUS_BYTES",
    "BucketLayout",
    "BucketSpec",
    "Certified",
    "Commit",
    "ControlProtocolError",
    "Diverged",
    "Goodbye",
    "JobStart",
    "Message",
    "ParamSlice",
    "ParamSpec",
    "RestoreRefused",
    "RestoreRequest",
    "ShadowStatusError",
    "StatusReport",
    "StatusRequest",
    "attach_job_state",
    "decode_message",
    "dtype_name",
    "encode_message",
    "job_state_of",
    "query_status",
    "recv_message",
    "send_message",
    "torch_dtype",
    "validate_data_position",
]

MAX_STATUS_BYTES = 16 << 20
"""A status document is a few KiB; a reply announcing more is not a shadow's."""


# ---- sockets ----------------------------------------------------------------------------
def send_message(sock: socket.socket, message: Message, timeout: float) -> None:
    """Write one authenticated frame; OSError (TimeoutError included) if it cannot within ``timeout``."""
    parts = encode_message(message)
    send_frame(sock, parts[1:], int(getattr(message, "job_id", 0)), timeout)


def recv_message(sock: socket.socket, timeout: float) -> Message:
    """Read one frame (each socket read waits at most ``timeout`` seconds); FrameAuthError if forged."""
    text, blob = recv_frame(sock, timeout)
    return decode_message(text, blob)


# ---- asking a shadow for its status -----------------------------------------------------
class ShadowStatusError(ConnectionError):
    """One shadow could not be asked or gave no usable answer; the message says why."""


def _left(deadline: float, timeout: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no answer within {timeout:g} s")
    return left


def query_status(
    address: Addr, timeout: float, job_id: int = 0, auth: ControlAuth | None = None, name: str | None = None
) -> dict[str, Any]:
    """One shadow's status document (docs/shadow.md); raises :class:`ShadowStatusError` naming the cause.

    The whole exchange (connect, request, reply) takes at most ``timeout`` seconds, and is
    authenticated with ``auth`` (the job's secret; None: this process's). ``name``: the
    shadow meant; a node that names itself otherwise in its hello is refused (nothing is
    sent to it), so a redirected connection cannot answer for another shadow.
    """
    deadline = time.monotonic() + timeout
    request = encode_message(StatusRequest(job_id))[1:]
    try:
        with socket.create_connection(address, timeout=timeout) as conn:
            session = bind(conn, auth, job_id, name=name)
            try:
                session.send(conn, request, job_id, _left(deadline, timeout))
            except FrameAuthError as exc:  # the hello named another node
                raise ShadowStatusError(f"refused: {exc}") from None
            try:
                text, blob = session.recv(conn, _left(deadline, timeout), MAX_STATUS_BYTES)
                reply = decode_message(text, blob)
            except FrameAuthError as exc:
                raise ShadowStatusError(
                    f"bad reply: {exc} (does the shadow have this job's secret?)"
                ) from None
            except ControlProtocolError as exc:
                raise ShadowStatusError(f"bad reply: {exc}") from None
    except ShadowStatusError:
        raise
    except TimeoutError:
        raise ShadowStatusError(f"no answer within {timeout:g} s") from None
    except ConnectionRefusedError:
        raise ShadowStatusError("connection refused (no shadow listening)") from None
    except ConnectionError as exc:
        raise ShadowStatusError(
            f"bad reply: {exc} (a shadow closes a connection it cannot authenticate: does it have "
            "this job's secret?)"
        ) from None
    except AuthConfigError as exc:
        raise ShadowStatusError(str(exc)) from None
    except OSError as exc:
        raise ShadowStatusError(exc.strerror or str(exc)) from None
    if not isinstance(reply, StatusReport):
        raise ShadowStatusError(f"bad reply: {reply.TYPE!r} to a status request")
    if not isinstance(reply.status, dict):
        raise ShadowStatusError("bad reply: the status is not a JSON object")
    return reply.status
