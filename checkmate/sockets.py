"""Socket buffer sizing and binding shared by every Checkmate socket (workers' transport, shadows).

Linux caps ``SO_RCVBUF``/``SO_SNDBUF`` at ``net.core.rmem_max``/``wmem_max`` (4 MiB on
many machines, doubled by the kernel to 8 MiB), which holds only about 500 jumbo
datagrams: one 8 MB gradient bucket does not fit. A process with ``CAP_NET_ADMIN``
(root, also inside a network namespace it created) may exceed the cap with
``SO_RCVBUFFORCE``/``SO_SNDBUFFORCE``, which Python's :mod:`socket` does not name;
:func:`grow_buffer` uses them where it can and falls back to the capped option.
"""

from __future__ import annotations

import array
import fcntl
import logging
import os
import socket
import termios

from checkmate.address import format_host_port

logger = logging.getLogger(__name__)

SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
"""Linux's option numbers (asm-generic/socket.h); Python's socket module does not define them."""
_FORCE = {socket.SO_RCVBUF: SO_RCVBUFFORCE, socket.SO_SNDBUF: SO_SNDBUFFORCE}


def grow_buffer(sock: socket.socket, option: int, size: int) -> int:
    """Set ``option`` (``SO_RCVBUF`` or ``SO_SNDBUF``) to ``size`` bytes, past the sysctl cap as root.

    Returns the size the kernel reports afterwards (twice what it granted, by Linux's
    convention). Never raises for a refused size: the socket keeps what it could get.
    """
    force = _FORCE.get(option)
    if force is None:
        raise ValueError(f"socket option {option} is neither SO_RCVBUF nor SO_SNDBUF")
    granted = False
    if os.geteuid() == 0:
        try:
            sock.setsockopt(socket.SOL_SOCKET, force, size)
            granted = True
        except OSError as exc:  # no CAP_NET_ADMIN here (e.g. an unprivileged container)
            logger.debug("SO_*BUFFORCE refused (%s); using the capped option", exc)
    if not granted:
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, size)
        except OSError as exc:
            logger.debug("cannot set socket buffer option %d to %d: %s", option, size, exc)
    return int(sock.getsockopt(socket.SOL_SOCKET, option))


def receive_queued(sock: socket.socket) -> bool:
    """Whether datagrams wait unread in ``sock``'s receive queue (Linux ``FIONREAD``/``SIOCINQ``).

    A receiver that is behind holds what it has not read yet: a gap in what it has read
    may still be in the queue (a reason to wait before asking for it again). False if the
    queue cannot be read.
    """
    queued = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, queued, True)
    except OSError:
        return False
    return queued[0] > 0


class BindError(OSError):
    """A socket that cannot take its address; the message names who binds, the address and why.

    Keeps the ``errno`` of the refusal (``EADDRINUSE``, ``EADDRNOTAVAIL``, ``EACCES``...).
    """


def _bind_error(exc: OSError, role: str, address: tuple[str, int], kind: str) -> BindError:
    where = format_host_port(str(address[0]), int(address[1]))
    return BindError(exc.errno, f"{role} cannot bind {kind} {where}: {exc.strerror or exc}")


def bind(sock: socket.socket, address: tuple[str, int], role: str) -> None:
    """``sock.bind(address)``; a refusal raises :class:`BindError` naming ``role`` and ``HOST:PORT``.

    ``role`` says whose socket it is (e.g. "shadow sh1's data socket").
    """
    try:
        sock.bind(address)
    except OSError as exc:
        kind = "UDP" if sock.type == socket.SOCK_DGRAM else "TCP"
        raise _bind_error(exc, role, address, kind) from None


def create_server(address: tuple[str, int], role: str, *, reuse_port: bool = False) -> socket.socket:
    """:func:`socket.create_server` (TCP, listening); a refusal raises :class:`BindError` as :func:`bind`."""
    try:
        return socket.create_server(address, reuse_port=reuse_port)
    except OSError as exc:
        raise _bind_error(exc, role, address, "TCP") from None
