"""The program's P4Info as the server needs it, and P4Runtime match keys and actions in and out.

:class:`ProgramIndex` is the shared :class:`checkmate.p4.p4info.P4InfoIndex` whose lookups
fail the P4Runtime way (INVALID_ARGUMENT naming the unknown id) and which refuses what
this target lacks (action profiles). :func:`translate_key` and :func:`translate_action`
turn a ``p4.v1`` match and action into the state's :class:`FieldMatch` tuple and
:class:`ActionCall`, checking them against the table; :func:`field_to_proto` and
:func:`action_to_proto` go back, in canonical form, for Read. No lock: the index is
immutable once built, and the translations are pure.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from google.rpc import code_pb2
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2

from checkmate.p4.bytestrings import encode_bytestring
from checkmate.p4.p4info import (
    ActionInfo,
    CounterInfo,
    MatchFieldInfo,
    MatchKind,
    P4InfoError,
    P4InfoIndex,
    TableInfo,
)
from embedded_switch.p4runtime.errors import INVALID, Failure, decode_value
from embedded_switch.state import ActionCall, FieldMatch

logger = logging.getLogger(__name__)

ONEOF_OF_KIND = {
    MatchKind.EXACT: "exact",
    MatchKind.LPM: "lpm",
    MatchKind.TERNARY: "ternary",
    MatchKind.RANGE: "range",
    MatchKind.OPTIONAL: "optional",
}
"""The ``FieldMatch`` oneof that carries each kind."""


class ProgramIndex(P4InfoIndex):
    """The P4Info objects a server needs, by id; built from a P4Info already checked as ours."""

    def __init__(self, info: p4info_pb2.P4Info) -> None:
        try:
            super().__init__(info)
        except P4InfoError as e:
            raise Failure(INVALID, str(e)) from None
        for t in self.tables.values():
            if t.implementation_id:
                raise Failure(INVALID, f"P4Info table {t.name} uses an action profile; this target has none")
        self.actions_by_alias: dict[str, ActionInfo] = {a.alias: a for a in self.actions.values()}

    # ---- lookups that fail the P4Runtime way ----------------------------------------
    def table(self, table_id: int) -> TableInfo:
        if table_id == 0:
            raise Failure(INVALID, "table_id 0 is only valid as a read wildcard")
        info = self.tables.get(table_id)
        if info is None:
            raise Failure(INVALID, f"unknown table id {table_id}: the P4Info has no such table")
        return info

    def counter(self, counter_id: int) -> CounterInfo:
        info = self.counters.get(counter_id)
        if info is None:
            raise Failure(INVALID, f"unknown counter id {counter_id}: the P4Info has no such counter")
        return info


def multicast_group_entry(
    pre: p4runtime_pb2.PacketReplicationEngineEntry,
) -> p4runtime_pb2.MulticastGroupEntry:
    """The multicast group a replication-engine entity names; clone sessions are not supported."""
    which = pre.WhichOneof("type")
    if which == "clone_session_entry":
        raise Failure(code_pb2.UNIMPLEMENTED, "clone sessions are not supported by this target")
    if which is None:
        raise Failure(
            INVALID, "PacketReplicationEngineEntry has neither a multicast group nor a clone session"
        )
    return pre.multicast_group_entry


def counter_index(info: CounterInfo, index: int) -> int:
    """``index`` if it is a cell of counter ``info``; INVALID_ARGUMENT otherwise."""
    if not 0 <= index < info.size:
        raise Failure(INVALID, f"index {index} is out of range for counter {info.name} of size {info.size}")
    return index


# ---- match keys and actions -------------------------------------------------------------


def dont_care(f: MatchFieldInfo) -> FieldMatch:
    if f.kind is MatchKind.LPM:
        return FieldMatch(MatchKind.LPM, 0, prefix_len=0)
    if f.kind is MatchKind.TERNARY:
        return FieldMatch(MatchKind.TERNARY, 0, mask=0)
    if f.kind is MatchKind.RANGE:
        return FieldMatch(MatchKind.RANGE, 0, high=(1 << f.bitwidth) - 1)
    return FieldMatch(MatchKind.OPTIONAL, 0, wildcard=True)


def translate_field(table: TableInfo, f: MatchFieldInfo, m: p4runtime_pb2.FieldMatch) -> FieldMatch:
    given = m.WhichOneof("field_match_type")
    expected = ONEOF_OF_KIND[f.kind]
    where = f"table {table.name} field {f.name}"
    if given is None:
        raise Failure(INVALID, f"{where}: the FieldMatch carries no value")
    if given != expected:
        raise Failure(INVALID, f"{where} is an {expected} match in the P4Info, the entry gives {given}")
    width = f.bitwidth
    if f.kind is MatchKind.EXACT:
        return FieldMatch(MatchKind.EXACT, decode_value(m.exact.value, width, where))
    if f.kind is MatchKind.OPTIONAL:
        return FieldMatch(MatchKind.OPTIONAL, decode_value(m.optional.value, width, where))
    if f.kind is MatchKind.LPM:
        value = decode_value(m.lpm.value, width, where)
        plen = m.lpm.prefix_len
        if not 1 <= plen <= width:
            raise Failure(
                INVALID,
                f"{where}: prefix length {plen} is outside 1..{width} "
                f"(omit the field for a don't-care match)",
            )
        if value & ((1 << (width - plen)) - 1):
            raise Failure(INVALID, f"{where}: value 0x{value:x} has bits set beyond its /{plen} prefix")
        return FieldMatch(MatchKind.LPM, value, prefix_len=plen)
    if f.kind is MatchKind.TERNARY:
        value = decode_value(m.ternary.value, width, where + " value")
        mask = decode_value(m.ternary.mask, width, where + " mask")
        if mask == 0:
            raise Failure(INVALID, f"{where}: all-zero mask (omit the field for a don't-care match)")
        if value & ~mask:
            raise Failure(INVALID, f"{where}: value 0x{value:x} has bits outside mask 0x{mask:x}")
        return FieldMatch(MatchKind.TERNARY, value, mask=mask)
    low = decode_value(m.range.low, width, where + " low")
    high = decode_value(m.range.high, width, where + " high")
    if low > high:
        raise Failure(INVALID, f"{where}: range low 0x{low:x} is above high 0x{high:x}")
    if low == 0 and high == (1 << width) - 1:
        raise Failure(INVALID, f"{where}: the range covers every value (omit the field for don't care)")
    return FieldMatch(MatchKind.RANGE, low, high=high)


def translate_key(
    table: TableInfo, matches: Iterable[p4runtime_pb2.FieldMatch], priority: int
) -> tuple[FieldMatch, ...]:
    """The state's key (one FieldMatch per P4Info field, in order) for a P4Runtime match."""
    by_id: dict[int, FieldMatch] = {}
    fields = {f.id: f for f in table.fields}
    for m in matches:
        f = fields.get(m.field_id)
        if f is None:
            raise Failure(
                INVALID,
                f"table {table.name} has no match field with id {m.field_id} "
                f"(its fields: {', '.join(f'{x.id}={x.name}' for x in table.fields)})",
            )
        if m.field_id in by_id:
            raise Failure(INVALID, f"table {table.name}: match field {f.name} is given twice")
        by_id[m.field_id] = translate_field(table, f, m)
    key = []
    for f in table.fields:
        fm = by_id.get(f.id)
        if fm is None:
            if f.kind is MatchKind.EXACT:
                raise Failure(
                    INVALID,
                    f"table {table.name}: exact match field {f.name} is missing "
                    f"(only ternary/LPM/range/optional fields may be omitted)",
                )
            fm = dont_care(f)
        key.append(fm)
    if table.needs_priority:
        if priority <= 0:
            raise Failure(
                INVALID,
                f"table {table.name} has ternary/range/optional fields: priority must be > 0, got {priority}",
            )
    elif priority != 0:
        raise Failure(
            INVALID, f"table {table.name} has only exact/LPM fields: priority must be 0, got {priority}"
        )
    return tuple(key)


