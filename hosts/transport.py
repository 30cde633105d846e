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
UDP over IPv4; nothing here depends on the checksum. Delivery callbacks run on
the receive thread and must copy what they keep: the payload view is reused for
the next datagram.

Layout. :class:`Transport` is assembled from three layers, each extending the one below:

=============================  ==============================  =====================================
module (layer)                 threads                         locks
=============================  ==============================  =====================================
:mod:`hosts.transport_io`      any thread that sends           ``_out_lock`` (the DATA queue),
(:class:`TransportIO`:                                         ``_write_lock`` (one writer at a
counters, MACs, faults,                                        time, in queue order); counters
batches, UDP GSO writes)                                       bumped by writers take no lock
:mod:`hosts.transport_flow`    callers (``send``), the         ``_lock`` (an ``RLock``) for all
(:class:`FlowControl`:         receive thread (ACKs, data      flow and job state; failure
send windows, ACK/SACK/NACK,   bookkeeping), the timer         callbacks run after it is released
RTO, dead peers)               thread ``cm-timer-<ip>``
:mod:`hosts.transport_receive` the receive thread              none to read and dispatch; the
(:class:`Receiver`: GRO        ``cm-rx-<ip>``                  flow bookkeeping takes ``_lock``
reads, checks, dispatch)
this module (:class:`Transport`: set-up, jobs, statistics,     ``_lock`` for jobs and statistics
public send API)
=============================  ==============================  =====================================

The native data path. With ``TransportConfig.datapath == "native"`` (the default where
:mod:`hosts.native` built) none of the threads above start: :class:`hosts.transport_native.NativeDatapath`
serves the socket from one compiled thread (reads, checks, flows, timers, the ring's reduce and
forward; docs/protocol.md, "The native data path") and Python runs per bucket and for rare
events. The Python layers stay the reference implementation (``datapath="python"``,
``CHECKMATE_TRANSPORT=python``).

``_lock`` is taken before ``_out_lock``/``_write_lock`` (a send under ``_lock`` queues and may
write), never after; inside :meth:`Transport.batch` a sender holding ``_lock`` only queues.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from checkmate.address import parse_host_port
from checkmate.auth import DatagramAuth, datagram_job, derive_key, secret_or_env
from checkmate.network import Addr
from checkmate.sockets import bind, grow_buffer
from checkmate.wire import CHECKMATE_UDP_PORT, MAX_PAYLOAD_BYTES, CheckmateHeader, WireFormatError
from hosts import native
from hosts.faults import FaultInjector
from hosts.transport_flow import pack_ranges, unpack_ranges
from hosts.transport_io import DATA_TYPE, SOL_UDP, UDP_GRO, Buffer
from hosts.transport_native import NativeDatapath
from hosts.transport_receive import Receiver
from hosts.transport_records import (
    DATAPATHS,
    TRANSPORT_ENV,
    DataFieldsHandler,
    DataHandler,
    FailureHandler,
    Job,
    PeerTimeoutError,
    TransportClosedError,
    TransportConfig,
    datapath_from_env,
)

__all__ = [
    "DATAPATHS",
    "TRANSPORT_ENV",
    "Addr",
    "PeerTimeoutError",
    "Transport",
    "TransportClosedError",
    "TransportConfig",
    "datapath_from_env",
    "pack_ranges",
    "resolve",
    "unpack_ranges",
]

logger = logging.getLogger(__name__)

_DATAGRAM_TRUESIZE = 32768
"""Kernel memory to budget per jumbo datagram in a receive buffer (for the advertised window;
measured: 512 x 9 KB datagrams overflow an 8 MiB buffer on loopback, 256 do not)."""


def resolve(addr: tuple[str, int] | str, default_port: int = CHECKMATE_UDP_PORT) -> Addr:
    """``"ip"``, ``"ip:port"`` or ``(host, port)`` -> ``(dotted-quad, port)``."""
    if isinstance(addr, str):
        host, port = parse_host_port(addr, default_port)
        return (socket.gethostbyname(host), port)
    return (socket.gethostbyname(addr[0]), int(addr[1]))


