"""Writes :mod:`checkmate.p4.names`, the P4Info's names as Python constants, from the committed P4Info.

    python -m checkmate.p4.generate_names            # rewrite checkmate/p4/names.py
    python -m checkmate.p4.generate_names --check    # exit 1 if it is stale (what the test does)

Run it after the P4Info changes (``make p4`` and copying p4c's P4Info to
``p4src/checkmate.p4info.txtpb``). For every table, action and counter of the
P4Info it writes a class named after the object's short name (``route_ipv4`` ->
``RouteIpv4``) whose ``NAME`` is that name, with one constant per match field or
action parameter, the fields or parameters in P4Info order, and a table's
actions and default action. A table, action, field or parameter renamed in the P4
source so becomes a renamed Python attribute: code that used the old one fails
to import or in mypy, not at the first write to a switch.
"""

from __future__ import annotations

import argparse
import keyword
import logging
import sys
from collections.abc import Iterable
from pathlib import Path

from p4.config.v1 import p4info_pb2

from checkmate.p4.p4info import MATCH_KINDS, load_p4info, preamble_alias
from checkmate.p4.program import P4INFO_PATH
from checkmate.p4.tofino import tofino_counters

logger = logging.getLogger(__name__)

NAMES_PATH = Path(__file__).with_name("names.py")
"""The generated module."""
_RESERVED = frozenset({"NAME", "PARAMS", "MATCH_FIELDS", "ACTIONS", "DEFAULT_ACTION"})
"""Attributes every generated class may have: a field or parameter must not take one of them."""
_LINE_LENGTH = 110
"""pyproject.toml's ruff line length: the generated module passes ruff format."""
_UNITS = {
    p4info_pb2.CounterSpec.PACKETS: "packets",
    p4info_pb2.CounterSpec.BYTES: "bytes",
    p4info_pb2.CounterSpec.BOTH: "packets and bytes",
}

_HEADER = '''"""The Checkmate program's P4Info names as Python constants: GENERATED, do not edit.

Written by ``python -m checkmate.p4.generate_names`` from p4src/checkmate.p4info.txtpb,
the P4Info p4c writes for p4src/v1model/checkmate.p4; tests/test_p4_names.py fails when
this file is stale. Each class is one table, action or counter; ``NAME`` is its short
name (its P4Info alias), which the v1model and TNA P4Infos share and which
:class:`checkmate.p4.p4info.P4InfoIndex` resolves in either. The ids in the docstrings
are the v1model P4Info's (TNA's differ: its names carry the ``pipe.`` prefix).
:func:`checkmate.p4.conformance.check_names` checks that a P4Info defines all of them.
"""

from __future__ import annotations

from typing import Final
'''


class NamesError(ValueError):
    """A P4Info whose names cannot become Python constants (a clash, a missing default action)."""


def class_name(short: str) -> str:
    """``route_ipv4`` -> ``RouteIpv4``."""
    return "".join(part[:1].upper() + part[1:] for part in short.split("_") if part)


def constant_name(name: str, owner: str) -> str:
    """A field's or parameter's constant: ``dst_addr`` -> ``DST_ADDR``; NamesError if unusable."""
    constant = name.upper()
    if not constant.isidentifier() or keyword.iskeyword(constant) or constant in _RESERVED:
        raise NamesError(f"{owner}: {name!r} cannot be a Python constant ({constant!r})")
    return constant


def _tuple(items: Iterable[str]) -> str:
    items = list(items)
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _assign(target: str, items: Iterable[str], indent: str = "") -> list[str]:
    """``target = (a, b)`` on one line if it fits in 110 columns, else one item a line (as ruff formats)."""
    items = list(items)
    line = f"{indent}{target} = {_tuple(items)}"
    if len(line) <= _LINE_LENGTH:
        return [line]
    return [f"{indent}{target} = (", *(f"{indent}    {item}," for item in items), f"{indent})"]


def _check_unique(kind: str, names: list[str]) -> None:
    classes = [class_name(n) for n in names]
    repeated = sorted({n for n, c in zip(names, classes, strict=True) if classes.count(c) > 1})
    if repeated:
        raise NamesError(f"P4Info {kind} names {repeated} do not give distinct Python class names")


def render(info: p4info_pb2.P4Info) -> str:
    """The text of :mod:`checkmate.p4.names` for ``info``."""
    actions = {a.preamble.id: a for a in info.actions}
    action_names = [preamble_alias(a.preamble) for a in info.actions]
    table_names = [preamble_alias(t.preamble) for t in info.tables]
    counter_names = [preamble_alias(c.preamble) for c in info.counters]
    counter_names += [preamble_alias(c.preamble) for c in tofino_counters(info)]
    _check_unique("object", action_names + table_names + counter_names)
    blocks = [_HEADER]
    blocks.append(_section("actions", first=True))
    for action in info.actions:
        blocks.append(_action_class(action))
    blocks.append(_section("tables"))
    for table in info.tables:
        blocks.append(_table_class(table, actions))
    blocks.append(_section("counters"))
    for counter in info.counters:
        unit = _UNITS.get(counter.spec.unit, "unspecified unit")
        blocks.append(_counter_class(counter.preamble, f"{unit}, {counter.size} cells"))
    for tna_counter in tofino_counters(info):
        blocks.append(_counter_class(tna_counter.preamble, f"{tna_counter.unit}, {tna_counter.size} cells"))
    blocks.append(_section("the whole program"))
    blocks.append(_index(table_names, action_names, counter_names))
    return "\n".join(blocks)


