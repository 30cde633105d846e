"""The P4 program this target runs: p4src/v1model/checkmate.p4, by its P4Info.

The embedded target implements exactly one program. :data:`PIPELINE` describes what
its interpreter (:mod:`embedded_switch.pipeline`) relies on: the tables it looks up,
with their key fields in the order it passes them, the actions it tells apart, with
their parameters in the order it unpacks them, each table's default action, and the
counters it bumps. The names are :mod:`checkmate.p4.names` (generated from the P4Info);
the order is the interpreter's. :func:`check_pipeline` checks that description against
a P4Info: :func:`build_state` does it for every P4Info loaded or pushed, and the P4Runtime
server for the committed P4Info when it starts. A P4Info in which a table, field, action
or parameter was renamed, dropped or reordered is refused at load, naming it, never
misread packet by packet.

This module also checks that a P4Info pushed by a controller describes the program this
target runs (its own P4Info is :data:`checkmate.p4.program.P4INFO_PATH`), and builds the
empty :class:`SwitchState` (tables with the default actions the P4 source declares,
counters) that the pipeline reads.

Both forms of the program's P4Info are accepted: p4c 1.2.5's (each table's
``initial_default_action``, and the directly called action ``drop`` listed; the
committed p4src/checkmate.p4info.txtpb) and the older form without those. An
``initial_default_action`` that is present must name the table's default action.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from p4.config.v1 import p4info_pb2

from checkmate.p4 import names
from checkmate.p4.p4info import MATCH_KINDS, load_p4info, preamble_alias
from embedded_switch.state import ActionCall, CounterArray, MatchFieldSpec, SwitchState, Table

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TableUse:
    """How the interpreter uses one table."""

    table: str
    key: tuple[str, ...]
    """The match fields, in the order the interpreter passes the lookup key."""
    actions: tuple[tuple[str, tuple[str, ...]], ...]
    """The actions it acts on, each with its parameters in the order it unpacks them."""
    default_action: str
    """What a miss runs until a controller changes it (the P4 source's ``default_action``)."""


PIPELINE: tuple[TableUse, ...] = (
    TableUse(
        names.CheckSource.NAME,
        (names.CheckSource.SRC_ADDR,),
        ((names.ExpectPort.NAME, (names.ExpectPort.PORT,)),),
        names.SourceUnknown.NAME,
    ),
    TableUse(
        names.RouteIpv4.NAME,
        (names.RouteIpv4.DST_ADDR,),
        ((names.Forward.NAME, (names.Forward.PORT, names.Forward.SRC_MAC, names.Forward.DST_MAC)),),
        names.DropNoRoute.NAME,
    ),
    TableUse(
        names.LookupJob.NAME,
        (names.LookupJob.JOB_ID,),
        ((names.SetJobSlot.NAME, (names.SetJobSlot.SLOT,)),),
        names.JobUnknown.NAME,
    ),
    TableUse(
        names.ReplicateToShadow.NAME,
        (
            names.ReplicateToShadow.JOB_ID,
            names.ReplicateToShadow.INGRESS_PORT,
            names.ReplicateToShadow.SHARD_KEY,
            names.ReplicateToShadow.NEXT_HOP_PORT,
        ),
        ((names.SetMulticastGroup.NAME, (names.SetMulticastGroup.GROUP,)),),
        names.RejectReplication.NAME,
    ),
    TableUse(
        names.RewriteShadowCopy.NAME,
        (names.RewriteShadowCopy.EGRESS_RID,),
        (
            (
                names.SetShadowDestination.NAME,
                (
                    names.SetShadowDestination.SRC_MAC,
                    names.SetShadowDestination.DST_MAC,
                    names.SetShadowDestination.DST_ADDR,
                    names.SetShadowDestination.DST_PORT,
                ),
            ),
        ),
        names.DropShadowCopy.NAME,
    ),
)
"""The tables :class:`embedded_switch.pipeline.Pipeline` interprets, in the order it applies them."""
PIPELINE_COUNTERS: tuple[str, ...] = (
    names.IngressDrops.NAME,
    names.RejectedReplications.NAME,
    names.ShadowCopies.NAME,
    names.EgressDrops.NAME,
)
"""The counters the interpreter bumps."""
DEFAULT_ACTIONS: dict[str, ActionCall] = {use.table: ActionCall(use.default_action) for use in PIPELINE}
"""Each table's ``default_action`` as written in the P4 source."""

_COUNTER_UNITS = {
    p4info_pb2.CounterSpec.PACKETS: "packets",
    p4info_pb2.CounterSpec.BYTES: "bytes",
    p4info_pb2.CounterSpec.BOTH: "both",
}


class ProgramMismatchError(ValueError):
    """A P4Info that does not describe the program this target runs."""


def check_pipeline(info: p4info_pb2.P4Info) -> None:
    """Raise ProgramMismatchError, naming every difference, unless ``info`` has what PIPELINE uses.

    Each table with exactly the key fields PIPELINE passes, in that order (other tables are
    refused too: the interpreter would never apply them); each action PIPELINE acts on listed
    by its table, with exactly those parameters in that order; each default action among the
    table's actions; each counter.
    """
    actions = {a.preamble.id: a for a in info.actions}
    tables = {preamble_alias(t.preamble): t for t in info.tables}
    problems: list[str] = []
    for use in PIPELINE:
        table = tables.get(use.table)
        if table is None:
            problems.append(f"it has no table {use.table}")
            continue
        fields = tuple(m.name for m in table.match_fields)
        if fields != use.key:
            problems.append(f"table {use.table} matches {fields}, the pipeline looks it up by {use.key}")
        listed = {
            preamble_alias(actions[r.id].preamble): actions[r.id]
            for r in table.action_refs
            if r.id in actions
        }
        for name, params in use.actions:
            action = listed.get(name)
            if action is None:
                problems.append(f"table {use.table} has no action {name}")
                continue
            found = tuple(p.name for p in action.params)
            if found != params:
                problems.append(f"action {name} takes {found}, the pipeline unpacks {params}")
        if use.default_action not in listed:
            problems.append(f"table {use.table} has no action {use.default_action} (its default action)")
    extra = sorted(set(tables) - {use.table for use in PIPELINE})
    if extra:
        problems.append(f"it has tables the pipeline never applies: {extra}")
    counters = {preamble_alias(c.preamble) for c in info.counters}
    problems += [f"it has no counter {name}" for name in PIPELINE_COUNTERS if name not in counters]
    if problems:
        raise ProgramMismatchError(
            "this target interprets the Checkmate program (embedded_switch/program.py: PIPELINE) and "
            "the P4Info differs: " + "; ".join(problems)
        )


def program_signature(info: p4info_pb2.P4Info) -> dict[str, object]:
    """Names and widths that identify the program (ids may differ between compilers)."""
    actions = {a.preamble.id: a for a in info.actions}
    tables = {}
    for t in info.tables:
        tables[t.preamble.name] = (
            tuple((m.name, m.bitwidth, m.match_type) for m in t.match_fields),
            tuple(
                sorted(
                    (actions[r.id].preamble.name, tuple((p.name, p.bitwidth) for p in actions[r.id].params))
                    for r in t.action_refs
                    if r.id in actions
                )
            ),
        )
    counters = {c.preamble.name: (c.spec.unit, c.size) for c in info.counters}
    return {"tables": tables, "counters": counters}


def check_program(info: p4info_pb2.P4Info, reference: p4info_pb2.P4Info | None = None) -> None:
    """Raise ProgramMismatchError, naming the first difference, unless ``info`` is our program."""
    expected = program_signature(reference if reference is not None else load_p4info())
    got = program_signature(info)
    for kind in ("tables", "counters"):
        want_items: dict[str, object] = expected[kind]  # type: ignore[assignment]
        got_items: dict[str, object] = got[kind]  # type: ignore[assignment]
        missing = sorted(set(want_items) - set(got_items))
        extra = sorted(set(got_items) - set(want_items))
        if missing or extra:
            raise ProgramMismatchError(
                f"this target runs the Checkmate program (p4src/v1model/checkmate.p4); the pushed P4Info "
                f"lacks {kind} {missing} and has unknown {kind} {extra}"
            )
        for name, spec in want_items.items():
            if got_items[name] != spec:
                raise ProgramMismatchError(f"P4Info {kind[:-1]} {name} differs from the Checkmate program")
    action_names = {a.preamble.id: a.preamble.name for a in info.actions}
    for t in info.tables:
        if not t.HasField("initial_default_action"):
            continue
        default = DEFAULT_ACTIONS.get(preamble_alias(t.preamble))
        named = action_names.get(
            t.initial_default_action.action_id, f"id {t.initial_default_action.action_id}"
        )
        if default is not None and named.split(".")[-1] != default.name:
            raise ProgramMismatchError(
                f"P4Info table {t.preamble.name}: initial default action {named} differs from the "
                f"Checkmate program's {default.name}"
            )


def build_state(info: p4info_pb2.P4Info) -> SwitchState:
    """An empty SwitchState for the program ``info`` describes (all tables at their defaults).

    ProgramMismatchError if ``info`` lacks what the interpreter uses (:func:`check_pipeline`).
    """
    check_pipeline(info)
    state = SwitchState()
    for t in info.tables:
        alias = preamble_alias(t.preamble)
        fields = [MatchFieldSpec(m.name, m.bitwidth, MATCH_KINDS[m.match_type]) for m in t.match_fields]
        state.tables[alias] = Table(t.preamble.name, alias, fields, t.size, DEFAULT_ACTIONS[alias])
    for c in info.counters:
        alias = preamble_alias(c.preamble)
        state.counters[alias] = CounterArray(c.preamble.name, alias, c.size, _COUNTER_UNITS[c.spec.unit])
    return state
