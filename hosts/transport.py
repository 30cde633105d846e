"""Reliable, windowed, selectively acknowledged UDP transport over the Checkmate header.

One :class:`Transport` owns one UDP socket (normally ``ip:48879``) and carries
any number of *flows*. A flow is (peer address, job, direction): the sender
numbers its DATA datagrams 0, 1, 2, ... in ``header.sequence``; the receiver
answers with ACKs (cumulative ack + SACK ranges) and, when a gap persists,
NACKs (the missing ranges). docs/protocol.md ("Host transport") specifies the
ACK/NACK payloads.

* **Send window, flow control.** At most ``min(window, peer's advertised
  window)`` datagrams are unacknowledged per flow; the rest wait in a queue.
  :meth:`Transport.send` never blocks, so a receive thread can forward data
  without deadlocking on its own ACKs.
* **Retransmission.** On timeout (RTO from smoothed RTT, Karn's rule,
  exponential backoff; counted from the flow's last acknowledged progress, as TCP
  restarts its timer on every new ACK, so a slow but draining receiver is not
  flooded with duplicates), on SACK evidence (a datagram ``dupthresh`` below the
  highest SACKed one) and on NACK. A retransmission keeps every flag of the
  original (REPLICATE included) and adds RETRANSMIT.
* **Duplicates and reordering.** The receiver keeps the cumulative sequence
  and the set received above it; a datagram seen before is dropped (and
  re-acknowledged). Datagrams are delivered as they arrive, in any order: the
  header says where their elements go.
* **Zero copy.** The header's 32 bytes and a memoryview of tensor memory go to
  ``sendmsg`` together; retransmissions reuse the same view.
* **Fewer system calls.** Inside :meth:`Transport.batch` (the receive thread's bursts, a
  ring's first sends) DATA datagrams to one address are collected and sent as one UDP GSO
  write (``UDP_SEGMENT``: the kernel cuts it into the same datagrams, each with its own
  Checkmate header, so the wire is unchanged); the socket reads with ``UDP_GRO``, so a
  coalesced run arrives in one read and is split by the segment size the kernel reports.
  A route that cannot segment (a veth with checksum offload off, as in the emulated
  network) refuses the first GSO write; the transport then sends datagram by datagram.
* **Bad input.** Corrupt headers, unknown jobs, ranks whose address does not
  match, acknowledgements of unsent data: dropped and counted per reason
  (``stats()["drop.<reason>"]``), never delivered.
* **Authentication.** ACK, NACK, REPAIR_REQUEST and REPAIR_DATA datagrams carry
  a 16-byte MAC of the job's key after their payload (:class:`checkmate.auth.DatagramAuth`);
  one without a valid tag is dropped (``drop.unauthenticated``) before it is parsed.
  DATA carries none: only the ring peer's address is accepted (docs/security.md).
* **Dead peers.** A flow whose peer acknowledges nothing for ``peer_timeout``
  seconds fails with :class:`PeerTimeoutError` naming the peer; the job's
  failure callback runs once and later sends to it raise the same error.

UDP checksum 0 (what replicated packets carry) is accepted by the kernel for
UDP over IPv4; nothing here depends on the checksum. Threads: one receive
thread per socket (decode, bookkeeping, delivery, batched ACKs at the end of
each burst) and one timer thread (retransmission timeouts, NACKs, dead-peer
detection). Delivery callbacks run on the receive thread and must copy what
they keep: the payload view is reused for the next datagram.
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
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from checkmate.auth import DatagramAuth, datagram_job, needs_tag, secret_from_env
from checkmate.network import Addr
from checkmate.sockets import grow_buffer
from checkmate.wire import (
    CHECKMATE_UDP_PORT,
    HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    CheckmateHeader,
    DType,
    Flags,
    MessageType,
    WireFormatError,
    add_flags,
    decode,
    decode_data,
    set_sequence,
)
from hosts.faults import FaultConfig, FaultInjector, SendAction

logger = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
DataHandler = Callable[[CheckmateHeader, memoryview, Addr], None]
DataFieldsHandler = Callable[[tuple[int, ...], memoryview, Addr], None]
"""A DATA handler taking the header as :func:`checkmate.wire.decode_data`'s ints (no header object)."""
FailureHandler = Callable[["PeerTimeoutError"], None]

