"""Write of the embedded switch's server: table entries, default actions, multicast groups, counters.

A batch is CONTINUE_ON_ERROR, ROLLBACK_ON_ERROR or DATAPLANE_ATOMIC. Every update
returns its undo; DATAPLANE_ATOMIC is all-or-nothing like ROLLBACK_ON_ERROR (the
applied updates are undone in reverse when one fails). Each table publishes its entries
whole and each group's replica tuple is replaced in one store, but a packet in flight
can see a batch half-applied across tables and groups. A failed batch raises the
UNKNOWN :class:`~embedded_switch.p4runtime.errors.Failure` carrying one ``p4.v1.Error``
per update (ABORTED for the rolled-back and the not attempted).

Limits are BMv2's: 4096 multicast groups and L1 nodes, group ids below 32768, 9-bit
ports, 16-bit instances.

Lock: a batch holds its pipeline's ``SwitchState.write_lock`` from first update to last;
the data path reads the state without locks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from google.rpc import code_pb2
from p4.v1 import p4runtime_pb2

from checkmate.p4.p4info import TableInfo
from embedded_switch import program
from embedded_switch.p4runtime.config import Pipeline
from embedded_switch.p4runtime.errors import (
    INVALID,
    NOT_FOUND,
    OK,
    Failure,
    batch_failure,
    code_name,
    decode_value,
)
from embedded_switch.p4runtime.index import (
    counter_index,
    describe_key,
    multicast_group_entry,
    translate_action,
    translate_key,
)
from embedded_switch.state import ActionCall, Replica, TableEntry

logger = logging.getLogger(__name__)

MAX_MULTICAST_GROUPS = 4096
"""BMv2's default limit on multicast groups."""
MAX_L1_NODES = 4096
"""BMv2's default limit on L1 nodes (one per distinct instance in each group)."""
MULTICAST_GROUP_ID_LIMIT = 32768
"""User multicast group ids must be below this (BMv2 keeps the rest for itself)."""
PORT_LIMIT = 512
"""v1model ports are 9 bits wide."""
INSTANCE_LIMIT = 1 << 16
"""A replica's instance becomes its 16-bit egress_rid."""

Update = p4runtime_pb2.Update
Atomicity = p4runtime_pb2.WriteRequest


@dataclass(eq=False)
class Batch:
    pipeline: Pipeline
    l1_nodes: int


Undo = Callable[[], None]


def count_l1_nodes(replicas: Iterable[Replica]) -> int:
    return len({r.instance for r in replicas})


def write(pipeline: Pipeline, request: p4runtime_pb2.WriteRequest) -> p4runtime_pb2.WriteResponse:
    """Apply a Write whose device and primary the caller has checked; Failure if any update failed."""
    atomicity = request.atomicity
    if atomicity not in Atomicity.Atomicity.values():
        raise Failure(INVALID, f"unknown atomicity {atomicity}")
    if not request.updates:
        return p4runtime_pb2.WriteResponse()
    results = _apply_batch(pipeline, request.updates, atomicity)
    if any(r.canonical_code != OK for r in results):
        raise batch_failure(results)
    return p4runtime_pb2.WriteResponse()


def _apply_batch(
    pipeline: Pipeline, updates: Sequence[p4runtime_pb2.Update], atomicity: int
) -> list[p4runtime_pb2.Error]:
    state = pipeline.state
    all_or_nothing = atomicity != Atomicity.CONTINUE_ON_ERROR
    results: list[p4runtime_pb2.Error] = []
    with state.write_lock:
        batch = Batch(pipeline, sum(count_l1_nodes(r) for r in state.multicast_groups.values()))
        undo: list[Undo] = []
        for i, update in enumerate(updates):
            try:
                undo.append(_apply_update(batch, update))
                results.append(p4runtime_pb2.Error(canonical_code=OK))
            except Failure as e:
                logger.debug("update %d failed: %s %s", i, code_name(e.code), e.message)
                results.append(p4runtime_pb2.Error(canonical_code=e.code, message=e.message))
                if all_or_nothing:
                    for fn in reversed(undo):
                        fn()
                    mode = Atomicity.Atomicity.Name(atomicity)
                    why = f"update {i} failed ({code_name(e.code)}) and the batch is {mode}"
                    for j in range(len(updates)):
                        if j < i:
                            results[j] = p4runtime_pb2.Error(
                                canonical_code=code_pb2.ABORTED, message=f"rolled back: {why}"
                            )
                        elif j > i:
                            results.append(
                                p4runtime_pb2.Error(
                                    canonical_code=code_pb2.ABORTED, message=f"not attempted: {why}"
                                )
                            )
                    break
    return results


