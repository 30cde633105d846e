"""Build script for Checkmate's optional C extensions; everything else lives in pyproject.toml.

Each extension is built from source in this repository when a C compiler and the
Python headers are present (``make setup`` or ``pip install -e .``). Every one is
optional: a failed build prints one warning and the install goes on, and the code
that would use the extension takes its pure-Python path instead (and says so once
when it starts). Add an extension by appending it to ``EXTENSIONS``.
"""

from __future__ import annotations

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

_C_FLAGS = ["-O2", "-Wall", "-Wextra", "-std=gnu11"]
_BUILD_ERRORS = (CCompilerError, CompileError, ExecError, LinkError, PlatformError, OSError)

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


setup(ext_modules=EXTENSIONS, cmdclass={"build_ext": OptionalBuildExt})
