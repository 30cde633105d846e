"""The shadow node's maintenance thread: repair requests for gaps, and the status file.

Every 5 ms while a committed iteration lacks copies (else every 50 ms, or when woken) the
:class:`Maintenance` thread has the :class:`~shadow.node_receive.Receiver` plan repairs
(REPAIR_REQUEST for exactly the missing ranges of an iteration whose commit is here, see
:mod:`shadow.repair`) and sends them, MAC added, from the data port; an unrepairable
iteration makes the shadow ask rank 0 for fresh state. Once a second it rewrites the status
file from the node's status document. It owns its thread, its wake-up event and its pacing;
it holds no lock (its state is its thread's alone).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkmate.auth import DatagramKeys
from shadow.node_link import ControlLink
from shadow.node_receive import Receiver
from shadow.node_service import StateService
from shadow.node_state import ComponentThread, ShadowConfig

logger = logging.getLogger(__name__)

REPAIR_DEFER_LIMIT_S = 1.0
"""Longest a shadow defers planning repairs while copies still wait unread in its socket."""
MAINTENANCE_BUSY_S = 0.005
"""The maintenance thread's period while a committed iteration lacks copies."""
MAINTENANCE_IDLE_S = 0.05
"""Its period otherwise (a commit wakes it at once)."""


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # the shadow's status: its owner's only
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class Maintenance:
    """Repairs and the status file of a shadow node (no lock: its state is its thread's)."""

    def __init__(
        self,
        config: ShadowConfig,
        receiver: Receiver,
        state: StateService,
        link: ControlLink,
        keys: DatagramKeys,
        status: Callable[[], dict[str, Any]],
        stop: threading.Event,
        publish: Callable[[str, bytes], None] | None = None,
    ) -> None:
        self._name = config.name
        self._resync_on_unrepairable = config.resync_on_unrepairable
        self._status_file = config.status_file
        if self._status_file is None and config.snapshots is not None:
            self._status_file = config.snapshots.directory / f"status-{config.name}.json"
        self._receiver = receiver
        self._state = state
        self._link = link
        self._keys = keys
        self._status = status
        self._publish = publish
        """Remote snapshots: hands the status document to the snapshot writer for the export."""
        self._stop = stop
        self._wake = threading.Event()
        """Wakes the thread (a commit arrived, a repair is due now, or the node closes)."""
        self._thread = ComponentThread(self._name, "maint", self._maintenance_loop)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Plan repairs now (a commit arrived, or copies were refused)."""
        self._wake.set()

    def join(self, timeout: float) -> None:
        self._wake.set()
        self._thread.join(timeout)

    def _maintenance_loop(self) -> None:
        next_status = time.monotonic()
        deferred_since: float | None = None
        repair_wanted = False
        while not self._stop.is_set():
            # Every 5 ms while a committed iteration lacks copies (repairs are due or in flight),
            # else every 50 ms or when a commit arrives: an idle shadow does not spin.
            self._wake.wait(MAINTENANCE_BUSY_S if repair_wanted else MAINTENANCE_IDLE_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            # Nothing is missing that still waits unread in the socket (a loaded shadow): plan
            # repairs once the socket is drained, or after REPAIR_DEFER_LIMIT_S at the latest,
            # so that steady traffic that never lets the queue empty cannot starve repairs.
            if self._receiver.queued():
                deferred_since = now if deferred_since is None else deferred_since
            else:
                deferred_since = None
            if deferred_since is None or now - deferred_since >= REPAIR_DEFER_LIMIT_S:
                deferred_since = None
                repair_wanted = self._repair(now)
            if now >= next_status:
                next_status = now + 1.0
                self.write_status()

    def _repair(self, now: float) -> bool:
        """Plan and send the repairs due now; True if a committed iteration lacks copies."""
        if self._state.diverged():
            return False  # nothing is applied until rank 0 re-seeds, so nothing to repair
        plan = self._receiver.plan_repairs(now)
        for addr, header, payload in plan.sends:
            try:
                datagram = header.pack() + payload
                tag = self._keys.for_job(header.job_id).tag((datagram,))
                self._receiver.send(datagram + tag, addr)
            except OSError as exc:
                logger.debug("repair request to %s failed: %s", addr, exc)
        if plan.failure is not None and self._resync_on_unrepairable:
            self._link.request_fresh_state(plan.failure)
        return plan.wanted

    def write_status(self) -> None:
        """Rewrite the status file (``ShadowConfig.status_file``, or the snapshot directory's)."""
        path = self._status_file
        if path is None:
            return
        text = json.dumps(self._status(), indent=1, sort_keys=True) + "\n"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write_text(path, text)
        except OSError as exc:
            logger.warning("shadow %s: cannot write status file %s: %s", self._name, path, exc)
        if self._publish is not None:
            self._publish(f"status-{self._name}.json", text.encode("utf-8"))
