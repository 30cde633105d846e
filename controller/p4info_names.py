"""P4Info names to numeric ids and back: the only place the controller sees ids.

The controller speaks in unqualified names (``route_ipv4``, ``forward``,
``shadow_copies``). A P4Info may qualify them differently: p4c's v1model
output says ``CheckmateIngress.route_ipv4`` with alias ``route_ipv4``; TNA's
says ``pipe.CheckmateIngress.route_ipv4``. A name resolves if it equals an
object's full name, its alias, or the last dotted component of either, and
exactly one object of that kind matches. Counters are read from
``P4Info.counters`` and, for the Tofino compiler's TNA P4Info, from its
``Counter`` externs (:mod:`controller.tofino_p4info`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from p4.config.v1 import p4info_pb2

from controller.tofino_p4info import tofino_counters

logger = logging.getLogger(__name__)


class P4InfoNameError(KeyError):
    """A name the P4Info does not define (or defines more than once)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown P4Info name"


@dataclass(frozen=True)
class FieldInfo:
    """A match field or an action parameter."""

    id: int
    name: str
    bitwidth: int
    match_type: int = 0
    """p4info_pb2.MatchField.MatchType for match fields; 0 for action parameters."""


def short_name(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def load_p4info(path: str | Path) -> p4info_pb2.P4Info:
    """Parse a P4Info file (text format, or binary if it does not parse as text).

    Text P4Infos of TNA programs carry ``barefoot.*`` extern messages; importing
    :mod:`controller.tofino_p4info` (above) lets the text parser expand them.
    """
    data = Path(path).read_bytes()
    info = p4info_pb2.P4Info()
    try:
        text_format.Parse(data.decode(), info, allow_unknown_field=True)
    except (UnicodeDecodeError, text_format.ParseError):
        info = p4info_pb2.P4Info()
        info.ParseFromString(data)
    return info


class P4InfoNames:
    """Resolves tables, actions, counters, match fields and parameters by name."""

    def __init__(self, p4info: p4info_pb2.P4Info) -> None:
        self.p4info = p4info
        self._tables = {t.preamble.id: t for t in p4info.tables}
        self._actions = {a.preamble.id: a for a in p4info.actions}
        self._counter_sizes = {c.preamble.id: int(c.size) for c in p4info.counters}
        tna_counters = tofino_counters(p4info)
        self._counter_sizes.update({c.preamble.id: c.size for c in tna_counters})
        self._table_ids = self._index("table", p4info.tables)
        self._action_ids = self._index("action", p4info.actions)
        self._counter_ids = self._index("counter", [*p4info.counters, *tna_counters])

    @staticmethod
    def _index(kind: str, objects: Iterable[object]) -> dict[str, list[int]]:
        index: dict[str, list[int]] = {}
        for obj in objects:
            preamble = obj.preamble  # type: ignore[attr-defined]
            names = {preamble.name, short_name(preamble.name)}
            if preamble.alias:
                names |= {preamble.alias, short_name(preamble.alias)}
            for name in names:
                index.setdefault(name, []).append(preamble.id)
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

    # ---- name -> id ---------------------------------------------------------------
    def table_id(self, name: str) -> int:
        return self._resolve("table", self._table_ids, name)

    def action_id(self, name: str) -> int:
        return self._resolve("action", self._action_ids, name)

    def counter_id(self, name: str) -> int:
        return self._resolve("counter", self._counter_ids, name)

    def match_field(self, table: str, field: str) -> FieldInfo:
        t = self._tables[self.table_id(table)]
        for m in t.match_fields:
            if m.name == field or short_name(m.name) == field:
                return FieldInfo(m.id, short_name(m.name), m.bitwidth, m.match_type)
        raise P4InfoNameError(
            f"table {table} has no match field {field!r}; fields: {[m.name for m in t.match_fields]}"
        )

    def match_fields(self, table: str) -> list[FieldInfo]:
        t = self._tables[self.table_id(table)]
        return [FieldInfo(m.id, short_name(m.name), m.bitwidth, m.match_type) for m in t.match_fields]

    def param(self, action: str, name: str) -> FieldInfo:
        a = self._actions[self.action_id(action)]
        for p in a.params:
            if p.name == name:
                return FieldInfo(p.id, p.name, p.bitwidth)
        raise P4InfoNameError(
            f"action {action} has no parameter {name!r}; parameters: {[p.name for p in a.params]}"
        )

    def table_size(self, table: str) -> int:
        return int(self._tables[self.table_id(table)].size)

    def counter_size(self, counter: str) -> int:
        return self._counter_sizes[self.counter_id(counter)]

    # ---- id -> name ---------------------------------------------------------------
    def table_name(self, table_id: int) -> str:
        try:
            return short_name(self._tables[table_id].preamble.name)
        except KeyError:
            raise P4InfoNameError(f"the P4Info has no table with id {table_id}") from None

    def action_name(self, action_id: int) -> str:
        try:
            return short_name(self._actions[action_id].preamble.name)
        except KeyError:
            raise P4InfoNameError(f"the P4Info has no action with id {action_id}") from None

    def match_field_by_id(self, table_id: int, field_id: int) -> FieldInfo:
        for m in self._tables[table_id].match_fields:
            if m.id == field_id:
                return FieldInfo(m.id, short_name(m.name), m.bitwidth, m.match_type)
        raise P4InfoNameError(f"table {self.table_name(table_id)} has no match field with id {field_id}")

    def param_by_id(self, action_id: int, param_id: int) -> FieldInfo:
        for p in self._actions[action_id].params:
            if p.id == param_id:
                return FieldInfo(p.id, p.name, p.bitwidth)
        raise P4InfoNameError(f"action {self.action_name(action_id)} has no parameter with id {param_id}")

    def param_names(self, action: str) -> list[str]:
        return [p.name for p in self._actions[self.action_id(action)].params]
