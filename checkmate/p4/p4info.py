"""A P4Info, loaded and indexed: the one place that maps P4Info names to ids and back.

:func:`load_p4info` reads a text or binary P4Info (TNA's ``barefoot.*`` extern messages
expand because :mod:`checkmate.p4.tofino` declares them). :class:`P4InfoIndex` holds
its tables, actions, counters and packet metadata by id, checked for the structural
faults a switch must refuse (repeated ids, unknown action references, unsupported
match kinds), and resolves names as p4runtime-shell does: a name resolves if it equals
an object's full name, its alias, or the last dotted component of either, and exactly
one object of that kind matches. So ``route_ipv4`` names ``CheckmateIngress.route_ipv4``
in v1model's P4Info and ``pipe.CheckmateIngress.route_ipv4`` in TNA's. Counters are
read from ``P4Info.counters`` and, for the Tofino compiler's TNA P4Info, from its
``Counter`` externs.

The controller resolves names with it; the embedded switch looks objects up by id.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf import text_format
from google.protobuf.message import DecodeError
from p4.config.v1 import p4info_pb2

from checkmate.p4.program import P4INFO_PATH
from checkmate.p4.tofino import tofino_counters

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class MatchKind(enum.Enum):
    """How a table key field matches (P4Runtime's ``FieldMatch`` kinds)."""

    EXACT = "exact"
    LPM = "lpm"
    TERNARY = "ternary"
    RANGE = "range"
    OPTIONAL = "optional"


MATCH_KINDS: dict[int, MatchKind] = {
    p4info_pb2.MatchField.EXACT: MatchKind.EXACT,
    p4info_pb2.MatchField.LPM: MatchKind.LPM,
    p4info_pb2.MatchField.TERNARY: MatchKind.TERNARY,
    p4info_pb2.MatchField.RANGE: MatchKind.RANGE,
    p4info_pb2.MatchField.OPTIONAL: MatchKind.OPTIONAL,
}
"""P4Info ``MatchField.MatchType`` -> :class:`MatchKind`."""
PRIORITY_KINDS = frozenset({MatchKind.TERNARY, MatchKind.RANGE, MatchKind.OPTIONAL})
"""A table with a field of one of these kinds needs a priority on every entry."""

_TNA_COUNTER_UNITS = {
    "UNSPECIFIED": p4info_pb2.CounterSpec.UNSPECIFIED,
    "BYTES": p4info_pb2.CounterSpec.BYTES,
    "PACKETS": p4info_pb2.CounterSpec.PACKETS,
    "PACKETS_AND_BYTES": p4info_pb2.CounterSpec.BOTH,
}


class P4InfoError(ValueError):
    """A P4Info with a structural fault (repeated ids, a dangling reference, an unknown match kind)."""


class P4InfoNameError(KeyError):
    """A name or id the P4Info does not define (or a name it defines more than once)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown P4Info name"


def short_name(name: str) -> str:
    """The last dotted component: ``CheckmateIngress.route_ipv4`` -> ``route_ipv4``."""
    return name.rsplit(".", 1)[-1]


def preamble_alias(preamble: p4info_pb2.Preamble) -> str:
    """An object's alias, or the last component of its name when the P4Info gives none."""
    return str(preamble.alias or short_name(preamble.name))


def load_p4info(path: str | Path = P4INFO_PATH) -> p4info_pb2.P4Info:
    """Parse a P4Info file: text format, or binary if it does not parse as text.

    P4InfoError (naming the text parser's complaint) if it is neither; OSError if unreadable.
    """
    data = Path(path).read_bytes()
    info = p4info_pb2.P4Info()
    try:
        text_format.Parse(data.decode(), info, allow_unknown_field=True)
    except (UnicodeDecodeError, text_format.ParseError) as text_error:
        info = p4info_pb2.P4Info()
        try:
            info.ParseFromString(data)
        except DecodeError:
            raise P4InfoError(f"{path} is not a P4Info text file ({text_error}) nor a binary one") from None
    return info


@dataclass(frozen=True, slots=True)
class MatchFieldInfo:
    id: int
    name: str
    bitwidth: int
    kind: MatchKind

    @property
    def short_name(self) -> str:
        return short_name(self.name)


@dataclass(frozen=True, slots=True)
class ParamInfo:
    id: int
    name: str
    bitwidth: int


@dataclass(frozen=True, slots=True)
class ActionInfo:
    id: int
    name: str
    alias: str
    params: tuple[ParamInfo, ...]


@dataclass(frozen=True, slots=True)
class TableInfo:
    id: int
    name: str
    alias: str
    fields: tuple[MatchFieldInfo, ...]
    action_scopes: dict[int, int]
    """action id -> P4Info ``ActionRef`` scope."""
    size: int
    const_default_action_id: int
    supports_idle_timeout: bool
    implementation_id: int
    """An action profile or selector (0: direct actions only)."""

    @property
    def needs_priority(self) -> bool:
        return any(f.kind in PRIORITY_KINDS for f in self.fields)


@dataclass(frozen=True, slots=True)
class CounterInfo:
    id: int
    name: str
    alias: str
    unit: int
    """P4Info ``CounterSpec.Unit``."""
    size: int


@dataclass(frozen=True, slots=True)
class PacketMetadataInfo:
    id: int
    name: str
    bitwidth: int


class P4InfoIndex:
    """A P4Info's objects by id and by name; P4InfoError if it is structurally broken."""

    def __init__(self, info: p4info_pb2.P4Info) -> None:
        self.p4info = info
        self.actions: dict[int, ActionInfo] = {}
        self.tables: dict[int, TableInfo] = {}
        self.counters: dict[int, CounterInfo] = {}
        self.packet_in: tuple[PacketMetadataInfo, ...] = ()
        self.packet_out: tuple[PacketMetadataInfo, ...] = ()
        for a in info.actions:
            params = tuple(ParamInfo(p.id, p.name, p.bitwidth) for p in a.params)
            if len({p.id for p in params}) != len(params):
                raise P4InfoError(f"P4Info action {a.preamble.name} repeats a parameter id")
            action = ActionInfo(a.preamble.id, a.preamble.name, preamble_alias(a.preamble), params)
            self._add(self.actions, action.id, action)
        for t in info.tables:
            self._add(self.tables, t.preamble.id, self._table(t))
        for c in info.counters:
            counter = CounterInfo(
                c.preamble.id, c.preamble.name, preamble_alias(c.preamble), c.spec.unit, c.size
            )
            self._add(self.counters, counter.id, counter)
        for tc in tofino_counters(info):
            unit = _TNA_COUNTER_UNITS[tc.unit]
            counter = CounterInfo(
                tc.preamble.id, tc.preamble.name, preamble_alias(tc.preamble), unit, tc.size
            )
            self._add(self.counters, counter.id, counter)
        for cpm in info.controller_packet_metadata:
            metadata = tuple(PacketMetadataInfo(m.id, m.name, m.bitwidth) for m in cpm.metadata)
            if cpm.preamble.name == "packet_in":
                self.packet_in = metadata
            elif cpm.preamble.name == "packet_out":
                self.packet_out = metadata
        self._table_ids = self._names(self.tables.values())
        self._action_ids = self._names(self.actions.values())
        self._counter_ids = self._names(self.counters.values())

    def _table(self, t: p4info_pb2.Table) -> TableInfo:
        fields = []
        for m in t.match_fields:
            kind = MATCH_KINDS.get(m.match_type)
            if kind is None:
                raise P4InfoError(
                    f"P4Info table {t.preamble.name}: field {m.name} has an unsupported match type"
                )
            fields.append(MatchFieldInfo(m.id, m.name, m.bitwidth, kind))
        if len({f.id for f in fields}) != len(fields):
            raise P4InfoError(f"P4Info table {t.preamble.name} repeats a match field id")
        scopes = {}
        for ref in t.action_refs:
            if ref.id not in self.actions:
                raise P4InfoError(f"P4Info table {t.preamble.name} refers to unknown action id {ref.id}")
            scopes[ref.id] = ref.scope
        return TableInfo(
            t.preamble.id,
            t.preamble.name,
            preamble_alias(t.preamble),
            tuple(fields),
            scopes,
            t.size,
            t.const_default_action_id,
            t.idle_timeout_behavior == p4info_pb2.Table.NOTIFY_CONTROL,
            t.implementation_id,
        )

    @staticmethod
    def _add(into: dict[int, Any], object_id: int, obj: Any) -> None:
        if object_id in into:
            raise P4InfoError(f"P4Info repeats object id {object_id} ({obj.name})")
        into[object_id] = obj

    @staticmethod
    def _names(objects: Iterable[TableInfo | ActionInfo | CounterInfo]) -> dict[str, list[int]]:
        index: dict[str, list[int]] = {}
        for obj in objects:
            for name in {obj.name, short_name(obj.name), obj.alias, short_name(obj.alias)}:
                index.setdefault(name, []).append(obj.id)
        return index

    @staticmethod
    def _resolve(kind: str, index: dict[str, list[int]], name: str) -> int:
        ids = sorted(set(index.get(name, [])))
        if not ids:
            known = sorted({n for n in index if "." not in n})
            raise P4InfoNameError(f"the P4Info has no {kind} named {name!r}; {kind}s: {known}")
        if len(ids) > 1:
            raise P4InfoNameError(f"{kind} name {name!r} is ambiguous in the P4Info (ids {ids})")
        return ids[0]

    @staticmethod
    def _by_id(kind: str, objects: dict[int, _T], object_id: int) -> _T:
        try:
            return objects[object_id]
        except KeyError:
            raise P4InfoNameError(f"the P4Info has no {kind} with id {object_id}") from None

    # ---- by name -------------------------------------------------------------------
    def table_id(self, name: str) -> int:
        return self._resolve("table", self._table_ids, name)

    def action_id(self, name: str) -> int:
        return self._resolve("action", self._action_ids, name)

    def counter_id(self, name: str) -> int:
        return self._resolve("counter", self._counter_ids, name)

    def match_field(self, table: str, field: str) -> MatchFieldInfo:
        """A field of ``table`` by its full or last-component name."""
        t = self.tables[self.table_id(table)]
        for f in t.fields:
            if field in (f.name, f.short_name):
                return f
        raise P4InfoNameError(
            f"table {table} has no match field {field!r}; fields: {[f.name for f in t.fields]}"
        )

    def match_fields(self, table: str) -> tuple[MatchFieldInfo, ...]:
        return self.tables[self.table_id(table)].fields

    def param(self, action: str, name: str) -> ParamInfo:
        a = self.actions[self.action_id(action)]
        for p in a.params:
            if p.name == name:
                return p
        raise P4InfoNameError(
            f"action {action} has no parameter {name!r}; parameters: {[p.name for p in a.params]}"
        )

    def param_names(self, action: str) -> list[str]:
        return [p.name for p in self.actions[self.action_id(action)].params]

    def table_size(self, table: str) -> int:
        return int(self.tables[self.table_id(table)].size)

    def counter_size(self, counter: str) -> int:
        return int(self.counters[self.counter_id(counter)].size)

    # ---- by id ---------------------------------------------------------------------
    def table(self, table_id: int) -> TableInfo:
        return self._by_id("table", self.tables, table_id)

    def action(self, action_id: int) -> ActionInfo:
        return self._by_id("action", self.actions, action_id)

    def counter(self, counter_id: int) -> CounterInfo:
        return self._by_id("counter", self.counters, counter_id)

    def table_name(self, table_id: int) -> str:
        return short_name(self.table(table_id).name)

    def action_name(self, action_id: int) -> str:
        return short_name(self.action(action_id).name)

    def match_field_by_id(self, table_id: int, field_id: int) -> MatchFieldInfo:
        for f in self.table(table_id).fields:
            if f.id == field_id:
                return f
        raise P4InfoNameError(f"table {self.table_name(table_id)} has no match field with id {field_id}")

    def param_by_id(self, action_id: int, param_id: int) -> ParamInfo:
        for p in self.action(action_id).params:
            if p.id == param_id:
                return p
        raise P4InfoNameError(f"action {self.action_name(action_id)} has no parameter with id {param_id}")
