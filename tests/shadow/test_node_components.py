"""The shadow node is components that own their state (docs/architecture.md, "The shadow node").

Walks the node's modules (``shadow/node*.py``) with :mod:`ast` and fails when a component
reads or writes another object's private attribute (``other._x``), when ``ShadowNode``
inherits its behaviour from mixins again, or when one of its modules grows past 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

from shadow.node import ShadowNode

REPO = Path(__file__).resolve().parents[2]
NODE_MODULES = sorted((REPO / "shadow").glob("node*.py"), key=lambda p: p.name)
MAX_MODULE_LINES = 600


def _foreign_private_uses(path: Path, root: Path = REPO) -> list[str]:
    """``path:line: expression`` of every ``other._x`` (not ``self``/``cls``, not a dunder) in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        if not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        out.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_component_touches_another_ones_private_attributes() -> None:
    assert len(NODE_MODULES) >= 8, [p.name for p in NODE_MODULES]
    found = [use for path in NODE_MODULES for use in _foreign_private_uses(path)]
    assert not found, "a private attribute used outside its class:\n" + "\n".join(found)


def test_the_node_composes_its_components_instead_of_inheriting_them() -> None:
    assert ShadowNode.__bases__ == (object,)


def test_every_module_of_the_node_stays_small() -> None:
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in NODE_MODULES}
    assert all(n <= MAX_MODULE_LINES for n in sizes.values()), sizes


def test_the_walk_finds_a_foreign_private_attribute(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "class A:\n    def f(self, other):\n        other._count = self._mine + other.__len__()\n"
        "        return self._link._job\n",
        encoding="utf-8",
    )
    assert _foreign_private_uses(probe, tmp_path) == [
        "probe.py:3: other._count",
        "probe.py:4: self._link._job",
    ]
