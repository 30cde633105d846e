"""Imports run one way: checkmate/ <- the stages <- topologies/ <- experiments/ <- examples/.

Walks every module of the project's top-level packages with :mod:`ast` and fails on
an import that runs up or sideways (a stage importing another stage, the shared
package importing a stage, anything importing the user scripts in ``examples/``).
Imports inside functions and ``TYPE_CHECKING`` blocks count: they run too, or they
tie the layers together for the reader. Module names in strings (``python -m ...``
command lines) are not imports and are not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

STAGES = ("controller", "embedded_switch", "hosts", "shadow")
ALLOWED: dict[str, frozenset[str]] = {
    "checkmate": frozenset(),
    **{stage: frozenset({"checkmate"}) for stage in STAGES},
    "topologies": frozenset({"checkmate", *STAGES}),
    "experiments": frozenset({"checkmate", *STAGES, "topologies"}),
    "examples": frozenset({"checkmate", *STAGES, "topologies", "experiments"}),
    "p4src": frozenset(),  # the P4 program, package data (installed as checkmate.p4.p4src): no code
}
"""Top-level package -> the project packages it may import (besides itself)."""

KNOWN: dict[str, str] = {}
"""Violations present when this test was written, each with what fixes it; remove an entry once fixed."""


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, a module of ``package``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # A relative import stays inside the module's own top-level package
                # unless it climbs out of it, which a layout of top-level packages cannot.
                found.append((node.lineno, package if node.module is None else f"{package}.{node.module}"))
            elif node.module is not None:
                found.append((node.lineno, node.module))
    return found


def violations(root: Path, allowed: dict[str, frozenset[str]]) -> dict[str, list[str]]:
    """``"file -> module"`` -> the lines where a package imports a project package it may not."""
    bad: dict[str, list[str]] = {}
    for package, may in allowed.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, module in imported_modules(path, package):
                top = module.split(".")[0]
                if top in allowed and top != package and top not in may:
                    key = f"{path.relative_to(root).as_posix()} -> {module}"
                    bad.setdefault(key, []).append(f"line {line}")
    return bad


def test_no_import_runs_up_or_sideways() -> None:
    found = violations(REPO, ALLOWED)
    new = {key: lines for key, lines in found.items() if key not in KNOWN}
    assert not new, "imports that run up or sideways (see ALLOWED):\n" + "\n".join(
        f"  {key} ({', '.join(lines)})" for key, lines in sorted(new.items())
    )
    gone = sorted(set(KNOWN) - set(found))
    assert not gone, f"fixed, remove from KNOWN: {gone}"


def test_every_top_level_package_has_a_row() -> None:
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert packages == set(ALLOWED), f"packages without a layering row: {sorted(packages - set(ALLOWED))}"


def test_the_check_finds_an_import_that_runs_up(tmp_path: Path) -> None:
    for package, text in {
        "checkmate": "import json\n",
        "hosts": "from checkmate.wire import X\nfrom .ddp import Y\n",
        "shadow": "def f():\n    from hosts.ddp import Z\n",
        "topologies": "import experiments.job\n",
        "examples": "from hosts import resume\n",
    }.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "m.py").write_text(text)
    assert violations(tmp_path, ALLOWED) == {
        "shadow/m.py -> hosts.ddp": ["line 2"],
        "topologies/m.py -> experiments.job": ["line 1"],
    }