def _apply_update(batch: Batch, update: p4runtime_pb2.Update) -> Undo:
    kind = update.type
    if kind not in (Update.INSERT, Update.MODIFY, Update.DELETE):
        raise Failure(INVALID, f"update type {kind} is not INSERT, MODIFY or DELETE")
    entity = update.entity.WhichOneof("entity")
    if entity == "table_entry":
        return _write_table_entry(batch.pipeline, kind, update.entity.table_entry)
    if entity == "packet_replication_engine_entry":
        return _write_pre(batch, kind, update.entity.packet_replication_engine_entry)
    if entity == "counter_entry":
        return _write_counter(batch.pipeline, kind, update.entity.counter_entry)
    if entity is None:
        raise Failure(INVALID, "the update's entity has no type set")
    raise Failure(code_pb2.UNIMPLEMENTED, f"{entity} is not supported by this target")


def _write_table_entry(pipeline: Pipeline, kind: int, te: p4runtime_pb2.TableEntry) -> Undo:
    info = pipeline.index.table(te.table_id)
    table = pipeline.state.tables[info.alias]
    if te.idle_timeout_ns and not info.supports_idle_timeout:
        raise Failure(INVALID, f"table {info.name} does not support idle timeout (idle_timeout_ns must be 0)")
    for direct in ("meter_config", "counter_data", "meter_counter_data"):
        if te.HasField(direct):
            raise Failure(INVALID, f"table {info.name} has no direct resource for {direct}")
    if te.HasField("time_since_last_hit"):
        raise Failure(INVALID, "time_since_last_hit is read-only")
    if te.is_const:
        raise Failure(INVALID, "is_const is read-only")
    if te.is_default_action:
        return _write_default(pipeline, kind, info, te)
    key = translate_key(info, te.match, te.priority)
    entry_id = table.entry_id(key, te.priority)
    meta_key = (info.alias, entry_id)
    metadata = pipeline.entry_metadata
    existing = table.get(key, te.priority)
    described = describe_key(info, key, te.priority)
    if kind == Update.INSERT:
        if existing is not None:
            raise Failure(
                code_pb2.ALREADY_EXISTS,
                f"table {info.name} already has an entry for {described} (use MODIFY to change it)",
            )
        action = _entry_action(pipeline, info, te)
        if info.size and len(table) >= info.size:
            raise Failure(code_pb2.RESOURCE_EXHAUSTED, f"table {info.name} is full ({info.size} entries)")
        table.insert(TableEntry(key, action, te.priority))
        metadata[meta_key] = (te.controller_metadata, te.metadata)

        def undo_insert() -> None:
            table.delete(key, te.priority)
            metadata.pop(meta_key, None)

        return undo_insert
    if existing is None:
        raise Failure(NOT_FOUND, f"table {info.name} has no entry for {described}")
    old_meta = metadata.get(meta_key)
    if kind == Update.MODIFY:
        action = _entry_action(pipeline, info, te)
        # A new entry, published like an insert: the pipeline caches decisions per
        # Table.generation, so changing the old entry in place would go unseen.
        replacement = TableEntry(key, action, te.priority, existing.hit_packets, existing.hit_bytes)
        table.insert(replacement)
        metadata[meta_key] = (te.controller_metadata, te.metadata)

        def undo_modify() -> None:
            table.insert(existing)
            if old_meta is not None:
                metadata[meta_key] = old_meta

        return undo_modify
    table.delete(key, te.priority)
    metadata.pop(meta_key, None)

    def undo_delete() -> None:
        table.insert(existing)
        if old_meta is not None:
            metadata[meta_key] = old_meta

    return undo_delete


def _entry_action(pipeline: Pipeline, info: TableInfo, te: p4runtime_pb2.TableEntry) -> ActionCall:
    kind = te.action.WhichOneof("type")
    if kind is None:
        raise Failure(INVALID, f"the entry for table {info.name} has no action")
    if kind != "action":
        raise Failure(INVALID, f"table {info.name} has no action profile: give a direct action, not {kind}")
    return translate_action(pipeline.index, info, te.action.action, default=False)


def _write_default(pipeline: Pipeline, kind: int, info: TableInfo, te: p4runtime_pb2.TableEntry) -> Undo:
    if kind != Update.MODIFY:
        raise Failure(
            INVALID,
            f"the default entry of table {info.name} can only be modified (MODIFY), "
            f"not {Update.Type.Name(kind)}",
        )
    if te.match or te.priority:
        raise Failure(INVALID, f"the default entry of table {info.name} has no match fields and no priority")
    if info.const_default_action_id:
        raise Failure(code_pb2.PERMISSION_DENIED, f"the default action of table {info.name} is const")
    table = pipeline.state.tables[info.alias]
    which = te.action.WhichOneof("type")
    if which is None:
        action = program.DEFAULT_ACTIONS[info.alias]
    elif which == "action":
        action = translate_action(pipeline.index, info, te.action.action, default=True)
    else:
        raise Failure(INVALID, f"table {info.name} has no action profile: give a direct action, not {which}")
    old = table.default_action
    table.default_action = action

    def undo() -> None:
        table.default_action = old

    return undo


