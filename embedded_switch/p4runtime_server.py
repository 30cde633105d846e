"""The P4Runtime gRPC server of the embedded switch target.

Serves the ``p4.v1.P4Runtime`` service (P4Runtime spec v1.3+, the protos of the
``p4runtime`` package) for the one program this target runs, answering the way
``simple_switch_grpc`` (BMv2 + PI) does, so a controller cannot tell the two apart:

- StreamChannel: client arbitration per (device id, role) with election ids. The
  highest election id is the primary; every client gets a MasterArbitrationUpdate with
  status OK (primary), ALREADY_EXISTS (backup while a primary exists) or NOT_FOUND (no
  primary). A wrong device id ends the stream with NOT_FOUND, an election id already
  held by another stream with INVALID_ARGUMENT. When the primary's stream ends, the next
  highest becomes primary and all clients are told. PacketOut is accepted from the
  primary only; PacketIn goes to the primary of the default role.
- SetForwardingPipelineConfig (VERIFY, VERIFY_AND_SAVE, VERIFY_AND_COMMIT, COMMIT,
  RECONCILE_AND_COMMIT) accepts a P4Info of the Checkmate program (ids may differ from
  ours; names and widths may not) and stores ``p4_device_config`` unread.
  GetForwardingPipelineConfig honours every response type.
- Write (CONTINUE_ON_ERROR, ROLLBACK_ON_ERROR, DATAPLANE_ATOMIC) of table entries,
  default actions, multicast groups and counter cells; Read with wildcards; Capabilities.

Errors follow the spec: a failed Write batch ends with gRPC status UNKNOWN and a
``grpc-status-details-bin`` trailer holding a ``google.rpc.Status`` whose details are one
packed ``p4.v1.Error`` per update (OK for those that succeeded), as PI does, so
p4runtime-shell's ``P4RuntimeWriteException`` prints them. Errors of a whole request
(not primary, no pipeline, wrong device, malformed protobuf, a missing entry in a Read)
end with that canonical code and a ``google.rpc.Status`` of the same code in the trailer.

Like PI, a Write or SetForwardingPipelineConfig that carries no election id is accepted
while no controller holds a stream for its role (handy for grpc_cli and scripts).

DATAPLANE_ATOMIC is all-or-nothing like ROLLBACK_ON_ERROR (undo on failure); each table
publishes its entries whole and each group's replica tuple is replaced in one store, but a
packet in flight can see a batch half-applied across tables and groups.

PacketOut: the P4Info may declare ``controller_packet_metadata`` "packet_out"; a metadata
field named ``egress_port`` then names the port the payload is sent out of. Without it
(our program declares none) the payload is injected as if received on the CPU port:
``on_packet_out(payload, cpu_port)``; with no CPU port configured it is refused with a
StreamError.

Writers hold ``SwitchState.write_lock``; the data path reads the state without locks.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, status_pb2
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2

from checkmate.tls import TlsConfigError, TlsFiles
from embedded_switch import program
from embedded_switch.state import ActionCall, FieldMatch, MatchKind, Replica, SwitchState, TableEntry

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
MAX_STREAMS = 16
"""Most controller streams at once, as in PI."""
MAX_QUEUED_PACKET_INS = 1024
"""Packet-ins waiting for a slow controller beyond this are dropped (and counted)."""
READ_CHUNK = 1000
"""Entities per ReadResponse."""
DEFAULT_ROLE = ""
_STREAM_POLL_S = 0.5
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_ERROR_DETAILS_BYTES = 6000
"""Budget for a failed Write's per-update details: gRPC clients reject trailers above 8 KiB
(soft) / 16 KiB (hard) by default, and each update costs about 35 bytes even when OK."""

_OK = code_pb2.OK
_INVALID = code_pb2.INVALID_ARGUMENT
_NOT_FOUND = code_pb2.NOT_FOUND
_GRPC_CODES = {c.value[0]: c for c in grpc.StatusCode}

_MATCH_KINDS = {
    p4info_pb2.MatchField.EXACT: MatchKind.EXACT,
    p4info_pb2.MatchField.LPM: MatchKind.LPM,
    p4info_pb2.MatchField.TERNARY: MatchKind.TERNARY,
    p4info_pb2.MatchField.RANGE: MatchKind.RANGE,
    p4info_pb2.MatchField.OPTIONAL: MatchKind.OPTIONAL,
}
_ONEOF_OF_KIND = {
    MatchKind.EXACT: "exact",
    MatchKind.LPM: "lpm",
    MatchKind.TERNARY: "ternary",
    MatchKind.RANGE: "range",
    MatchKind.OPTIONAL: "optional",
}
_PRIORITY_KINDS = frozenset({MatchKind.TERNARY, MatchKind.RANGE, MatchKind.OPTIONAL})

_Update = p4runtime_pb2.Update
_Atomicity = p4runtime_pb2.WriteRequest
_PipelineAction = p4runtime_pb2.SetForwardingPipelineConfigRequest
_ResponseType = p4runtime_pb2.GetForwardingPipelineConfigRequest
_M = TypeVar("_M", bound=Message)


def _code_name(code: int) -> str:
    return str(code_pb2.Code.Name(code)) if code in code_pb2.Code.values() else str(code)


class _Failure(Exception):
    """A canonical P4Runtime error: for one update, one read, or a whole request."""

    def __init__(self, code: int, message: str, details: Sequence[p4runtime_pb2.Error] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = tuple(details)


# ---- bytestrings (spec section "Bytestrings") ------------------------------------------


def decode_bytestring(value: bytes, bitwidth: int, what: str) -> int:
    """The integer a P4Runtime bytestring encodes; INVALID_ARGUMENT unless it fits ``bitwidth``.

    Accepts the canonical form and any form padded up to the field's full byte width.
    """
    if not value:
        raise _Failure(_INVALID, f"{what}: empty bytestring (a value needs at least one byte)")
    number = int.from_bytes(value, "big")
    full_width = (bitwidth + 7) // 8
    if len(value) > full_width or number >> bitwidth:
        raise _Failure(
            _INVALID,
            f"{what}: value 0x{value.hex()} ({len(value)} bytes, {number.bit_length()} significant bits) "
            f"does not fit the field's {bitwidth} bits",
        )
    return number


def encode_bytestring(number: int) -> bytes:
    """The canonical (shortest) bytestring of ``number``; zero is one zero byte."""
    return number.to_bytes(max(1, (number.bit_length() + 7) // 8), "big")


def _batch_failure(results: Sequence[p4runtime_pb2.Error]) -> _Failure:
    """The UNKNOWN status of a failed Write: one p4.v1.Error per update, in order.

    Past MAX_ERROR_DETAILS_BYTES the details stop (a prefix, so each keeps its update's
    index) and the message names the failed updates instead; a client would otherwise
    drop the whole trailer and see no error detail at all.
    """
    failed = [i for i, r in enumerate(results) if r.canonical_code != _OK]
    kept, size = 0, 0
    for r in results:
        size += r.ByteSize() + 40  # Any framing and type URL
        if size > MAX_ERROR_DETAILS_BYTES:
            break
        kept += 1
    message = f"{len(failed)} of {len(results)} updates failed"
    if kept == len(results):
        return _Failure(code_pb2.UNKNOWN, message, details=results)
    # the cause first: in a rolled-back batch every other update is merely ABORTED
    failed.sort(key=lambda i: (results[i].canonical_code == code_pb2.ABORTED, i))
    shown = ", ".join(f"{i} {_code_name(results[i].canonical_code)}" for i in failed[:10])
    more = ", ..." if len(failed) > 10 else ""
    message += (
        f" (updates {shown}{more}); per-update details cover updates 0..{kept - 1} only, "
        f"to keep the gRPC trailer within the clients' metadata limit"
    )
    logger.warning("Write: %s; first failure: %s", message, results[failed[0]].message)
    return _Failure(code_pb2.UNKNOWN, message, details=results[:kept])


def _uint128(value: p4runtime_pb2.Uint128) -> int:
    return (value.high << 64) | value.low


def _set_uint128(out: p4runtime_pb2.Uint128, number: int) -> None:
    out.high = number >> 64
    out.low = number & ((1 << 64) - 1)


def _parse(cls: type[_M], raw: bytes, what: str) -> _M:
    try:
        return cls.FromString(raw)
    except (DecodeError, UnicodeDecodeError) as e:
        raise _Failure(_INVALID, f"malformed {what}: {e}") from None


# ---- the program, indexed by P4Info id --------------------------------------------------


@dataclass(frozen=True, slots=True)
class _FieldInfo:
    id: int
    name: str
    bitwidth: int
    kind: MatchKind


@dataclass(frozen=True, slots=True)
class _ParamInfo:
    id: int
    name: str
    bitwidth: int


@dataclass(frozen=True, slots=True)
class _ActionInfo:
    id: int
    name: str
    alias: str
    params: tuple[_ParamInfo, ...]


@dataclass(frozen=True, slots=True)
class _TableInfo:
    id: int
    name: str
    alias: str
    fields: tuple[_FieldInfo, ...]
    action_scopes: dict[int, int]
    """action id -> p4info ActionRef scope."""
    size: int
    const_default_action_id: int
    supports_idle_timeout: bool

    @property
    def needs_priority(self) -> bool:
        return any(f.kind in _PRIORITY_KINDS for f in self.fields)


@dataclass(frozen=True, slots=True)
class _CounterInfo:
    id: int
    name: str
    alias: str
    unit: int
    size: int


@dataclass(frozen=True, slots=True)
class _PacketMetadataInfo:
    id: int
    name: str
    bitwidth: int


def _short_name(preamble: p4info_pb2.Preamble) -> str:
    return str(preamble.alias or preamble.name.split(".")[-1])


class ProgramIndex:
    """The P4Info objects a server needs, by id; built from a P4Info already checked as ours."""

    def __init__(self, info: p4info_pb2.P4Info) -> None:
        self.actions: dict[int, _ActionInfo] = {}
        self.tables: dict[int, _TableInfo] = {}
        self.counters: dict[int, _CounterInfo] = {}
        self.packet_in: tuple[_PacketMetadataInfo, ...] = ()
        self.packet_out: tuple[_PacketMetadataInfo, ...] = ()
        for a in info.actions:
            params = tuple(_ParamInfo(p.id, p.name, p.bitwidth) for p in a.params)
            if len({p.id for p in params}) != len(params):
                raise _Failure(_INVALID, f"P4Info action {a.preamble.name} repeats a parameter id")
            self._add(
                self.actions,
                a.preamble.id,
                _ActionInfo(a.preamble.id, a.preamble.name, _short_name(a.preamble), params),
            )
        for t in info.tables:
            fields = []
            for m in t.match_fields:
                if m.match_type not in _MATCH_KINDS:
                    raise _Failure(
                        _INVALID,
                        f"P4Info table {t.preamble.name}: field {m.name} has an unsupported match type",
                    )
                fields.append(_FieldInfo(m.id, m.name, m.bitwidth, _MATCH_KINDS[m.match_type]))
            if len({f.id for f in fields}) != len(fields):
                raise _Failure(_INVALID, f"P4Info table {t.preamble.name} repeats a match field id")
            scopes = {}
            for ref in t.action_refs:
                if ref.id not in self.actions:
                    raise _Failure(
                        _INVALID, f"P4Info table {t.preamble.name} refers to unknown action id {ref.id}"
                    )
                scopes[ref.id] = ref.scope
            if t.implementation_id:
                raise _Failure(
                    _INVALID, f"P4Info table {t.preamble.name} uses an action profile; this target has none"
                )
            self._add(
                self.tables,
                t.preamble.id,
                _TableInfo(
                    t.preamble.id,
                    t.preamble.name,
                    _short_name(t.preamble),
                    tuple(fields),
                    scopes,
                    t.size,
                    t.const_default_action_id,
                    t.idle_timeout_behavior == p4info_pb2.Table.NOTIFY_CONTROL,
                ),
            )
        for c in info.counters:
            self._add(
                self.counters,
                c.preamble.id,
                _CounterInfo(c.preamble.id, c.preamble.name, _short_name(c.preamble), c.spec.unit, c.size),
            )
        for cpm in info.controller_packet_metadata:
            metadata = tuple(_PacketMetadataInfo(m.id, m.name, m.bitwidth) for m in cpm.metadata)
            if cpm.preamble.name == "packet_in":
                self.packet_in = metadata
            elif cpm.preamble.name == "packet_out":
                self.packet_out = metadata
        self.actions_by_alias = {a.alias: a for a in self.actions.values()}

    @staticmethod
    def _add(into: dict[int, Any], object_id: int, obj: Any) -> None:
        if object_id in into:
            raise _Failure(_INVALID, f"P4Info repeats object id {object_id} ({obj.name})")
        into[object_id] = obj

    # ---- lookups that fail the P4Runtime way ----------------------------------------
    def table(self, table_id: int) -> _TableInfo:
        if table_id == 0:
            raise _Failure(_INVALID, "table_id 0 is only valid as a read wildcard")
        info = self.tables.get(table_id)
        if info is None:
            raise _Failure(_INVALID, f"unknown table id {table_id}: the P4Info has no such table")
        return info

    def counter(self, counter_id: int) -> _CounterInfo:
        info = self.counters.get(counter_id)
        if info is None:
            raise _Failure(_INVALID, f"unknown counter id {counter_id}: the P4Info has no such counter")
        return info


# ---- match keys and actions -------------------------------------------------------------


def _dont_care(f: _FieldInfo) -> FieldMatch:
    if f.kind is MatchKind.LPM:
        return FieldMatch(MatchKind.LPM, 0, prefix_len=0)
    if f.kind is MatchKind.TERNARY:
        return FieldMatch(MatchKind.TERNARY, 0, mask=0)
    if f.kind is MatchKind.RANGE:
        return FieldMatch(MatchKind.RANGE, 0, high=(1 << f.bitwidth) - 1)
    return FieldMatch(MatchKind.OPTIONAL, 0, wildcard=True)


def _translate_field(table: _TableInfo, f: _FieldInfo, m: p4runtime_pb2.FieldMatch) -> FieldMatch:
    given = m.WhichOneof("field_match_type")
    expected = _ONEOF_OF_KIND[f.kind]
    where = f"table {table.name} field {f.name}"
    if given is None:
        raise _Failure(_INVALID, f"{where}: the FieldMatch carries no value")
    if given != expected:
        raise _Failure(_INVALID, f"{where} is an {expected} match in the P4Info, the entry gives {given}")
    width = f.bitwidth
    if f.kind is MatchKind.EXACT:
        return FieldMatch(MatchKind.EXACT, decode_bytestring(m.exact.value, width, where))
    if f.kind is MatchKind.OPTIONAL:
        return FieldMatch(MatchKind.OPTIONAL, decode_bytestring(m.optional.value, width, where))
    if f.kind is MatchKind.LPM:
        value = decode_bytestring(m.lpm.value, width, where)
        plen = m.lpm.prefix_len
        if not 1 <= plen <= width:
            raise _Failure(
                _INVALID,
                f"{where}: prefix length {plen} is outside 1..{width} "
                f"(omit the field for a don't-care match)",
            )
        if value & ((1 << (width - plen)) - 1):
            raise _Failure(_INVALID, f"{where}: value 0x{value:x} has bits set beyond its /{plen} prefix")
        return FieldMatch(MatchKind.LPM, value, prefix_len=plen)
    if f.kind is MatchKind.TERNARY:
        value = decode_bytestring(m.ternary.value, width, where + " value")
        mask = decode_bytestring(m.ternary.mask, width, where + " mask")
        if mask == 0:
            raise _Failure(_INVALID, f"{where}: all-zero mask (omit the field for a don't-care match)")
        if value & ~mask:
            raise _Failure(_INVALID, f"{where}: value 0x{value:x} has bits outside mask 0x{mask:x}")
        return FieldMatch(MatchKind.TERNARY, value, mask=mask)
    low = decode_bytestring(m.range.low, width, where + " low")
    high = decode_bytestring(m.range.high, width, where + " high")
    if low > high:
        raise _Failure(_INVALID, f"{where}: range low 0x{low:x} is above high 0x{high:x}")
    if low == 0 and high == (1 << width) - 1:
        raise _Failure(_INVALID, f"{where}: the range covers every value (omit the field for don't care)")
    return FieldMatch(MatchKind.RANGE, low, high=high)


def translate_key(
    table: _TableInfo, matches: Iterable[p4runtime_pb2.FieldMatch], priority: int
) -> tuple[FieldMatch, ...]:
    """The state's key (one FieldMatch per P4Info field, in order) for a P4Runtime match."""
    by_id: dict[int, FieldMatch] = {}
    fields = {f.id: f for f in table.fields}
    for m in matches:
        f = fields.get(m.field_id)
        if f is None:
            raise _Failure(
                _INVALID,
                f"table {table.name} has no match field with id {m.field_id} "
                f"(its fields: {', '.join(f'{x.id}={x.name}' for x in table.fields)})",
            )
        if m.field_id in by_id:
            raise _Failure(_INVALID, f"table {table.name}: match field {f.name} is given twice")
        by_id[m.field_id] = _translate_field(table, f, m)
    key = []
    for f in table.fields:
        fm = by_id.get(f.id)
        if fm is None:
            if f.kind is MatchKind.EXACT:
                raise _Failure(
                    _INVALID,
                    f"table {table.name}: exact match field {f.name} is missing "
                    f"(only ternary/LPM/range/optional fields may be omitted)",
                )
            fm = _dont_care(f)
        key.append(fm)
    if table.needs_priority:
        if priority <= 0:
            raise _Failure(
                _INVALID,
                f"table {table.name} has ternary/range/optional fields: priority must be > 0, got {priority}",
            )
    elif priority != 0:
        raise _Failure(
            _INVALID, f"table {table.name} has only exact/LPM fields: priority must be 0, got {priority}"
        )
    return tuple(key)


