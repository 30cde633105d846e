"""The entities the controller writes, by name, and their P4Runtime encoding.

:class:`TableEntry` and :class:`MulticastGroup` are plain, hashable values in
P4Info names (as p4runtime-shell's entities are); :class:`EntityCodec` turns
them into ``p4.v1`` messages for one switch's P4Info and back. Two entities
with the same :attr:`key` are the same switch object (P4Runtime identity:
table + match + priority, or the group id); desired and installed state are
both ``dict[key, entity]`` and are compared with ``==``.

:class:`Update` is one write with what it replaces, so that every update has
an inverse (:meth:`Update.inverse`) for rolling a batch back.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from p4.v1 import p4runtime_pb2

from checkmate.p4 import names
from checkmate.p4.bytestrings import decode_bytestring, encode_bytestring
from checkmate.p4.p4info import MatchKind, P4InfoIndex

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class Match:
    """One match field. ``prefix_len`` is set for LPM fields only."""

    field: str
    value: int
    prefix_len: int | None = None


@dataclass(frozen=True)
class TableEntry:
    table: str
    match: tuple[Match, ...]
    action: str
    params: tuple[tuple[str, int], ...] = ()
    priority: int = 0

    @classmethod
    def make(
        cls,
        table: str,
        match: Mapping[str, int | tuple[int, int]],
        action: str,
        params: Mapping[str, int] | None = None,
        priority: int = 0,
    ) -> TableEntry:
        """Build from dicts: ``match={"dst_addr": (ip, 32)}`` for LPM, ``{"job_id": 7}`` for exact."""
        fields = []
        for name, value in match.items():
            if isinstance(value, tuple):
                fields.append(Match(name, value[0], value[1]))
            else:
                fields.append(Match(name, value))
        return cls(table, tuple(sorted(fields)), action, tuple(sorted((params or {}).items())), priority)

    @property
    def key(self) -> tuple[object, ...]:
        return ("table", self.table, self.match, self.priority)

    def param(self, name: str) -> int:
        return dict(self.params)[name]

    def match_value(self, name: str) -> int:
        for m in self.match:
            if m.field == name:
                return m.value
        raise KeyError(name)

    def __str__(self) -> str:
        match = ", ".join(
            f"{m.field}={m.value}" + (f"/{m.prefix_len}" if m.prefix_len is not None else "")
            for m in self.match
        )
        params = ", ".join(f"{k}={v}" for k, v in self.params)
        return f"{self.table}[{match}] -> {self.action}({params})"


@dataclass(frozen=True)
class MulticastGroup:
    group_id: int
    replicas: tuple[tuple[int, int], ...]
    """(egress port, instance) pairs, sorted."""

    @classmethod
    def make(cls, group_id: int, replicas: Iterable[tuple[int, int]]) -> MulticastGroup:
        return cls(group_id, tuple(sorted(replicas)))

    @property
    def key(self) -> tuple[object, ...]:
        return ("group", self.group_id)

    def __str__(self) -> str:
        replicas = ", ".join(f"port {p} instance {i}" for p, i in self.replicas)
        return f"multicast group {self.group_id} {{{replicas}}}"


Entity = TableEntry | MulticastGroup


class UpdateKind(enum.Enum):
    INSERT = p4runtime_pb2.Update.INSERT
    MODIFY = p4runtime_pb2.Update.MODIFY
    DELETE = p4runtime_pb2.Update.DELETE


@dataclass(frozen=True)
class Update:
    """One write. ``previous`` is what a MODIFY replaces (needed to undo it)."""

    kind: UpdateKind
    entity: Entity
    previous: Entity | None = None

    def inverse(self) -> Update:
        if self.kind is UpdateKind.INSERT:
            return Update(UpdateKind.DELETE, self.entity)
        if self.kind is UpdateKind.DELETE:
            return Update(UpdateKind.INSERT, self.entity)
        assert self.previous is not None, "a MODIFY must know what it replaces"
        return Update(UpdateKind.MODIFY, self.previous, self.entity)

    def __str__(self) -> str:
        return f"{self.kind.name} {self.entity}"


# ---- ordering -------------------------------------------------------------------
_INSERT_RANK = {
    "group": 0,
    names.RewriteShadowCopy.NAME: 0,
    names.RouteIpv4.NAME: 0,
    names.CheckSource.NAME: 0,
    names.LookupJob.NAME: 1,
    names.ReplicateToShadow.NAME: 2,
}
_DELETE_RANK = {
    names.ReplicateToShadow.NAME: 3,
    names.LookupJob.NAME: 4,
    names.RewriteShadowCopy.NAME: 5,
    "group": 5,
    names.RouteIpv4.NAME: 5,
    names.CheckSource.NAME: 5,
}


def _kind_name(entity: Entity) -> str:
    return "group" if isinstance(entity, MulticastGroup) else entity.table


def write_order(update: Update) -> tuple[int, str]:
    """Sort key that never lets an entry point at a missing group or rewrite.

    Groups, rewrites and routes are written first, then the job's slot, then
    the replication entries; deletions run the other way round.
    """
    name = _kind_name(update.entity)
    if update.kind is UpdateKind.DELETE:
        return _DELETE_RANK.get(name, 5), name
    return _INSERT_RANK.get(name, 0), name


def sort_updates(updates: Iterable[Update]) -> list[Update]:
    return sorted(updates, key=lambda u: (write_order(u), repr(u.entity.key)))


def diff(
    desired: Mapping[tuple[object, ...], Entity], installed: Mapping[tuple[object, ...], Entity]
) -> list[Update]:
    """The updates that turn ``installed`` into ``desired``, in a safe write order."""
    updates: list[Update] = []
    for key, entity in desired.items():
        current = installed.get(key)
        if current is None:
            updates.append(Update(UpdateKind.INSERT, entity))
        elif current != entity:
            updates.append(Update(UpdateKind.MODIFY, entity, current))
    for key, entity in installed.items():
        if key not in desired:
            updates.append(Update(UpdateKind.DELETE, entity))
    return sort_updates(updates)


# ---- wire encoding ----------------------------------------------------------------
class EntityCodec:
    """Encodes entities for one switch's P4Info and decodes what the switch reads back."""

    def __init__(self, names: P4InfoIndex) -> None:
        self.names = names

    def to_entity(self, entity: Entity) -> p4runtime_pb2.Entity:
        message = p4runtime_pb2.Entity()
        if isinstance(entity, MulticastGroup):
            group = message.packet_replication_engine_entry.multicast_group_entry
            group.multicast_group_id = entity.group_id
            for port, instance in entity.replicas:
                replica = group.replicas.add()
                # PI (BMv2) reads the deprecated egress_port field; it is still valid in 1.4.
                replica.egress_port = port
                replica.instance = instance
            return message
        entry = message.table_entry
        entry.table_id = self.names.table_id(entity.table)
        for m in entity.match:
            info = self.names.match_field(entity.table, m.field)
            prefix_len = info.bitwidth if m.prefix_len is None else m.prefix_len
            if info.kind is MatchKind.LPM and prefix_len == 0:
                continue  # a /0 prefix is a don't-care and must be omitted
            field = entry.match.add()
            field.field_id = info.id
            if info.kind is MatchKind.LPM:
                mask = ((1 << prefix_len) - 1) << (info.bitwidth - prefix_len)
                field.lpm.value = encode_bytestring(m.value & mask, info.bitwidth)
                field.lpm.prefix_len = prefix_len
            elif info.kind is MatchKind.EXACT:
                field.exact.value = encode_bytestring(m.value, info.bitwidth)
            else:
                raise ValueError(
                    f"{entity.table}.{m.field}: only exact and LPM matches are used by Checkmate"
                )
        if entity.priority:
            entry.priority = entity.priority
        action = entry.action.action
        action.action_id = self.names.action_id(entity.action)
        given = dict(entity.params)
        expected = self.names.param_names(entity.action)
        if sorted(given) != sorted(expected):
            raise ValueError(f"action {entity.action} takes parameters {expected}, got {sorted(given)}")
        for name in expected:
            spec = self.names.param(entity.action, name)
            param = action.params.add()
            param.param_id = spec.id
            param.value = encode_bytestring(given[name], spec.bitwidth)
        return message

    def to_update(self, update: Update) -> p4runtime_pb2.Update:
        message = p4runtime_pb2.Update()
        message.type = update.kind.value
        message.entity.CopyFrom(self.to_entity(update.entity))
        return message

    def from_entity(self, message: p4runtime_pb2.Entity) -> Entity:
        which = message.WhichOneof("entity")
        if which == "packet_replication_engine_entry":
            group = message.packet_replication_engine_entry.multicast_group_entry
            replicas = []
            for r in group.replicas:
                if r.WhichOneof("port_kind") == "port":
                    port = decode_bytestring(r.port, 32, f"multicast group {group.multicast_group_id} port")
                else:
                    port = r.egress_port
                replicas.append((port, r.instance))
            return MulticastGroup.make(group.multicast_group_id, replicas)
        if which != "table_entry":
            raise ValueError(f"cannot decode a {which} entity")
        entry = message.table_entry
        table = self.names.table_name(entry.table_id)
        fields = []
        for field in entry.match:
            info = self.names.match_field_by_id(entry.table_id, field.field_id)
            kind = field.WhichOneof("field_match_type")
            if kind == "lpm":
                value = decode_bytestring(field.lpm.value, info.bitwidth, f"{table}.{info.short_name}")
                fields.append(Match(info.short_name, value, field.lpm.prefix_len))
            elif kind == "exact":
                value = decode_bytestring(field.exact.value, info.bitwidth, f"{table}.{info.short_name}")
                fields.append(Match(info.short_name, value))
            else:
                raise ValueError(f"table {table}: unexpected {kind} match on {info.short_name}")
        action_id = entry.action.action.action_id
        action = self.names.action_name(action_id)
        params = []
        for p in entry.action.action.params:
            param = self.names.param_by_id(action_id, p.param_id)
            params.append((param.name, decode_bytestring(p.value, param.bitwidth, f"{action}.{param.name}")))
        return TableEntry(table, tuple(sorted(fields)), action, tuple(sorted(params)), entry.priority)
