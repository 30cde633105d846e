"""A reader for the few P4_16 declarations our tests compare with the P4Info.

Not a P4 parser: it understands the subset p4src/ uses (header/struct fields,
typedefs, #define sizes, action parameters, table keys/actions/size, counters;
@hidden tables are skipped, as P4Info generators skip them),
enough to check names and bit widths against the committed P4Info. It reads a
program as p4c does, through the C preprocessor (``cpp``, which p4c runs too):
the shared ingress (p4src/shared/ingress*.p4) is #included inside each
architecture's control, with macros for what the architectures spell differently.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

P4SRC = Path(__file__).resolve().parents[1] / "p4src"
CPP_TIMEOUT_S = 60.0
# The architecture headers a program includes with <...>: empty here, their types are ARCH_TYPES.
_ARCH_HEADERS = ("core.p4", "v1model.p4", "tna.p4", "t2na.p4")

# Architecture-provided fields our keys use, with their widths.
ARCH_FIELDS = {
    "standard_metadata.ingress_port": 9,
    "standard_metadata.egress_spec": 9,
    "standard_metadata.egress_rid": 16,
    "ig_intr_md.ingress_port": 9,
    "eg_intr_md.egress_rid": 16,
}
ARCH_TYPES = {"PortId_t": 9, "MulticastGroupId_t": 16}


@dataclass
class P4Table:
    name: str
    keys: list[tuple[str, str, int]]  # (match field name, match kind, bitwidth)
    actions: list[str]
    size: int


@dataclass
class P4Program:
    actions: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    tables: dict[str, P4Table] = field(default_factory=dict)
    counters: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (unit, size)
    constants: dict[str, int] = field(default_factory=dict)
    header_fields: dict[str, list[tuple[str, int]]] = field(default_factory=dict)


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _block(text: str, start: int) -> str:
    """The text between the brace at or after ``start`` and its matching brace."""
    open_at = text.index("{", start)
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    raise ValueError("unbalanced braces")


def preprocess(arch: str) -> str:
    """p4src/<arch>/checkmate.p4 after the C preprocessor, as p4c sees it (TNA: for Tofino 1)."""
    cpp = shutil.which("cpp")
    if cpp is None:
        raise RuntimeError("reading p4src needs the C preprocessor cpp (Debian: apt-get install cpp)")
    defines = ["-D__TARGET_TOFINO__=1"] if arch == "tna" else []
    with tempfile.TemporaryDirectory(prefix="p4include-") as include:
        for header in _ARCH_HEADERS:
            (Path(include) / header).write_text("")
        run = subprocess.run(
            [
                cpp,
                "-P",
                "-undef",
                "-nostdinc",
                "-x",
                "c",
                "-I",
                include,
                *defines,
                str(P4SRC / arch / "checkmate.p4"),
            ],
            capture_output=True,
            text=True,
            timeout=CPP_TIMEOUT_S,
        )
    if run.returncode != 0:
        raise RuntimeError(f"cpp failed on p4src/{arch}/checkmate.p4: {run.stderr}")
    return run.stdout


def read_program(arch: str) -> P4Program:
    """Read p4src/<arch>/checkmate.p4 with everything it includes (p4src/shared/ among them)."""
    files = sorted((P4SRC / "shared").glob("*.p4")) + sorted((P4SRC / arch).rglob("*.p4"))
    raw = "\n".join(_strip_comments(f.read_text()) for f in files)
    text = _strip_comments(preprocess(arch))
    program = P4Program()
    widths: dict[str, int] = dict(ARCH_TYPES)
    for name, value in re.findall(r"#define\s+(\w+)\s+(\d+)", raw):
        program.constants[name] = int(value)
    for name, value in re.findall(r"const\s+bit<\d+>\s+(\w+)\s*=\s*(0x[0-9A-Fa-f]+|\d+)\s*;", text):
        program.constants[name] = int(value, 0)
    for width, name in re.findall(r"typedef\s+bit<(\d+)>\s+(\w+)\s*;", text):
        widths[name] = int(width)
    for alias_of, name in re.findall(r"typedef\s+([A-Za-z_]\w*)\s+(\w+)\s*;", text):
        widths[name] = widths[alias_of]

    def width_of(type_name: str) -> int:
        match = re.fullmatch(r"bit<(\d+)>", type_name)
        return int(match.group(1)) if match else widths[type_name]

    for kind, name in re.findall(r"\b(header|struct)\s+(\w+)\s*\{", text):
        body = _block(text, text.index(f"{kind} {name}"))
        program.header_fields[name] = [
            (fname, width_of(ftype))
            for ftype, fname in re.findall(r"(bit<\d+>|\w+)\s+(\w+)\s*;", body)
            if ftype == "bit" or ftype.startswith("bit<") or ftype in widths
        ]
    struct_members = {}
    for name, fields in program.header_fields.items():
        struct_members[name] = dict(fields)
    # Which struct/header type each top-level name refers to.
    instance_types = {"meta": "checkmate_metadata_t"}
    for htype, hname in re.findall(
        r"^\s*(\w+_h)\s+(\w+)\s*;", _block(text, text.index("struct headers_t")), flags=re.M
    ):
        instance_types[f"hdr.{hname}"] = htype

    def key_width(expr: str) -> int:
        if expr in ARCH_FIELDS:
            return ARCH_FIELDS[expr]
        owner, _, member = expr.rpartition(".")
        return struct_members[instance_types[owner]][member]

    for name, params in re.findall(r"\baction\s+(\w+)\s*\(([^)]*)\)", text):
        plist = []
        for param in filter(None, (p.strip() for p in params.split(","))):
            ptype, pname = param.rsplit(None, 1)
            plist.append((pname, width_of(ptype)))
        program.actions[name] = plist
    for match in re.finditer(r"(@hidden\s+)?\btable\s+(\w+)\s*\{", text):
        if match.group(1):
            continue  # a compiler-only table (TNA's const checks): not in the P4Info
        name = match.group(2)
        body = _block(text, match.start())
        keys = [
            (alias, kind, key_width(expr))
            for expr, kind, alias in re.findall(
                r"([\w.]+)\s*:\s*(exact|lpm|ternary|range|optional)\s*@name\(\"(\w+)\"\)", body
            )
        ]
        actions = re.findall(r"(\w+)\s*;", _block(body, body.index("actions")))
        size_token = re.search(r"size\s*=\s*(\w+)\s*;", body).group(1)  # type: ignore[union-attr]
        size = int(size_token) if size_token.isdigit() else program.constants[size_token]
        program.tables[name] = P4Table(name, keys, actions, size)
    v1model_counter = r"\bcounter\s*\((\w+)\s*,\s*CounterType\.(\w+)\)\s*(\w+)\s*;"
    for size_token, unit, name in re.findall(v1model_counter, text):
        program.counters[name] = (unit, program.constants.get(size_token) or int(size_token))
    for size_token, unit, name in re.findall(
        r"\bCounter\s*<[^(]*>\s*\((\w+)\s*,\s*CounterType_t\.(\w+)\)\s*(\w+)\s*;", text
    ):
        program.counters[name] = (unit.lower(), program.constants.get(size_token) or int(size_token))
    return program


# ---- control flow of an apply block -------------------------------------------------------------------
DROP_PRIMITIVES = ("mark_to_drop(", "drop_ctl =")
"""What drops a packet: v1model's primitive, and TNA's deparser drop control."""
CHOOSE_GROUP = re.compile(r"\bmcast_grp(_a|_b)?\s*=")
"""What chooses a multicast group: v1model's ``standard_metadata.mcast_grp``, TNA's ``mcast_grp_a/b``."""


@dataclass
class Statement:
    """One statement of an apply block: plain (``text``) or an if with its two branches."""

    text: str
    then: list[Statement] = field(default_factory=list)
    otherwise: list[Statement] = field(default_factory=list)

    @property
    def is_if(self) -> bool:
        return self.text.startswith("if")


def _parenthesised(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError("unbalanced parentheses")


def parse_statements(text: str) -> list[Statement]:
    """The statements of a block's body: ``if (...) S [else S]``, ``{ ... }`` and ``...;``."""
    statements: list[Statement] = []
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return statements
        statement, i = _statement(text, i)
        statements.extend(statement)


