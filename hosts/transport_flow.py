"""Flows of :class:`hosts.transport.Transport`: send windows, ACK/SACK/NACK, retransmission timers.

A flow is (peer address, job, direction). :class:`FlowControl` holds the state machine of both
directions, all of it under the transport's ``_lock`` (an ``RLock``):

* sending (caller threads): :meth:`FlowControl.send_packed` numbers a DATA datagram and sends
  it if the window allows, else queues it; ACKs refill the window;
* receiving (the receive thread): :meth:`FlowControl._accept_data` drops duplicates and keeps
  the cumulative sequence and the set above it; ACKs go out every ``ack_every`` datagrams and at
  the end of each burst (:meth:`FlowControl._flush_acks`); :meth:`FlowControl._on_ack` takes
  ACK/NACK ranges, samples RTT (Karn's rule) and resends on SACK/NACK evidence;
* the timer thread (:meth:`FlowControl._timer_loop`): retransmission timeouts with backoff,
  NACKs of persistent gaps, dead-peer detection; failure callbacks run outside the lock.

Also here: the ACK/NACK range codec (docs/protocol.md). The flow records, the job record and
the errors a flow raises live in :mod:`hosts.transport_records` (re-exported here).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Sequence

from checkmate.network import Addr
from checkmate.wire import (
    MAX_PAYLOAD_BYTES,
    CheckmateHeader,
    DType,
    Flags,
    MessageType,
    WireFormatError,
    add_flags,
    decode,
    set_sequence,
)
from hosts.transport_io import Buffer, TransportIO
from hosts.transport_records import (
    DataFieldsHandler,
    DataHandler,
    FailureHandler,
    Job,
    Outstanding,
    PeerTimeoutError,
    RecvFlow,
    SendFlow,
    TransportClosedError,
)

__all__ = [
    "MAX_RANGES",
    "MAX_SEQUENCE",
    "DataFieldsHandler",
    "DataHandler",
    "FailureHandler",
    "FlowControl",
    "Job",
    "Outstanding",
    "PeerTimeoutError",
    "RecvFlow",
    "SendFlow",
    "TransportClosedError",
    "pack_ranges",
    "unpack_ranges",
]

logger = logging.getLogger(__name__)

MAX_SEQUENCE = (1 << 32) - 1
_NEVER = float("inf")
"""The timer's deadline when nothing is outstanding: it sleeps until woken."""
MAX_RANGES = 128
"""Most SACK/NACK ranges one ACK or NACK carries (1 KiB of payload)."""
_RANGE = struct.Struct("!II")


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


