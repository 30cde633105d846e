"""Whether a P4Info is the Checkmate program Python was written for, checked once, up front.

Python names the program's tables, actions, counters, match fields and action parameters
through :mod:`checkmate.p4.names`, constants generated from the committed P4Info. A switch
may run another P4Info (an older build, a hand-edited one, TNA's with its own ids):
:func:`check_names` compares it with those constants when the controller first meets it
(or when the embedded switch loads it), so a renamed or missing table is refused there,
named, rather than at the first write that uses it. Ids are not compared: names are
resolved per P4Info (:class:`~checkmate.p4.p4info.P4InfoIndex`), so TNA's P4Info passes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from checkmate.p4 import names as program_names
from checkmate.p4.p4info import P4InfoIndex, P4InfoNameError

logger = logging.getLogger(__name__)


def missing_names(
    index: P4InfoIndex,
    tables: Mapping[str, Sequence[str]] = program_names.TABLES,
    table_actions: Mapping[str, Sequence[str]] = program_names.TABLE_ACTIONS,
    actions: Mapping[str, Sequence[str]] = program_names.ACTIONS,
    counters: Iterable[str] = program_names.COUNTERS,
) -> list[str]:
    """What ``index`` lacks of the given names (by default all of :mod:`checkmate.p4.names`).

    Each table with exactly these match fields in this order, each of its actions with exactly
    these parameters, each counter. Actions no table lists (``drop``, called directly) are not
    required: older P4Infos omit them. One line per difference, e.g. ``table route_ipv4``.
    """
    missing: list[str] = []
    for table, fields in tables.items():
        try:
            info = index.tables[index.table_id(table)]
        except P4InfoNameError:
            missing.append(f"table {table}")
            continue
        found = tuple(f.short_name for f in info.fields)
        if found != tuple(fields):
            missing.append(f"table {table} with match fields {tuple(fields)} (it has {found})")
        listed = {index.action_name(action_id) for action_id in info.action_scopes}
        for action in table_actions.get(table, ()):
            if action not in listed:
                missing.append(f"action {action} in table {table}")
    required = {a for table in tables for a in table_actions.get(table, ())}
    for action in sorted(required):
        try:
            params = tuple(p.name for p in index.action(index.action_id(action)).params)
        except P4InfoNameError:
            missing.append(f"action {action}")
            continue
        if params != tuple(actions.get(action, ())):
            missing.append(
                f"action {action} with parameters {tuple(actions.get(action, ()))} (it has {params})"
            )
    for counter in counters:
        try:
            index.counter_id(counter)
        except P4InfoNameError:
            missing.append(f"counter {counter}")
    return missing


def check_names(index: P4InfoIndex, what: str = "a P4Info") -> None:
    """P4InfoNameError naming everything of :mod:`checkmate.p4.names` that ``index`` lacks."""
    missing = missing_names(index)
    if missing:
        raise P4InfoNameError(
            f"{what} is not the Checkmate program's (checkmate/p4/names.py): it lacks " + "; ".join(missing)
        )
