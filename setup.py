"""Build of the optional native data paths: the transport's (hosts/native/datapath.c ->
hosts.native._datapath) and the embedded switch's (embedded_switch/native/_datapath.c ->
embedded_switch.native._datapath, its own pure-Python fallback in embedded_switch/native/__init__.py).

Everything else about the package is in pyproject.toml. The extension is ``optional``: where it
cannot be compiled (no compiler, no Python headers), ``pip install -e .`` still succeeds and the
transport runs its Python data path with one warning (hosts/native/__init__.py).
CFLAGS from the environment are added (e.g. ``CFLAGS=-fsanitize=address`` for an ASan build).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hosts.native._datapath",
            sources=["hosts/native/datapath.c"],
            depends=["hosts/native/sha256.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-std=gnu11", "-fno-strict-aliasing"],
            optional=True,
        ),
        Extension(
            "embedded_switch.native._datapath",
            sources=["embedded_switch/native/_datapath.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-std=gnu11"],
            optional=True,
        ),
    ]
)
