"""The P4 program this target runs: p4src/v1model/checkmate.p4, by its P4Info.

The embedded target implements exactly one program. This module checks that a
P4Info pushed by a controller describes that program (its own P4Info is
:data:`checkmate.p4.program.P4INFO_PATH`),
and builds the empty :class:`SwitchState` (tables with the default actions the
P4 source declares, counters) that the pipeline reads.

Both forms of the program's P4Info are accepted: p4c 1.2.5's (each table's
``initial_default_action``, and the directly called action ``drop`` listed; the
committed p4src/checkmate.p4info.txtpb) and the older form without those. An
``initial_default_action`` that is present must name the table's default action.
"""

from __future__ import annotations

import logging

from p4.config.v1 import p4info_pb2

from checkmate.p4.p4info import MATCH_KINDS, load_p4info, preamble_alias
from embedded_switch.state import ActionCall, CounterArray, MatchFieldSpec, SwitchState, Table

logger = logging.getLogger(__name__)

DEFAULT_ACTIONS: dict[str, ActionCall] = {
    "check_source": ActionCall("source_unknown"),
    "route_ipv4": ActionCall("drop_no_route"),
    "lookup_job": ActionCall("job_unknown"),
    "replicate_to_shadow": ActionCall("reject_replication"),
    "rewrite_shadow_copy": ActionCall("drop_shadow_copy"),
}
"""Each table's ``default_action`` as written in the P4 source."""

_COUNTER_UNITS = {
    p4info_pb2.CounterSpec.PACKETS: "packets",
    p4info_pb2.CounterSpec.BYTES: "bytes",
    p4info_pb2.CounterSpec.BOTH: "both",
}


class ProgramMismatchError(ValueError):
    """A P4Info that does not describe the program this target runs."""


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
    """An empty SwitchState for the program ``info`` describes (all tables at their defaults)."""
    state = SwitchState()
    for t in info.tables:
        alias = preamble_alias(t.preamble)
        fields = [MatchFieldSpec(m.name, m.bitwidth, MATCH_KINDS[m.match_type]) for m in t.match_fields]
        state.tables[alias] = Table(t.preamble.name, alias, fields, t.size, DEFAULT_ACTIONS[alias])
    for c in info.counters:
        alias = preamble_alias(c.preamble)
        state.counters[alias] = CounterArray(c.preamble.name, alias, c.size, _COUNTER_UNITS[c.spec.unit])
    return state