def _field_to_proto(f: _FieldInfo, fm: FieldMatch) -> p4runtime_pb2.FieldMatch | None:
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


def _describe_key(table: _TableInfo, key: tuple[FieldMatch, ...], priority: int) -> str:
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
    index: ProgramIndex, table: _TableInfo, msg: p4runtime_pb2.Action, default: bool
) -> ActionCall:
    """The state's ActionCall for an Action message, validated against ``table``."""
    action = index.actions.get(msg.action_id)
    if action is None:
        raise _Failure(_INVALID, f"unknown action id {msg.action_id}: the P4Info has no such action")
    scope = table.action_scopes.get(action.id)
    if scope is None:
        names = ", ".join(index.actions[i].name for i in table.action_scopes)
        raise _Failure(
            _INVALID, f"action {action.name} is not an action of table {table.name} (its actions: {names})"
        )
    if default and scope == p4info_pb2.ActionRef.TABLE_ONLY:
        raise _Failure(_INVALID, f"action {action.name} may not be the default action of table {table.name}")
    if not default and scope == p4info_pb2.ActionRef.DEFAULT_ONLY:
        raise _Failure(_INVALID, f"action {action.name} may only be the default action of table {table.name}")
    params = {p.id: p for p in action.params}
    values: dict[int, int] = {}
    for p in msg.params:
        info = params.get(p.param_id)
        if info is None:
            raise _Failure(
                _INVALID,
                f"action {action.name} has no parameter with id {p.param_id} "
                f"(its parameters: {', '.join(f'{x.id}={x.name}' for x in action.params)})",
            )
        if p.param_id in values:
            raise _Failure(_INVALID, f"action {action.name}: parameter {info.name} is given twice")
        values[p.param_id] = decode_bytestring(
            p.value, info.bitwidth, f"action {action.name} parameter {info.name}"
        )
    missing = [p.name for p in action.params if p.id not in values]
    if missing:
        raise _Failure(_INVALID, f"action {action.name}: missing parameter(s) {', '.join(missing)}")
    return ActionCall(action.alias, tuple(values[p.id] for p in action.params))


