"""Make Debian's Mininet importable from ``.venv``.

``apt-get install mininet`` puts the ``mininet`` package in the system
``dist-packages`` only, and ``.venv`` is built from another Python. Adding the
whole system ``dist-packages`` to ``sys.path`` would let system copies of
packages (cryptography, yaml, pip, ...) satisfy or shadow ours, so we never
do that. Instead:

* ``make setup`` links the one ``mininet`` package directory into ``.venv``'s
  site-packages (``python -m topologies.mininet_import --link`` does the same);
* :func:`import_mininet` falls back to loading just that package from the
  system location when the link is missing.

Mininet 2.3 is pure Python that needs only the standard library (and the
``mnexec`` helper binary), so the package works under any Python 3.10/3.11.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SYSTEM_LOCATIONS: tuple[Path, ...] = (
    Path("/usr/lib/python3/dist-packages"),
    Path("/usr/local/lib/python3/dist-packages"),
    Path("/usr/lib/python3/site-packages"),
)
"""Where distribution packages put ``mininet/``, in search order."""


class MininetMissing(RuntimeError):
    """Mininet is not installed (or not importable); the message says how to install it."""


def find_system_mininet() -> Path | None:
    """The system ``mininet`` package directory, or None."""
    for location in SYSTEM_LOCATIONS:
        candidate = location / "mininet"
        if (candidate / "__init__.py").is_file():
            return candidate
    return None


def import_mininet() -> ModuleType:
    """Import and return the ``mininet`` package, from ``.venv`` or the system location only.

    ``mininet.log`` calls ``logging.setLoggerClass`` with a singleton logger
    class, which would turn every logger created afterwards into Mininet's
    one logger; the standard class is put back right after it is imported.
    """
    module = _import_package()
    importlib.import_module("mininet.log")
    logging.setLoggerClass(logging.Logger)
    return module


def _import_package() -> ModuleType:
    try:
        return importlib.import_module("mininet")
    except ImportError:
        pass
    directory = find_system_mininet()
    if directory is None:
        raise MininetMissing(
            "Mininet is not installed: run `make setup` (as root) or `apt-get install mininet`"
        ) from None
    spec = importlib.util.spec_from_file_location(
        "mininet", directory / "__init__.py", submodule_search_locations=[str(directory)]
    )
    if spec is None or spec.loader is None:
        raise MininetMissing(f"cannot load Mininet from {directory}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mininet"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # any failure here means the system package does not fit this Python
        del sys.modules["mininet"]
        raise MininetMissing(f"Mininet at {directory} does not import under this Python: {exc}") from exc
    logger.debug("loaded mininet from %s (only that package, not its dist-packages)", directory)
    return module


def link_into_site_packages(site_packages: Path | None = None) -> Path | None:
    """Symlink the system ``mininet`` directory into ``site_packages`` (idempotent).

    Returns the link, or None when Mininet is not installed on the system.
    """
    directory = find_system_mininet()
    if directory is None:
        return None
    site = site_packages or Path(sysconfig.get_paths()["purelib"])
    link = site / "mininet"
    if link.is_symlink() and link.resolve() == directory.resolve():
        return link
    if link.exists() and not link.is_symlink():
        raise MininetMissing(f"{link} exists and is not our link; remove it by hand")
    if link.is_symlink():
        link.unlink()
    link.symlink_to(directory, target_is_directory=True)
    return link


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", action="store_true", help="link the system mininet into site-packages")
    args = parser.parse_args(argv)
    if args.link:
        link = link_into_site_packages()
        print(f"mininet: {link}" if link else "mininet: not installed on the system; nothing linked")
        return 0
    try:
        module = import_mininet()
    except MininetMissing as exc:
        print(exc, file=sys.stderr)
        return 1
    version = getattr(importlib.import_module("mininet.net"), "VERSION", "?")
    print(f"mininet {version} from {Path(module.__file__ or '?').parent}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