class Transport(Receiver):
    """A reliable datagram transport on one UDP socket. Use as a context manager or call close()."""

    def __init__(self, config: TransportConfig) -> None:
        self.config = config
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        grow_buffer(self._sock, socket.SO_RCVBUF, config.rcvbuf_bytes)
        grow_buffer(self._sock, socket.SO_SNDBUF, config.sndbuf_bytes)
        bind(self._sock, resolve(config.bind), "the Checkmate transport")
        self._sock.setblocking(False)
        self._gro = False
        with contextlib.suppress(OSError):
            self._sock.setsockopt(SOL_UDP, UDP_GRO, 1)
            self._gro = True
        self._gso = config.gso
        self._batching = threading.local()
        """``depth``: how deep this thread is in :meth:`batch` contexts."""
        self._outgoing = []
        """DATA datagrams numbered but not yet written, in sequence order (under ``_out_lock``)."""
        self._out_lock = threading.Lock()
        self._write_lock = threading.Lock()
        """Held while a batch is written, so that one written later never overtakes it."""
        self.address = self._sock.getsockname()
        rcvbuf = self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        self.advertised_window = max(8, min(config.window, rcvbuf // _DATAGRAM_TRUESIZE))
        if self.advertised_window < config.window:
            logger.info(
                "%s: receive buffer is %d bytes; advertising a window of %d datagrams",
                self.address,
                rcvbuf,
                self.advertised_window,
            )
        self._native: NativeDatapath | None = None
        if config.datapath == "native":
            module = native.load()
            if module is not None:
                self._native = NativeDatapath(module, self)
        # the native engine injects its own faults (same probabilities, its own generator)
        self._faults = FaultInjector(config.faults) if config.faults.active and self._native is None else None
        self._held = None
        self._lock = threading.RLock()
        self._jobs = {}
        self._send_flows = {}
        self._recv_flows = {}
        self._dirty = set()
        self._counters = {}
        self._stop = threading.Event()
        self._timer_event = threading.Event()
        self._timer_deadline = 0.0
        self._timer_count = 0
        self._rx_wake = os.pipe()
        self._tap: Callable[[CheckmateHeader, Addr, bool], None] | None = None
        self._copy_hook: Callable[[bytes, Addr], None] | None = None
        self._rx = threading.Thread(target=self._receive_loop, name=f"cm-rx-{self.address[0]}", daemon=True)
        self._timer = threading.Thread(
            target=self._timer_loop, name=f"cm-timer-{self.address[0]}", daemon=True
        )
        if self._native is not None:
            self._native.start()  # its one thread reads, acknowledges, forwards and keeps the timers
        else:
            self._rx.start()
            self._timer.start()

    @property
    def native(self) -> NativeDatapath | None:
        """The compiled data path serving this socket, or None on the Python path."""
        return self._native

    @property
    def datapath(self) -> str:
        """``"native"`` or ``"python"``: the data path this transport actually runs."""
        return "native" if self._native is not None else "python"

    @property
    def tap(self) -> Callable[[CheckmateHeader, Addr, bool], None] | None:
        """Called with (header, destination, is_retransmission) for every reliable transmission."""
        return self._tap

    @tap.setter
    def tap(self, value: Callable[[CheckmateHeader, Addr, bool], None] | None) -> None:
        self._tap = value
        if self._native is not None:
            self._native.engine.set_tap(value is not None or self._copy_hook is not None)

    @property
    def copy_hook(self) -> Callable[[bytes, Addr], None] | None:
        """Called with the datagram's bytes and destination for every reliable transmission (tests
        that copy tagged datagrams to shadows, as a switch would). On the native path it costs a
        Python call per datagram, like :attr:`tap`."""
        return self._copy_hook

    @copy_hook.setter
    def copy_hook(self, value: Callable[[bytes, Addr], None] | None) -> None:
        self._copy_hook = value
        if self._native is not None:
            self._native.engine.set_tap(value is not None or self._tap is not None)

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

        ``secret``: the job's (None: :attr:`TransportConfig.secret`, else this process's from the
        environment, :func:`checkmate.auth.secret_or_env`, AuthConfigError when there is none).
        """
        secret_bytes = secret_or_env(
            secret if secret is not None else self.config.secret, "Transport.add_job"
        )
        auth = DatagramAuth(secret_bytes, job_id)
        resolved = {int(r): resolve(a) for r, a in peers.items()}
        # Python's table first, then the engine's: once the engine knows the job it accepts and
        # acknowledges the job's DATA and hands it up, and a datagram handed up for a job not yet
        # in this table would be lost after its ACK (until then the engine drops it unacknowledged,
        # and the sender retransmits).
        with self._lock:
            self._jobs[job_id] = Job(
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
        if self._native is not None:
            try:
                self._native.add_job(job_id, rank, resolved, derive_key(secret_bytes, "transport", job_id))
            except BaseException:
                with self._lock:
                    self._jobs.pop(job_id, None)
                raise

    def remove_job(self, job_id: int) -> None:
        if self._native is not None:
            self._native.remove_job(job_id)
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
        self._timer_event.set()
        os.write(self._rx_wake[1], b"x")
        if self._native is not None:
            self._native.stop()
        else:
            self._rx.join(timeout=2.0)
            self._timer.join(timeout=2.0)
        self._sock.close()
        for fd in self._rx_wake:
            os.close(fd)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counters)
            out["flows.send"] = len(self._send_flows)
            out["flows.recv"] = len(self._recv_flows)
            out["unacked"] = sum(len(f.unacked) + len(f.pending) for f in self._send_flows.values())
            out["timer_wakeups"] = self._timer_count
        if self._faults is not None:
            out.update({f"fault.{k}": v for k, v in self._faults.counts.items()})
        if self._native is not None:
            gauges = ("flows.send", "flows.recv", "unacked")
            for name, value in self._native.engine.stats().items():
                out[name] = value if name in gauges else out.get(name, 0) + value
            out["timer_wakeups"] = out.get("native.wakeups", 0)
        return out

    def drops(self) -> dict[str, int]:
        """Dropped datagrams by reason."""
        return {k[5:]: v for k, v in self.stats().items() if k.startswith("drop.")}

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every sent datagram is acknowledged; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._native is not None:
                busy = bool(self._native.engine.busy())
            else:
                with self._lock:
                    flows = self._send_flows.values()
                    busy = any((f.unacked or f.pending) and f.failed is None for f in flows)
            if not busy:
                return True
            time.sleep(0.001)
        return False

    # ---- sending --------------------------------------------------------------------
    def send(self, peer: Addr, header: CheckmateHeader, payload: Buffer = b"") -> None:
        """Queue one DATA datagram reliably to ``peer`` (never blocks).

        ``header.sequence`` is assigned here. ``payload`` is sent and resent
        from the given memory, which must stay unchanged until acknowledged.
        Raises :class:`PeerTimeoutError` if the flow to ``peer`` has failed.
        """
        self.send_packed(peer, header.job_id, bytearray(header.pack()), payload)

    def send_packed(self, peer: Addr, job_id: int, header_bytes: bytearray, payload: Buffer = b"") -> None:
        """:meth:`send` with the header packed (:func:`checkmate.wire.pack_data_header`); see
        :meth:`hosts.transport_flow.FlowControl.send_packed`. The native path copies ``payload``."""
        if self._native is None:
            super().send_packed(peer, job_id, header_bytes, payload)
            return
        if self._stop.is_set():
            raise TransportClosedError(f"transport {self.address} is closed")
        view = memoryview(payload).cast("B") if not isinstance(payload, memoryview) else payload
        if len(view) > MAX_PAYLOAD_BYTES:
            raise WireFormatError(f"payload of {len(view)} bytes exceeds {MAX_PAYLOAD_BYTES}")
        self._native.send(peer, job_id, header_bytes, view)

    def _emit(self, parts: Sequence[Buffer], addr: Addr) -> None:
        if self._native is None:
            super()._emit(parts, addr)
            return
        if parts[0][1] != DATA_TYPE:  # every type but DATA carries the job's MAC
            job = self._jobs.get(datagram_job(parts[0]))
            if job is None or job.auth is None:
                self.count("send_no_key")
                return
            parts = job.auth.seal(parts)
        self._native.emit(b"".join(parts), addr)

    def send_unreliable(self, addr: Addr, header: CheckmateHeader | bytes, payload: Buffer = b"") -> None:
        """Send one datagram once, outside any flow (repair answers, NACKs of repair requests).

        ``header``: a header, or its 32 packed bytes.
        """
        self._emit((header if isinstance(header, bytes) else header.pack(), payload), addr)
        self.count("unreliable_sent")
