"""Reconciliation: make each switch hold exactly what the registry and network say.

The controller owns the five tables of the Checkmate program and the
multicast groups. :func:`read_installed` reads them back; :func:`plan_reconcile`
diffs them against the desired state (routes and source checks from the network description,
every registered job's entities): missing entries are inserted, differing
ones modified, stale ones (left by a crash, a removed job, or a hand edit)
deleted. Entities are compared by P4Runtime identity, so nothing is ever
inserted twice. The result is written like any change: one batch per
switch, undone as a whole on failure.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from p4.v1 import p4runtime_pb2

from checkmate.p4 import names
from controller.entities import Entity, EntityCodec, MulticastGroup, TableEntry, Update, UpdateKind, diff
from controller.switch_connection import SwitchConnection

logger = logging.getLogger(__name__)

OWNED_TABLES = tuple(names.TABLES)
"""Every table of the Checkmate program; the controller owns all of them."""
GROUPS = "multicast groups"

EntityMap = dict[tuple[object, ...], Entity]


@dataclass
class ReconcileReport:
    """What reconciliation changed, per switch."""

    inserted: dict[str, int] = field(default_factory=dict)
    modified: dict[str, int] = field(default_factory=dict)
    deleted: dict[str, int] = field(default_factory=dict)
    skipped_jobs: list[str] = field(default_factory=list)
    """Registered jobs that no longer fit the network (their entries are removed)."""

    @property
    def changes(self) -> int:
        return sum(self.inserted.values()) + sum(self.modified.values()) + sum(self.deleted.values())

    def add(self, switch: str, updates: Iterable[Update]) -> None:
        for update in updates:
            bucket = {
                UpdateKind.INSERT: self.inserted,
                UpdateKind.MODIFY: self.modified,
                UpdateKind.DELETE: self.deleted,
            }[update.kind]
            bucket[switch] = bucket.get(switch, 0) + 1

    def summary(self) -> str:
        if not self.changes:
            text = "in sync: nothing to change"
        else:
            switches = sorted(set(self.inserted) | set(self.modified) | set(self.deleted))
            text = "; ".join(
                f"{s}: +{self.inserted.get(s, 0)} ~{self.modified.get(s, 0)} -{self.deleted.get(s, 0)}"
                for s in switches
            )
        for note in self.skipped_jobs:
            text += f"\nskipped: {note}"
        return text


def in_scope(entity: Entity, scope: Iterable[str]) -> bool:
    """Whether ``entity`` belongs to one of the tables (or GROUPS) in ``scope``."""
    names = set(scope)
    if isinstance(entity, MulticastGroup):
        return GROUPS in names
    return entity.table in names


def read_installed(
    connection: SwitchConnection,
    codec: EntityCodec,
    scope: Iterable[str] = (*OWNED_TABLES, GROUPS),
) -> EntityMap:
    """The switch's entries in the scoped tables and its multicast groups, by key."""
    requests: list[p4runtime_pb2.Entity] = []
    for name in scope:
        request = p4runtime_pb2.Entity()
        if name == GROUPS:
            request.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = 0
        else:
            request.table_entry.table_id = codec.names.table_id(name)
        requests.append(request)
    installed: EntityMap = {}
    for message in connection.read(requests):
        entity = codec.from_entity(message)
        if isinstance(entity, TableEntry) and entity.table not in OWNED_TABLES:
            continue
        if entity.key in installed:
            logger.warning("switch %s returned %s twice", connection.name, entity)
        installed[entity.key] = entity
    return installed


def plan_reconcile(
    desired: Mapping[tuple[object, ...], Entity], installed: EntityMap, scope: Iterable[str]
) -> list[Update]:
    """The ordered updates that make the scoped part of ``installed`` equal ``desired``."""
    names = tuple(scope)
    want = {k: e for k, e in desired.items() if in_scope(e, names)}
    have = {k: e for k, e in installed.items() if in_scope(e, names)}
    return diff(want, have)
