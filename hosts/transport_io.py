"""Socket writes of :class:`hosts.transport.Transport`: MACs, injected faults, batches, UDP GSO.

:class:`TransportIO` is the bottom layer of the transport: it declares the state every layer
shares (set in :meth:`hosts.transport.Transport.__init__`), keeps the counters behind
``stats()``, and owns every ``sendmsg`` on the socket. Any thread writes through it.

* :meth:`TransportIO._emit` seals control datagrams with the job's MAC and applies injected
  faults (drop, hold, duplicate); the one held datagram is under ``_lock``.
* DATA datagrams wait in ``_outgoing`` (under ``_out_lock``) in sequence order; inside
  :meth:`TransportIO.batch` they stay there until the outermost exit, otherwise they leave at
  once. Whoever writes takes the whole queue under ``_write_lock`` (so a batch written later
  never overtakes one written earlier) and writes runs of one size to one address as one GSO
  write (``UDP_SEGMENT``); a route that refuses GSO is sent to datagram by datagram from then on.
* Writers never wait for ``_lock``: the counters they bump (:meth:`TransportIO._bump`) take no
  lock, a rare lost increment being the price.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence

from checkmate.auth import datagram_job
from checkmate.network import Addr
from checkmate.wire import MessageType
from hosts.faults import FaultInjector, SendAction
from hosts.transport_records import Job, RecvFlow, SendFlow, TransportConfig

logger = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
DATA_TYPE = int(MessageType.DATA)
SOL_UDP = socket.IPPROTO_UDP
_UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
"""Linux: the segment size of a GSO send (a control message on ``sendmsg``)."""
UDP_GRO = getattr(socket, "UDP_GRO", 104)
"""Linux: a socket option (receive coalesced runs) and the control message saying their segment size."""
_MAX_UDP_PAYLOAD = 65507
"""Largest UDP payload of one IPv4 packet: what one GSO write may carry in all."""
_GSO_MAX_SEGMENTS = 64
BATCH_FLUSH = 64
"""A batch is written out once this many datagrams wait in it."""


class TransportIO:
    """Shared state, counters and socket writes; the layers above extend it (see :mod:`hosts.transport`)."""

    config: TransportConfig
    address: Addr
    advertised_window: int
    _sock: socket.socket
    _gro: bool
    _gso: bool
    _batching: threading.local
    _outgoing: list[tuple[Sequence[Buffer], Addr]]
    _out_lock: threading.Lock
    _write_lock: threading.Lock
    _faults: FaultInjector | None
    _held: tuple[Sequence[Buffer], Addr, float] | None
    _lock: threading.RLock
    _jobs: dict[int, Job]
    _send_flows: dict[tuple[Addr, int], SendFlow]
    _recv_flows: dict[tuple[Addr, int], RecvFlow]
    _dirty: set[tuple[Addr, int]]
    _counters: dict[str, int]
    _stop: threading.Event
    _timer_event: threading.Event
    _rx_wake: tuple[int, int]
    """A pipe the receive thread polls beside the socket; ``close()`` writes to it."""
    _timer_deadline: float
    """What the timer thread sleeps towards (``inf``: nothing outstanding, until woken)."""
    _timer_count: int
    """The timer thread's wake-ups (``stats()["timer_wakeups"]``)."""

    # ---- statistics -----------------------------------------------------------------
    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + n

    def _bump(self, name: str) -> None:
        """:meth:`count` without the lock (for writers, which may not wait for it; a rare lost
        increment is the price)."""
        self._counters[name] = self._counters.get(name, 0) + 1

    def count_drop(self, reason: str) -> None:
        """Count a datagram dropped for ``reason`` (also used by the layers above)."""
        self.count(f"drop.{reason}")

    def _wake_timer(self, deadline: float) -> None:
        """Wake the timer thread if ``deadline`` comes before the one it sleeps towards."""
        if deadline < self._timer_deadline:
            self._timer_deadline = deadline
            self._timer_event.set()

    # ---- sending --------------------------------------------------------------------
    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Hold this thread's DATA datagrams and write them at the end (GSO runs where possible).

        Nests; the outermost exit writes. Held datagrams of every thread wait in one queue in
        sequence order, and whoever writes takes the whole queue, so a flow's datagrams leave
        in the order they were numbered (no reordering for the receiver to SACK).
        """
        local = self._batching
        depth = getattr(local, "depth", 0)
        local.depth = depth + 1
        try:
            yield
        finally:
            local.depth = depth
            if depth == 0:
                self._flush_outgoing()

    def _flush_outgoing(self) -> None:
        with self._write_lock:
            with self._out_lock:
                items, self._outgoing = self._outgoing, []
            if items:
                self._write_batch(items)

    def _emit(self, parts: Sequence[Buffer], addr: Addr) -> None:
        if parts[0][1] != DATA_TYPE:  # every type but DATA carries the job's MAC
            job = self._jobs.get(datagram_job(parts[0]))
            if job is None or job.auth is None:
                self.count("send_no_key")
                return
            parts = job.auth.seal(parts)
        faults = self._faults
        if faults is None:
            self._sendmsg(parts, addr)
            return
        action = faults.on_send()
        if action == SendAction.DROP:
            return
        if action == SendAction.HOLD:
            with self._lock:
                now = time.monotonic()
                previous, self._held = self._held, (parts, addr, now)
                self._wake_timer(now + self.config.timer_tick)
            if previous is not None:
                self._sendmsg(previous[0], previous[1])
            return
        self._sendmsg(parts, addr)
        if action == SendAction.DUPLICATE:
            self._sendmsg(parts, addr)
        with self._lock:
            held, self._held = self._held, None
        if held is not None:
            self._sendmsg(held[0], held[1])

    def _sendmsg(self, parts: Sequence[Buffer], addr: Addr) -> None:
        if parts[0][1] != DATA_TYPE:  # control datagrams: at once (their order does not matter)
            self._write(parts, addr)
            return
        with self._out_lock:
            self._outgoing.append((parts, addr))
        if not getattr(self._batching, "depth", 0):
            self._flush_outgoing()  # behind whatever other threads hold, never before it
        # In a batch the caller may hold the flow lock: writing waits for flush_if_full(),
        # which batch owners call where they hold no lock.

    def flush_if_full(self) -> None:
        """Write the held datagrams if a batch's worth waits (call it holding no lock)."""
        if len(self._outgoing) >= BATCH_FLUSH:
            self._flush_outgoing()

    def _write_batch(self, items: list[tuple[Sequence[Buffer], Addr]]) -> None:
        """Write collected datagrams: per address in order, runs of one size as one GSO write."""
        if not self._gso:
            for parts, addr in items:
                self._write(parts, addr)
            return
        runs: dict[Addr, tuple[int, list[Buffer], int, bool]] = {}  # addr -> (segment, parts, count, closed)
        for parts, addr in items:
            size = len(parts[0]) + len(parts[1]) if len(parts) == 2 else sum(len(p) for p in parts)
            run = runs.get(addr)
            if run is not None:
                segment, flat, count, closed = run
                if (
                    not closed
                    and size <= segment
                    and (count + 1) * segment <= _MAX_UDP_PAYLOAD
                    and (count < _GSO_MAX_SEGMENTS)
                ):
                    flat.extend(parts)
                    runs[addr] = (segment, flat, count + 1, size < segment)
                    continue
                self._write_run(segment, flat, count, addr)
            runs[addr] = (size, list(parts), 1, False)
        for addr, (segment, flat, count, _) in runs.items():
            self._write_run(segment, flat, count, addr)

    def _write_run(self, segment: int, parts: list[Buffer], count: int, addr: Addr) -> None:
        if count == 1 or not self._gso:
            if count == 1:
                self._write(parts, addr)
                return
        else:
            control = [(SOL_UDP, _UDP_SEGMENT, struct.pack("=H", segment))]
            if self._write(parts, addr, control, gso=True):
                self._counters["gso_writes"] = self._counters.get("gso_writes", 0) + 1
                return
            if self._gso:  # not a refusal of GSO itself: the run is lost like one datagram would be
                return
        # resend the run datagram by datagram: each datagram is 2 parts (header, payload) or
        # the sealed 3 (header, payload, tag) -- only DATA is batched, which is always 2
        for i in range(0, len(parts), 2):
            self._write(parts[i : i + 2], addr)

    def _write(
        self,
        parts: Sequence[Buffer],
        addr: Addr,
        control: Sequence[tuple[int, int, bytes]] = (),
        gso: bool = False,
    ) -> bool:
        """One ``sendmsg``, waiting a while for buffer space; True if the kernel took it."""
        deadline: float | None = None
        while True:
            try:
                self._sock.sendmsg(parts, control, 0, addr)
                return True
            except BlockingIOError:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.config.send_block_timeout
                elif now >= deadline:
                    self._bump("send_blocked")
                    return False
                poller = select.poll()  # not select(): no limit on the descriptor's number
                poller.register(self._sock, select.POLLOUT)
                poller.poll(max(0.0, deadline - now) * 1000.0)
            except OSError as exc:
                if self._stop.is_set():
                    return False
                if gso and exc.errno in (
                    errno.EIO,
                    errno.EINVAL,
                    errno.EOPNOTSUPP,
                    errno.ENOPROTOOPT,
                    errno.EMSGSIZE,
                ):
                    # the route cannot segment (its device has no checksum offload): one by one from now on
                    self._gso = False
                    logger.info(
                        "%s: UDP GSO refused towards %s (%s); sending datagram by datagram",
                        self.address,
                        addr,
                        exc,
                    )
                    self._bump("gso_refused")
                    return False
                self._bump("send_error")
                logger.debug("sendmsg to %s failed: %s", addr, exc)
                return False
