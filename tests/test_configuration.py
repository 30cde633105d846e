"""One configuration per process: no environment read below the entry points, the secret as a value.

Walks every module of the library packages with :mod:`ast` and fails on a read of the
environment (``os.environ``, ``os.getenv``, :func:`checkmate.auth.secret_from_env`)
outside :data:`checkmate.config.ENTRY_POINTS`, and on a component falling back to the
environment for its secret (:func:`checkmate.auth.secret_or_env`) outside
:data:`SECRET_FALLBACKS`. Also keeps docs/configuration.md's table of variables equal to
:data:`checkmate.config.ENVIRONMENT_VARIABLES` and that list equal to the variables the code names.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import socket
from collections.abc import Iterable
from pathlib import Path

import pytest

from checkmate.auth import AuthConfigError, derive_key
from checkmate.config import ENTRY_POINTS, ENVIRONMENT_VARIABLES, environment_table
from checkmate.control_frame import process_auth

REPO = Path(__file__).resolve().parents[1]
LIBRARY = ("checkmate", "controller", "embedded_switch", "hosts", "shadow", "topologies")
"""The packages the wheel installs (setup.py PACKAGES' top folders)."""
SCRIPTS = ("examples", "experiments")
"""Command lines and scripts: they may read the environment; the variables they name are listed too."""
ENVIRONMENT_READS = frozenset({"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"})
"""Attributes (or names imported) of :mod:`os` that read or write the environment."""
SECRET_READERS = frozenset({"secret_from_env"})
SECRET_FALLBACKS = frozenset(
    {
        "hosts/transport.py:Transport.add_job",
        "checkmate/control_frame.py:process_auth",
        "shadow/node.py:ShadowNode.__init__",
    }
)
"""Components a script may build without a secret (their public signatures predate passing it):
they fall back to this process's through :func:`checkmate.auth.secret_or_env`. The project's
entry points always pass the secret; add no entry here, pass the secret instead."""
DOCS = REPO / "docs" / "configuration.md"
TABLE_START = "<!-- generated: python -m checkmate.config -->\n"
TABLE_END = "<!-- end generated -->\n"


class _Finder(ast.NodeVisitor):
    """``(qualified function name, line, what)`` of every use of the names asked for."""

    def __init__(self, os_names: frozenset[str], functions: frozenset[str]) -> None:
        self.os_names = os_names
        self.functions = functions
        self.scope: list[str] = []
        self.found: list[tuple[str, int, str]] = []

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped  # noqa: N815  (ast's names)

    def _note(self, node: ast.AST, what: str) -> None:
        self.found.append((".".join(self.scope), getattr(node, "lineno", 0), what))

    def visit_Attribute(self, node: ast.Attribute) -> None:  # noqa: N802
        if isinstance(node.value, ast.Name) and node.value.id == "os" and node.attr in self.os_names:
            self._note(node, f"os.{node.attr}")
        elif node.attr in self.functions:
            self._note(node, node.attr)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:  # noqa: N802
        if node.id in self.functions:
            self._note(node, node.id)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:  # noqa: N802
        if node.module == "os":
            for alias in node.names:
                if alias.name in self.os_names:
                    self._note(node, f"from os import {alias.name}")


def uses(
    root: Path, packages: tuple[str, ...], os_names: frozenset[str], functions: frozenset[str]
) -> list[str]:
    """``path:function`` (``path`` alone at module level) ``line: what`` of every use under ``packages``."""
    out: list[str] = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            finder = _Finder(os_names, functions)
            finder.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
            relative = path.relative_to(root).as_posix()
            out.extend(f"{relative}:{scope}" + f" line {line}: {what}" for scope, line, what in finder.found)
    return out


def _place(use: str) -> tuple[str, str]:
    """``(path, qualified function)`` of a :func:`uses` line."""
    head = use.split(" line ", 1)[0]
    path, _, scope = head.partition(":")
    return path, scope


def allowed(use: str, entry_points: Iterable[str]) -> bool:
    """Whether ``use`` lies in an entry point: its module (glob) or its function (or one nested in it)."""
    path, scope = _place(use)
    for key in entry_points:
        module, _, function = key.partition(":")
        if not fnmatch.fnmatch(path, module):
            continue
        if not function or scope == function or scope.startswith(function + "."):
            return True
    return False


def test_no_environment_read_below_the_entry_points() -> None:
    bad = [
        use
        for use in uses(REPO, LIBRARY, ENVIRONMENT_READS, SECRET_READERS)
        if not allowed(use, ENTRY_POINTS)
    ]
    assert not bad, (
        "the environment is read below the entry points (read it at the entry point, pass the value "
        "down; docs/configuration.md):\n" + "\n".join(bad)
    )


def test_every_entry_point_listed_reads_the_environment() -> None:
    reads = uses(REPO, LIBRARY, ENVIRONMENT_READS, SECRET_READERS)
    stale = [key for key in ENTRY_POINTS if not any(allowed(use, [key]) for use in reads)]
    assert not stale, f"ENTRY_POINTS lists places that no longer read the environment: {stale}"


def test_only_the_listed_components_fall_back_to_the_environment_for_the_secret() -> None:
    fallbacks = {
        f"{path}:{scope}"
        for path, scope in map(_place, uses(REPO, LIBRARY, frozenset(), frozenset({"secret_or_env"})))
        if scope  # the import
    } - {"checkmate/auth.py:secret_or_env"}
    assert fallbacks == SECRET_FALLBACKS


def test_the_walk_finds_a_read_below_an_entry_point(tmp_path: Path) -> None:
    package = tmp_path / "hosts"
    package.mkdir()
    (package / "leaf.py").write_text(
        "import os\nfrom os import getenv\nfrom checkmate.auth import secret_from_env\n\n"
        "class Leaf:\n    def __init__(self):\n        self.bind = os.environ.get('CHECKMATE_BIND')\n"
        "        self.secret = secret_from_env()\n\n"
        "def entry():\n    return os.getenv('X')\n",
        encoding="utf-8",
    )
    reads = uses(tmp_path, ("hosts",), ENVIRONMENT_READS, SECRET_READERS)
    assert [r for r in reads if not allowed(r, ["hosts/leaf.py:entry"])] == [
        "hosts/leaf.py: line 2: from os import getenv",
        "hosts/leaf.py:Leaf.__init__ line 7: os.environ",
        "hosts/leaf.py:Leaf.__init__ line 8: secret_from_env",
    ]
    assert not [r for r in reads if not allowed(r, ["hosts/leaf.py"])]


def test_the_docs_list_every_variable_as_the_code_does() -> None:
    text = DOCS.read_text(encoding="utf-8")
    assert TABLE_START in text and TABLE_END in text, f"{DOCS} lost its generated table's markers"
    table = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    assert table == environment_table(), (
        f"{DOCS.name} is stale: replace its table with the output of .venv/bin/python -m checkmate.config"
    )


def _named_variables(root: Path) -> set[str]:
    """``CHECKMATE_*`` names that are whole string constants (environment variables; the wire's
    constants are Python names, not strings) in the library and the scripts."""
    names: set[str] = set()
    for package in LIBRARY + SCRIPTS:
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if re.fullmatch(r"CHECKMATE_[A-Z0-9_]+", node.value):
                        names.add(node.value)
    return names


def test_every_variable_the_code_reads_is_listed_once() -> None:
    listed = [var.name.split("<", 1)[0] for var in ENVIRONMENT_VARIABLES]
    assert len(listed) == len(set(listed)), "a variable is listed twice"
    named = _named_variables(REPO)
    assert sorted(named - set(listed)) == [], "variables the code names that checkmate.config does not list"
    assert sorted(set(listed) - named) == [], "variables checkmate.config lists that no code names"


def test_a_component_given_the_secret_needs_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The secret as a value: with none in the environment, what the entry point passed is used."""
    from hosts.ddp_config import CheckmateConfig
    from hosts.transport import Transport, TransportConfig

    secret = bytes(range(32))
    config = CheckmateConfig.from_env(
        {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "CHECKMATE_JOB_SECRET": secret.hex()}
    )
    assert config.secret == secret and "secret" not in repr(config)
    for name in ("CHECKMATE_JOB_SECRET", "CHECKMATE_JOB_SECRET_FILE", "CHECKMATE_JOB_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(AuthConfigError, match="no job secret"):
        process_auth()
    assert process_auth(secret).keys[False] == derive_key(secret, "control/client")
    with Transport(
        TransportConfig(bind=("127.0.0.1", 0), datapath="python", secret=config.secret)
    ) as transport:
        transport.add_job(7, 0, {1: ("127.0.0.1", _free_udp_port())}, on_data=lambda h, p, a: None)
        auth = transport._jobs[7].auth
        assert auth is not None and auth._key == derive_key(secret, "transport", 7)


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
