"""The P4Runtime gRPC server of the embedded switch target: assembles the parts and serves them.

Serves the ``p4.v1.P4Runtime`` service (P4Runtime spec v1.3+, the protos of the
``p4runtime`` package) for the one program this target runs, answering the way
``simple_switch_grpc`` (BMv2 + PI) does, so a controller cannot tell the two apart.
Each concern has its own module under :mod:`embedded_switch.p4runtime`, and each part
takes its own lock:

- ``errors``: canonical errors, the Status trailer, bytestrings. No lock (pure).
- ``index``: the P4Info by id; match keys and actions in and out. No lock (immutable).
- ``sessions``: StreamChannel sessions and arbitration per role. ``Arbiter.lock``.
- ``stream``: the StreamChannel RPC, PacketOut and PacketIn. ``Arbiter.lock`` (through the
  arbiter's methods) and ``PacketIO.stats_lock``, one after the other.
- ``config``: Set/GetForwardingPipelineConfig. ``PipelineStore.lock``.
- ``write``: Write (CONTINUE_ON_ERROR, ROLLBACK_ON_ERROR, DATAPLANE_ATOMIC).
  ``SwitchState.write_lock`` for the whole batch.
- ``read``: Read, with wildcards. ``SwitchState.write_lock`` while collecting.

No two of these locks are ever held together; the data path takes none of them.

Errors follow the spec: a failed Write batch ends with gRPC status UNKNOWN and a
``grpc-status-details-bin`` trailer holding a ``google.rpc.Status`` whose details are one
packed ``p4.v1.Error`` per update (OK for those that succeeded), as PI does, so
p4runtime-shell's ``P4RuntimeWriteException`` prints them. Errors of a whole request
(not primary, no pipeline, wrong device, malformed protobuf, a missing entry in a Read)
end with that canonical code and a ``google.rpc.Status`` of the same code in the trailer.
A bug in one RPC ends that RPC with INTERNAL, never the server.

Safe by default (docs/security.md): the default address is loopback; TLS without client
certificates (anyone who reaches the port could take the primary role) and plaintext on
an address other than loopback or a unix socket are refused unless the caller says
``insecure=True`` (``checkmate-switch --insecure-...``), which is logged as such.
StreamChannels are bounded per peer and in all, idle ones cancelled, and the gRPC pool
keeps threads for the other calls (:mod:`embedded_switch.p4runtime_limits`).
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf.message import Message
from google.rpc import code_pb2
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2

from checkmate.p4.p4info import load_p4info
from checkmate.tls import DEFAULT_P4RUNTIME_ADDRESS, InsecureServerError, TlsConfigError, TlsFiles, exposure
from embedded_switch import program
from embedded_switch.p4runtime import read, write
from embedded_switch.p4runtime.config import PipelineAction, PipelineStore, ResponseType
from embedded_switch.p4runtime.errors import Failure, parse, set_failure, uint128
from embedded_switch.p4runtime.sessions import Arbiter, End
from embedded_switch.p4runtime.stream import P4RuntimeStats, PacketIO, StreamChannel
from embedded_switch.p4runtime_limits import StreamGate, StreamLimits
from embedded_switch.state import SwitchState

logger = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def _api_version() -> str:
    try:
        return importlib.metadata.version("p4runtime")
    except importlib.metadata.PackageNotFoundError:
        return "1.4.1"


class P4RuntimeServer:
    """The P4Runtime service of one embedded switch (one device id)."""

    def __init__(
        self,
        device_id: int,
        address: str = DEFAULT_P4RUNTIME_ADDRESS,
        cpu_port: int | None = None,
        on_pipeline: Callable[[SwitchState], None] | None = None,
        on_packet_out: Callable[[bytes, int], None] | None = None,
        tls: TlsFiles | None = None,
        client_auth: bool = False,
        insecure: bool = False,
        limits: StreamLimits | None = None,
    ) -> None:
        """``tls``: serve P4Runtime over TLS with ``tls.cert``/``tls.key``; ``client_auth``: accept only
        clients whose certificate ``tls.ca`` signed (mutual TLS). None: plaintext (tutorial workflow,
        loopback or a unix socket only unless ``insecure``). ``insecure``: also serve TLS without
        client certificates, or plaintext on another address (logged). InsecureServerError otherwise."""
        if tls is not None and (tls.cert is None or tls.key is None):
            raise TlsConfigError("a TLS P4Runtime server needs its certificate and key")
        why = exposure(address, tls is not None, client_auth)
        if why is not None and not insecure:
            raise InsecureServerError(
                f"refusing to serve P4Runtime with {why}; use mutual TLS (--grpc-server-with-client-auth) "
                "or say so explicitly (--insecure-grpc-server)"
            )
        self._exposure = why
        self._tls = (tls.read(), client_auth) if tls is not None else None
        self.device_id = device_id
        self.address = address
        self._server: grpc.Server | None = None
        reference = load_p4info()
        program.check_pipeline(reference)  # the committed P4Info is what the interpreter reads, by name
        self._pipelines = PipelineStore(device_id, reference, on_pipeline)
        self._arbiter = Arbiter(device_id)
        self._packets = PacketIO(self._arbiter, self._pipelines, cpu_port, on_packet_out)
        self._streams = StreamChannel(self._arbiter, self._packets)
        self.limits = limits or StreamLimits()
        self._gate = StreamGate(self._streams.serve, self.limits, f"P4Runtime device {device_id}")

    @property
    def refusals(self) -> dict[str, int]:
        """Streams refused or cancelled, by cause (p4runtime_streams, _per_host, _idle_stream)."""
        return dict(self._gate.refused)

    @property
    def cpu_port(self) -> int | None:
        return self._packets.cpu_port

    @property
    def stats(self) -> P4RuntimeStats:
        """Packet I/O counts of the server (nothing is dropped silently)."""
        return self._packets.stats

    # ---- lifecycle -----------------------------------------------------------------
    def start(self) -> int:
        """Bind and serve; returns the bound TCP port (``address`` may use port 0)."""
        if self._server is not None:
            raise RuntimeError("P4RuntimeServer already started")
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.limits.pool_size, thread_name_prefix="p4runtime"),
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ],
        )
        server.add_generic_rpc_handlers((self._handlers(),))
        try:
            if self._tls is not None:
                (ca, cert, key), client_auth = self._tls
                assert cert is not None and key is not None
                credentials = grpc.ssl_server_credentials(
                    [(key, cert)],
                    root_certificates=ca if client_auth else None,
                    require_client_auth=client_auth,
                )
                port = server.add_secure_port(self.address, credentials)
            else:
                port = server.add_insecure_port(self.address)
        except RuntimeError as e:
            raise OSError(f"P4Runtime server cannot bind {self.address}: {e}") from None
        if port == 0:
            raise OSError(f"P4Runtime server cannot bind {self.address} (address in use?)")
        server.start()
        self._server = server
        if self._exposure is not None:
            logger.warning(
                "P4Runtime server for device %d: INSECURE, as asked: %s", self.device_id, self._exposure
            )
        logger.info(
            "P4Runtime server for device %d listening on %s (port %d), %s",
            self.device_id,
            self.address,
            port,
            "plaintext (tutorial workflow: anyone who reaches the port can program the switch)"
            if self._tls is None
            else "TLS" + (" with client certificates (mutual TLS)" if self._tls[1] else ""),
        )
        return int(port)

    def stop(self, grace: float = 1.0) -> None:
        """End every stream and stop serving, waiting at most ``grace`` seconds (plus one) for RPCs."""
        server, self._server = self._server, None
        for s in self._arbiter.sessions():
            s.outbox.put(End())
        if server is not None:
            server.stop(grace).wait(timeout=grace + 1.0)
            logger.info("P4Runtime server for device %d stopped", self.device_id)

    # ---- pipeline ------------------------------------------------------------------
    @property
    def state(self) -> SwitchState | None:
        """The state the data path runs, or None until a pipeline is committed."""
        pipeline = self._pipelines.committed
        return pipeline.state if pipeline is not None else None

    def load_pipeline(self, p4info: p4info_pb2.P4Info | str | Path) -> None:
        """Commit ``p4info`` (a message or a text-format file) as VERIFY_AND_COMMIT would.

        Raises program.ProgramMismatchError when it is not the Checkmate program.
        """
        if isinstance(p4info, str | Path):
            p4info = load_p4info(Path(p4info))
        try:
            pipeline = self._pipelines.prepare(p4runtime_pb2.ForwardingPipelineConfig(p4info=p4info))
        except Failure as e:
            raise program.ProgramMismatchError(e.message) from None
        self._pipelines.commit(pipeline)

    def load_default_pipeline(self) -> None:
        """Commit the Checkmate program's own P4Info (p4src/checkmate.p4info.txtpb)."""
        self.load_pipeline(self._pipelines.reference)

    def send_packet_in(self, payload: bytes, ingress_port: int) -> None:
        """Send a PacketIn to the primary controller (of the default role); dropped and counted if none."""
        self._packets.send_packet_in(payload, ingress_port)

    # ---- the RPCs ------------------------------------------------------------------
    def _write(self, raw: bytes) -> p4runtime_pb2.WriteResponse:
        request = parse(p4runtime_pb2.WriteRequest, raw, "WriteRequest")
        self._arbiter.check_device(request.device_id)
        self._arbiter.check_primary(
            request.role, uint128(request.election_id) if request.HasField("election_id") else None
        )
        return write.write(self._pipelines.for_requests(), request)

    def _read(self, raw: bytes) -> list[p4runtime_pb2.ReadResponse]:
        request = parse(p4runtime_pb2.ReadRequest, raw, "ReadRequest")
        self._arbiter.check_device(request.device_id)
        return read.read(self._pipelines.for_requests(), request)

    def _set_pipeline(self, raw: bytes) -> p4runtime_pb2.SetForwardingPipelineConfigResponse:
        request = parse(PipelineAction, raw, "SetForwardingPipelineConfigRequest")
        self._arbiter.check_device(request.device_id)
        self._arbiter.check_primary(
            request.role, uint128(request.election_id) if request.HasField("election_id") else None
        )
        return self._pipelines.set_pipeline(request)

    def _get_pipeline(self, raw: bytes) -> p4runtime_pb2.GetForwardingPipelineConfigResponse:
        request = parse(ResponseType, raw, "GetForwardingPipelineConfigRequest")
        self._arbiter.check_device(request.device_id)
        return self._pipelines.get_pipeline(request)

    @staticmethod
    def _capabilities(raw: bytes) -> p4runtime_pb2.CapabilitiesResponse:
        parse(p4runtime_pb2.CapabilitiesRequest, raw, "CapabilitiesRequest")
        return p4runtime_pb2.CapabilitiesResponse(p4runtime_api_version=_api_version())

    # ---- gRPC plumbing -------------------------------------------------------------
    def _handlers(self) -> grpc.GenericRpcHandler:
        def raw(data: bytes) -> bytes:
            return data

        def unary(
            name: str, fn: Callable[[bytes], Message], empty: Callable[[], Message]
        ) -> grpc.RpcMethodHandler:
            def handler(request: bytes, context: grpc.ServicerContext) -> Message:
                try:
                    return fn(request)
                except Failure as e:
                    set_failure(context, e)
                except Exception:  # noqa: BLE001 - a bug costs one RPC, never the server
                    logger.exception("P4Runtime %s failed", name)
                    set_failure(
                        context, Failure(code_pb2.INTERNAL, f"internal error in {name}; see the switch log")
                    )
                return empty()

            return grpc.unary_unary_rpc_method_handler(
                handler, request_deserializer=raw, response_serializer=lambda m: m.SerializeToString()
            )

        def read(request: bytes, context: grpc.ServicerContext) -> Iterator[p4runtime_pb2.ReadResponse]:
            try:
                responses = self._read(request)
            except Failure as e:
                set_failure(context, e)
                return
            except Exception:  # noqa: BLE001 - a bug costs one RPC, never the server
                logger.exception("P4Runtime Read failed")
                set_failure(context, Failure(code_pb2.INTERNAL, "internal error in Read; see the switch log"))
                return
            yield from responses

        return grpc.method_handlers_generic_handler(
            "p4.v1.P4Runtime",
            {
                "Write": unary("Write", self._write, p4runtime_pb2.WriteResponse),
                "Read": grpc.unary_stream_rpc_method_handler(
                    read, request_deserializer=raw, response_serializer=lambda m: m.SerializeToString()
                ),
                "SetForwardingPipelineConfig": unary(
                    "SetForwardingPipelineConfig",
                    self._set_pipeline,
                    p4runtime_pb2.SetForwardingPipelineConfigResponse,
                ),
                "GetForwardingPipelineConfig": unary(
                    "GetForwardingPipelineConfig",
                    self._get_pipeline,
                    p4runtime_pb2.GetForwardingPipelineConfigResponse,
                ),
                "StreamChannel": grpc.stream_stream_rpc_method_handler(
                    self._gate.serve,
                    request_deserializer=raw,
                    response_serializer=lambda m: m.SerializeToString(),
                ),
                "Capabilities": unary("Capabilities", self._capabilities, p4runtime_pb2.CapabilitiesResponse),
            },
        )
