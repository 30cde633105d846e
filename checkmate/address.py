"""``HOST:PORT`` text, read and written one way everywhere (IPv4, names and ``[IPv6]:PORT``).

Every command-line flag, job file and network description that names a socket
address goes through :func:`parse_host_port`, which refuses what it cannot mean
(no port, a port outside the TCP/UDP range, no host, an unbracketed IPv6 address
with a port) with a message that quotes the text. :func:`format_host_port` writes
an address back so that :func:`parse_host_port` reads it again (brackets around IPv6).
"""

from __future__ import annotations

import ipaddress

MAX_PORT = 65535


class AddressError(ValueError):
    """Text that is not a ``HOST:PORT`` address; the message quotes it and says what is wrong."""


def _port(text: str, port: str, allow_zero: bool) -> int:
    if not port.isascii() or not port.isdigit():
        raise AddressError(f"{text!r}: port {port!r} is not a number")
    number = int(port)
    low = 0 if allow_zero else 1
    if not low <= number <= MAX_PORT:
        raise AddressError(f"{text!r}: port {number} is outside {low}..{MAX_PORT}")
    return number


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host.partition("%")[0])
    except ValueError:
        return False
    return True


def parse_host_port(
    text: str,
    default_port: int | None = None,
    *,
    default_host: str | None = None,
    allow_zero: bool = False,
) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` (or ``HOST`` / ``[IPv6]`` / a bare IPv6 address when
    ``default_port`` is given) as ``(host, port)``, the host without brackets.

    ``default_host`` stands for an empty host (``:5000``); without it an empty host is an
    error. ``allow_zero`` admits port 0 (a listening socket's "any free port").
    Raises :class:`AddressError` for anything else.
    """
    if not isinstance(text, str):
        raise AddressError(f"{text!r} is not HOST:PORT text")
    stripped = text.strip()
    if not stripped:
        raise AddressError("empty address: expected HOST:PORT")
    port_text: str | None
    if stripped.startswith("["):  # [IPv6]:PORT or [IPv6]
        host, close, rest = stripped[1:].partition("]")
        if not close:
            raise AddressError(f"{text!r}: '[' without ']' (write an IPv6 address as [ADDR]:PORT)")
        if not _is_ipv6(host):
            raise AddressError(f"{text!r}: {host!r} in brackets is not an IPv6 address")
        if rest and not rest.startswith(":"):
            raise AddressError(f"{text!r}: expected ':PORT' after ']'")
        port_text = rest[1:] if rest else None
    elif stripped.count(":") > 1:  # a bare IPv6 address: no port can follow it unambiguously
        if not _is_ipv6(stripped):
            raise AddressError(f"{text!r} is not HOST:PORT (write an IPv6 address as [ADDR]:PORT)")
        host, port_text = stripped, None
    else:
        host, sep, port_text_found = stripped.partition(":")
        port_text = port_text_found if sep else None
        if sep and not port_text:
            raise AddressError(f"{text!r}: missing port after ':' (expected HOST:PORT)")
    if not host:
        if default_host is None:
            raise AddressError(f"{text!r}: empty host (expected HOST:PORT)")
        host = default_host
    if any(c.isspace() for c in host):
        raise AddressError(f"{text!r}: the host contains white space")
    if port_text is None:
        if default_port is None:
            raise AddressError(f"{text!r}: missing port (expected HOST:PORT)")
        return host, default_port
    return host, _port(text, port_text, allow_zero)


def format_host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets (``[::1]:5000``): what :func:`parse_host_port` reads."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
