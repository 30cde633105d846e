"""The StreamChannel of the embedded switch's server: arbitration, PacketOut, PacketIn.

Each StreamChannel RPC gets a :class:`~embedded_switch.p4runtime.sessions.Session`; a
reader thread per stream parses requests (arbitration goes to the
:class:`~embedded_switch.p4runtime.sessions.Arbiter`, PacketOut to the data path) while
the RPC's own thread sends what lands in the session's outbox.

PacketOut is accepted from the primary only. The P4Info may declare
``controller_packet_metadata`` "packet_out"; a metadata field named ``egress_port`` then
names the port the payload is sent out of. Without it (our program declares none) the
payload is injected as if received on the CPU port: ``on_packet_out(payload, cpu_port)``;
with no CPU port configured it is refused with a StreamError. PacketIn goes to the
primary of the default role; beyond :data:`MAX_QUEUED_PACKET_INS` waiting for a slow
controller it is dropped and counted (nothing is dropped silently).

Locks: arbitration state under ``Arbiter.lock`` (taken by the arbiter's methods);
``PacketIO``'s counters under its own ``stats_lock``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
from google.rpc import code_pb2
from p4.v1 import p4runtime_pb2

from checkmate.p4.bytestrings import encode_bytestring
from embedded_switch.p4runtime.config import PipelineStore
from embedded_switch.p4runtime.errors import INVALID, OK, Failure, code_name, decode_value, parse, set_failure
from embedded_switch.p4runtime.sessions import DEFAULT_ROLE, Arbiter, End, Session

logger = logging.getLogger(__name__)

MAX_QUEUED_PACKET_INS = 1024
"""Packet-ins waiting for a slow controller beyond this are dropped (and counted)."""
_STREAM_POLL_S = 0.5


@dataclass
class P4RuntimeStats:
    """Packet I/O counts of the server (nothing is dropped silently)."""

    packet_ins_sent: int = 0
    packet_ins_dropped: int = 0
    packet_outs_accepted: int = 0
    packet_outs_rejected: int = 0


class PacketIO:
    """PacketIn to the primary controller, PacketOut from it into the data path."""

    def __init__(
        self,
        arbiter: Arbiter,
        pipelines: PipelineStore,
        cpu_port: int | None,
        on_packet_out: Callable[[bytes, int], None] | None,
    ) -> None:
        self._arbiter = arbiter
        self._pipelines = pipelines
        self.cpu_port = cpu_port
        self._on_packet_out = on_packet_out
        self.stats = P4RuntimeStats()
        self.stats_lock = threading.Lock()

    def send_packet_in(self, payload: bytes, ingress_port: int) -> None:
        """Send a PacketIn to the primary controller (of the default role); dropped and counted if none."""
        pipeline = self._pipelines.committed
        msg = p4runtime_pb2.StreamMessageResponse()
        msg.packet.payload = payload
        if pipeline is not None:
            for m in pipeline.index.packet_in:
                value = ingress_port & ((1 << m.bitwidth) - 1) if m.name == "ingress_port" else 0
                msg.packet.metadata.add(metadata_id=m.id, value=encode_bytestring(value))
        refused = self._arbiter.send_to_primary(msg, DEFAULT_ROLE, MAX_QUEUED_PACKET_INS)
        with self.stats_lock:
            if refused is None:
                self.stats.packet_ins_sent += 1
            else:
                self.stats.packet_ins_dropped += 1
        if refused is not None:
            logger.debug("packet-in from port %d dropped: %s", ingress_port, refused)

    def packet_out(self, session: Session, packet: p4runtime_pb2.PacketOut) -> bool:
        """Hand a PacketOut to the data path; False (and a StreamError to the client) if refused."""

        def reject(code: int, message: str) -> bool:
            with self.stats_lock:
                self.stats.packet_outs_rejected += 1
            logger.debug("PacketOut from %s rejected: %s", session.peer, message)
            err = p4runtime_pb2.StreamMessageResponse()
            err.error.canonical_code = code
            err.error.message = message
            err.error.packet_out.packet_out.CopyFrom(packet)
            session.outbox.put(err)
            return False

        arbitrated, is_primary = self._arbiter.standing(session)
        if not arbitrated:
            return reject(code_pb2.FAILED_PRECONDITION, "send a MasterArbitrationUpdate before any PacketOut")
        if not is_primary:
            return reject(
                code_pb2.PERMISSION_DENIED, "PacketOut is accepted from the primary controller only"
            )
        pipeline = self._pipelines.committed
        if pipeline is None:
            return reject(code_pb2.FAILED_PRECONDITION, "No forwarding pipeline config set for this device")
        declared = {m.id: m for m in pipeline.index.packet_out}
        port = self.cpu_port
        for md in packet.metadata:
            info = declared.get(md.metadata_id)
            if info is None:
                return reject(
                    INVALID, f"PacketOut metadata id {md.metadata_id} is not in the P4Info's packet_out"
                )
            try:
                value = decode_value(md.value, info.bitwidth, f"PacketOut metadata {info.name}")
            except Failure as e:
                return reject(e.code, e.message)
            if info.name == "egress_port":
                port = value
        if port is None:
            return reject(
                code_pb2.FAILED_PRECONDITION,
                "no CPU port configured (--cpu-port): PacketOut without egress_port metadata "
                "cannot be injected",
            )
        if self._on_packet_out is None:
            return reject(code_pb2.UNAVAILABLE, "no data path is attached to this P4Runtime server")
        try:
            self._on_packet_out(bytes(packet.payload), port)
        except Exception as e:  # noqa: BLE001 - the data path's failure must cost one packet, not the stream
            logger.exception("data path failed on a PacketOut to port %d", port)
            return reject(code_pb2.INTERNAL, f"the data path failed to send the packet: {e}")
        with self.stats_lock:
            self.stats.packet_outs_accepted += 1
        return True


class StreamChannel:
    """Serves StreamChannel RPCs: one session per stream, a reader thread per session."""

    def __init__(self, arbiter: Arbiter, packets: PacketIO) -> None:
        self._arbiter = arbiter
        self._packets = packets

    def serve(
        self, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[p4runtime_pb2.StreamMessageResponse]:
        session = self._arbiter.open_session(context.peer())
        context.add_callback(lambda: self._arbiter.close_session(session))
        reader = threading.Thread(
            target=self._read_stream,
            args=(session, requests),
            name=f"p4runtime-stream-{session.sid}",
            daemon=True,
        )
        reader.start()
        try:
            while True:
                try:
                    item = session.outbox.get(timeout=_STREAM_POLL_S)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                if isinstance(item, End):
                    if item.code != OK:
                        logger.info(
                            "stream from %s ended: %s %s", session.peer, code_name(item.code), item.message
                        )
                        set_failure(context, Failure(item.code, item.message))
                    return
                yield item
        finally:
            self._arbiter.close_session(session)

    def _read_stream(self, session: Session, requests: Iterator[bytes]) -> None:
        end = End()
        try:
            for raw in requests:
                if session.closed:
                    return
                try:
                    request = parse(p4runtime_pb2.StreamMessageRequest, raw, "StreamMessageRequest")
                except Failure as e:
                    self._stream_error(session, e.code, e.message)
                    continue
                result = self._handle_stream_message(session, request)
                if result is not None:
                    end = result
                    return
        except grpc.RpcError:
            logger.debug("stream from %s cancelled", session.peer)
        except Exception:  # noqa: BLE001 - a bug ends this stream, never the server
            logger.exception("stream from %s failed", session.peer)
            end = End(code_pb2.INTERNAL, "internal error on the stream; see the switch log")
        finally:
            session.outbox.put(end)

    def _stream_error(self, session: Session, code: int, message: str) -> None:
        msg = p4runtime_pb2.StreamMessageResponse()
        msg.error.canonical_code = code
        msg.error.message = message
        msg.error.other.SetInParent()
        session.outbox.put(msg)

    def _handle_stream_message(
        self, session: Session, request: p4runtime_pb2.StreamMessageRequest
    ) -> End | None:
        kind = request.WhichOneof("update")
        if kind == "arbitration":
            return self._arbiter.arbitrate(session, request.arbitration)
        if kind == "packet":
            self._packets.packet_out(session, request.packet)
        elif kind == "digest_ack":
            msg = p4runtime_pb2.StreamMessageResponse()
            msg.error.canonical_code = code_pb2.UNIMPLEMENTED
            msg.error.message = "this target has no digests"
            msg.error.digest_list_ack.digest_list_ack.CopyFrom(request.digest_ack)
            session.outbox.put(msg)
        elif kind == "other":
            self._stream_error(
                session, code_pb2.UNIMPLEMENTED, "architecture-specific stream messages are not supported"
            )
        else:
            self._stream_error(session, INVALID, "StreamMessageRequest has no update set")
        return None