_DATA_TYPE = int(MessageType.DATA)
MAX_SEQUENCE = (1 << 32) - 1
MAX_RANGES = 128
"""Most SACK/NACK ranges one ACK or NACK carries (1 KiB of payload)."""
_RANGE = struct.Struct("!II")
_SOL_UDP = socket.IPPROTO_UDP
_UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)
"""Linux: the segment size of a GSO send (a control message on ``sendmsg``)."""
_UDP_GRO = getattr(socket, "UDP_GRO", 104)
"""Linux: a socket option (receive coalesced runs) and the control message saying their segment size."""
_MAX_UDP_PAYLOAD = 65507
"""Largest UDP payload of one IPv4 packet: what one GSO write may carry in all."""
_GSO_MAX_SEGMENTS = 64
_BATCH_FLUSH = 64
"""A batch is written out once this many datagrams wait in it."""
_GRO_SEGMENT = struct.Struct("=i")
_GRO_CMSG_SPACE = socket.CMSG_SPACE(_GRO_SEGMENT.size)
_DATAGRAM_TRUESIZE = 32768
"""Kernel memory to budget per jumbo datagram in a receive buffer (for the advertised window;
measured: 512 x 9 KB datagrams overflow an 8 MiB buffer on loopback, 256 do not)."""


class PeerTimeoutError(TimeoutError):
    """A peer stopped answering: nothing acknowledged (or received) within the timeout."""

    def __init__(self, peer: Addr, job_id: int, rank: int | None, detail: str) -> None:
        self.peer = peer
        self.job_id = job_id
        self.rank = rank
        who = f"rank {rank} at {peer[0]}:{peer[1]}" if rank is not None else f"{peer[0]}:{peer[1]}"
        super().__init__(f"job {job_id}: peer {who} is not responding: {detail}")


class TransportClosedError(RuntimeError):
    """The transport was closed while an operation needed it."""


@dataclass(frozen=True)
class TransportConfig:
    """Everything a transport needs; the defaults suit jumbo datagrams on one host or a LAN."""

    bind: Addr = ("127.0.0.1", CHECKMATE_UDP_PORT)
    window: int = 1024
    """Most unacknowledged datagrams per flow (also the window this side advertises)."""
    rcvbuf_bytes: int = 64 << 20
    sndbuf_bytes: int = 16 << 20
    initial_rto: float = 0.1
    min_rto: float = 0.2
    """Python receivers queue datagrams for milliseconds, and a loaded machine deschedules them for
    tens; losses are mostly repaired by SACK/NACK first, the RTO is for a silent peer or a lost tail."""
    max_rto: float = 0.5
    peer_timeout: float = 10.0
    """Seconds without any acknowledgement from a peer with data outstanding before it is declared dead."""
    ack_every: int = 32
    """Acknowledge at once after this many new datagrams; otherwise at the end of each receive burst."""
    dupthresh: int = 3
    """A datagram this far below the highest SACKed one is presumed lost and resent."""
    nack_delay: float = 0.004
    """How long a gap must persist before the receiver NACKs it."""
    nack_interval: float = 0.02
    """Least time between two NACKs of one flow."""
    timer_tick: float = 0.002
    max_reorder: int = 1 << 16
    """Datagrams further than this beyond the cumulative sequence are dropped (bounded memory)."""
    send_block_timeout: float = 0.5
    """Longest wait for socket buffer space before a datagram is counted as dropped."""
    gso: bool = True
    """Send batched runs of equal-sized DATA datagrams as one UDP GSO write where the route allows it."""
    faults: FaultConfig = field(default_factory=FaultConfig)


@dataclass(slots=True)
class _Outstanding:
    seq: int
    header_bytes: bytearray
    """The bytes sent: ``header`` packed with ``seq`` (and RETRANSMIT once resent)."""
    payload: memoryview
    first_sent: float = 0.0
    last_sent: float = 0.0
    retransmits: int = 0


