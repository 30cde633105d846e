"""The host agents and the ``checkmate`` backend are components that own their state
(docs/architecture.md, "The host agent").

Walks the agents' and the backend's modules (``hosts/ddp*.py``, ``hosts/c10d_*.py``) with
:mod:`ast` and fails when a component reads or writes another object's private attribute
(``other._x``; torch's own internals, which the FSDP2 and TP code must reach, are listed), when a
class uses private state of its own (``self._x``) that it never sets or defines (a mixin's
borrowed state), and when an agent or the process group inherits its behaviour from mixins again.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch.distributed as dist

import hosts.c10d_backend
import hosts.c10d_fsdp
import hosts.ddp

REPO = Path(__file__).resolve().parents[2]
AGENT_MODULES = sorted(
    [*(REPO / "hosts").glob("ddp*.py"), *(REPO / "hosts").glob("c10d_*.py")], key=lambda p: p.name
)
TORCH_INTERNALS = frozenset(
    {
        "_clip_grads_with_norm_",  # torch.nn.utils.clip_grad's helper, patched to record the coefficient
        "_unscale_grads_",  # GradScaler's, patched to record the inverse scale
        "_get_default_group",  # the default process group (the FSDP2 agent needs the checkmate backend)
        "_get_fsdp_state",  # FSDP2's module state: its param groups
        "_fsdp_param_groups",
        "_orig_size",  # an FSDP2 parameter's unsharded size
        "_parameters",  # a module's parameter table (DTensor parameters kept local, hosts/ddp_tp.py)
        "_checkmate_localized",  # hosts/ddp_tp.py's own mark on the module it localized
        "_comm_hooks",  # DDP's registered hooks (one already there is refused)
        "_Work",  # c10d's Work base class (hosts/c10d_work.py's FutureWork)
    }
)


def _foreign_private_uses(path: Path, root: Path = REPO) -> list[str]:
    """``path:line: expression`` of every ``other._x`` (not ``self``/``cls``, not a dunder) in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in TORCH_INTERNALS:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        out.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return out


def _borrowed_private_state(path: Path, root: Path = REPO) -> list[str]:
    """``path:line: Class uses self._x`` for every private ``self._x`` a class of ``path`` uses but
    never assigns (``self._x = ...`` in its methods) nor defines in its body (a method, a value;
    an annotation alone does not count): state a mixin borrows from the class it is mixed into."""
    out: list[str] = []
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        own: set[str] = set()
        for stmt in cls.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(stmt.name)
            elif isinstance(stmt, ast.Assign):
                own.update(target.id for target in stmt.targets if isinstance(target, ast.Name))
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
                own.add(stmt.target.id)
        uses = [
            node
            for node in ast.walk(cls)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ]
        own.update(node.attr for node in uses if isinstance(node.ctx, ast.Store))
        out.extend(
            f"{path.relative_to(root)}:{node.lineno}: {cls.name} uses {ast.unparse(node)}"
            for node in uses
            if node.attr not in own
        )
    return out


def test_no_component_touches_another_ones_private_attributes() -> None:
    assert len(AGENT_MODULES) >= 11, [p.name for p in AGENT_MODULES]
    found = [use for path in AGENT_MODULES for use in _foreign_private_uses(path)]
    assert not found, "a private attribute used outside its class:\n" + "\n".join(found)


def test_no_class_borrows_private_state_it_does_not_set() -> None:
    found = [use for path in AGENT_MODULES for use in _borrowed_private_state(path)]
    assert not found, "private state a class uses but never sets (a mixin's):\n" + "\n".join(found)


def test_the_agents_compose_their_components_instead_of_inheriting_them() -> None:
    assert hosts.ddp.CheckmateAgent.__bases__ == (object,)
    assert hosts.c10d_fsdp.FsdpCheckmateAgent.__bases__ == (object,)
    assert hosts.c10d_backend.CheckmateProcessGroup.__bases__ == (dist.ProcessGroup,)


def test_the_walk_finds_a_foreign_private_attribute(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "class A:\n    def f(self, other):\n        other._count = self._mine + other.__len__()\n"
        "        return other._state\n",
        encoding="utf-8",
    )
    assert _foreign_private_uses(probe, tmp_path) == ["probe.py:3: other._count", "probe.py:4: other._state"]


def test_the_walk_finds_borrowed_private_state(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "class Mixin:\n    _lock: object\n    def f(self):\n        with self._lock:\n"
        "            self._count = self._count + self._step()\n\n"
        "class Own:\n    def __init__(self):\n        self._n = 0\n"
        "    def f(self):\n        return self._n\n",
        encoding="utf-8",
    )
    assert _borrowed_private_state(probe, tmp_path) == [
        "probe.py:4: Mixin uses self._lock",
        "probe.py:5: Mixin uses self._step",
    ]
