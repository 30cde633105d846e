"""The receive thread of :class:`hosts.transport.Transport`: UDP GRO reads, checks, dispatch.

:class:`Receiver` reads the socket in bursts (up to 256 reads per wake-up), splits a coalesced
GRO run by the segment size the kernel reports, and dispatches each datagram: control
datagrams are opened with the job's MAC first; DATA takes the per-datagram path (its header
as ints, no header object) to the flow bookkeeping and the job's handler; ACK/NACK go to
:meth:`hosts.transport_flow.FlowControl._on_ack`; repair requests to the job's service. Bad
datagrams are dropped and counted by reason. A burst runs inside
:meth:`hosts.transport_io.TransportIO.batch`, so forwards leave in GSO runs at its end, and
ends with the batched ACKs. Reading and dispatch take no lock; the flow bookkeeping takes
``_lock``. Handlers run on this thread and must copy what they keep.
"""

from __future__ import annotations

import logging
import select
import socket
import struct

from checkmate.auth import datagram_job, needs_tag
from checkmate.network import Addr
from checkmate.wire import HEADER_BYTES, MAX_PAYLOAD_BYTES, MessageType, WireFormatError, decode, decode_data
from hosts.transport_flow import FlowControl
from hosts.transport_io import BATCH_FLUSH, DATA_TYPE, SOL_UDP, UDP_GRO

logger = logging.getLogger(__name__)

_GRO_SEGMENT = struct.Struct("=i")
_GRO_CMSG_SPACE = socket.CMSG_SPACE(_GRO_SEGMENT.size)


class Receiver(FlowControl):
    """The receive thread's loop and per-datagram dispatch."""

    def _receive_loop(self) -> None:
        buf = bytearray(65536 if self._gro else HEADER_BYTES + MAX_PAYLOAD_BYTES + 1024)
        view = memoryview(buf)
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        poller.register(self._rx_wake[0], select.POLLIN)  # close() writes to it: no polling timeout
        sock = self._sock
        while not self._stop.is_set():
            try:
                if not poller.poll():
                    continue
            except OSError:
                return
            if self._stop.is_set():
                return
            with self.batch():  # forwards and first sends go out in GSO runs at the end of the burst
                for _ in range(256):
                    segment = 0
                    try:
                        if self._gro:
                            n, control, _flags, addr = sock.recvmsg_into([buf], _GRO_CMSG_SPACE)
                            for level, kind, data in control:
                                if level == SOL_UDP and kind == UDP_GRO and len(data) >= 4:
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
                    if len(self._outgoing) >= BATCH_FLUSH:
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
        self._handle_datagram(data, addr)

    def _handle_datagram(self, data: memoryview, addr: Addr) -> None:
        """Check and dispatch one datagram (after the injected receive loss; the native data path
        hands up the datagrams it leaves to these checks)."""
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
            len(data) > 1 and data[1] == DATA_TYPE
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
