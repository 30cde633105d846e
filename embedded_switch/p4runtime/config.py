"""Forwarding pipeline configs: SetForwardingPipelineConfig and GetForwardingPipelineConfig.

:class:`PipelineStore` holds the committed pipeline (the one the data path runs) and a
saved one (VERIFY_AND_SAVE; Read and Write address it until COMMIT). A pushed P4Info
must describe the Checkmate program (:mod:`embedded_switch.program`; ids may differ
from ours, names and widths may not); ``p4_device_config`` is stored unread. Every
SetForwardingPipelineConfig action is honoured (VERIFY, VERIFY_AND_SAVE,
VERIFY_AND_COMMIT, COMMIT, RECONCILE_AND_COMMIT), and every GetForwardingPipelineConfig
response type.

Lock: ``PipelineStore.lock`` guards which pipeline is committed or saved; readers of
:attr:`PipelineStore.committed` take a reference without it (one attribute read).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from google.rpc import code_pb2
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2

from checkmate.p4.p4info import preamble_alias
from embedded_switch import program
from embedded_switch.p4runtime.errors import INVALID, Failure
from embedded_switch.p4runtime.index import ProgramIndex
from embedded_switch.state import SwitchState

logger = logging.getLogger(__name__)

PipelineAction = p4runtime_pb2.SetForwardingPipelineConfigRequest
ResponseType = p4runtime_pb2.GetForwardingPipelineConfigRequest


@dataclass(eq=False)
class Pipeline:
    """A forwarding pipeline config and the state realising it."""

    p4info: p4info_pb2.P4Info
    device_config: bytes
    cookie: int | None
    index: ProgramIndex
    state: SwitchState
    entry_metadata: dict[tuple[str, tuple[object, ...]], tuple[int, bytes]] = field(default_factory=dict)
    """(table alias, entry id) -> (controller_metadata, metadata), returned on reads."""
    group_metadata: dict[int, bytes] = field(default_factory=dict)


def with_reference_aliases(info: p4info_pb2.P4Info, reference: p4info_pb2.P4Info) -> p4info_pb2.P4Info:
    """A copy of ``info`` whose aliases are ours, so the state keeps the names the pipeline uses."""
    aliases = {}
    for group in ("tables", "actions", "counters"):
        for obj in getattr(reference, group):
            aliases[(group, obj.preamble.name)] = preamble_alias(obj.preamble)
    canonical = p4info_pb2.P4Info()
    canonical.CopyFrom(info)
    for group in ("tables", "actions", "counters"):
        for obj in getattr(canonical, group):
            alias = aliases.get((group, obj.preamble.name))
            if alias is not None:
                obj.preamble.alias = alias
    return canonical


class PipelineStore:
    """The committed and the saved pipeline of one device, and the requests that change them."""

    def __init__(
        self,
        device_id: int,
        reference: p4info_pb2.P4Info,
        on_pipeline: Callable[[SwitchState], None] | None = None,
    ) -> None:
        self.device_id = device_id
        self.reference = reference
        self._on_pipeline = on_pipeline
        self.lock = threading.Lock()
        self.committed: Pipeline | None = None
        self._saved: Pipeline | None = None

    def prepare(self, config: p4runtime_pb2.ForwardingPipelineConfig) -> Pipeline:
        info = config.p4info
        try:
            program.check_program(info, self.reference)
        except program.ProgramMismatchError as e:
            raise Failure(INVALID, str(e)) from None
        canonical = with_reference_aliases(info, self.reference)
        index = ProgramIndex(canonical)
        try:
            state = program.build_state(canonical)
        except program.ProgramMismatchError as e:
            raise Failure(INVALID, str(e)) from None
        except KeyError as e:
            raise Failure(INVALID, f"P4Info names an object this target does not implement: {e}") from None
        stored = p4info_pb2.P4Info()
        stored.CopyFrom(info)
        cookie = config.cookie.cookie if config.HasField("cookie") else None
        return Pipeline(stored, bytes(config.p4_device_config), cookie, index, state)

    def commit(self, pipeline: Pipeline) -> None:
        if self._on_pipeline is not None:
            self._on_pipeline(pipeline.state)
        with self.lock:
            self.committed = pipeline
            self._saved = None
        logger.info(
            "device %d: pipeline committed (%d tables, %d counters, %d bytes of device config)",
            self.device_id,
            len(pipeline.state.tables),
            len(pipeline.state.counters),
            len(pipeline.device_config),
        )

    def for_requests(self) -> Pipeline:
        """The pipeline Read and Write address: a saved one (VERIFY_AND_SAVE) or the committed one."""
        with self.lock:
            pipeline = self._saved or self.committed
        if pipeline is None:
            raise Failure(code_pb2.FAILED_PRECONDITION, "No forwarding pipeline config set for this device")
        return pipeline

    def set_pipeline(
        self, request: p4runtime_pb2.SetForwardingPipelineConfigRequest
    ) -> p4runtime_pb2.SetForwardingPipelineConfigResponse:
        """Carry out a SetForwardingPipelineConfig whose device and primary the caller has checked."""
        action = request.action
        name = PipelineAction.Action.Name(action) if action in PipelineAction.Action.values() else str(action)
        if action == PipelineAction.COMMIT:
            if request.HasField("config"):
                raise Failure(INVALID, "COMMIT takes no config: it realises the one saved by VERIFY_AND_SAVE")
            with self.lock:
                pipeline = self._saved
            if pipeline is None:
                raise Failure(
                    code_pb2.FAILED_PRECONDITION, "no saved config to commit: send VERIFY_AND_SAVE first"
                )
        elif action in (
            PipelineAction.VERIFY,
            PipelineAction.VERIFY_AND_SAVE,
            PipelineAction.VERIFY_AND_COMMIT,
            PipelineAction.RECONCILE_AND_COMMIT,
        ):
            if not request.HasField("config"):
                raise Failure(INVALID, f"{name} needs a config")
            pipeline = self.prepare(request.config)
        else:
            raise Failure(
                INVALID,
                f"action {name} is not one of VERIFY, VERIFY_AND_SAVE, VERIFY_AND_COMMIT, "
                f"COMMIT, RECONCILE_AND_COMMIT",
            )
        if action == PipelineAction.VERIFY:
            return p4runtime_pb2.SetForwardingPipelineConfigResponse()
        if action == PipelineAction.VERIFY_AND_SAVE:
            with self.lock:
                self._saved = pipeline
            logger.info("device %d: pipeline saved; Read and Write address it until COMMIT", self.device_id)
            return p4runtime_pb2.SetForwardingPipelineConfigResponse()
        if action == PipelineAction.RECONCILE_AND_COMMIT:
            current = self.committed
            if current is not None:  # same program: the forwarding state carries over as it is
                pipeline = replace(
                    pipeline,
                    state=current.state,
                    entry_metadata=current.entry_metadata,
                    group_metadata=current.group_metadata,
                )
        try:
            self.commit(pipeline)
        except Exception as e:  # noqa: BLE001 - report the data path's refusal to the controller
            logger.exception("data path refused the pipeline")
            raise Failure(code_pb2.INTERNAL, f"the data path could not load the pipeline: {e}") from None
        return p4runtime_pb2.SetForwardingPipelineConfigResponse()

    def get_pipeline(
        self, request: p4runtime_pb2.GetForwardingPipelineConfigRequest
    ) -> p4runtime_pb2.GetForwardingPipelineConfigResponse:
        """Answer a GetForwardingPipelineConfig whose device the caller has checked."""
        pipeline = self.committed
        if pipeline is None:
            raise Failure(code_pb2.FAILED_PRECONDITION, "No forwarding pipeline config set for this device")
        kind = request.response_type
        if kind not in ResponseType.ResponseType.values():
            raise Failure(INVALID, f"unknown response_type {kind}")
        response = p4runtime_pb2.GetForwardingPipelineConfigResponse()
        config = response.config
        if kind in (ResponseType.ALL, ResponseType.P4INFO_AND_COOKIE):
            config.p4info.CopyFrom(pipeline.p4info)
        if kind in (ResponseType.ALL, ResponseType.DEVICE_CONFIG_AND_COOKIE):
            config.p4_device_config = pipeline.device_config
        if pipeline.cookie is not None:
            config.cookie.cookie = pipeline.cookie
        return response
