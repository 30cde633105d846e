"""Build script for Checkmate's packages and optional C extensions; the rest lives in pyproject.toml.

The wheel ships the library's packages (not ``examples`` or ``experiments``, which run from
the checkout) and, as package data, the P4 program: ``p4src/`` becomes ``checkmate.p4.p4src``
(with BMv2's JSON when ``make p4`` compiled it before the build), read through
importlib.resources (checkmate/p4/program.py). tests/test_packaging.py checks both.

Each extension is built from source in this repository when a C compiler and the
Python headers are present (``make setup`` or ``pip install -e .``). Every one is
optional: a failed build prints one warning and the install goes on, and the code
that would use the extension takes its pure-Python path instead (and says so once
when it starts). Add an extension by appending it to ``EXTENSIONS``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

_C_FLAGS = ["-O2", "-Wall", "-Wextra", "-std=gnu11"]
_BUILD_ERRORS = (CCompilerError, CompileError, ExecError, LinkError, PlatformError, OSError)

LIBRARY = ["checkmate", "controller", "embedded_switch", "hosts", "shadow", "topologies"]
"""The top folders whose packages the wheel installs (every package under them)."""
P4SRC_PACKAGE = "checkmate.p4.p4src"
PACKAGES = [*find_packages(include=[name for top in LIBRARY for name in (top, f"{top}.*")]), P4SRC_PACKAGE]
PACKAGE_DATA = {
    P4SRC_PACKAGE: ["*.txtpb", "**/*.p4", "**/*.txtpb"],
    "checkmate": ["wireshark/*.lua"],
    "controller": ["measured/*.json", "measured/*/*.json"],
}
BMV2_JSON = Path("build/v1model/checkmate.json")
"""What ``make p4`` compiles; a wheel built after it carries it in checkmate/p4/p4src/v1model/."""

EXTENSIONS = [
    # The embedded switch's native data path: batched AF_PACKET I/O and the compiled flow cache.
    Extension(
        "embedded_switch.native._datapath",
        sources=["embedded_switch/native/_datapath.c"],
        extra_compile_args=_C_FLAGS,
        optional=True,
    ),
    # The host transport's native data path (hosts/native/__init__.py loads it; TransportConfig.datapath).
    Extension(
        "hosts.native._datapath",
        sources=["hosts/native/datapath.c"],
        depends=["hosts/native/sha256.h"],
        extra_compile_args=[*_C_FLAGS, "-fno-strict-aliasing"],
        optional=True,
    ),
]


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: an extension that does not build is skipped."""

    def run(self) -> None:
        try:
            super().run()
        except _BUILD_ERRORS as exc:  # no compiler at all, or no Python headers
            self.warn(f"C extensions not built ({exc}); the pure-Python paths will be used")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except _BUILD_ERRORS as exc:
            self.warn(f"C extension {ext.name} not built ({exc}); its pure-Python path will be used")


class BuildPyWithProgram(build_py):
    """build_py that also puts BMv2's compiled JSON, when ``make p4`` made one, beside the P4 sources."""

    def run(self) -> None:
        super().run()
        if BMV2_JSON.is_file() and not self.editable_mode:
            target = Path(self.build_lib, *P4SRC_PACKAGE.split("."), "v1model", BMV2_JSON.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(BMV2_JSON, target)


setup(
    packages=PACKAGES,
    package_dir={P4SRC_PACKAGE: "p4src"},
    package_data=PACKAGE_DATA,
    include_package_data=False,
    ext_modules=EXTENSIONS,
    cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPyWithProgram},
)
