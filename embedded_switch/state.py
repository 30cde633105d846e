"""The switch's forwarding state: what P4Runtime writes and the pipeline reads.

Tables, multicast groups and counters of the loaded P4 program, named as in
its P4Info. Writers (the P4Runtime server) hold ``SwitchState.write_lock`` and
publish changes by replacing a table's lookup structures whole, so the packet
path reads without taking any lock and always sees a consistent table.

Match semantics follow P4Runtime: exact, LPM (longest prefix wins), ternary
and range (highest priority wins; priorities are required and > 0, and two
entries with the same key and priority are the same entry), optional.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from checkmate.p4.p4info import MatchKind

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FieldMatch:
    """One key field of an entry. ``value`` is used by every kind; the rest as named.

    exact/optional: value (optional with ``wildcard`` True matches anything);
    lpm: value and prefix_len; ternary: value and mask; range: low=value, high.
    """

    kind: MatchKind
    value: int = 0
    prefix_len: int = 0
    mask: int = 0
    high: int = 0
    wildcard: bool = False

    def matches(self, key: int, bitwidth: int) -> bool:
        if self.kind is MatchKind.EXACT:
            return key == self.value
        if self.kind is MatchKind.OPTIONAL:
            return self.wildcard or key == self.value
        if self.kind is MatchKind.LPM:
            shift = bitwidth - self.prefix_len
            return (key >> shift) == (self.value >> shift)
        if self.kind is MatchKind.TERNARY:
            return (key & self.mask) == (self.value & self.mask)
        return self.value <= key <= self.high


@dataclass(frozen=True, slots=True)
class ActionCall:
    """An action and its parameter values, in the order the P4Info lists them."""

    name: str
    """The action's P4Info alias, e.g. ``"forward"``."""
    params: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class MatchFieldSpec:
    name: str
    bitwidth: int
    kind: MatchKind


@dataclass(slots=True)
class TableEntry:
    """An installed entry. ``key`` has one FieldMatch per match field, in P4Info order."""

    key: tuple[FieldMatch, ...]
    action: ActionCall
    priority: int = 0
    hit_packets: int = 0
    hit_bytes: int = 0


@dataclass(frozen=True, slots=True)
class LookupResult:
    action: ActionCall
    hit: bool
    entry: TableEntry | None