def _section(title: str, first: bool = False) -> str:
    """A section comment, with the blank lines ruff format and isort want around it."""
    head = f"# ---- {title} "
    return ("" if first else "\n") + head + "-" * (100 - len(head)) + "\n"


def _class_head(short: str, doc: str) -> list[str]:
    """The first lines of the class for the object ``short``: its docstring and NAME."""
    return ["", f"class {class_name(short)}:", f'    """{doc}"""', "", f'    NAME: Final = "{short}"']


def _members(owner: str, members: Iterable[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(lines, constant names) for (name, docstring) pairs: one documented constant each."""
    lines: list[str] = []
    constants: list[str] = []
    for name, doc in members:
        constant = constant_name(name, owner)
        constants.append(constant)
        lines += [f'    {constant}: Final = "{name}"', f'    """{doc}"""']
    return lines, constants


def _action_class(action: p4info_pb2.Action) -> str:
    short = preamble_alias(action.preamble)
    lines = _class_head(short, f"Action ``{action.preamble.name}`` (id {action.preamble.id}).")
    members, constants = _members(
        f"action {short}",
        ((p.name, f"Parameter {i}: {p.bitwidth} bits.") for i, p in enumerate(action.params, 1)),
    )
    lines += members + _assign("PARAMS: Final[tuple[str, ...]]", constants, "    ")
    return "\n".join(lines) + "\n"


def _table_class(table: p4info_pb2.Table, actions: dict[int, p4info_pb2.Action]) -> str:
    short = preamble_alias(table.preamble)
    if not table.HasField("initial_default_action"):
        raise NamesError(
            f"P4Info table {table.preamble.name} has no initial_default_action: "
            "regenerate the P4Info with p4c 1.2.5 or later"
        )
    default = actions.get(table.initial_default_action.action_id)
    if default is None:
        raise NamesError(f"P4Info table {table.preamble.name}: its default action is not an action")
    doc = f"Table ``{table.preamble.name}`` (id {table.preamble.id}), {table.size} entries."
    lines = _class_head(short, doc)
    members, constants = _members(
        f"table {short}",
        (
            (f.name, f"Match field {i}: {MATCH_KINDS[f.match_type].value}, {f.bitwidth} bits.")
            for i, f in enumerate(table.match_fields, 1)
        ),
    )
    lines += members + _assign("MATCH_FIELDS: Final[tuple[str, ...]]", constants, "    ")
    refs = [class_name(preamble_alias(actions[r.id].preamble)) + ".NAME" for r in table.action_refs]
    lines += _assign("ACTIONS: Final[tuple[str, ...]]", refs, "    ")
    lines.append(f"    DEFAULT_ACTION: Final = {class_name(preamble_alias(default.preamble))}.NAME")
    return "\n".join(lines) + "\n"


def _counter_class(preamble: p4info_pb2.Preamble, what: str) -> str:
    lines = _class_head(preamble_alias(preamble), f"Counter ``{preamble.name}`` (id {preamble.id}): {what}.")
    return "\n".join(lines) + "\n"


def _index(tables: list[str], actions: list[str], counters: list[str]) -> str:
    def mapping(names: list[str], attribute: str) -> list[str]:
        return [f"    {class_name(n)}.NAME: {class_name(n)}.{attribute}," for n in names]

    lines = ["", "TABLES: Final[dict[str, tuple[str, ...]]] = {", *mapping(tables, "MATCH_FIELDS"), "}"]
    lines.append('"""Every table, by name: its match fields in P4Info order."""')
    lines += ["TABLE_ACTIONS: Final[dict[str, tuple[str, ...]]] = {", *mapping(tables, "ACTIONS"), "}"]
    lines.append('"""Every table, by name: the actions it may run."""')
    lines += ["ACTIONS: Final[dict[str, tuple[str, ...]]] = {", *mapping(actions, "PARAMS"), "}"]
    lines.append('"""Every action, by name: its parameters in P4Info order."""')
    lines += _assign("COUNTERS: Final[tuple[str, ...]]", (f"{class_name(n)}.NAME" for n in counters))
    lines.append('"""Every counter, by name."""')
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkmate.p4.generate_names", description=__doc__)
    parser.add_argument("--p4info", type=Path, default=P4INFO_PATH, help="the P4Info to read")
    parser.add_argument("--out", type=Path, default=NAMES_PATH, help="the module to write")
    parser.add_argument("--check", action="store_true", help="only say whether --out is up to date")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    text = render(load_p4info(args.p4info))
    current = args.out.read_text() if args.out.is_file() else None
    if args.check:
        if current != text:
            logger.error("%s is stale: run python -m checkmate.p4.generate_names", args.out)
            return 1
        logger.info("%s is up to date", args.out)
        return 0
    if current != text:
        args.out.write_text(text)
        logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
