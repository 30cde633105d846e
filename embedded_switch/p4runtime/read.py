"""Read of the embedded switch's server: table entries, default actions, counters, multicast groups.

Wildcards as the spec has them: table_id 0 (every table), no match (every entry of a
table), counter_id 0, no index (every cell), multicast group id 0 (every group). A read
of one entry or group that does not exist is NOT_FOUND. Entries come back in canonical
form (don't-care fields omitted) with the controller metadata they were written with,
:data:`READ_CHUNK` entities per ReadResponse.

Lock: a Read holds its pipeline's ``SwitchState.write_lock`` while it collects, so it sees
no half-applied batch; the data path never takes that lock.
"""

from __future__ import annotations

import logging

from google.rpc import code_pb2
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2

from checkmate.p4.p4info import TableInfo
from embedded_switch.p4runtime.config import Pipeline
from embedded_switch.p4runtime.errors import INVALID, NOT_FOUND, Failure
from embedded_switch.p4runtime.index import (
    action_to_proto,
    counter_index,
    describe_key,
    field_to_proto,
    multicast_group_entry,
    translate_key,
)
from embedded_switch.state import TableEntry

logger = logging.getLogger(__name__)

READ_CHUNK = 1000
"""Entities per ReadResponse."""


def read(pipeline: Pipeline, request: p4runtime_pb2.ReadRequest) -> list[p4runtime_pb2.ReadResponse]:
    """The responses to a Read whose device the caller has checked."""
    entities: list[p4runtime_pb2.Entity] = []
    with pipeline.state.write_lock:  # a consistent snapshot; the data path never takes this lock
        for entity in request.entities:
            entities.extend(_read_entity(pipeline, entity))
    responses = []
    for start in range(0, len(entities), READ_CHUNK):
        responses.append(p4runtime_pb2.ReadResponse(entities=entities[start : start + READ_CHUNK]))
    return responses or [p4runtime_pb2.ReadResponse()]


def _read_entity(pipeline: Pipeline, entity: p4runtime_pb2.Entity) -> list[p4runtime_pb2.Entity]:
    kind = entity.WhichOneof("entity")
    if kind == "table_entry":
        return [p4runtime_pb2.Entity(table_entry=e) for e in _read_tables(pipeline, entity.table_entry)]
    if kind == "counter_entry":
        return [p4runtime_pb2.Entity(counter_entry=e) for e in _read_counters(pipeline, entity.counter_entry)]
    if kind == "packet_replication_engine_entry":
        return [
            p4runtime_pb2.Entity(packet_replication_engine_entry=e)
            for e in _read_groups(pipeline, entity.packet_replication_engine_entry)
        ]
    if kind is None:
        raise Failure(INVALID, "a read entity has no type set")
    raise Failure(code_pb2.UNIMPLEMENTED, f"{kind} is not supported by this target")


def _read_tables(pipeline: Pipeline, te: p4runtime_pb2.TableEntry) -> list[p4runtime_pb2.TableEntry]:
    index = pipeline.index
    if te.table_id == 0:
        if te.match:
            raise Failure(INVALID, "a read of all tables (table_id 0) cannot give match fields")
        tables = list(index.tables.values())
    else:
        tables = [index.table(te.table_id)]
    out = []
    for info in tables:
        table = pipeline.state.tables[info.alias]
        if te.is_default_action:
            msg = p4runtime_pb2.TableEntry(table_id=info.id, is_default_action=True)
            action_to_proto(index, table.default_action, msg.action.action)
            out.append(msg)
        elif te.match:
            key = translate_key(info, te.match, te.priority)
            entry = table.get(key, te.priority)
            if entry is None:
                raise Failure(
                    NOT_FOUND,
                    f"table {info.name} has no entry for {describe_key(info, key, te.priority)}",
                )
            out.append(_entry_to_proto(pipeline, info, entry))
        else:
            out.extend(_entry_to_proto(pipeline, info, entry) for entry in table.entries())
    return out


def _entry_to_proto(pipeline: Pipeline, info: TableInfo, entry: TableEntry) -> p4runtime_pb2.TableEntry:
    msg = p4runtime_pb2.TableEntry(table_id=info.id, priority=entry.priority)
    for f, fm in zip(info.fields, entry.key, strict=True):
        match = field_to_proto(f, fm)
        if match is not None:
            msg.match.append(match)
    action_to_proto(pipeline.index, entry.action, msg.action.action)
    table = pipeline.state.tables[info.alias]
    meta = pipeline.entry_metadata.get((info.alias, table.entry_id(entry.key, entry.priority)))
    if meta is not None:
        msg.controller_metadata, msg.metadata = meta
    return msg


def _read_counters(pipeline: Pipeline, ce: p4runtime_pb2.CounterEntry) -> list[p4runtime_pb2.CounterEntry]:
    if ce.counter_id == 0:
        if ce.HasField("index"):
            raise Failure(INVALID, "a read of all counters (counter_id 0) cannot give an index")
        counters = list(pipeline.index.counters.values())
    else:
        counters = [pipeline.index.counter(ce.counter_id)]
    out = []
    for info in counters:
        array = pipeline.state.counters[info.alias]
        cells = [counter_index(info, ce.index.index)] if ce.HasField("index") else range(info.size)
        for i in cells:
            packets, nbytes = array.read(i)
            msg = p4runtime_pb2.CounterEntry(counter_id=info.id)
            msg.index.index = i
            if info.unit in (p4info_pb2.CounterSpec.PACKETS, p4info_pb2.CounterSpec.BOTH):
                msg.data.packet_count = packets
            if info.unit in (p4info_pb2.CounterSpec.BYTES, p4info_pb2.CounterSpec.BOTH):
                msg.data.byte_count = nbytes
            msg.data.SetInParent()
            out.append(msg)
    return out


def _read_groups(
    pipeline: Pipeline, pre: p4runtime_pb2.PacketReplicationEngineEntry
) -> list[p4runtime_pb2.PacketReplicationEngineEntry]:
    groups = pipeline.state.multicast_groups
    gid = multicast_group_entry(pre).multicast_group_id
    if gid == 0:
        wanted = sorted(groups)
    elif gid in groups:
        wanted = [gid]
    else:
        raise Failure(NOT_FOUND, f"multicast group {gid} does not exist")
    out = []
    for g in wanted:
        msg = p4runtime_pb2.PacketReplicationEngineEntry()
        entry = msg.multicast_group_entry
        entry.multicast_group_id = g
        entry.metadata = pipeline.group_metadata.get(g, b"")
        for r in groups[g]:
            entry.replicas.add(egress_port=r.egress_port, instance=r.instance)
        out.append(msg)
    return out