def _action_to_proto(index: ProgramIndex, call: ActionCall, out: p4runtime_pb2.Action) -> None:
    action = index.actions_by_alias.get(call.name)
    if action is None:
        raise _Failure(code_pb2.INTERNAL, f"installed action {call.name} is not in the P4Info")
    out.action_id = action.id
    for p, value in zip(action.params, call.params, strict=True):
        out.params.add(param_id=p.id, value=encode_bytestring(value))


# ---- pipelines, batches, streams --------------------------------------------------------


@dataclass(eq=False)
class _Pipeline:
    """A forwarding pipeline config and the state realising it."""

    p4info: p4info_pb2.P4Info
    device_config: bytes
    cookie: int | None
    index: ProgramIndex
    state: SwitchState
    entry_metadata: dict[tuple[str, tuple[object, ...]], tuple[int, bytes]] = field(default_factory=dict)
    """(table alias, entry id) -> (controller_metadata, metadata), returned on reads."""
    group_metadata: dict[int, bytes] = field(default_factory=dict)


@dataclass(eq=False)
class _Batch:
    pipeline: _Pipeline
    l1_nodes: int


_Undo = Callable[[], None]


def _l1_nodes(replicas: Iterable[Replica]) -> int:
    return len({r.instance for r in replicas})


@dataclass(frozen=True, slots=True)
class _End:
    """Ends a stream: OK when the client is done, an error code to reject it."""

    code: int = _OK
    message: str = ""


@dataclass(eq=False)
class _Session:
    """One StreamChannel."""

    sid: int
    peer: str
    outbox: queue.Queue[p4runtime_pb2.StreamMessageResponse | _End] = field(default_factory=queue.Queue)
    arbitrated: bool = False
    role: str = DEFAULT_ROLE
    election_id: int | None = None
    closed: bool = False


@dataclass
class P4RuntimeStats:
    """Packet I/O counts of the server (nothing is dropped silently)."""

    packet_ins_sent: int = 0
    packet_ins_dropped: int = 0
    packet_outs_accepted: int = 0
    packet_outs_rejected: int = 0


def _api_version() -> str:
    try:
        return importlib.metadata.version("p4runtime")
    except importlib.metadata.PackageNotFoundError:
        return "1.4.1"


