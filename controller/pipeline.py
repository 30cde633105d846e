"""Pushing the Checkmate pipeline: P4Info plus the target's device config.

What ``p4_device_config`` holds depends on the target:

* BMv2 (``simple_switch_grpc``): the JSON p4c writes
  (``p4c --target bmv2 --arch v1model``, ``make p4``), as bytes.
* The embedded target (``checkmate-switch``): nothing. It runs exactly one
  program and checks that the P4Info describes it.
* Tofino (Stratum or bf_switchd's P4Runtime server, not testable here): the
  "packed" config of bf-p4c's outputs, built by :func:`pack_tofino_config`:
  ``<u32 LE len(program name)> name <u32 LE len(tofino.bin)> tofino.bin
  <u32 LE len(context.json)> context.json``. TNA's P4Info qualifies names with
  ``pipe.``; the controller resolves unqualified names, so nothing else changes.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from pathlib import Path

from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2

from checkmate.p4.p4info import load_p4info
from checkmate.p4.program import P4INFO_PATH, Target
from controller.errors import ControllerError, SwitchRpcError
from controller.switch_connection import PIPELINE_TIMEOUT_S, SwitchConnection

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineConfig:
    """A P4Info and the device config bytes for one target."""

    target: Target
    p4info: p4info_pb2.P4Info
    device_config: bytes = b""

    @classmethod
    def embedded(cls, p4info_path: str | Path = P4INFO_PATH) -> PipelineConfig:
        return cls(Target.EMBEDDED, load_p4info(p4info_path))

    @classmethod
    def bmv2(cls, p4info_path: str | Path, bmv2_json: str | Path) -> PipelineConfig:
        return cls(Target.BMV2, load_p4info(p4info_path), Path(bmv2_json).read_bytes())

    @classmethod
    def tofino(
        cls,
        p4info_path: str | Path,
        tofino_bin: str | Path,
        context_json: str | Path,
        program: str = "checkmate",
    ) -> PipelineConfig:
        config = pack_tofino_config(program, Path(tofino_bin).read_bytes(), Path(context_json).read_bytes())
        return cls(Target.TOFINO, load_p4info(p4info_path), config)


def pack_tofino_config(program: str, tofino_bin: bytes, context_json: bytes) -> bytes:
    """The packed ``p4_device_config`` a Tofino P4Runtime server takes (see the module docstring)."""
    name = program.encode()
    parts = [struct.pack("<I", len(name)), name]
    parts += [struct.pack("<I", len(tofino_bin)), tofino_bin]
    parts += [struct.pack("<I", len(context_json)), context_json]
    return b"".join(parts)


def delete_multicast_groups(connection: SwitchConnection) -> int:
    """Delete every multicast group the switch reports; return how many were deleted.

    BMv2 (simple_switch_grpc 1.15.5 with PI) keeps the replicas of the groups that
    existed before a SetForwardingPipelineConfig in its data plane, while reads say
    the groups are gone: each push made while a group existed left one more copy
    of it once the group was installed again (5 copies of a frame after 4 such pushes). So
    every push is preceded by this (docs/controller.md). A switch that runs no
    pipeline yet (a fresh process) has no groups: 0. ControllerError if the
    switch refuses a delete for any reason other than the group being gone already.
    """
    request = p4runtime_pb2.Entity()
    request.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = 0
    try:
        found = connection.read([request])
    except SwitchRpcError as exc:
        if exc.code_name in ("FAILED_PRECONDITION", "NOT_FOUND"):
            return 0
        raise
    updates = []
    for entity in found:
        if not entity.packet_replication_engine_entry.HasField("multicast_group_entry"):
            continue
        update = p4runtime_pb2.Update(type=p4runtime_pb2.Update.DELETE)
        group_id = entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id
        update.entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = group_id
        updates.append(update)
    errors = [e for e in connection.write(updates) if e is not None and e.code_name != "NOT_FOUND"]
    if errors:
        raise ControllerError(
            f"switch {connection.name}: deleting its multicast groups before a pipeline push failed "
            f"({len(errors)} of {len(updates)}): " + "; ".join(str(e) for e in errors[:5])
        )
    if updates:
        logger.info("switch %s: deleted %d multicast group(s) before the push", connection.name, len(updates))
    return len(updates)


def push_pipeline(
    connection: SwitchConnection, config: PipelineConfig, timeout: float = PIPELINE_TIMEOUT_S
) -> None:
    """SetForwardingPipelineConfig(VERIFY_AND_COMMIT): the switch's entries are gone afterwards.

    Its multicast groups are deleted first (:func:`delete_multicast_groups`), so no
    replica of an old group survives the push in BMv2's data plane.
    """
    delete_multicast_groups(connection)
    logger.info(
        "switch %s: pushing the %s pipeline (%d tables, %d bytes of device config)",
        connection.name,
        config.target.value,
        len(config.p4info.tables),
        len(config.device_config),
    )
    connection.set_pipeline(config.p4info, config.device_config, timeout=timeout)
