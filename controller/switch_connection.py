"""One P4Runtime session with one switch, built on p4runtime-shell's client.

p4runtime-shell's interactive shell keeps a single global connection, so the
controller opens one :class:`SwitchConnection` per switch on top of its
``P4RuntimeClient`` (the stream channel, arbitration and stub), with two
changes: the channel must become ready within ``timeout`` seconds or
:class:`SwitchUnreachableError` is raised (the stock client would exit the
process), and every RPC carries a deadline. Writes return the per-update
``p4.v1.Error`` list that a spec-conformant server puts in
``grpc-status-details-bin``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
from google.rpc import code_pb2, status_pb2
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2
from p4runtime_sh.p4runtime import P4RuntimeClient, SSLOptions

from checkmate.tls import TlsConfigError, TlsFiles, check_files
from controller.errors import (
    ControllerError,
    NoPipelineError,
    NotPrimaryError,
    SwitchRpcError,
    SwitchUnreachableError,
    UpdateError,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
PIPELINE_TIMEOUT_S = 60.0
"""Pushing a pipeline can take far longer than a write (BMv2 rebuilds its whole state)."""


def _code_name(code: int) -> str:
    try:
        return code_pb2.Code.Name(code)
    except ValueError:
        return f"CODE_{code}"


class _Client(P4RuntimeClient):
    """p4runtime-shell's client with a bounded connect and a handshake that raises."""

    def __init__(
        self,
        switch: str,
        device_id: int,
        address: str,
        election_id: int,
        timeout: float,
        tls: TlsFiles | None = None,
    ) -> None:
        self._switch = switch
        self._address = address
        self._timeout = timeout
        self._tls = tls
        self.is_primary = False
        self.primary_election_id: tuple[int, int] | None = None
        ssl = None
        if tls is not None:
            ssl = SSLOptions(
                False,
                str(tls.ca),
                None if tls.cert is None else str(tls.cert),
                None if tls.key is None else str(tls.key),
            )
        super().__init__(device_id, address, (0, election_id), ssl_options=ssl)

    def set_up_stream(self) -> None:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=self._timeout)
        except grpc.FutureTimeoutError:
            self.channel.close()
            if self._tls is not None:
                raise SwitchUnreachableError(
                    f"switch {self._switch} ({self._address}, device {self.device_id}): no TLS session "
                    f"within {self._timeout:g} s: the handshake failed or nobody answers (is the switch "
                    "serving TLS; "
                    f"is its certificate signed by {self._tls.ca}, unexpired and naming {self._address}; "
                    "does it take this controller's certificate?)"
                ) from None
            raise SwitchUnreachableError(
                f"switch {self._switch} ({self._address}, device {self.device_id}) is unreachable: "
                f"no P4Runtime server answered within {self._timeout:g} s"
            ) from None
        super().set_up_stream()

    def handshake(self) -> None:
        request = p4runtime_pb2.StreamMessageRequest()
        request.arbitration.device_id = self.device_id
        request.arbitration.election_id.high = self.election_id[0]
        request.arbitration.election_id.low = self.election_id[1]
        self.stream_out_q.put(request)
        reply = self.get_stream_packet("arbitration", timeout=self._timeout)
        if reply is None:
            ended = self._stream_end()
            self._abandon()
            if ended is not None:
                raise SwitchRpcError(
                    f"switch {self._switch} ({self._address}) ended the P4Runtime session for device "
                    f"{self.device_id}, election id {self.election_id[1]}: {ended[0]}: {ended[1]}",
                    ended[0],
                )
            raise SwitchUnreachableError(
                f"switch {self._switch} ({self._address}) did not answer arbitration for device "
                f"{self.device_id} within {self._timeout:g} s (wrong device_id, or the server is stuck)"
            )
        self.is_primary = reply.arbitration.status.code == code_pb2.OK
        self.primary_election_id = (reply.arbitration.election_id.high, reply.arbitration.election_id.low)
        logger.debug("switch %s: session as %s", self._switch, "primary" if self.is_primary else "backup")

    def _stream_end(self) -> tuple[str, str] | None:
        """(code, details) if the server has ended the stream (e.g. an election id already in use)."""
        stream = self.stream
        if not stream.done():
            return None
        code = stream.code()
        return (code.name if code is not None else "UNKNOWN"), (stream.details() or "")

    def _abandon(self) -> None:
        self.stream_out_q.put(None)
        self.channel.close()
        self.stream_recv_thread.join(timeout=self._timeout)

    def close(self) -> None:
        """End the stream (the server sees a half-close), then the channel; never blocks long."""
        self.stream_out_q.put(None)
        self.stream_recv_thread.join(timeout=self._timeout)
        self.channel.close()
        self.stream_recv_thread.join(timeout=self._timeout)


