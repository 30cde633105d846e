"""What a wheel ships: every package of the library's top folders, found by setup.py's rule.

``examples/`` and ``experiments/`` run from the checkout and are not installed; ``p4src/``
ships as the data package ``checkmate.p4.p4src``. tests/test_wheel.py installs the wheel.
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest
import setuptools

REPO = Path(__file__).resolve().parents[1]
LIBRARY = {"checkmate", "controller", "embedded_switch", "hosts", "shadow", "topologies"}
CHECKOUT_ONLY = {"examples", "experiments"}


def _setup_arguments(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What setup.py passes to setuptools.setup (run with setup() recorded, not called)."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: seen.update(kwargs))
    monkeypatch.chdir(REPO)
    runpy.run_path(str(REPO / "setup.py"), run_name="setup")
    return seen


def _package_dirs() -> set[str]:
    """Every folder with an ``__init__.py`` outside tests/ and build outputs, as a dotted name."""
    names = set()
    for init in REPO.glob("*/**/__init__.py"):
        parts = init.parent.relative_to(REPO).parts
        if parts[0] in ("tests", "build") or parts[0].startswith(".") or parts[0].endswith(".egg-info"):
            continue
        names.add(".".join(parts))
    return names


def test_every_library_package_is_shipped(monkeypatch: pytest.MonkeyPatch) -> None:
    arguments = _setup_arguments(monkeypatch)
    shipped = set(arguments["packages"])
    packages = {name for name in _package_dirs() if name.split(".")[0] in LIBRARY}
    assert {"checkmate.checkpoint", "embedded_switch.p4runtime"} <= packages
    assert packages - shipped == set(), "packages the wheel would leave out"
    assert shipped - packages == {"checkmate.p4.p4src"}, "the wheel would ship something unexpected"
    assert arguments["package_dir"] == {"checkmate.p4.p4src": "p4src"}
    assert not {name for name in shipped if name.split(".")[0] in CHECKOUT_ONLY}


def test_every_top_folder_is_library_checkout_only_or_data() -> None:
    tops = {name.split(".")[0] for name in _package_dirs()}
    assert tops == LIBRARY | CHECKOUT_ONLY | {"p4src"}, "a new top folder: ship it in setup.py or say why not"


def test_every_folder_with_python_code_is_a_package() -> None:
    # A folder of modules without __init__.py is not found by the rule above and would not ship.
    tops = {name.split(".")[0] for name in _package_dirs()}
    loose = sorted(
        str(path.parent.relative_to(REPO))
        for top in tops
        for path in (REPO / top).rglob("*.py")
        if not (path.parent / "__init__.py").exists()
    )
    assert loose == []
