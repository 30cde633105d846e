"""What a wheel ships: every package of the project's top folders, found from pyproject.toml's rule."""

from __future__ import annotations

from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration

REPO = Path(__file__).resolve().parents[1]


def _shipped() -> set[str]:
    """The packages setuptools finds with pyproject.toml's rule (what ``pip wheel .`` puts in the wheel)."""
    config = read_configuration(REPO / "pyproject.toml")
    return set(config["tool"]["setuptools"]["packages"])


def _package_dirs() -> set[str]:
    """Every folder with an ``__init__.py`` outside tests/ and build outputs, as a dotted name."""
    names = set()
    for init in REPO.glob("*/**/__init__.py"):
        parts = init.parent.relative_to(REPO).parts
        if parts[0] in ("tests", "build") or parts[0].startswith(".") or parts[0].endswith(".egg-info"):
            continue
        names.add(".".join(parts))
    return names


def test_every_package_is_shipped() -> None:
    shipped = _shipped()
    packages = _package_dirs()
    assert {"checkmate.checkpoint", "experiments.bench", "embedded_switch.p4runtime"} <= packages
    assert packages - shipped == set(), "packages the wheel would leave out"
    # e.g. checkmate/wireshark (no __init__.py) found as a namespace package
    assert shipped - packages == set(), "the wheel would ship something that is not a project package"


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