@dataclass
class _SendFlow:
    peer: Addr
    job_id: int
    peer_rank: int | None
    rto: float
    peer_window: int
    next_seq: int = 0
    cum_acked: int = 0
    unacked: dict[int, _Outstanding] = field(default_factory=dict)
    """Ordered by last transmission time (a retransmitted entry moves to the end)."""
    pending: deque[_Outstanding] = field(default_factory=deque)
    srtt: float | None = None
    rttvar: float = 0.0
    backoff: float = 1.0
    last_progress: float = 0.0
    failed: PeerTimeoutError | None = None


@dataclass
class _RecvFlow:
    peer: Addr
    job_id: int
    cum: int = 0
    ooo: set[int] = field(default_factory=set)
    since_ack: int = 0
    ack_due: bool = False
    gap_since: float = 0.0
    last_nack: float = 0.0


@dataclass
class _Job:
    job_id: int
    rank: int
    peers: dict[int, Addr]
    by_addr: dict[Addr, int]
    on_data: DataHandler
    on_request: DataHandler | None
    on_failure: FailureHandler | None
    auth: DatagramAuth | None = None
    on_data_fields: DataFieldsHandler | None = None


def resolve(addr: tuple[str, int] | str, default_port: int = CHECKMATE_UDP_PORT) -> Addr:
    """``"ip"``, ``"ip:port"`` or ``(host, port)`` -> ``(dotted-quad, port)``."""
    if isinstance(addr, str):
        host, _, port = addr.partition(":")
        return (socket.gethostbyname(host), int(port) if port else default_port)
    return (socket.gethostbyname(addr[0]), int(addr[1]))


def pack_ranges(ranges: Sequence[tuple[int, int]]) -> bytes:
    """ACK/NACK payload: each range as (start, end) big-endian uint32, half-open."""
    return b"".join(_RANGE.pack(s, e) for s, e in ranges)


def unpack_ranges(payload: Buffer, count: int) -> list[tuple[int, int]]:
    """Inverse of :func:`pack_ranges`; WireFormatError if the length or a range is wrong."""
    if len(payload) != count * _RANGE.size:
        raise WireFormatError(f"{count} ranges need {count * _RANGE.size} payload bytes, got {len(payload)}")
    ranges = [_RANGE.unpack_from(payload, i * _RANGE.size) for i in range(count)]
    for s, e in ranges:
        if s >= e:
            raise WireFormatError(f"empty or inverted range [{s}, {e})")
    return ranges


def _to_ranges(seqs: Sequence[int], limit: int = MAX_RANGES) -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []
    for s in seqs:
        if ranges and ranges[-1][1] == s:
            ranges[-1] = (ranges[-1][0], s + 1)
        else:
            if len(ranges) == limit:
                break
            ranges.append((s, s + 1))
    return ranges