class SwitchConnection:
    """A primary (or backup) P4Runtime session with one switch, every RPC under a deadline."""

    def __init__(
        self,
        name: str,
        address: str,
        device_id: int,
        election_id: int = 1,
        timeout: float = DEFAULT_TIMEOUT_S,
        tls: TlsFiles | None = None,
    ) -> None:
        """``tls``: P4Runtime over TLS (``tls.cert``/``tls.key``: mutual TLS); None: plaintext."""
        self.name = name
        self.address = address
        self.device_id = device_id
        self.election_id = election_id
        self.timeout = timeout
        if tls is not None:
            try:
                check_files(tls)
            except TlsConfigError as exc:
                raise ControllerError(f"switch {name}: {exc}") from None
        else:
            logger.info(
                "switch %s: P4Runtime in plaintext (the tutorial workflow; --tls-ca, --tls-cert and "
                "--tls-key for TLS)",
                name,
            )
        self._client = _Client(name, device_id, address, election_id, timeout, tls)
        logger.info("switch %s: connected to %s (device %d)", name, address, device_id)
        if not self._client.is_primary:
            logger.warning(
                "switch %s: another controller (election id %s) is primary; this one (%d) can only read",
                name,
                self._client.primary_election_id,
                election_id,
            )

    @property
    def is_primary(self) -> bool:
        return bool(self._client.is_primary)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> SwitchConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stamp(
        self, request: p4runtime_pb2.WriteRequest | p4runtime_pb2.SetForwardingPipelineConfigRequest
    ) -> None:
        request.device_id = self.device_id
        request.election_id.high = 0
        request.election_id.low = self.election_id

    def _rpc_error(self, what: str, error: grpc.RpcError) -> ControllerError:
        code = error.code()
        details = error.details() or ""
        if code == grpc.StatusCode.PERMISSION_DENIED:
            primary = self._client.primary_election_id
            return NotPrimaryError(
                f"switch {self.name} refused {what}: this controller (election id {self.election_id}) is "
                f"not the primary client (primary's election id: {primary}); {details}"
            )
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return SwitchRpcError(
                f"switch {self.name} ({self.address}): {what} failed with {code.name} after at most "
                f"{self.timeout:g} s: {details}",
                code.name,
            )
        return SwitchRpcError(f"switch {self.name}: {what} failed: {code.name}: {details}", code.name)

    # ---- writes -------------------------------------------------------------------------
    def write(self, updates: Sequence[p4runtime_pb2.Update]) -> list[UpdateError | None]:
        """Write one batch (CONTINUE_ON_ERROR); return each update's error, None where it succeeded.

        Raises SwitchRpcError (or NotPrimaryError) when the RPC fails as a whole.
        """
        if not updates:
            return []
        request = p4runtime_pb2.WriteRequest()
        self._stamp(request)
        request.atomicity = p4runtime_pb2.WriteRequest.CONTINUE_ON_ERROR
        request.updates.extend(updates)
        try:
            self._client.stub.Write(request, timeout=self.timeout)
        except grpc.RpcError as error:
            per_update = _per_update_errors(error, len(updates))
            if per_update is None:
                raise self._rpc_error(f"a write of {len(updates)} update(s)", error) from None
            return per_update
        return [None] * len(updates)

    # ---- reads --------------------------------------------------------------------------
    def read(self, entities: Sequence[p4runtime_pb2.Entity]) -> list[p4runtime_pb2.Entity]:
        request = p4runtime_pb2.ReadRequest()
        request.device_id = self.device_id
        request.entities.extend(entities)
        result: list[p4runtime_pb2.Entity] = []
        try:
            for response in self._client.stub.Read(request, timeout=self.timeout):
                result.extend(response.entities)
        except grpc.RpcError as error:
            raise self._rpc_error("a read", error) from None
        return result

    # ---- pipeline -----------------------------------------------------------------------
    def get_p4info(self) -> p4info_pb2.P4Info:
        """The P4Info of the pipeline the switch runs; NoPipelineError if it runs none."""
        request = p4runtime_pb2.GetForwardingPipelineConfigRequest()
        request.device_id = self.device_id
        request.response_type = p4runtime_pb2.GetForwardingPipelineConfigRequest.P4INFO_AND_COOKIE
        try:
            reply = self._client.stub.GetForwardingPipelineConfig(request, timeout=self.timeout)
        except grpc.RpcError as error:
            if error.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                raise NoPipelineError(
                    f"switch {self.name} has no pipeline yet; run `checkmate-ctl pipeline push` first"
                ) from None
            raise self._rpc_error("reading the pipeline config", error) from None
        if not reply.config.HasField("p4info") or not reply.config.p4info.tables:
            raise NoPipelineError(
                f"switch {self.name} has no pipeline yet; run `checkmate-ctl pipeline push` first"
            )
        return reply.config.p4info

    def set_pipeline(
        self,
        p4info: p4info_pb2.P4Info,
        device_config: bytes,
        timeout: float = PIPELINE_TIMEOUT_S,
    ) -> None:
        """VERIFY_AND_COMMIT a P4Info and device config (the switch's state starts empty)."""
        request = p4runtime_pb2.SetForwardingPipelineConfigRequest()
        self._stamp(request)
        request.action = p4runtime_pb2.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT
        request.config.p4info.CopyFrom(p4info)
        request.config.p4_device_config = device_config
        try:
            self._client.stub.SetForwardingPipelineConfig(request, timeout=timeout)
        except grpc.RpcError as error:
            raise self._rpc_error("the pipeline push", error) from None


def _per_update_errors(error: grpc.RpcError, count: int) -> list[UpdateError | None] | None:
    """The p4.v1.Error per update from grpc-status-details-bin, or None if there is no such list."""
    trailing = error.trailing_metadata() or ()
    for key, value in trailing:
        if key != "grpc-status-details-bin":
            continue
        status = status_pb2.Status()
        status.ParseFromString(value)
        if len(status.details) != count:
            return None
        errors: list[UpdateError | None] = []
        for index, detail in enumerate(status.details):
            p4_error = p4runtime_pb2.Error()
            if not detail.Unpack(p4_error):
                return None
            if p4_error.canonical_code == code_pb2.OK:
                errors.append(None)
            else:
                errors.append(UpdateError(index, _code_name(p4_error.canonical_code), p4_error.message))
        return errors
    return None
