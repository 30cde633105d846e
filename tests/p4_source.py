"""A reader for the few P4_16 declarations our tests compare with the P4Info.

Not a P4 parser: it understands the subset p4src/ uses (header/struct fields,
typedefs, #define sizes, action parameters, table keys/actions/size, counters;
@hidden tables are skipped, as P4Info generators skip them),
enough to check names and bit widths against the committed P4Info.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

P4SRC = Path(__file__).resolve().parents[1] / "p4src"

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


def read_program(arch: str) -> P4Program:
    """Read p4src/shared/*.p4 plus p4src/<arch>/ (main file and includes)."""
    files = sorted((P4SRC / "shared").glob("*.p4")) + sorted((P4SRC / arch).rglob("*.p4"))
    text = "\n".join(_strip_comments(f.read_text()) for f in files)
    program = P4Program()
    widths: dict[str, int] = dict(ARCH_TYPES)
    for name, value in re.findall(r"#define\s+(\w+)\s+(\d+)", text):
        program.constants[name] = int(value)
    for name, value in re.findall(r"const\s+bit<\d+>\s+(\w+)\s*=\s*(0x[0-9A-Fa-f]+|\d+)\s*;", text):
        program.constants[name] = int(value, 0)
    for width, name in re.findall(r"typedef\s+bit<(\d+)>\s+(\w+)\s*;", text):
        widths[name] = int(width)

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