class Transport:
    """A reliable datagram transport on one UDP socket. Use as a context manager or call close()."""

    def __init__(self, config: TransportConfig) -> None:
        self.config = config
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        grow_buffer(self._sock, socket.SO_RCVBUF, config.rcvbuf_bytes)
        grow_buffer(self._sock, socket.SO_SNDBUF, config.sndbuf_bytes)
        self._sock.bind(resolve(config.bind))
        self._sock.setblocking(False)
        self._gro = False
        with contextlib.suppress(OSError):
            self._sock.setsockopt(_SOL_UDP, _UDP_GRO, 1)
            self._gro = True
        self._gso = config.gso
        self._batching = threading.local()
        """``depth``: how deep this thread is in :meth:`batch` contexts."""
        self._outgoing: list[tuple[Sequence[Buffer], Addr]] = []
        """DATA datagrams numbered but not yet written, in sequence order (under ``_out_lock``)."""
        self._out_lock = threading.Lock()
        self._write_lock = threading.Lock()
        """Held while a batch is written, so that one written later never overtakes it."""
        self.address: Addr = self._sock.getsockname()
        rcvbuf = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        self.advertised_window = max(8, min(config.window, rcvbuf // _DATAGRAM_TRUESIZE))
        if self.advertised_window < config.window:
            logger.info(
                "%s: receive buffer is %d bytes; advertising a window of %d datagrams",
                self.address,
                rcvbuf,
                self.advertised_window,
            )
        self._faults = FaultInjector(config.faults) if config.faults.active else None
        self._held: tuple[Sequence[Buffer], Addr, float] | None = None
        self._lock = threading.RLock()
        self._jobs: dict[int, _Job] = {}
        self._send_flows: dict[tuple[Addr, int], _SendFlow] = {}
        self._recv_flows: dict[tuple[Addr, int], _RecvFlow] = {}
        self._dirty: set[tuple[Addr, int]] = set()
        self._counters: dict[str, int] = {}
        self._stop = threading.Event()
        self.tap: Callable[[CheckmateHeader, Addr, bool], None] | None = None
        """Called with (header, destination, is_retransmission) for every reliable transmission."""
        self._rx = threading.Thread(target=self._receive_loop, name=f"cm-rx-{self.address[0]}", daemon=True)
        self._timer = threading.Thread(
            target=self._timer_loop, name=f"cm-timer-{self.address[0]}", daemon=True
        )
        self._rx.start()
        self._timer.start()

    # ---- set-up ---------------------------------------------------------------------
    def add_job(
        self,
        job_id: int,
        rank: int,
        peers: Mapping[int, Addr],
        on_data: DataHandler,
        on_request: DataHandler | None = None,
        on_failure: FailureHandler | None = None,
        secret: bytes | None = None,
        on_data_fields: DataFieldsHandler | None = None,
    ) -> None:
        """Accept flows of ``job_id`` from ``peers`` (rank -> address); this side is ``rank``.

        ``on_data_fields``: when given, DATA is delivered to it (header as ints, see
        :func:`checkmate.wire.decode_data`) instead of to ``on_data`` -- the per-datagram fast path.

        ``secret``: the job's (None: this process's, :func:`checkmate.auth.secret_from_env`,
        which raises AuthConfigError when there is none).
        """
        auth = DatagramAuth(secret if secret is not None else secret_from_env(), job_id)
        resolved = {int(r): resolve(a) for r, a in peers.items()}
        with self._lock:
            self._jobs[job_id] = _Job(
                job_id=job_id,
                rank=rank,
                peers=resolved,
                by_addr={a: r for r, a in resolved.items()},
                on_data=on_data,
                on_request=on_request,
                on_failure=on_failure,
                auth=auth,
                on_data_fields=on_data_fields,
            )

    def remove_job(self, job_id: int) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)
            for key in [k for k in self._send_flows if k[1] == job_id]:
                del self._send_flows[key]
            for key in [k for k in self._recv_flows if k[1] == job_id]:
                del self._recv_flows[key]

    def close(self, drain_timeout: float = 0.0) -> None:
        """Stop the threads and close the socket, after waiting up to ``drain_timeout`` for ACKs."""
        if self._stop.is_set():
            return
        if drain_timeout > 0:
            self.wait_idle(drain_timeout)
        self._stop.set()
        self._rx.join(timeout=2.0)
        self._timer.join(timeout=2.0)
        self._sock.close()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counters)
            out["flows.send"] = len(self._send_flows)
            out["flows.recv"] = len(self._recv_flows)
            out["unacked"] = sum(len(f.unacked) + len(f.pending) for f in self._send_flows.values())
        if self._faults is not None:
            out.update({f"fault.{k}": v for k, v in self._faults.counts.items()})
        return out

    def drops(self) -> dict[str, int]:
        """Dropped datagrams by reason."""
        return {k[5:]: v for k, v in self.stats().items() if k.startswith("drop.")}

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every sent datagram is acknowledged; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                busy = any((f.unacked or f.pending) and f.failed is None for f in self._send_flows.values())
            if not busy:
                return True
            time.sleep(0.001)
        return False

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

    def send(self, peer: Addr, header: CheckmateHeader, payload: Buffer = b"") -> None:
        """Queue one DATA datagram reliably to ``peer`` (never blocks).

        ``header.sequence`` is assigned here. ``payload`` is sent and resent
        from the given memory, which must stay unchanged until acknowledged.
        Raises :class:`PeerTimeoutError` if the flow to ``peer`` has failed.
        """
        self.send_packed(peer, header.job_id, bytearray(header.pack()), payload)

    def send_packed(self, peer: Addr, job_id: int, header_bytes: bytearray, payload: Buffer = b"") -> None:
        """:meth:`send` with the header already packed (:func:`checkmate.wire.pack_data_header`).

        ``header_bytes`` is the transport's from now on: it writes the sequence and, on a
        resend, the RETRANSMIT flag into it.
        """
        if self._stop.is_set():
            raise TransportClosedError(f"transport {self.address} is closed")
        view = memoryview(payload).cast("B") if not isinstance(payload, memoryview) else payload
        if len(view) > MAX_PAYLOAD_BYTES:
            raise WireFormatError(f"payload of {len(view)} bytes exceeds {MAX_PAYLOAD_BYTES}")
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                raise KeyError(f"job {job_id} is not registered with this transport")
            key = (peer, job_id)
            flow = self._send_flows.get(key)
            if flow is None:
                flow = _SendFlow(
                    peer=peer,
                    job_id=job_id,
                    peer_rank=job.by_addr.get(peer),
                    rto=self.config.initial_rto,
                    peer_window=self.config.window,
                )
                self._send_flows[key] = flow
            if flow.failed is not None:
                raise flow.failed
            seq = flow.next_seq
            if seq > MAX_SEQUENCE:
                raise OverflowError(f"flow to {peer} exhausted its 32-bit sequence space")
            flow.next_seq += 1
            set_sequence(header_bytes, seq)
            item = _Outstanding(seq=seq, header_bytes=header_bytes, payload=view)
            if len(flow.unacked) < min(self.config.window, flow.peer_window) and not flow.pending:
                self._transmit(flow, item, time.monotonic())
            else:
                flow.pending.append(item)

    def send_unreliable(self, addr: Addr, header: CheckmateHeader | bytes, payload: Buffer = b"") -> None:
        """Send one datagram once, outside any flow (repair answers, NACKs of repair requests).

        ``header``: a header, or its 32 packed bytes.
        """
        self._emit((header if isinstance(header, bytes) else header.pack(), payload), addr)
        self.count("unreliable_sent")

    def _transmit(self, flow: _SendFlow, item: _Outstanding, now: float) -> None:
        """First transmission of ``item`` (lock held)."""
        if not flow.unacked:
            flow.last_progress = now
        item.first_sent = item.last_sent = now
        flow.unacked[item.seq] = item
        self._emit((item.header_bytes, item.payload), flow.peer)
        self._counters["data_sent"] = self._counters.get("data_sent", 0) + 1
        if self.tap is not None:
            self.tap(decode(bytes(item.header_bytes) + bytes(item.payload))[0], flow.peer, False)

    def _retransmit(self, flow: _SendFlow, item: _Outstanding, now: float, why: str) -> None:
        """Resend ``item`` with RETRANSMIT added to its flags (lock held)."""
        if item.retransmits == 0:
            add_flags(item.header_bytes, Flags.RETRANSMIT)
        item.retransmits += 1
        item.last_sent = now
        del flow.unacked[item.seq]
        flow.unacked[item.seq] = item
        self._emit((item.header_bytes, item.payload), flow.peer)
        name = f"retransmit.{why}"
        self._counters[name] = self._counters.get(name, 0) + 1
        if self.tap is not None:
            self.tap(decode(bytes(item.header_bytes) + bytes(item.payload))[0], flow.peer, True)

    def _fill_window(self, flow: _SendFlow, now: float) -> None:
        limit = min(self.config.window, flow.peer_window)
        while flow.pending and len(flow.unacked) < limit:
            self._transmit(flow, flow.pending.popleft(), now)

    def _emit(self, parts: Sequence[Buffer], addr: Addr) -> None:
        if parts[0][1] != _DATA_TYPE:  # every type but DATA carries the job's MAC
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
                previous, self._held = self._held, (parts, addr, time.monotonic())
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
        if parts[0][1] != _DATA_TYPE:  # control datagrams: at once (their order does not matter)
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
        if len(self._outgoing) >= _BATCH_FLUSH:
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
            control = [(_SOL_UDP, _UDP_SEGMENT, struct.pack("=H", segment))]
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
                select.select([], [self._sock], [], deadline - now)
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

    # ---- receiving ------------------------------------------------------------------
    def _receive_loop(self) -> None:
        buf = bytearray(65536 if self._gro else HEADER_BYTES + MAX_PAYLOAD_BYTES + 1024)
        view = memoryview(buf)
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        sock = self._sock
        while not self._stop.is_set():
            try:
                if not poller.poll(50):
                    continue
            except OSError:
                return
            with self.batch():  # forwards and first sends go out in GSO runs at the end of the burst
                for _ in range(256):
                    segment = 0
                    try:
                        if self._gro:
                            n, control, _flags, addr = sock.recvmsg_into([buf], _GRO_CMSG_SPACE)
                            for level, kind, data in control:
                                if level == _SOL_UDP and kind == _UDP_GRO and len(data) >= 4:
                                    segment = _GRO_SEGMENT.unpack_from(data)[0]
                        else:
                            n, addr = sock.recvfrom_into(buf)
                    except BlockingIOError:
                        break
                    except OSError as exc:
                        if self._stop.is_set():
                            return
                        self.count("recv_error")
                        logger.debug("recvfrom failed: %s", exc)
                        break
                    if (
                        0 < segment < n
                    ):  # a coalesced run of datagrams of `segment` bytes (the last may be shorter)
                        for start in range(0, n, segment):
                            self._handle_safely(view[start : min(start + segment, n)], addr)
                    else:
                        self._handle_safely(view[:n], addr)
                    if len(self._outgoing) >= _BATCH_FLUSH:
                        self._flush_outgoing()
            self._flush_acks()

    def _handle_safely(self, data: memoryview, addr: Addr) -> None:
        try:
            self._handle(data, addr)
        except Exception:  # noqa: BLE001 - a handler bug must not kill the receive thread
            self.count("handler_error")
            logger.exception("error handling a datagram from %s", addr)

    def _handle(self, data: memoryview, addr: Addr) -> None:
        if self._faults is not None and self._faults.drop_received():
            return
        if needs_tag(data):
            job = self._jobs.get(datagram_job(data))
            if job is None or job.auth is None:
                self.count_drop("unknown_job")  # no key to check it with (e.g. the job closed)
                return
            opened = job.auth.open(data)
            if opened is None:
                self.count_drop("unauthenticated")
                return
            data = opened
        elif (
            len(data) > 1 and data[1] == _DATA_TYPE
        ):  # the per-datagram path: no header object unless a handler wants one
            try:
                fields, payload = decode_data(data)
            except WireFormatError as exc:
                self.count_drop("malformed")
                logger.debug("malformed datagram from %s: %s", addr, exc)
                return
            job = self._jobs.get(fields[4])
            if job is None:
                self.count_drop("unknown_job")
                return
            if job.peers.get(fields[7]) != addr:
                self.count_drop("unknown_rank")
                return
            if self._accept_data(fields[4], fields[12], addr):
                if job.on_data_fields is not None:
                    job.on_data_fields(fields, payload, addr)
                else:
                    job.on_data(decode(data)[0], payload, addr)
            return
        try:
            header, payload = decode(data)
        except WireFormatError as exc:
            self.count_drop("malformed")
            logger.debug("malformed datagram from %s: %s", addr, exc)
            return
        job = self._jobs.get(header.job_id)
        if job is None:
            self.count_drop("unknown_job")
            return
        kind = header.msg_type
        if kind is MessageType.REPAIR_REQUEST:
            if job.on_request is None:
                self.count_drop("no_repair_service")
            else:
                job.on_request(header, payload, addr)
            return
        if kind is MessageType.REPAIR_DATA:
            self.count_drop("unexpected_type")
            return
        if job.peers.get(header.sender_rank) != addr:
            self.count_drop("unknown_rank")
            return
        if kind is MessageType.ACK:
            self._on_ack(header, payload, addr, nack=False)
        else:
            self._on_ack(header, payload, addr, nack=True)

    def _accept_data(self, job_id: int, seq: int, addr: Addr) -> bool:
        """Flow bookkeeping for one DATA datagram; False for a duplicate or out-of-window one."""
        key = (addr, job_id)
        with self._lock:
            flow = self._recv_flows.get(key)
            if flow is None:
                flow = self._recv_flows[key] = _RecvFlow(peer=addr, job_id=job_id)
            self._dirty.add(key)
            if seq < flow.cum or seq in flow.ooo:
                flow.ack_due = True
                self._counters["drop.duplicate"] = self._counters.get("drop.duplicate", 0) + 1
                return False
            if seq - flow.cum > self.config.max_reorder:
                self._counters["drop.sequence_window"] = self._counters.get("drop.sequence_window", 0) + 1
                return False
            if seq == flow.cum:
                flow.cum += 1
                ooo = flow.ooo
                while flow.cum in ooo:
                    ooo.discard(flow.cum)
                    flow.cum += 1
            else:
                if not flow.ooo:
                    flow.gap_since = time.monotonic()
                flow.ooo.add(seq)
                flow.ack_due = True
            flow.since_ack += 1
            self._counters["data_received"] = self._counters.get("data_received", 0) + 1
            if flow.since_ack >= self.config.ack_every:
                self._send_ack(flow)
        return True

    def _send_ack(self, flow: _RecvFlow) -> None:
        """ACK: sequence = cumulative ack, element_offset = advertised window, payload = SACK ranges."""
        job = self._jobs.get(flow.job_id)
        if job is None:
            return
        ranges = _to_ranges(sorted(flow.ooo)) if flow.ooo else []
        header = CheckmateHeader(
            msg_type=MessageType.ACK,
            job_id=flow.job_id,
            iteration=0,
            bucket_id=0,
            sender_rank=job.rank,
            element_offset=self.advertised_window,
            element_count=len(ranges),
            sequence=flow.cum,
            dtype=DType.NONE,
        )
        flow.since_ack = 0
        flow.ack_due = False
        self._emit((header.pack(), pack_ranges(ranges)), flow.peer)
        self._counters["acks_sent"] = self._counters.get("acks_sent", 0) + 1

    def _send_nack(self, flow: _RecvFlow, now: float) -> None:
        """NACK: sequence = cumulative ack, payload = the missing ranges below the highest received."""
        job = self._jobs.get(flow.job_id)
        if job is None or not flow.ooo:
            return
        received = sorted(flow.ooo)
        missing: list[tuple[int, int]] = []
        start = flow.cum
        for s in received:
            if s > start:
                missing.append((start, s))
                if len(missing) == MAX_RANGES:
                    break
            start = s + 1
        if not missing:
            return
        header = CheckmateHeader(
            msg_type=MessageType.NACK,
            job_id=flow.job_id,
            iteration=0,
            bucket_id=0,
            sender_rank=job.rank,
            element_offset=self.advertised_window,
            element_count=len(missing),
            sequence=flow.cum,
            dtype=DType.NONE,
        )
        flow.last_nack = now
        self._emit((header.pack(), pack_ranges(missing)), flow.peer)
        self._counters["nacks_sent"] = self._counters.get("nacks_sent", 0) + 1

    def _flush_acks(self) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            for key in dirty:
                flow = self._recv_flows.get(key)
                if flow is not None and (flow.since_ack or flow.ack_due):
                    self._send_ack(flow)

    def _on_ack(self, header: CheckmateHeader, payload: memoryview, addr: Addr, nack: bool) -> None:
        try:
            ranges = unpack_ranges(payload, header.element_count)
        except WireFormatError:
            self.count_drop("malformed_ack")
            return
        now = time.monotonic()
        with self._lock:
            flow = self._send_flows.get((addr, header.job_id))
            if flow is None or flow.failed is not None:
                self._counters["drop.unexpected_ack"] = self._counters.get("drop.unexpected_ack", 0) + 1
                return
            cum = header.sequence
            if cum > flow.next_seq or any(e > flow.next_seq for _, e in ranges):
                self._counters["drop.ack_beyond_sent"] = self._counters.get("drop.ack_beyond_sent", 0) + 1
                return
            self._counters["nacks_received" if nack else "acks_received"] = (
                self._counters.get("nacks_received" if nack else "acks_received", 0) + 1
            )
            if header.element_offset:
                flow.peer_window = max(1, header.element_offset)
            sample: float | None = None
            unacked = flow.unacked
            if cum > flow.cum_acked:
                for s in range(flow.cum_acked, cum):
                    item = unacked.pop(s, None)
                    if item is not None and item.retransmits == 0:
                        sample = now - item.first_sent
                flow.cum_acked = cum
                flow.last_progress = now
                flow.backoff = 1.0
            if nack:
                guard = max(flow.srtt or 0.0, 0.001)
                for s, e in ranges:
                    for seq in range(max(s, cum), e):
                        item = unacked.get(seq)
                        if item is not None and now - item.last_sent >= guard:
                            self._retransmit(flow, item, now, "nack")
            elif ranges:
                highest = cum
                for s, e in ranges:
                    for seq in range(max(s, cum), e):
                        item = unacked.pop(seq, None)
                        if item is not None:
                            flow.last_progress = now
                            if item.retransmits == 0:
                                sample = now - item.first_sent
                    highest = max(highest, e)
                guard = max(flow.srtt or 0.0, 0.001)
                for seq in range(cum, highest - self.config.dupthresh):
                    item = unacked.get(seq)
                    if item is not None and now - item.last_sent >= guard:
                        self._retransmit(flow, item, now, "sack")
            if sample is not None:
                self._update_rtt(flow, sample)
            self._fill_window(flow, now)

    def _update_rtt(self, flow: _SendFlow, sample: float) -> None:
        if flow.srtt is None:
            flow.srtt, flow.rttvar = sample, sample / 2
        else:
            flow.rttvar = 0.75 * flow.rttvar + 0.25 * abs(flow.srtt - sample)
            flow.srtt = 0.875 * flow.srtt + 0.125 * sample
        flow.rto = min(self.config.max_rto, max(self.config.min_rto, flow.srtt + 4 * flow.rttvar))

    # ---- timers ---------------------------------------------------------------------
    def _timer_loop(self) -> None:
        tick = self.config.timer_tick
        while not self._stop.wait(tick):
            try:
                self._on_tick(time.monotonic())
            except Exception:  # noqa: BLE001 - keep the timer alive; the error is logged
                logger.exception("transport timer failed")

    def _on_tick(self, now: float) -> None:
        failures: list[tuple[_Job | None, PeerTimeoutError]] = []
        held = None
        with self._lock:
            if self._held is not None and now - self._held[2] >= self.config.timer_tick:
                held, self._held = self._held, None
            for flow in self._send_flows.values():
                if flow.failed is not None or not flow.unacked:
                    continue
                if now - flow.last_progress > self.config.peer_timeout:
                    error = PeerTimeoutError(
                        flow.peer,
                        flow.job_id,
                        flow.peer_rank,
                        f"nothing acknowledged for {now - flow.last_progress:.1f}s "
                        f"(timeout {self.config.peer_timeout:.1f}s), "
                        f"{len(flow.unacked) + len(flow.pending)} datagrams outstanding",
                    )
                    flow.failed = error
                    flow.unacked.clear()
                    flow.pending.clear()
                    self._counters["peer_failures"] = self._counters.get("peer_failures", 0) + 1
                    failures.append((self._jobs.get(flow.job_id), error))
                    continue
                timeout = flow.rto * flow.backoff
                if now - flow.last_progress < timeout:
                    # The peer acknowledged something within the RTO: it is draining what it was
                    # sent, only late (a busy or starved receiver). Resending now would only add
                    # duplicates to its full buffer; real losses are resent on SACK/NACK evidence.
                    continue
                expired = []
                for item in flow.unacked.values():
                    if now - item.last_sent < timeout:
                        break
                    expired.append(item)
                    if len(expired) >= 64:
                        break
                if expired:
                    flow.backoff = min(flow.backoff * 2, self.config.max_rto / flow.rto)
                    for item in expired:
                        self._retransmit(flow, item, now, "timeout")
            for rflow in self._recv_flows.values():
                if (
                    rflow.ooo
                    and now - rflow.gap_since >= self.config.nack_delay
                    and now - rflow.last_nack >= self.config.nack_interval
                ):
                    self._send_nack(rflow, now)
        if held is not None:
            self._sendmsg(held[0], held[1])
        for job, error in failures:
            logger.error("%s", error)
            if job is not None and job.on_failure is not None:
                job.on_failure(error)