def _write_pre(batch: Batch, kind: int, pre: p4runtime_pb2.PacketReplicationEngineEntry) -> Undo:
    group = multicast_group_entry(pre)
    gid = group.multicast_group_id
    if gid == 0:
        raise Failure(INVALID, "multicast group id 0 is invalid")
    if gid >= MULTICAST_GROUP_ID_LIMIT:
        raise Failure(
            INVALID,
            f"multicast group id {gid} is out of range: group ids must be below "
            f"{MULTICAST_GROUP_ID_LIMIT}, as in BMv2",
        )
    pipeline = batch.pipeline
    groups = pipeline.state.multicast_groups
    old = groups.get(gid)
    old_meta = pipeline.group_metadata.get(gid)
    old_l1 = batch.l1_nodes

    def undo() -> None:
        if old is None:
            groups.pop(gid, None)
            pipeline.group_metadata.pop(gid, None)
        else:
            groups[gid] = old
            if old_meta is not None:
                pipeline.group_metadata[gid] = old_meta
        batch.l1_nodes = old_l1

    if kind == Update.DELETE:
        if old is None:
            raise Failure(NOT_FOUND, f"multicast group {gid} does not exist")
        del groups[gid]
        pipeline.group_metadata.pop(gid, None)
        batch.l1_nodes -= count_l1_nodes(old)
        return undo
    replicas = _translate_replicas(gid, group.replicas)
    if kind == Update.INSERT:
        if old is not None:
            raise Failure(
                code_pb2.ALREADY_EXISTS,
                f"multicast group {gid} already exists (use MODIFY to change its replicas)",
            )
        if len(groups) >= MAX_MULTICAST_GROUPS:
            raise Failure(
                code_pb2.RESOURCE_EXHAUSTED,
                f"the switch holds its maximum of {MAX_MULTICAST_GROUPS} multicast groups",
            )
    elif old is None:
        raise Failure(NOT_FOUND, f"multicast group {gid} does not exist")
    l1_nodes = batch.l1_nodes - (count_l1_nodes(old) if old is not None else 0) + count_l1_nodes(replicas)
    if l1_nodes > MAX_L1_NODES:
        raise Failure(
            code_pb2.RESOURCE_EXHAUSTED,
            f"multicast group {gid} needs more L1 nodes than the {MAX_L1_NODES} the switch has",
        )
    groups[gid] = replicas  # one dict store: the data path sees the old or the new replica list
    pipeline.group_metadata[gid] = bytes(group.metadata)
    batch.l1_nodes = l1_nodes
    return undo


def _translate_replicas(gid: int, replicas: Iterable[p4runtime_pb2.Replica]) -> tuple[Replica, ...]:
    out: list[Replica] = []
    seen: set[tuple[int, int]] = set()
    for r in replicas:
        kind = r.WhichOneof("port_kind")
        if kind == "egress_port":
            port = r.egress_port
        elif kind == "port":
            port = decode_value(r.port, 32, f"multicast group {gid} replica port")
        else:
            raise Failure(INVALID, f"multicast group {gid}: a replica has no egress port")
        if port >= PORT_LIMIT:
            raise Failure(
                INVALID,
                f"multicast group {gid}: egress port {port} is out of range "
                f"(v1model ports are 9 bits, 0..{PORT_LIMIT - 1})",
            )
        if r.instance >= INSTANCE_LIMIT:
            raise Failure(
                INVALID,
                f"multicast group {gid}: instance {r.instance} does not fit the 16-bit egress_rid",
            )
        if (port, r.instance) in seen:
            raise Failure(
                INVALID,
                f"multicast group {gid}: duplicate replica (egress port {port}, instance {r.instance})",
            )
        seen.add((port, r.instance))
        out.append(Replica(port, r.instance))
    return tuple(out)


def _write_counter(pipeline: Pipeline, kind: int, ce: p4runtime_pb2.CounterEntry) -> Undo:
    if kind != Update.MODIFY:
        raise Failure(INVALID, f"counter entries can only be modified (MODIFY), not {Update.Type.Name(kind)}")
    if ce.counter_id == 0:
        raise Failure(INVALID, "counter_id 0 is only valid as a read wildcard")
    info = pipeline.index.counter(ce.counter_id)
    array = pipeline.state.counters[info.alias]
    packets, nbytes = ce.data.packet_count, ce.data.byte_count
    if packets < 0 or nbytes < 0:
        raise Failure(INVALID, f"counter {info.name}: counts cannot be negative")
    if ce.HasField("index"):
        index = counter_index(info, ce.index.index)
        old = array.read(index)
        array.reset(index, packets, nbytes)

        def undo_cell() -> None:
            array.reset(index, *old)

        return undo_cell
    old_packets, old_bytes = list(array.packets), list(array.bytes)
    array.packets, array.bytes = [packets] * array.size, [nbytes] * array.size

    def undo_all() -> None:
        array.packets, array.bytes = old_packets, old_bytes

    return undo_all
