"""Who may hold a connection to a control server before proving the job's secret, and for how long.

A client that has not yet sent an authenticated frame is *pending*. Pending
connections are bounded per source address and in total; when either bound is
reached the oldest pending connection (of that source, or of all) is closed to
make room, so a flood of idle or half-open connections cannot keep an honest
client out (it proves the key in its first round trip, a flooder never does).
Connections that authenticated are bounded separately (``max_connections`` in
all) and never evicted. A pending connection is also closed when it has not
authenticated within ``auth_timeout`` (the server checks :meth:`Admission.expired`).

Every refusal is counted (``count(cause)``, the caller's counters: status and
metrics) and logged as one line naming its cause; under a flood the log says
it at most once per cause every :data:`LOG_INTERVAL_S` with how many were
refused meanwhile (the counters have each one).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

logger = logging.getLogger(__name__)

LOG_INTERVAL_S: Final = 10.0


@dataclass(frozen=True)
class ControlLimits:
    """Bounds on a control server's connections (see the module docstring)."""

    auth_timeout: float = 5.0
    """Seconds a client has, from accept, to send its first authenticated frame."""
    max_pending_per_source: int = 8
    max_pending: int = 64
    max_connections: int = 256
    """Authenticated connections at once (honest peers: rank 0 and a few status or restore clients)."""


class RefusalLog:
    """One log line per refusal cause and interval, with the number refused since the last line."""

    def __init__(self, who: str, interval: float = LOG_INTERVAL_S) -> None:
        self.who = who
        self.interval = interval
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}
        self._lock = threading.Lock()

    def refused(self, cause: str, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            quiet = now - self._last.get(cause, -self.interval) < self.interval
            if quiet:
                self._since[cause] = self._since.get(cause, 0) + 1
                more = 0
            else:
                self._last[cause] = now
                more = self._since.pop(cause, 0)
        if quiet:
            logger.debug("%s: refused (%s): %s", self.who, cause, detail)
        else:
            logger.warning(
                "%s: refused (%s): %s%s",
                self.who,
                cause,
                detail,
                f" ({more} more refused for this cause since the last such line)" if more else "",
            )


@dataclass
class Ticket:
    """One admitted connection."""

    sock: socket.socket
    source: str
    accepted: float
    authenticated: bool = False
    evicted: str | None = None
    """Why the server closed it to make room (the handler logs nothing more), or None."""


class Admission:
    """Admits, evicts and releases one server's connections (thread-safe)."""

    def __init__(
        self, who: str, limits: ControlLimits, count: Callable[[str], object], log: RefusalLog | None = None
    ) -> None:
        self.who = who
        self.limits = limits
        self._count = count
        self.log = log or RefusalLog(who)
        self._pending: OrderedDict[int, Ticket] = OrderedDict()  # oldest first
        self._authenticated = 0
        self._lock = threading.Lock()

    def refuse(self, cause: str, detail: str) -> None:
        """Count and log one refusal (also for causes the server finds itself)."""
        self._count(cause)
        self.log.refused(cause, detail)

    def admit(self, sock: socket.socket, source: str) -> Ticket | None:
        """A ticket for a just-accepted ``sock``, or None (``sock`` closed, counted, logged)."""
        evict: list[tuple[Ticket, str, str]] = []
        with self._lock:
            full = self._authenticated >= self.limits.max_connections
            if not full:
                same = [t for t in self._pending.values() if t.source == source]
                if len(same) >= self.limits.max_pending_per_source:
                    evict.append(
                        (
                            same[0],
                            "control_source_cap",
                            f"{len(same)} unauthenticated connections from {source} (at most "
                            f"{self.limits.max_pending_per_source}): closed the oldest",
                        )
                    )
                elif len(self._pending) >= self.limits.max_pending:
                    oldest = next(iter(self._pending.values()))
                    evict.append(
                        (
                            oldest,
                            "control_pending_cap",
                            f"{len(self._pending)} unauthenticated connections (at most "
                            f"{self.limits.max_pending}): closed the oldest, from {oldest.source}",
                        )
                    )
                for ticket, cause, _ in evict:
                    self._pending.pop(id(ticket), None)
                    ticket.evicted = cause
                admitted = Ticket(sock, source, time.monotonic())
                self._pending[id(admitted)] = admitted
        if full:
            self.refuse(
                "control_connection_cap",
                f"connection from {source}: {self.limits.max_connections} authenticated connections open",
            )
            sock.close()
            return None
        for ticket, cause, detail in evict:
            self.refuse(cause, detail)
            try:
                ticket.sock.shutdown(socket.SHUT_RDWR)  # its handler sees the end and closes it
            except OSError:
                pass
        return admitted

    def expired(self, ticket: Ticket, now: float | None = None) -> bool:
        """A pending ticket past its authentication deadline."""
        moment = time.monotonic() if now is None else now
        return not ticket.authenticated and moment - ticket.accepted > self.limits.auth_timeout

    def authenticated(self, ticket: Ticket) -> None:
        """The connection sent an authenticated frame: no longer pending, never evicted."""
        with self._lock:
            if ticket.authenticated or ticket.evicted is not None:
                return
            self._pending.pop(id(ticket), None)
            ticket.authenticated = True
            self._authenticated += 1

    def release(self, ticket: Ticket) -> None:
        """The connection is closed."""
        with self._lock:
            if ticket.authenticated:
                ticket.authenticated = False
                self._authenticated -= 1
            else:
                self._pending.pop(id(ticket), None)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"pending": len(self._pending), "authenticated": self._authenticated}
