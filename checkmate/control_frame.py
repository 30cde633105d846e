"""The control channel's framing, without torch: what a frame looks like on the TCP stream.

A frame is ``magic "CMC1" | json_len: u32 BE | blob_len: u64 BE | JSON (UTF-8) | blob``
(docs/protocol.md, "Control channel"). :mod:`checkmate.control` builds its messages
on this; tools that only exchange JSON with a shadow (``checkmate-ctl job show``)
use it directly and so do not import torch.
"""

from __future__ import annotations

import struct
from typing import Final

MAGIC: Final = b"CMC1"
PREFIX: Final = struct.Struct("!4sIQ")
"""Magic, JSON length, blob length."""
MAX_JSON_BYTES: Final = 64 << 20
MAX_BLOB_BYTES: Final = 1 << 40
DEFAULT_CONTROL_PORT: Final = 48880
"""TCP port a shadow listens on for its control channel, unless the job says otherwise."""


class ControlProtocolError(ValueError):
    """A control-channel frame or message that does not follow docs/protocol.md."""


def frame_prefix(json_len: int, blob_len: int) -> bytes:
    """The 16 bytes in front of a frame's JSON."""
    return PREFIX.pack(MAGIC, json_len, blob_len)


def parse_prefix(prefix: bytes | bytearray) -> tuple[int, int]:
    """``(json_len, blob_len)`` of a frame; ControlProtocolError for a wrong magic or a frame too large."""
    magic, json_len, blob_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ControlProtocolError(f"bad frame magic {magic!r}, expected {MAGIC!r}")
    if json_len > MAX_JSON_BYTES or blob_len > MAX_BLOB_BYTES:
        raise ControlProtocolError(f"frame too large: json {json_len} bytes, blob {blob_len} bytes")
    return json_len, blob_len