class FlowControl(TransportIO):
    """Both directions of every flow, and the timer thread (all under ``_lock``)."""

    tap: Callable[[CheckmateHeader, Addr, bool], None] | None
    copy_hook: Callable[[bytes, Addr], None] | None

    # ---- sending --------------------------------------------------------------------
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
                flow = SendFlow(
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
            item = Outstanding(seq=seq, header_bytes=header_bytes, payload=view)
            if len(flow.unacked) < min(self.config.window, flow.peer_window) and not flow.pending:
                self._transmit(flow, item, time.monotonic())
            else:
                flow.pending.append(item)

    def _transmit(self, flow: SendFlow, item: Outstanding, now: float) -> None:
        """First transmission of ``item`` (lock held)."""
        if not flow.unacked:
            flow.last_progress = now
            self._wake_timer(now + flow.rto * flow.backoff)
        item.first_sent = item.last_sent = now
        flow.unacked[item.seq] = item
        self._emit((item.header_bytes, item.payload), flow.peer)
        self._counters["data_sent"] = self._counters.get("data_sent", 0) + 1
        if self.tap is not None:
            self.tap(decode(bytes(item.header_bytes) + bytes(item.payload))[0], flow.peer, False)
        if self.copy_hook is not None:
            self.copy_hook(bytes(item.header_bytes) + bytes(item.payload), flow.peer)

    def _retransmit(self, flow: SendFlow, item: Outstanding, now: float, why: str) -> None:
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
        if self.copy_hook is not None:
            self.copy_hook(bytes(item.header_bytes) + bytes(item.payload), flow.peer)

    def _fill_window(self, flow: SendFlow, now: float) -> None:
        limit = min(self.config.window, flow.peer_window)
        while flow.pending and len(flow.unacked) < limit:
            self._transmit(flow, flow.pending.popleft(), now)

    # ---- receiving ------------------------------------------------------------------
    def _accept_data(self, job_id: int, seq: int, addr: Addr) -> bool:
        """Flow bookkeeping for one DATA datagram; False for a duplicate or out-of-window one."""
        key = (addr, job_id)
        with self._lock:
            flow = self._recv_flows.get(key)
            if flow is None:
                flow = self._recv_flows[key] = RecvFlow(peer=addr, job_id=job_id)
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
                    self._wake_timer(self._nack_due(flow))
                flow.ooo.add(seq)
                flow.ack_due = True
            flow.since_ack += 1
            self._counters["data_received"] = self._counters.get("data_received", 0) + 1
            if flow.since_ack >= self.config.ack_every:
                self._send_ack(flow)
        return True

    def _nack_due(self, flow: RecvFlow) -> float:
        """When the gap of ``flow`` may be NACKed (``nack_delay`` old, ``nack_interval`` after the last)."""
        return max(flow.gap_since + self.config.nack_delay, flow.last_nack + self.config.nack_interval)

    def _send_ack(self, flow: RecvFlow) -> None:
        """ACK: sequence = cumulative ack, element_offset = advertised window, payload = SACK ranges."""
        job = self._jobs.get(flow.job_id)
        if job is None:
            return
        ranges = _to_ranges(sorted(flow.ooo)) if flow.ooo else []
        flow.since_ack = 0
        flow.ack_due = False
        self._emit(self._range_datagram(MessageType.ACK, flow, job.rank, ranges), flow.peer)
        self._counters["acks_sent"] = self._counters.get("acks_sent", 0) + 1

    def _send_nack(self, flow: RecvFlow, now: float) -> None:
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
        flow.last_nack = now
        self._emit(self._range_datagram(MessageType.NACK, flow, job.rank, missing), flow.peer)
        self._counters["nacks_sent"] = self._counters.get("nacks_sent", 0) + 1

    def _range_datagram(
        self, msg_type: MessageType, flow: RecvFlow, rank: int, ranges: list[tuple[int, int]]
    ) -> tuple[bytes, bytes]:
        """An ACK or NACK to ``flow``'s peer: cumulative ack, advertised window, ``ranges``."""
        header = CheckmateHeader(
            msg_type=msg_type,
            job_id=flow.job_id,
            iteration=0,
            bucket_id=0,
            sender_rank=rank,
            element_offset=self.advertised_window,
            element_count=len(ranges),
            sequence=flow.cum,
            dtype=DType.NONE,
        )
        return header.pack(), pack_ranges(ranges)

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

    def _update_rtt(self, flow: SendFlow, sample: float) -> None:
        if flow.srtt is None:
            flow.srtt, flow.rttvar = sample, sample / 2
        else:
            flow.rttvar = 0.75 * flow.rttvar + 0.25 * abs(flow.srtt - sample)
            flow.srtt = 0.875 * flow.srtt + 0.125 * sample
        flow.rto = min(self.config.max_rto, max(self.config.min_rto, flow.srtt + 4 * flow.rttvar))

    # ---- timers ---------------------------------------------------------------------
    def _timer_loop(self) -> None:
        """Sleep until the next deadline (none: until woken), then run :meth:`_on_tick`.

        No wake-ups while nothing is outstanding: :meth:`_wake_timer` wakes the thread when a
        flow gets data outstanding, a gap appears or a datagram is held, if that makes a
        deadline earlier than the one it sleeps towards. Deadlines closer than ``timer_tick``
        apart are served in one wake-up.
        """
        tick = self.config.timer_tick
        wake = self._timer_event
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                deadline = self._on_tick(now)  # also publishes it and clears ``wake``, under ``_lock``
            except Exception:  # noqa: BLE001 - keep the timer alive; the error is logged
                logger.exception("transport timer failed")
                deadline = now + tick
            if self._stop.is_set():
                return
            if deadline == _NEVER:
                wake.wait()
            else:
                wake.wait(max(deadline - time.monotonic(), tick))
            self._timer_count += 1

    def _on_tick(self, now: float) -> float:
        """Serve every deadline due at ``now``; the next deadline (``_NEVER`` when none)."""
        failures: list[tuple[Job | None, PeerTimeoutError]] = []
        held = None
        tick = self.config.timer_tick
        nxt = _NEVER
        with self._lock:
            if self._held is not None:
                if now - self._held[2] >= tick:
                    held, self._held = self._held, None
                else:
                    nxt = self._held[2] + tick
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
                nxt = min(nxt, flow.last_progress + self.config.peer_timeout)
                if now - flow.last_progress < timeout:
                    # The peer acknowledged something within the RTO: it is draining what it was
                    # sent, only late (a busy or starved receiver). Resending now would only add
                    # duplicates to its full buffer; real losses are resent on SACK/NACK evidence.
                    nxt = min(nxt, flow.last_progress + timeout)
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
                if flow.unacked:  # the oldest transmission's timeout (with the new backoff)
                    oldest = next(iter(flow.unacked.values()))
                    timeout = flow.rto * flow.backoff
                    nxt = min(nxt, max(oldest.last_sent, flow.last_progress) + timeout)
            for rflow in self._recv_flows.values():
                if not rflow.ooo:
                    continue
                if (
                    now - rflow.gap_since >= self.config.nack_delay
                    and now - rflow.last_nack >= self.config.nack_interval
                ):
                    self._send_nack(rflow, now)
                nxt = min(nxt, self._nack_due(rflow))
            # published under the lock that every waker holds, so no wake-up falls in between
            self._timer_deadline = nxt
            self._timer_event.clear()
        if held is not None:
            self._sendmsg(held[0], held[1])
        for job, error in failures:
            logger.error("%s", error)
            if job is not None and job.on_failure is not None:
                job.on_failure(error)
        return nxt
