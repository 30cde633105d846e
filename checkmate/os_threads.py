"""Give each Python thread's OS thread the Python thread's name, so tools outside the process see it.

Python 3.11 leaves every OS thread named after the program (``python``), so ``top -H``,
``ps -L``, ``/proc/PID/task/*/comm`` and the benchmark's per-thread account
(:mod:`experiments.bench.worker_account`) cannot tell the receive thread from the training
thread. :func:`name_os_threads` writes each live Python thread's name (cut to the kernel's 15
bytes) into ``/proc/self/task/TID/comm``; threads started later are named by the next call.
Linux only; elsewhere, and for a thread that ended meanwhile, it does nothing.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_TASKS = Path("/proc/self/task")
_COMM_BYTES = 15


def name_os_threads() -> int:
    """Name the OS thread of every live Python thread after it; returns how many were named."""
    if not _TASKS.is_dir():
        return 0
    named = 0
    for thread in threading.enumerate():
        tid = thread.native_id
        if tid is None or thread is threading.main_thread():
            continue
        name = thread.name.encode("utf-8", "replace")[:_COMM_BYTES]
        try:
            (_TASKS / str(tid) / "comm").write_bytes(name)
        except OSError:  # the thread ended meanwhile
            continue
        named += 1
    return named