def _statement(text: str, i: int) -> tuple[list[Statement], int]:
    if text.startswith("{", i):
        body = _block(text, i)
        return parse_statements(body), i + len(body) + 2
    if re.match(r"if\s*\(", text[i:]):
        open_at = text.index("(", i)
        close = _parenthesised(text, open_at)
        cond = "if " + " ".join(text[open_at:close].split())
        then, i = _statement(text, _skip_space(text, close))
        otherwise: list[Statement] = []
        j = _skip_space(text, i)
        if re.match(r"else\b", text[j:]):
            otherwise, i = _statement(text, _skip_space(text, j + 4))
        return [Statement(cond, then, otherwise)], i
    end = text.index(";", i)
    return [Statement(" ".join(text[i:end].split()) + ";")], end + 1


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


@dataclass
class ControlFlow:
    """A control's actions, tables and apply block, read from the P4 source."""

    actions: dict[str, str]
    """action name -> body"""
    tables: dict[str, list[str]]
    """table name -> its actions (the default action among them)"""
    apply: list[Statement]

    def action_does(
        self, name: str, pattern: re.Pattern[str] | tuple[str, ...], seen: frozenset[str] = frozenset()
    ) -> bool:
        """Whether action ``name`` (or an action it calls) contains ``pattern``."""
        if name in seen or name not in self.actions:
            return False
        return self.text_does(self.actions[name], pattern, seen | {name})

    def text_does(
        self, text: str, pattern: re.Pattern[str] | tuple[str, ...], seen: frozenset[str] = frozenset()
    ) -> bool:
        """Whether a statement's text, or an action or table it calls, contains ``pattern``."""
        found = (
            bool(pattern.search(text)) if isinstance(pattern, re.Pattern) else any(p in text for p in pattern)
        )
        if found:
            return True
        for table in re.findall(r"\b(\w+)\.apply\s*\(", text):
            if any(self.action_does(a, pattern, seen) for a in self.tables.get(table, [])):
                return True
        return any(self.action_does(a, pattern, seen) for a in re.findall(r"\b(\w+)\s*\(", text))

    def drops_after_choosing_a_group(self) -> tuple[list[str], list[str]]:
        """(the statements that may choose a group, those that may drop on a path where one was chosen).

        Walks every path through the apply block (both branches of every if); a table's
        apply may run any of its actions, so a statement that applies a table whose
        actions choose a group both chooses one and, if one of those actions drops too,
        drops after choosing.
        """
        choosing: list[str] = []
        violations: list[str] = []

        def visit(text: str, chosen: bool) -> bool:
            chooses = self.text_does(text, CHOOSE_GROUP)
            drops = self.text_does(text, DROP_PRIMITIVES)
            if chooses:
                choosing.append(text)
                tables = re.findall(r"\b(\w+)\.apply\s*\(", text)
                acts = [a for t in tables for a in self.tables.get(t, [])]
                both = [
                    a
                    for a in acts
                    if self.action_does(a, CHOOSE_GROUP) and self.action_does(a, DROP_PRIMITIVES)
                ]
                if both or (not tables and drops):
                    violations.append(text)
            elif chosen and drops:
                violations.append(text)
            return chosen or chooses

        def walk(statements: list[Statement], chosen: bool) -> bool:
            for s in statements:
                chosen = visit(s.text, chosen)  # an if's condition may apply a table too
                if s.is_if:
                    chosen = walk(s.then, chosen) | walk(s.otherwise, chosen)
            return chosen

        walk(self.apply, False)
        return choosing, violations