def field_to_proto(f: MatchFieldInfo, fm: FieldMatch) -> p4runtime_pb2.FieldMatch | None:
    """A FieldMatch message in canonical form, or None for a don't-care field (omitted)."""
    m = p4runtime_pb2.FieldMatch(field_id=f.id)
    if fm.kind is MatchKind.EXACT:
        m.exact.value = encode_bytestring(fm.value)
    elif fm.kind is MatchKind.OPTIONAL:
        if fm.wildcard:
            return None
        m.optional.value = encode_bytestring(fm.value)
    elif fm.kind is MatchKind.LPM:
        if fm.prefix_len == 0:
            return None
        m.lpm.value = encode_bytestring(fm.value)
        m.lpm.prefix_len = fm.prefix_len
    elif fm.kind is MatchKind.TERNARY:
        if fm.mask == 0:
            return None
        m.ternary.value = encode_bytestring(fm.value)
        m.ternary.mask = encode_bytestring(fm.mask)
    else:
        if fm.value == 0 and fm.high == (1 << f.bitwidth) - 1:
            return None
        m.range.low = encode_bytestring(fm.value)
        m.range.high = encode_bytestring(fm.high)
    return m


def describe_key(table: TableInfo, key: tuple[FieldMatch, ...], priority: int) -> str:
    parts = []
    for f, fm in zip(table.fields, key, strict=True):
        if fm.kind is MatchKind.LPM:
            parts.append(f"{f.name}=0x{fm.value:x}/{fm.prefix_len}")
        elif fm.kind is MatchKind.TERNARY:
            parts.append(f"{f.name}=0x{fm.value:x}&&&0x{fm.mask:x}")
        elif fm.kind is MatchKind.RANGE:
            parts.append(f"{f.name}=0x{fm.value:x}..0x{fm.high:x}")
        elif fm.kind is MatchKind.OPTIONAL and fm.wildcard:
            parts.append(f"{f.name}=*")
        else:
            parts.append(f"{f.name}=0x{fm.value:x}")
    return ", ".join(parts) + (f" priority {priority}" if priority else "")