class Table:
    """A match-action table. Lookup is O(1) for exact tables, O(prefix lengths) for LPM."""

    def __init__(
        self,
        name: str,
        alias: str,
        fields: Iterable[MatchFieldSpec],
        size: int,
        default_action: ActionCall,
    ) -> None:
        self.name = name
        self.alias = alias
        self.fields = tuple(fields)
        self.size = size
        self.default_action = default_action
        self._entries: dict[tuple[object, ...], TableEntry] = {}
        kinds = {f.kind for f in self.fields}
        self.needs_priority = bool(kinds & {MatchKind.TERNARY, MatchKind.RANGE, MatchKind.OPTIONAL})
        self._all_exact = kinds <= {MatchKind.EXACT}
        lpm = [i for i, f in enumerate(self.fields) if f.kind is MatchKind.LPM]
        self._lpm_index = lpm[0] if len(lpm) == 1 and not self.needs_priority else None
        # Published lookup structures (replaced whole on every change).
        self._exact: dict[tuple[int, ...], TableEntry] = {}
        self._by_prefix: tuple[tuple[int, dict[tuple[int, ...], TableEntry]], ...] = ()
        self._ordered: tuple[TableEntry, ...] = ()
        self.generation = 0
        """Bumped on every published change of the entries (readers cache lookups by it)."""

    # ---- identity -------------------------------------------------------------
    def entry_id(self, key: tuple[FieldMatch, ...], priority: int) -> tuple[object, ...]:
        """What makes two entries the same entry (P4Runtime: key fields plus priority)."""
        return (*key, priority)

    # ---- reads ----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> Iterator[TableEntry]:
        return iter(list(self._entries.values()))

    def get(self, key: tuple[FieldMatch, ...], priority: int) -> TableEntry | None:
        return self._entries.get(self.entry_id(key, priority))

    def lookup(self, key: tuple[int, ...]) -> LookupResult:
        """Match packet field values (one int per match field) against the entries."""
        if self._all_exact:
            entry = self._exact.get(key)
        elif self._lpm_index is not None:
            entry = self._lookup_lpm(key)
        else:
            entry = self._lookup_ordered(key)
        if entry is None:
            return LookupResult(self.default_action, False, None)
        return LookupResult(entry.action, True, entry)

    def _lookup_lpm(self, key: tuple[int, ...]) -> TableEntry | None:
        index = self._lpm_index
        assert index is not None
        width = self.fields[index].bitwidth
        for prefix_len, bucket in self._by_prefix:
            shift = width - prefix_len
            masked = list(key)
            masked[index] = (key[index] >> shift) << shift
            entry = bucket.get(tuple(masked))
            if entry is not None:
                return entry
        return None

    def _lookup_ordered(self, key: tuple[int, ...]) -> TableEntry | None:
        for entry in self._ordered:
            if all(m.matches(k, f.bitwidth) for m, k, f in zip(entry.key, key, self.fields, strict=True)):
                return entry
        return None

    # ---- writes (caller holds SwitchState.write_lock) --------------------------
    def insert(self, entry: TableEntry) -> None:
        self._entries[self.entry_id(entry.key, entry.priority)] = entry
        self._publish()

    def delete(self, key: tuple[FieldMatch, ...], priority: int) -> TableEntry:
        entry = self._entries.pop(self.entry_id(key, priority))
        self._publish()
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self._publish()

    def _publish(self) -> None:
        entries = list(self._entries.values())
        if self._all_exact:
            self._exact = {tuple(m.value for m in e.key): e for e in entries}
        elif self._lpm_index is not None:
            index = self._lpm_index
            buckets: dict[int, dict[tuple[int, ...], TableEntry]] = {}
            for e in entries:
                plen = e.key[index].prefix_len
                width = self.fields[index].bitwidth
                values = [m.value for m in e.key]
                values[index] = (values[index] >> (width - plen)) << (width - plen)
                buckets.setdefault(plen, {})[tuple(values)] = e
            self._by_prefix = tuple(sorted(buckets.items(), key=lambda kv: -kv[0]))
        else:
            self._ordered = tuple(sorted(entries, key=lambda e: -e.priority))
        self.generation += 1  # after the structures: a reader never caches new-generation stale data


@dataclass(frozen=True, slots=True)
class Replica:
    """One copy a multicast group makes: out of ``egress_port``, with egress_rid = ``instance``."""

    egress_port: int
    instance: int


class CounterArray:
    """An indexed packets/bytes counter (P4 ``counter``), safe to bump from one thread."""

    def __init__(self, name: str, alias: str, size: int, unit: str) -> None:
        self.name = name
        self.alias = alias
        self.size = size
        self.unit = unit
        self.packets = [0] * size
        self.bytes = [0] * size

    def count(self, index: int, nbytes: int) -> None:
        if 0 <= index < self.size:
            self.packets[index] += 1
            self.bytes[index] += nbytes
        else:
            logger.warning("counter %s: index %d out of range %d", self.alias, index, self.size)

    def read(self, index: int) -> tuple[int, int]:
        return self.packets[index], self.bytes[index]

    def reset(self, index: int | None = None, packets: int = 0, nbytes: int = 0) -> None:
        if index is None:
            self.packets = [0] * self.size
            self.bytes = [0] * self.size
        else:
            self.packets[index] = packets
            self.bytes[index] = nbytes


@dataclass
class SwitchState:
    """All state of the loaded program. Tables and counters are keyed by P4Info alias."""

    tables: dict[str, Table] = field(default_factory=dict)
    counters: dict[str, CounterArray] = field(default_factory=dict)
    multicast_groups: dict[int, tuple[Replica, ...]] = field(default_factory=dict)
    write_lock: threading.RLock = field(default_factory=threading.RLock)

    def table(self, alias: str) -> Table:
        return self.tables[alias]

    def counter(self, alias: str) -> CounterArray:
        return self.counters[alias]

    def replicas(self, group: int) -> tuple[Replica, ...]:
        return self.multicast_groups.get(group, ())
