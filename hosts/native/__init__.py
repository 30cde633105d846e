"""The native data path: a compiled core of the host transport (hosts/native/datapath.c).

``_datapath`` is a CPython extension that setup.py builds with ``pip install -e .`` (``make
setup``); it is optional. :func:`load` returns the module, or None -- with one warning per
process saying why -- when it is missing or failed to build, and the transport then runs its
Python data path (:class:`hosts.transport.TransportConfig` ``datapath``). docs/architecture.md
("The native data path") says what runs in C.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_warned = False


def load() -> ModuleType | None:
    """The compiled module, or None (warned once per process) when it is not importable."""
    global _warned
    try:
        from hosts.native import _datapath  # type: ignore[attr-defined]
    except ImportError as exc:
        with _lock:
            if not _warned:
                _warned = True
                logger.warning(
                    "the native data path (hosts.native._datapath) is not available (%s); the host "
                    "transport uses its Python data path, about 4x slower. Rebuild it with "
                    "`pip install -e . --no-deps --no-build-isolation` (needs gcc and the Python headers)",
                    exc,
                )
        return None
    from checkmate.wire import HEADER_BYTES, MAX_PAYLOAD_BYTES

    if (_datapath.HEADER_BYTES, _datapath.MAX_PAYLOAD_BYTES) != (HEADER_BYTES, MAX_PAYLOAD_BYTES):
        with _lock:
            if not _warned:
                _warned = True
                logger.warning(
                    "the native data path was built for %d-byte payloads, checkmate.wire says %d; the "
                    "host transport uses its Python data path until it is rebuilt",
                    _datapath.MAX_PAYLOAD_BYTES,
                    MAX_PAYLOAD_BYTES,
                )
        return None
    return _datapath


def available() -> bool:
    """Whether the compiled data path can be used in this process."""
    return load() is not None