def translate_action(
    index: ProgramIndex, table: TableInfo, msg: p4runtime_pb2.Action, default: bool
) -> ActionCall:
    """The state's ActionCall for an Action message, validated against ``table``."""
    action = index.actions.get(msg.action_id)
    if action is None:
        raise Failure(INVALID, f"unknown action id {msg.action_id}: the P4Info has no such action")
    scope = table.action_scopes.get(action.id)
    if scope is None:
        names = ", ".join(index.actions[i].name for i in table.action_scopes)
        raise Failure(
            INVALID, f"action {action.name} is not an action of table {table.name} (its actions: {names})"
        )
    if default and scope == p4info_pb2.ActionRef.TABLE_ONLY:
        raise Failure(INVALID, f"action {action.name} may not be the default action of table {table.name}")
    if not default and scope == p4info_pb2.ActionRef.DEFAULT_ONLY:
        raise Failure(INVALID, f"action {action.name} may only be the default action of table {table.name}")
    params = {p.id: p for p in action.params}
    values: dict[int, int] = {}
    for p in msg.params:
        info = params.get(p.param_id)
        if info is None:
            raise Failure(
                INVALID,
                f"action {action.name} has no parameter with id {p.param_id} "
                f"(its parameters: {', '.join(f'{x.id}={x.name}' for x in action.params)})",
            )
        if p.param_id in values:
            raise Failure(INVALID, f"action {action.name}: parameter {info.name} is given twice")
        values[p.param_id] = decode_value(
            p.value, info.bitwidth, f"action {action.name} parameter {info.name}"
        )
    missing = [p.name for p in action.params if p.id not in values]
    if missing:
        raise Failure(INVALID, f"action {action.name}: missing parameter(s) {', '.join(missing)}")
    return ActionCall(action.alias, tuple(values[p.id] for p in action.params))


def action_to_proto(index: ProgramIndex, call: ActionCall, out: p4runtime_pb2.Action) -> None:
    action = index.actions_by_alias.get(call.name)
    if action is None:
        raise Failure(code_pb2.INTERNAL, f"installed action {call.name} is not in the P4Info")
    out.action_id = action.id
    for p, value in zip(action.params, call.params, strict=True):
        out.params.add(param_id=p.id, value=encode_bytestring(value))
