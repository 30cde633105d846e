"""Which optimizer states a checkpoint must hold for the optimizer's next step.

torch creates a parameter's optimizer state at its first step, all states at
once. A parameter with no state at all is one the optimizer never stepped (an
unused parameter): it loads as such. A parameter with *some* state must have
all of it, or the first ``optimizer.step()`` after the load fails (Adam:
``KeyError: 'exp_avg_sq'``) or silently restarts a moment. So:

* Adam / AdamW need ``step``, ``exp_avg``, ``exp_avg_sq`` (and
  ``max_exp_avg_sq`` in a group with ``amsgrad``);
* for every optimizer, the parameters of one param group that hold state hold
  the same states (a state the others have and one lacks is missing).

:func:`missing_optimizer_states` lists what is missing, one line per parameter,
naming the state, the rule and the fix; the reader's ``check_optimizer_states``,
``checkmate-ckpt verify`` and every loader refuse a checkpoint that has any.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from checkmate.checkpoint.format import PARAM_STATE

logger = logging.getLogger(__name__)

REQUIRED_STATES: dict[str, tuple[str, ...]] = {
    "Adam": ("step", "exp_avg", "exp_avg_sq"),
    "AdamW": ("step", "exp_avg", "exp_avg_sq"),
}
"""States every stepped parameter holds, by optimizer class name."""

AMSGRAD_STATE = "max_exp_avg_sq"


def required_states(kind: str | None, group: Mapping[str, Any]) -> set[str]:
    """The states ``kind`` needs of a stepped parameter in ``group`` (empty: not known for the kind)."""
    needed = set(REQUIRED_STATES.get(kind or "", ()))
    if needed and group.get("amsgrad"):
        needed.add(AMSGRAD_STATE)
    return needed


def missing_optimizer_states(
    optimizer: Mapping[str, Any] | None, states: Mapping[str, Collection[str]]
) -> list[str]:
    """One message per parameter whose optimizer state is incomplete (empty list: complete).

    ``optimizer``: global.json's description (``kind``, ``param_groups`` with
    ``params`` names); ``states``: parameter name -> the states held (``param``
    included or not).
    """
    optimizer = optimizer or {}
    kind = optimizer.get("kind") if isinstance(optimizer.get("kind"), str) else None
    groups: Sequence[Mapping[str, Any]] = [
        g for g in optimizer.get("param_groups") or [] if isinstance(g, Mapping)
    ]
    placed: set[str] = set()
    members: list[tuple[Mapping[str, Any], list[str]]] = []
    for group in groups:
        names = [n for n in group.get("params") or [] if isinstance(n, str) and n in states]
        placed.update(names)
        members.append((group, names))
    rest = sorted(set(states) - placed)
    if rest:
        members.append((groups[0] if len(groups) == 1 else {}, rest))
    problems = []
    for index, (group, names) in enumerate(members):
        held = {n: set(states[n]) - {PARAM_STATE} for n in names}
        stepped = [n for n in names if held[n]]
        if not stepped:
            continue
        needed = required_states(kind, group) | set().union(*(held[n] for n in stepped))
        for name in stepped:
            lacking = sorted(needed - held[name])
            if lacking:
                rule = (
                    f"{kind} needs {sorted(required_states(kind, group))} of every stepped parameter"
                    if required_states(kind, group) & set(lacking)
                    else f"the other parameters of param group {index} hold {sorted(needed)}"
                )
                problems.append(
                    f"{name}: optimizer state {lacking} missing (holds {sorted(held[name])}; {rule}); "
                    f"the optimizer's next step would fail or restart it. Re-save the checkpoint from the "
                    f"job, or take a complete step"
                )
    return problems
