"""The embedded switch's native data path: a compiled flow cache and batched AF_PACKET I/O.

``_datapath`` is a C extension that setup.py builds from ``_datapath.c`` when a compiler
is present; it is optional. Two data paths exist (``checkmate-switch --datapath``):

* ``python``: the reference, :class:`embedded_switch.pipeline.Pipeline` and the Python
  I/O loop of :class:`embedded_switch.ports.SwitchPorts`;
* ``native`` (the default when the extension imports): :class:`NativePipeline`, whose
  cached decisions run in C, and :class:`_datapath.PortIO`, which receives with
  ``recvmmsg`` and sends with ``sendmmsg``, one system call per batch and port.

The P4 program is interpreted by the same Python code on both paths: the native path
caches the decision :meth:`Pipeline._decide` made for a flow key and replays it in C, and
sends everything it cannot replay (short or malformed frames, misses, bad checksums,
changed multicast groups) through :meth:`Pipeline.native_miss`, the Python path itself.
So counters, drops and frames are the same; the test suites run on both.

When ``native`` is asked for and the extension did not build or import,
:func:`resolve_datapath` logs one warning and the Python path runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from types import ModuleType

from embedded_switch.pipeline import Buffer, DropStats, Pipeline
from embedded_switch.state import SwitchState

logger = logging.getLogger(__name__)

DATAPATHS = ("native", "python")
"""What ``--datapath`` accepts; the first is the default."""

_datapath: ModuleType | None
try:
    from embedded_switch.native import _datapath
except ImportError as exc:  # not built (no compiler at install time) or built for another Python
    _datapath = None
    IMPORT_ERROR: str | None = str(exc)
else:
    IMPORT_ERROR = None

_warned = False


def available() -> bool:
    """Whether the C extension imported."""
    return _datapath is not None


def extension() -> ModuleType:
    """The C extension module; raises RuntimeError (with the import error) when it is absent."""
    if _datapath is None:
        raise RuntimeError(f"the native data path is not built: {IMPORT_ERROR}")
    return _datapath


def resolve_datapath(requested: str) -> str:
    """The data path that will run for ``requested``: ``native`` falls back to ``python``, warning once."""
    global _warned
    if requested not in DATAPATHS:
        raise ValueError(f"unknown data path {requested!r}; expected one of {', '.join(DATAPATHS)}")
    if requested == "python" or available():
        return requested
    if not _warned:
        logger.warning(
            "the native data path is not available (%s); running the Python data path. "
            "Rebuild it with: .venv/bin/pip install -e . --no-deps --no-build-isolation",
            IMPORT_ERROR,
        )
        _warned = True
    return "python"


class NativePipeline(Pipeline):
    """A :class:`Pipeline` whose cached decisions run in C (``_datapath.FlowCache``).

    Same interface and results as the Python pipeline; :meth:`process` and
    :meth:`process_batch` go through the compiled cache, and the I/O layer
    (``_datapath.PortIO``) uses the same cache without leaving C for cached flows.
    """

    def __init__(self, state: SwitchState, drops: DropStats | None = None, cache: bool = True) -> None:
        self._flows = extension().FlowCache()
        super().__init__(state, drops, cache)

    def _bind(self, state: SwitchState) -> None:
        super()._bind(state)
        self._flows.clear()  # decisions of the old state's tables mean nothing for the new one

    def process(self, frame: Buffer, ingress_port: int) -> list[tuple[int, bytearray]]:
        result: list[tuple[int, bytearray]] = self._flows.process(self, (frame,), ingress_port)
        return result

    def process_batch(self, frames: Iterable[Buffer], ingress_port: int) -> list[tuple[int, bytearray]]:
        result: list[tuple[int, bytearray]] = self._flows.process(self, list(frames), ingress_port)
        return result

    def flow_stats(self) -> dict[str, int]:
        """Compiled-cache hits, misses (frames the Python path ran) and flows held."""
        stats: dict[str, int] = self._flows.stats()
        return stats


def make_pipeline(datapath: str, state: SwitchState, drops: DropStats | None = None) -> Pipeline:
    """The pipeline for ``datapath`` (``native`` or ``python``, as resolved by :func:`resolve_datapath`)."""
    if datapath == "native":
        return NativePipeline(state, drops)
    return Pipeline(state, drops)
