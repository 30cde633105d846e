"""The P4Runtime bytestring codec (P4Runtime spec, section "Bytestrings").

A value travels big-endian. The canonical form is the shortest (zero is one zero byte);
a receiver also accepts any form padded up to the field's full byte width.
"""

from __future__ import annotations


class BytestringError(ValueError):
    """A value that does not fit its field; the message names the field and the widths."""


def encode_bytestring(number: int, bitwidth: int | None = None) -> bytes:
    """The canonical (shortest) bytestring of ``number``; BytestringError if it does not fit ``bitwidth``."""
    if number < 0 or (bitwidth is not None and number >> bitwidth):
        raise BytestringError(f"value {number} does not fit in {bitwidth} bits")
    return number.to_bytes(max(1, (number.bit_length() + 7) // 8), "big")


def decode_bytestring(value: bytes, bitwidth: int, what: str) -> int:
    """The integer ``value`` encodes; BytestringError (naming ``what``) unless it fits ``bitwidth``."""
    if not value:
        raise BytestringError(f"{what}: empty bytestring (a value needs at least one byte)")
    number = int.from_bytes(value, "big")
    full_width = (bitwidth + 7) // 8
    if len(value) > full_width or number >> bitwidth:
        raise BytestringError(
            f"{what}: value 0x{value.hex()} ({len(value)} bytes, {number.bit_length()} significant bits) "
            f"does not fit the field's {bitwidth} bits"
        )
    return number