def _with_reference_aliases(info: p4info_pb2.P4Info, reference: p4info_pb2.P4Info) -> p4info_pb2.P4Info:
    """A copy of ``info`` whose aliases are ours, so the state keeps the names the pipeline uses."""
    aliases = {}
    for group in ("tables", "actions", "counters"):
        for obj in getattr(reference, group):
            aliases[(group, obj.preamble.name)] = _short_name(obj.preamble)
    canonical = p4info_pb2.P4Info()
    canonical.CopyFrom(info)
    for group in ("tables", "actions", "counters"):
        for obj in getattr(canonical, group):
            alias = aliases.get((group, obj.preamble.name))
            if alias is not None:
                obj.preamble.alias = alias
    return canonical


class P4RuntimeServer:
    """The P4Runtime service of one embedded switch (one device id)."""

    def __init__(
        self,
        device_id: int,
        address: str = "0.0.0.0:9559",
        cpu_port: int | None = None,
        on_pipeline: Callable[[SwitchState], None] | None = None,
        on_packet_out: Callable[[bytes, int], None] | None = None,
        tls: TlsFiles | None = None,
        client_auth: bool = False,
    ) -> None:
        """``tls``: serve P4Runtime over TLS with ``tls.cert``/``tls.key``; ``client_auth``: accept only
        clients whose certificate ``tls.ca`` signed (mutual TLS). None: plaintext (tutorial workflow)."""
        if tls is not None and (tls.cert is None or tls.key is None):
            raise TlsConfigError("a TLS P4Runtime server needs its certificate and key")
        self._tls = (tls.read(), client_auth) if tls is not None else None
        self.device_id = device_id
        self.address = address
        self.cpu_port = cpu_port
        self._on_pipeline = on_pipeline
        self._on_packet_out = on_packet_out
        self._reference = program.load_p4info()
        self._server: grpc.Server | None = None
        self._config_lock = threading.Lock()
        self._committed: _Pipeline | None = None
        self._saved: _Pipeline | None = None
        self._arb_lock = threading.Lock()
        self._sessions: dict[int, _Session] = {}
        self._session_ids = itertools.count(1)
        self.stats = P4RuntimeStats()

    # ---- lifecycle -----------------------------------------------------------------
    def start(self) -> int:
        """Bind and serve; returns the bound TCP port (``address`` may use port 0)."""
        if self._server is not None:
            raise RuntimeError("P4RuntimeServer already started")
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=2 * MAX_STREAMS + 16, thread_name_prefix="p4runtime"),
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
        with self._arb_lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            s.outbox.put(_End())
        if server is not None:
            server.stop(grace).wait(timeout=grace + 1.0)
            logger.info("P4Runtime server for device %d stopped", self.device_id)

    # ---- pipeline ------------------------------------------------------------------
    @property
    def state(self) -> SwitchState | None:
        """The state the data path runs, or None until a pipeline is committed."""
        pipeline = self._committed
        return pipeline.state if pipeline is not None else None

    def load_pipeline(self, p4info: p4info_pb2.P4Info | str | Path) -> None:
        """Commit ``p4info`` (a message or a text-format file) as VERIFY_AND_COMMIT would.

        Raises program.ProgramMismatchError when it is not the Checkmate program.
        """
        if isinstance(p4info, str | Path):
            p4info = program.load_p4info(Path(p4info))
        try:
            pipeline = self._prepare(p4runtime_pb2.ForwardingPipelineConfig(p4info=p4info))
        except _Failure as e:
            raise program.ProgramMismatchError(e.message) from None
        self._commit(pipeline)

    def load_default_pipeline(self) -> None:
        """Commit the Checkmate program's own P4Info (p4src/checkmate.p4info.txtpb)."""
        self.load_pipeline(self._reference)

    def _prepare(self, config: p4runtime_pb2.ForwardingPipelineConfig) -> _Pipeline:
        info = config.p4info
        try:
            program.check_program(info, self._reference)
        except program.ProgramMismatchError as e:
            raise _Failure(_INVALID, str(e)) from None
        canonical = _with_reference_aliases(info, self._reference)
        index = ProgramIndex(canonical)
        try:
            state = program.build_state(canonical)
        except KeyError as e:
            raise _Failure(_INVALID, f"P4Info names an object this target does not implement: {e}") from None
        stored = p4info_pb2.P4Info()
        stored.CopyFrom(info)
        cookie = config.cookie.cookie if config.HasField("cookie") else None
        return _Pipeline(stored, bytes(config.p4_device_config), cookie, index, state)

    def _commit(self, pipeline: _Pipeline) -> None:
        if self._on_pipeline is not None:
            self._on_pipeline(pipeline.state)
        with self._config_lock:
            self._committed = pipeline
            self._saved = None
        logger.info(
            "device %d: pipeline committed (%d tables, %d counters, %d bytes of device config)",
            self.device_id,
            len(pipeline.state.tables),
            len(pipeline.state.counters),
            len(pipeline.device_config),
        )

    def _pipeline_for_requests(self) -> _Pipeline:
        """The pipeline Read and Write address: a saved one (VERIFY_AND_SAVE) or the committed one."""
        with self._config_lock:
            pipeline = self._saved or self._committed
        if pipeline is None:
            raise _Failure(code_pb2.FAILED_PRECONDITION, "No forwarding pipeline config set for this device")
        return pipeline

    # ---- packet I/O ----------------------------------------------------------------
    def send_packet_in(self, payload: bytes, ingress_port: int) -> None:
        """Send a PacketIn to the primary controller (of the default role); dropped and counted if none."""
        pipeline = self._committed
        msg = p4runtime_pb2.StreamMessageResponse()
        msg.packet.payload = payload
        if pipeline is not None:
            for m in pipeline.index.packet_in:
                value = ingress_port & ((1 << m.bitwidth) - 1) if m.name == "ingress_port" else 0
                msg.packet.metadata.add(metadata_id=m.id, value=encode_bytestring(value))
        with self._arb_lock:
            primary = self._primary(DEFAULT_ROLE)
            if primary is None or primary.outbox.qsize() >= MAX_QUEUED_PACKET_INS:
                self.stats.packet_ins_dropped += 1
                logger.debug(
                    "packet-in from port %d dropped: %s",
                    ingress_port,
                    "no primary controller" if primary is None else "controller too slow",
                )
                return
            primary.outbox.put(msg)
            self.stats.packet_ins_sent += 1

    def _packet_out(self, session: _Session, packet: p4runtime_pb2.PacketOut) -> bool:
        """Hand a PacketOut to the data path; False (and a StreamError to the client) if refused."""

        def reject(code: int, message: str) -> bool:
            self.stats.packet_outs_rejected += 1
            logger.debug("PacketOut from %s rejected: %s", session.peer, message)
            err = p4runtime_pb2.StreamMessageResponse()
            err.error.canonical_code = code
            err.error.message = message
            err.error.packet_out.packet_out.CopyFrom(packet)
            session.outbox.put(err)
            return False

        with self._arb_lock:
            arbitrated, is_primary = session.arbitrated, self._primary(session.role) is session
        if not arbitrated:
            return reject(code_pb2.FAILED_PRECONDITION, "send a MasterArbitrationUpdate before any PacketOut")
        if not is_primary:
            return reject(
                code_pb2.PERMISSION_DENIED, "PacketOut is accepted from the primary controller only"
            )
        pipeline = self._committed
        if pipeline is None:
            return reject(code_pb2.FAILED_PRECONDITION, "No forwarding pipeline config set for this device")
        declared = {m.id: m for m in pipeline.index.packet_out}
        port = self.cpu_port
        for md in packet.metadata:
            info = declared.get(md.metadata_id)
            if info is None:
                return reject(
                    _INVALID, f"PacketOut metadata id {md.metadata_id} is not in the P4Info's packet_out"
                )
            try:
                value = decode_bytestring(md.value, info.bitwidth, f"PacketOut metadata {info.name}")
            except _Failure as e:
                return reject(e.code, e.message)
            if info.name == "egress_port":
                port = value
        if port is None:
            return reject(
                code_pb2.FAILED_PRECONDITION,
                "no CPU port configured (--cpu-port): PacketOut without egress_port metadata "
                "cannot be injected",
            )
        if self._on_packet_out is None:
            return reject(code_pb2.UNAVAILABLE, "no data path is attached to this P4Runtime server")
        try:
            self._on_packet_out(bytes(packet.payload), port)
        except Exception as e:  # noqa: BLE001 - the data path's failure must cost one packet, not the stream
            logger.exception("data path failed on a PacketOut to port %d", port)
            return reject(code_pb2.INTERNAL, f"the data path failed to send the packet: {e}")
        self.stats.packet_outs_accepted += 1
        return True

    # ---- arbitration (caller holds _arb_lock) --------------------------------------
    def _primary(self, role: str) -> _Session | None:
        best: _Session | None = None
        for s in self._sessions.values():
            if s.arbitrated and not s.closed and s.role == role and s.election_id is not None:
                if best is None or s.election_id > (best.election_id or 0):
                    best = s
        return best

    def _notify(self, session: _Session, primary: _Session | None) -> None:
        msg = p4runtime_pb2.StreamMessageResponse()
        arb = msg.arbitration
        arb.device_id = self.device_id
        if session.role:
            arb.role.name = session.role
        if primary is not None and primary.election_id is not None:
            _set_uint128(arb.election_id, primary.election_id)
        if primary is session:
            arb.status.code = _OK
            arb.status.message = "Is primary"
        elif primary is not None:
            arb.status.code = code_pb2.ALREADY_EXISTS
            arb.status.message = "Is backup: another controller is primary"
        else:
            arb.status.code = _NOT_FOUND
            arb.status.message = "Is backup: there is no primary"
        session.outbox.put(msg)

    def _notify_role(self, role: str) -> None:
        primary = self._primary(role)
        for s in self._sessions.values():
            if s.arbitrated and not s.closed and s.role == role:
                self._notify(s, primary)

    def _arbitrate(self, session: _Session, arb: p4runtime_pb2.MasterArbitrationUpdate) -> _End | None:
        role = arb.role.name
        election_id = _uint128(arb.election_id) if arb.HasField("election_id") else None
        with self._arb_lock:
            if arb.device_id != self.device_id:
                if not session.arbitrated:
                    return _End(
                        _NOT_FOUND,
                        f"device id {arb.device_id} not found: this switch is device {self.device_id}",
                    )
                return _End(code_pb2.FAILED_PRECONDITION, "Invalid device id: a stream cannot change device")
            if session.arbitrated and role != session.role:
                return _End(code_pb2.FAILED_PRECONDITION, "a stream cannot change its role")
            if election_id is not None:
                for other in self._sessions.values():
                    if (
                        other is not session
                        and other.arbitrated
                        and not other.closed
                        and other.role == role
                        and other.election_id == election_id
                    ):
                        return _End(
                            _INVALID,
                            f"Election id already exists: election id {election_id} is held "
                            f"by another stream for device {self.device_id} role '{role}'",
                        )
            if not session.arbitrated and sum(s.arbitrated for s in self._sessions.values()) >= MAX_STREAMS:
                return _End(code_pb2.RESOURCE_EXHAUSTED, f"Too many connections (at most {MAX_STREAMS})")
            before = self._primary(role)
            session.arbitrated, session.role, session.election_id = True, role, election_id
            after = self._primary(role)
            if before is not after:
                logger.info(
                    "device %d role '%s': primary is now %s (election id %s)",
                    self.device_id,
                    role,
                    after.peer if after else None,
                    after.election_id if after else None,
                )
                self._notify_role(role)
            else:
                self._notify(session, after)
        return None

    def _open_session(self, peer: str) -> _Session:
        with self._arb_lock:
            session = _Session(next(self._session_ids), peer)
            self._sessions[session.sid] = session
        return session

    def _close_session(self, session: _Session) -> None:
        with self._arb_lock:
            if session.closed:
                return
            was_primary = session.arbitrated and self._primary(session.role) is session
            session.closed = True
            del self._sessions[session.sid]
            if was_primary:
                after = self._primary(session.role)
                logger.info(
                    "device %d role '%s': primary %s left; primary is now %s",
                    self.device_id,
                    session.role,
                    session.peer,
                    after.peer if after else None,
                )
                self._notify_role(session.role)
        session.outbox.put(_End())

    def _check_primary(self, role: str, election_id: int | None) -> None:
        with self._arb_lock:
            primary = self._primary(role)
            anyone = any(s.arbitrated and not s.closed and s.role == role for s in self._sessions.values())
        if primary is None and not anyone and election_id is None:
            return  # as PI: no controller connected, a request without election id is accepted
        if primary is None or election_id != primary.election_id:
            raise _Failure(
                code_pb2.PERMISSION_DENIED,
                f"Not primary: election id {election_id} is not the primary's "
                f"({primary.election_id if primary else 'none'}) for device {self.device_id} "
                f"role '{role}'",
            )

    def _check_device(self, device_id: int) -> None:
        if device_id != self.device_id:
            raise _Failure(
                _NOT_FOUND, f"device id {device_id} not found: this switch is device {self.device_id}"
            )

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
                except _Failure as e:
                    self._fail(context, e)
                except Exception:  # noqa: BLE001 - a bug costs one RPC, never the server
                    logger.exception("P4Runtime %s failed", name)
                    self._fail(
                        context, _Failure(code_pb2.INTERNAL, f"internal error in {name}; see the switch log")
                    )
                return empty()

            return grpc.unary_unary_rpc_method_handler(
                handler, request_deserializer=raw, response_serializer=lambda m: m.SerializeToString()
            )

        def read(request: bytes, context: grpc.ServicerContext) -> Iterator[p4runtime_pb2.ReadResponse]:
            try:
                responses = self._read(request)
            except _Failure as e:
                self._fail(context, e)
                return
            except Exception:  # noqa: BLE001 - a bug costs one RPC, never the server
                logger.exception("P4Runtime Read failed")
                self._fail(context, _Failure(code_pb2.INTERNAL, "internal error in Read; see the switch log"))
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
                    self._stream_channel,
                    request_deserializer=raw,
                    response_serializer=lambda m: m.SerializeToString(),
                ),
                "Capabilities": unary("Capabilities", self._capabilities, p4runtime_pb2.CapabilitiesResponse),
            },
        )

    @staticmethod
    def _fail(context: grpc.ServicerContext, failure: _Failure) -> None:
        status = status_pb2.Status(code=failure.code, message=failure.message)
        for detail in failure.details:
            status.details.add().Pack(detail)
        context.set_trailing_metadata((("grpc-status-details-bin", status.SerializeToString()),))
        context.set_code(_GRPC_CODES.get(failure.code, grpc.StatusCode.UNKNOWN))
        context.set_details(failure.message)

    # ---- StreamChannel -------------------------------------------------------------
    def _stream_channel(
        self, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[p4runtime_pb2.StreamMessageResponse]:
        session = self._open_session(context.peer())
        context.add_callback(lambda: self._close_session(session))
        reader = threading.Thread(
            target=self._read_stream,
            args=(session, requests),
            name=f"p4runtime-stream-{session.sid}",
            daemon=True,
        )
        reader.start()
        try:
            while True:
                try:
                    item = session.outbox.get(timeout=_STREAM_POLL_S)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                if isinstance(item, _End):
                    if item.code != _OK:
                        logger.info(
                            "stream from %s ended: %s %s", session.peer, _code_name(item.code), item.message
                        )
                        self._fail(context, _Failure(item.code, item.message))
                    return
                yield item
        finally:
            self._close_session(session)

    def _read_stream(self, session: _Session, requests: Iterator[bytes]) -> None:
        end = _End()
        try:
            for raw in requests:
                if session.closed:
                    return
                try:
                    request = _parse(p4runtime_pb2.StreamMessageRequest, raw, "StreamMessageRequest")
                except _Failure as e:
                    self._stream_error(session, e.code, e.message)
                    continue
                result = self._handle_stream_message(session, request)
                if result is not None:
                    end = result
                    return
        except grpc.RpcError:
            logger.debug("stream from %s cancelled", session.peer)
        except Exception:  # noqa: BLE001 - a bug ends this stream, never the server
            logger.exception("stream from %s failed", session.peer)
            end = _End(code_pb2.INTERNAL, "internal error on the stream; see the switch log")
        finally:
            session.outbox.put(end)

    def _stream_error(self, session: _Session, code: int, message: str) -> None:
        msg = p4runtime_pb2.StreamMessageResponse()
        msg.error.canonical_code = code
        msg.error.message = message
        msg.error.other.SetInParent()
        session.outbox.put(msg)

    def _handle_stream_message(
        self, session: _Session, request: p4runtime_pb2.StreamMessageRequest
    ) -> _End | None:
        kind = request.WhichOneof("update")
        if kind == "arbitration":
            return self._arbitrate(session, request.arbitration)
        if kind == "packet":
            self._packet_out(session, request.packet)
        elif kind == "digest_ack":
            msg = p4runtime_pb2.StreamMessageResponse()
            msg.error.canonical_code = code_pb2.UNIMPLEMENTED
            msg.error.message = "this target has no digests"
            msg.error.digest_list_ack.digest_list_ack.CopyFrom(request.digest_ack)
            session.outbox.put(msg)
        elif kind == "other":
            self._stream_error(
                session, code_pb2.UNIMPLEMENTED, "architecture-specific stream messages are not supported"
            )
        else:
            self._stream_error(session, _INVALID, "StreamMessageRequest has no update set")
        return None

    # ---- Capabilities, pipeline config ---------------------------------------------
    def _capabilities(self, raw: bytes) -> p4runtime_pb2.CapabilitiesResponse:
        _parse(p4runtime_pb2.CapabilitiesRequest, raw, "CapabilitiesRequest")
        return p4runtime_pb2.CapabilitiesResponse(p4runtime_api_version=_api_version())

    def _set_pipeline(self, raw: bytes) -> p4runtime_pb2.SetForwardingPipelineConfigResponse:
        request = _parse(_PipelineAction, raw, "SetForwardingPipelineConfigRequest")
        self._check_device(request.device_id)
        self._check_primary(
            request.role, _uint128(request.election_id) if request.HasField("election_id") else None
        )
        action = request.action
        name = (
            _PipelineAction.Action.Name(action) if action in _PipelineAction.Action.values() else str(action)
        )
        if action == _PipelineAction.COMMIT:
            if request.HasField("config"):
                raise _Failure(
                    _INVALID, "COMMIT takes no config: it realises the one saved by VERIFY_AND_SAVE"
                )
            with self._config_lock:
                pipeline = self._saved
            if pipeline is None:
                raise _Failure(
                    code_pb2.FAILED_PRECONDITION, "no saved config to commit: send VERIFY_AND_SAVE first"
                )
        elif action in (
            _PipelineAction.VERIFY,
            _PipelineAction.VERIFY_AND_SAVE,
            _PipelineAction.VERIFY_AND_COMMIT,
            _PipelineAction.RECONCILE_AND_COMMIT,
        ):
            if not request.HasField("config"):
                raise _Failure(_INVALID, f"{name} needs a config")
            pipeline = self._prepare(request.config)
        else:
            raise _Failure(
                _INVALID,
                f"action {name} is not one of VERIFY, VERIFY_AND_SAVE, VERIFY_AND_COMMIT, "
                f"COMMIT, RECONCILE_AND_COMMIT",
            )
        if action == _PipelineAction.VERIFY:
            return p4runtime_pb2.SetForwardingPipelineConfigResponse()
        if action == _PipelineAction.VERIFY_AND_SAVE:
            with self._config_lock:
                self._saved = pipeline
            logger.info("device %d: pipeline saved; Read and Write address it until COMMIT", self.device_id)
            return p4runtime_pb2.SetForwardingPipelineConfigResponse()
        if action == _PipelineAction.RECONCILE_AND_COMMIT:
            current = self._committed
            if current is not None:  # same program: the forwarding state carries over as it is
                pipeline = replace(
                    pipeline,
                    state=current.state,
                    entry_metadata=current.entry_metadata,
                    group_metadata=current.group_metadata,
                )
        try:
            self._commit(pipeline)
        except Exception as e:  # noqa: BLE001 - report the data path's refusal to the controller
            logger.exception("data path refused the pipeline")
            raise _Failure(code_pb2.INTERNAL, f"the data path could not load the pipeline: {e}") from None
        return p4runtime_pb2.SetForwardingPipelineConfigResponse()

    def _get_pipeline(self, raw: bytes) -> p4runtime_pb2.GetForwardingPipelineConfigResponse:
        request = _parse(_ResponseType, raw, "GetForwardingPipelineConfigRequest")
        self._check_device(request.device_id)
        pipeline = self._committed
        if pipeline is None:
            raise _Failure(code_pb2.FAILED_PRECONDITION, "No forwarding pipeline config set for this device")
        kind = request.response_type
        if kind not in _ResponseType.ResponseType.values():
            raise _Failure(_INVALID, f"unknown response_type {kind}")
        response = p4runtime_pb2.GetForwardingPipelineConfigResponse()
        config = response.config
        if kind in (_ResponseType.ALL, _ResponseType.P4INFO_AND_COOKIE):
            config.p4info.CopyFrom(pipeline.p4info)
        if kind in (_ResponseType.ALL, _ResponseType.DEVICE_CONFIG_AND_COOKIE):
            config.p4_device_config = pipeline.device_config
        if pipeline.cookie is not None:
            config.cookie.cookie = pipeline.cookie
        return response

    # ---- Write ---------------------------------------------------------------------
    def _write(self, raw: bytes) -> p4runtime_pb2.WriteResponse:
        request = _parse(p4runtime_pb2.WriteRequest, raw, "WriteRequest")
        self._check_device(request.device_id)
        self._check_primary(
            request.role, _uint128(request.election_id) if request.HasField("election_id") else None
        )
        pipeline = self._pipeline_for_requests()
        atomicity = request.atomicity
        if atomicity not in _Atomicity.Atomicity.values():
            raise _Failure(_INVALID, f"unknown atomicity {atomicity}")
        if not request.updates:
            return p4runtime_pb2.WriteResponse()
        results = self._apply_batch(pipeline, request.updates, atomicity)
        if any(r.canonical_code != _OK for r in results):
            raise _batch_failure(results)
        return p4runtime_pb2.WriteResponse()

    def _apply_batch(
        self, pipeline: _Pipeline, updates: Sequence[p4runtime_pb2.Update], atomicity: int
    ) -> list[p4runtime_pb2.Error]:
        state = pipeline.state
        all_or_nothing = atomicity != _Atomicity.CONTINUE_ON_ERROR
        results: list[p4runtime_pb2.Error] = []
        with state.write_lock:
            batch = _Batch(pipeline, sum(_l1_nodes(r) for r in state.multicast_groups.values()))
            undo: list[_Undo] = []
            for i, update in enumerate(updates):
                try:
                    undo.append(self._apply_update(batch, update))
                    results.append(p4runtime_pb2.Error(canonical_code=_OK))
                except _Failure as e:
                    logger.debug("update %d failed: %s %s", i, _code_name(e.code), e.message)
                    results.append(p4runtime_pb2.Error(canonical_code=e.code, message=e.message))
                    if all_or_nothing:
                        for fn in reversed(undo):
                            fn()
                        mode = _Atomicity.Atomicity.Name(atomicity)
                        why = f"update {i} failed ({_code_name(e.code)}) and the batch is {mode}"
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

    def _apply_update(self, batch: _Batch, update: p4runtime_pb2.Update) -> _Undo:
        kind = update.type
        if kind not in (_Update.INSERT, _Update.MODIFY, _Update.DELETE):
            raise _Failure(_INVALID, f"update type {kind} is not INSERT, MODIFY or DELETE")
        entity = update.entity.WhichOneof("entity")
        if entity == "table_entry":
            return self._write_table_entry(batch.pipeline, kind, update.entity.table_entry)
        if entity == "packet_replication_engine_entry":
            return self._write_pre(batch, kind, update.entity.packet_replication_engine_entry)
        if entity == "counter_entry":
            return self._write_counter(batch.pipeline, kind, update.entity.counter_entry)
        if entity is None:
            raise _Failure(_INVALID, "the update's entity has no type set")
        raise _Failure(code_pb2.UNIMPLEMENTED, f"{entity} is not supported by this target")

    def _write_table_entry(self, pipeline: _Pipeline, kind: int, te: p4runtime_pb2.TableEntry) -> _Undo:
        info = pipeline.index.table(te.table_id)
        table = pipeline.state.tables[info.alias]
        if te.idle_timeout_ns and not info.supports_idle_timeout:
            raise _Failure(
                _INVALID, f"table {info.name} does not support idle timeout (idle_timeout_ns must be 0)"
            )
        for direct in ("meter_config", "counter_data", "meter_counter_data"):
            if te.HasField(direct):
                raise _Failure(_INVALID, f"table {info.name} has no direct resource for {direct}")
        if te.HasField("time_since_last_hit"):
            raise _Failure(_INVALID, "time_since_last_hit is read-only")
        if te.is_const:
            raise _Failure(_INVALID, "is_const is read-only")
        if te.is_default_action:
            return self._write_default(pipeline, kind, info, te)
        key = translate_key(info, te.match, te.priority)
        entry_id = table.entry_id(key, te.priority)
        meta_key = (info.alias, entry_id)
        metadata = pipeline.entry_metadata
        existing = table.get(key, te.priority)
        described = _describe_key(info, key, te.priority)
        if kind == _Update.INSERT:
            if existing is not None:
                raise _Failure(
                    code_pb2.ALREADY_EXISTS,
                    f"table {info.name} already has an entry for {described} (use MODIFY to change it)",
                )
            action = self._entry_action(pipeline, info, te)
            if info.size and len(table) >= info.size:
                raise _Failure(
                    code_pb2.RESOURCE_EXHAUSTED, f"table {info.name} is full ({info.size} entries)"
                )
            table.insert(TableEntry(key, action, te.priority))
            metadata[meta_key] = (te.controller_metadata, te.metadata)

            def undo_insert() -> None:
                table.delete(key, te.priority)
                metadata.pop(meta_key, None)

            return undo_insert
        if existing is None:
            raise _Failure(_NOT_FOUND, f"table {info.name} has no entry for {described}")
        old_meta = metadata.get(meta_key)
        if kind == _Update.MODIFY:
            action = self._entry_action(pipeline, info, te)
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

    @staticmethod
    def _entry_action(pipeline: _Pipeline, info: _TableInfo, te: p4runtime_pb2.TableEntry) -> ActionCall:
        kind = te.action.WhichOneof("type")
        if kind is None:
            raise _Failure(_INVALID, f"the entry for table {info.name} has no action")
        if kind != "action":
            raise _Failure(
                _INVALID, f"table {info.name} has no action profile: give a direct action, not {kind}"
            )
        return translate_action(pipeline.index, info, te.action.action, default=False)

    def _write_default(
        self, pipeline: _Pipeline, kind: int, info: _TableInfo, te: p4runtime_pb2.TableEntry
    ) -> _Undo:
        if kind != _Update.MODIFY:
            raise _Failure(
                _INVALID,
                f"the default entry of table {info.name} can only be modified (MODIFY), "
                f"not {_Update.Type.Name(kind)}",
            )
        if te.match or te.priority:
            raise _Failure(
                _INVALID, f"the default entry of table {info.name} has no match fields and no priority"
            )
        if info.const_default_action_id:
            raise _Failure(code_pb2.PERMISSION_DENIED, f"the default action of table {info.name} is const")
        table = pipeline.state.tables[info.alias]
        which = te.action.WhichOneof("type")
        if which is None:
            action = program.DEFAULT_ACTIONS[info.alias]
        elif which == "action":
            action = translate_action(pipeline.index, info, te.action.action, default=True)
        else:
            raise _Failure(
                _INVALID, f"table {info.name} has no action profile: give a direct action, not {which}"
            )
        old = table.default_action
        table.default_action = action

        def undo() -> None:
            table.default_action = old

        return undo

    def _write_pre(self, batch: _Batch, kind: int, pre: p4runtime_pb2.PacketReplicationEngineEntry) -> _Undo:
        which = pre.WhichOneof("type")
        if which == "clone_session_entry":
            raise _Failure(code_pb2.UNIMPLEMENTED, "clone sessions are not supported by this target")
        if which is None:
            raise _Failure(
                _INVALID, "PacketReplicationEngineEntry has neither a multicast group nor a clone session"
            )
        group = pre.multicast_group_entry
        gid = group.multicast_group_id
        if gid == 0:
            raise _Failure(_INVALID, "multicast group id 0 is invalid")
        if gid >= MULTICAST_GROUP_ID_LIMIT:
            raise _Failure(
                _INVALID,
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

        if kind == _Update.DELETE:
            if old is None:
                raise _Failure(_NOT_FOUND, f"multicast group {gid} does not exist")
            del groups[gid]
            pipeline.group_metadata.pop(gid, None)
            batch.l1_nodes -= _l1_nodes(old)
            return undo
        replicas = self._translate_replicas(gid, group.replicas)
        if kind == _Update.INSERT:
            if old is not None:
                raise _Failure(
                    code_pb2.ALREADY_EXISTS,
                    f"multicast group {gid} already exists (use MODIFY to change its replicas)",
                )
            if len(groups) >= MAX_MULTICAST_GROUPS:
                raise _Failure(
                    code_pb2.RESOURCE_EXHAUSTED,
                    f"the switch holds its maximum of {MAX_MULTICAST_GROUPS} multicast groups",
                )
        elif old is None:
            raise _Failure(_NOT_FOUND, f"multicast group {gid} does not exist")
        l1_nodes = batch.l1_nodes - (_l1_nodes(old) if old is not None else 0) + _l1_nodes(replicas)
        if l1_nodes > MAX_L1_NODES:
            raise _Failure(
                code_pb2.RESOURCE_EXHAUSTED,
                f"multicast group {gid} needs more L1 nodes than the {MAX_L1_NODES} the switch has",
            )
        groups[gid] = replicas  # one dict store: the data path sees the old or the new replica list
        pipeline.group_metadata[gid] = bytes(group.metadata)
        batch.l1_nodes = l1_nodes
        return undo

    @staticmethod
    def _translate_replicas(gid: int, replicas: Iterable[p4runtime_pb2.Replica]) -> tuple[Replica, ...]:
        out: list[Replica] = []
        seen: set[tuple[int, int]] = set()
        for r in replicas:
            kind = r.WhichOneof("port_kind")
            if kind == "egress_port":
                port = r.egress_port
            elif kind == "port":
                port = decode_bytestring(r.port, 32, f"multicast group {gid} replica port")
            else:
                raise _Failure(_INVALID, f"multicast group {gid}: a replica has no egress port")
            if port >= PORT_LIMIT:
                raise _Failure(
                    _INVALID,
                    f"multicast group {gid}: egress port {port} is out of range "
                    f"(v1model ports are 9 bits, 0..{PORT_LIMIT - 1})",
                )
            if r.instance >= INSTANCE_LIMIT:
                raise _Failure(
                    _INVALID,
                    f"multicast group {gid}: instance {r.instance} does not fit the 16-bit egress_rid",
                )
            if (port, r.instance) in seen:
                raise _Failure(
                    _INVALID,
                    f"multicast group {gid}: duplicate replica (egress port {port}, instance {r.instance})",
                )
            seen.add((port, r.instance))
            out.append(Replica(port, r.instance))
        return tuple(out)

    def _write_counter(self, pipeline: _Pipeline, kind: int, ce: p4runtime_pb2.CounterEntry) -> _Undo:
        if kind != _Update.MODIFY:
            raise _Failure(
                _INVALID, f"counter entries can only be modified (MODIFY), not {_Update.Type.Name(kind)}"
            )
        if ce.counter_id == 0:
            raise _Failure(_INVALID, "counter_id 0 is only valid as a read wildcard")
        info = pipeline.index.counter(ce.counter_id)
        array = pipeline.state.counters[info.alias]
        packets, nbytes = ce.data.packet_count, ce.data.byte_count
        if packets < 0 or nbytes < 0:
            raise _Failure(_INVALID, f"counter {info.name}: counts cannot be negative")
        if ce.HasField("index"):
            index = self._counter_index(info, ce.index.index)
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

    @staticmethod
    def _counter_index(info: _CounterInfo, index: int) -> int:
        if not 0 <= index < info.size:
            raise _Failure(
                _INVALID, f"index {index} is out of range for counter {info.name} of size {info.size}"
            )
        return index

    # ---- Read ----------------------------------------------------------------------
    def _read(self, raw: bytes) -> list[p4runtime_pb2.ReadResponse]:
        request = _parse(p4runtime_pb2.ReadRequest, raw, "ReadRequest")
        self._check_device(request.device_id)
        pipeline = self._pipeline_for_requests()
        entities: list[p4runtime_pb2.Entity] = []
        with pipeline.state.write_lock:  # a consistent snapshot; the data path never takes this lock
            for entity in request.entities:
                entities.extend(self._read_entity(pipeline, entity))
        responses = []
        for start in range(0, len(entities), READ_CHUNK):
            responses.append(p4runtime_pb2.ReadResponse(entities=entities[start : start + READ_CHUNK]))
        return responses or [p4runtime_pb2.ReadResponse()]

    def _read_entity(self, pipeline: _Pipeline, entity: p4runtime_pb2.Entity) -> list[p4runtime_pb2.Entity]:
        kind = entity.WhichOneof("entity")
        if kind == "table_entry":
            return [
                p4runtime_pb2.Entity(table_entry=e) for e in self._read_tables(pipeline, entity.table_entry)
            ]
        if kind == "counter_entry":
            return [
                p4runtime_pb2.Entity(counter_entry=e)
                for e in self._read_counters(pipeline, entity.counter_entry)
            ]
        if kind == "packet_replication_engine_entry":
            return [
                p4runtime_pb2.Entity(packet_replication_engine_entry=e)
                for e in self._read_groups(pipeline, entity.packet_replication_engine_entry)
            ]
        if kind is None:
            raise _Failure(_INVALID, "a read entity has no type set")
        raise _Failure(code_pb2.UNIMPLEMENTED, f"{kind} is not supported by this target")

    def _read_tables(
        self, pipeline: _Pipeline, te: p4runtime_pb2.TableEntry
    ) -> list[p4runtime_pb2.TableEntry]:
        index = pipeline.index
        if te.table_id == 0:
            if te.match:
                raise _Failure(_INVALID, "a read of all tables (table_id 0) cannot give match fields")
            tables = list(index.tables.values())
        else:
            tables = [index.table(te.table_id)]
        out = []
        for info in tables:
            table = pipeline.state.tables[info.alias]
            if te.is_default_action:
                msg = p4runtime_pb2.TableEntry(table_id=info.id, is_default_action=True)
                _action_to_proto(index, table.default_action, msg.action.action)
                out.append(msg)
            elif te.match:
                key = translate_key(info, te.match, te.priority)
                entry = table.get(key, te.priority)
                if entry is None:
                    raise _Failure(
                        _NOT_FOUND,
                        f"table {info.name} has no entry for {_describe_key(info, key, te.priority)}",
                    )
                out.append(self._entry_to_proto(pipeline, info, entry))
            else:
                out.extend(self._entry_to_proto(pipeline, info, entry) for entry in table.entries())
        return out

    @staticmethod
    def _entry_to_proto(pipeline: _Pipeline, info: _TableInfo, entry: TableEntry) -> p4runtime_pb2.TableEntry:
        msg = p4runtime_pb2.TableEntry(table_id=info.id, priority=entry.priority)
        for f, fm in zip(info.fields, entry.key, strict=True):
            match = _field_to_proto(f, fm)
            if match is not None:
                msg.match.append(match)
        _action_to_proto(pipeline.index, entry.action, msg.action.action)
        table = pipeline.state.tables[info.alias]
        meta = pipeline.entry_metadata.get((info.alias, table.entry_id(entry.key, entry.priority)))
        if meta is not None:
            msg.controller_metadata, msg.metadata = meta
        return msg

    def _read_counters(
        self, pipeline: _Pipeline, ce: p4runtime_pb2.CounterEntry
    ) -> list[p4runtime_pb2.CounterEntry]:
        if ce.counter_id == 0:
            if ce.HasField("index"):
                raise _Failure(_INVALID, "a read of all counters (counter_id 0) cannot give an index")
            counters = list(pipeline.index.counters.values())
        else:
            counters = [pipeline.index.counter(ce.counter_id)]
        out = []
        for info in counters:
            array = pipeline.state.counters[info.alias]
            cells = [self._counter_index(info, ce.index.index)] if ce.HasField("index") else range(info.size)
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
        self, pipeline: _Pipeline, pre: p4runtime_pb2.PacketReplicationEngineEntry
    ) -> list[p4runtime_pb2.PacketReplicationEngineEntry]:
        which = pre.WhichOneof("type")
        if which == "clone_session_entry":
            raise _Failure(code_pb2.UNIMPLEMENTED, "clone sessions are not supported by this target")
        if which is None:
            raise _Failure(
                _INVALID, "PacketReplicationEngineEntry has neither a multicast group nor a clone session"
            )
        groups = pipeline.state.multicast_groups
        gid = pre.multicast_group_entry.multicast_group_id
        if gid == 0:
            wanted = sorted(groups)
        elif gid in groups:
            wanted = [gid]
        else:
            raise _Failure(_NOT_FOUND, f"multicast group {gid} does not exist")
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