def read_control(arch: str, control: str) -> ControlFlow:
    """The actions, tables and apply block of ``control`` in p4src/<arch>/checkmate.p4, preprocessed."""
    return parse_control(preprocess(arch), control)


def parse_control(source: str, control: str) -> ControlFlow:
    """The actions, tables and apply block of ``control`` in P4 ``source``."""
    text = _strip_comments(source)
    match = re.search(rf"\bcontrol\s+{control}\s*\(", text)
    if match is None:
        raise ValueError(f"no control {control} in the source")
    body = _block(text, _parenthesised(text, text.index("(", match.start())))
    actions = {
        name: _block(body, m.end() - 1)
        for m in re.finditer(r"\baction\s+(\w+)\s*\([^)]*\)\s*\{", body)
        for name in [m.group(1)]
    }
    tables = {}
    for m in re.finditer(r"\btable\s+(\w+)\s*\{", body):
        table_body = _block(body, m.start())
        tables[m.group(1)] = re.findall(r"(\w+)\s*;", _block(table_body, table_body.index("actions")))
    applies = [m for m in re.finditer(r"(?<![.\w])apply\s*\{", body)]
    if len(applies) != 1:
        raise ValueError(f"control {control}: expected one apply block, found {len(applies)}")
    return ControlFlow(actions, tables, parse_statements(_block(body, applies[0].start())))
