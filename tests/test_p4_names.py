"""Python's names for the P4 program come from the P4Info: checkmate/p4/names.py is generated and current.

The generated module must equal what ``python -m checkmate.p4.generate_names`` writes from the
committed P4Info (stale: this fails), name only what both the v1model and the TNA P4Info
define, and be the only place in the library where a table, action or counter name is
written out as a string.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from google.protobuf import text_format
from p4.config.v1 import p4info_pb2

from checkmate.p4 import names
from checkmate.p4.conformance import check_names, missing_names
from checkmate.p4.generate_names import NAMES_PATH, NamesError, class_name, main, render
from checkmate.p4.p4info import P4InfoIndex, P4InfoNameError, load_p4info
from tests.p4_source import P4SRC

REPO = Path(__file__).resolve().parents[1]
TOFINO_P4INFO = P4SRC / "tna" / "checkmate.tofino.p4info.txtpb"
LIBRARY = ("checkmate", "controller", "embedded_switch", "hosts", "shadow", "topologies", "experiments")
"""Where no table, action or counter name may be a string literal (outside names.py)."""
KNOWN_LITERALS: dict[str, str] = {}
"""Files still spelling names out, each with why; remove an entry once it uses checkmate.p4.names."""


def renamed(info: p4info_pb2.P4Info, old: str, new: str) -> p4info_pb2.P4Info:
    """A copy of ``info`` with the table, action or counter ``old`` (short name) renamed ``new``."""
    copy = p4info_pb2.P4Info()
    copy.CopyFrom(info)
    for group in (copy.tables, copy.actions, copy.counters):
        for obj in group:
            if obj.preamble.alias == old or obj.preamble.name.endswith("." + old):
                obj.preamble.name = obj.preamble.name[: -len(old)] + new
                obj.preamble.alias = new
    return copy


def test_names_module_is_what_the_generator_writes_from_the_committed_p4info() -> None:
    assert NAMES_PATH.read_text() == render(load_p4info()), (
        "checkmate/p4/names.py is stale: python -m checkmate.p4.generate_names"
    )
    assert main(["--check"]) == 0


def test_a_renamed_table_changes_the_generated_module_and_the_check_says_stale(tmp_path: Path) -> None:
    info = renamed(load_p4info(), "route_ipv4", "route_v4")
    text = render(info)
    assert "class RouteV4:" in text and 'NAME: Final = "route_v4"' in text
    assert "class RouteIpv4:" not in text
    p4info = tmp_path / "renamed.p4info.txtpb"
    p4info.write_text(text_format.MessageToString(info))
    assert main(["--check", "--p4info", str(p4info)]) == 1
    out = tmp_path / "names.py"
    assert main(["--p4info", str(p4info), "--out", str(out)]) == 0
    assert out.read_text() == text
    assert main(["--check", "--p4info", str(p4info), "--out", str(out)]) == 0


def test_the_module_names_every_table_action_and_counter_with_fields_params_and_defaults() -> None:
    info = load_p4info()
    index = P4InfoIndex(info)
    assert set(names.TABLES) == {t.preamble.alias for t in info.tables}
    assert set(names.ACTIONS) == {a.preamble.alias for a in info.actions}
    assert set(names.COUNTERS) == {c.preamble.alias for c in info.counters}
    assert names.TABLES[names.RouteIpv4.NAME] == (names.RouteIpv4.DST_ADDR,) == ("dst_addr",)
    assert names.ACTIONS[names.Forward.NAME] == ("port", "src_mac", "dst_mac")
    assert names.RouteIpv4.DEFAULT_ACTION == names.DropNoRoute.NAME
    for table in info.tables:
        alias = table.preamble.alias
        default = index.action_name(table.initial_default_action.action_id)
        assert names.TABLE_ACTIONS[alias] == tuple(index.action_name(r.id) for r in table.action_refs)
        assert getattr(names, class_name(alias)).DEFAULT_ACTION == default


@pytest.mark.parametrize("path", [None, TOFINO_P4INFO], ids=["v1model", "tna"])
def test_both_architectures_p4infos_define_every_name(path: Path | None) -> None:
    index = P4InfoIndex(load_p4info() if path is None else load_p4info(path))
    assert missing_names(index) == []
    check_names(index)


def test_a_p4info_with_a_renamed_table_field_or_parameter_is_refused_naming_it() -> None:
    info = load_p4info()
    with pytest.raises(P4InfoNameError, match=r"lacks table route_ipv4") as error:
        check_names(P4InfoIndex(renamed(info, "route_ipv4", "route_v4")), "switch s1's P4Info")
    assert "switch s1's P4Info" in str(error.value)
    field = p4info_pb2.P4Info()
    field.CopyFrom(info)
    next(t for t in field.tables if t.preamble.alias == "lookup_job").match_fields[0].name = "job"
    param = p4info_pb2.P4Info()
    param.CopyFrom(info)
    next(a for a in param.actions if a.preamble.alias == "forward").params[0].name = "egress_port"
    assert missing_names(P4InfoIndex(field)) == [
        "table lookup_job with match fields ('job_id',) (it has ('job',))"
    ]
    assert missing_names(P4InfoIndex(param)) == [
        "action forward with parameters ('port', 'src_mac', 'dst_mac') "
        "(it has ('egress_port', 'src_mac', 'dst_mac'))"
    ]
    assert missing_names(P4InfoIndex(renamed(info, "shadow_copies", "copies"))) == ["counter shadow_copies"]


def test_a_name_that_is_no_python_constant_is_refused() -> None:
    info = load_p4info()
    next(t for t in info.tables if t.preamble.alias == "lookup_job").match_fields[0].name = "name"
    with pytest.raises(NamesError, match="table lookup_job: 'name' cannot be a Python constant"):
        render(info)


def _string_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def test_no_library_module_spells_out_a_table_action_or_counter_name() -> None:
    program = set(names.TABLES) | set(names.ACTIONS) | set(names.COUNTERS)
    found: dict[str, list[str]] = {}
    for top in LIBRARY:
        for path in sorted((REPO / top).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if path == NAMES_PATH or relative in KNOWN_LITERALS:
                continue
            hits = [f"line {line}: {value!r}" for line, value in _string_literals(path) if value in program]
            if hits:
                found[relative] = hits
    assert found == {}, "use checkmate.p4.names instead of these literals"
    for relative in KNOWN_LITERALS:
        literals = {value for _, value in _string_literals(REPO / relative)}
        assert literals & program, f"{relative} no longer spells names out: remove it from KNOWN_LITERALS"
