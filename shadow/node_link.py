"""The shadow node's link to rank 0: the job rank 0 announced, its control connection, and writes on it.

The control server's connection threads adopt rank 0's connection when a job_start
arrives on it (:meth:`ControlLink.begin_job`, :meth:`ControlLink.adopt`); the apply and
maintenance threads write through it (certified, diverged: :meth:`ControlLink.send`) and
ask rank 0 for fresh state (:meth:`ControlLink.request_fresh_state`: goodbye ``resync:``,
the connection retired). ``_lock`` guards the connection, the job and the retired set;
``_send_lock`` is held for each write (never both: a write is not made under ``_lock``).
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from checkmate.control import Goodbye, Message, send_message
from shadow.node_state import Job, ShadowConfig

logger = logging.getLogger(__name__)


class ControlLink:
    """Rank 0's control channel as the other components see it (``_lock``, ``_send_lock``)."""

    def __init__(self, config: ShadowConfig) -> None:
        self._name = config.name
        self._configured_job = config.job_id
        self._io_timeout = config.io_timeout
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._conn: socket.socket | None = None
        self._job: Job | None = None
        self._job_conn: socket.socket | None = None
        """The control connection the current job_start came on."""
        self._retiring: set[socket.socket] = set()
        """Control connections this shadow said goodbye on: read and discarded until rank 0 closes."""
        self._resync_requests = 0

    def job(self) -> Job | None:
        """The job of the latest job_start (or of the snapshot resumed from); None before one."""
        with self._lock:
            return self._job

    def job_id(self) -> int:
        with self._lock:
            return self._job.job_id if self._job is not None else (self._configured_job or 0)

    def begin_job(self, job: Job, conn: socket.socket) -> bool:
        """A job_start for ``job`` came on ``conn``; True if it starts a new run (not a layout change)."""
        with self._lock:
            new_run = conn is not self._job_conn or (
                self._job is not None
                and (self._job.world_size, self._job.workers) != (job.world_size, job.workers)
            )
            self._job = job
            self._job_conn = conn
            return new_run

    def resume(self, job: Job) -> None:
        """The job of the snapshot this shadow resumed from (until rank 0 sends a job_start)."""
        with self._lock:
            self._job = job

    def adopt(self, conn: socket.socket) -> None:
        """``conn`` is rank 0's control connection now; an older one is closed."""
        with self._lock:
            old, self._conn = self._conn, conn
        if old is not None and old is not conn:
            logger.info("shadow %s: rank 0 reconnected; dropping the old control connection", self._name)
            old.close()

    def is_current(self, conn: socket.socket) -> bool:
        with self._lock:
            return self._conn is conn

    def is_retired(self, conn: socket.socket) -> bool:
        """Whether this shadow said goodbye on ``conn`` (its reader discards what still comes)."""
        with self._lock:
            return conn in self._retiring

    def release(self, conn: socket.socket) -> None:
        """``conn`` is closing: forgotten as rank 0's connection and as retired."""
        with self._lock:
            if self._conn is conn:
                self._conn = None
            self._retiring.discard(conn)

    def connected(self) -> bool:
        with self._lock:
            return self._conn is not None

    def send_on(self, conn: socket.socket, message: Message, timeout: float) -> None:
        """Write ``message`` on ``conn`` (one write at a time); OSError as the socket raises it."""
        with self._send_lock:
            send_message(conn, message, timeout=timeout)

    def send(self, message: Message) -> bool:
        """Write ``message`` to rank 0; False if there is no control connection or the write failed."""
        with self._lock:
            conn = self._conn
        if conn is None:
            return False
        try:
            self.send_on(conn, message, self._io_timeout)
            return True
        except OSError as exc:
            logger.info("shadow %s: control write failed: %s", self._name, exc)
            return False

    def request_fresh_state(self, why: str) -> bool:
        """Ask rank 0 for fresh state on its current connection; False if there is none."""
        with self._lock:
            conn = self._conn
        if conn is None:
            return False
        return self.request_state(conn, why)

    def request_state(self, conn: socket.socket, why: str) -> bool:
        """Ask rank 0 for fresh state: goodbye on ``conn``, now retired; rank 0 reconnects and resends it.

        The connection is not closed here: its reader discards what rank 0 sent meanwhile until
        rank 0 closes its side (a close with unread bytes would reset the connection, and rank 0
        could lose this goodbye and a 'diverged' report before it). Returns True (keep reading).
        """
        with self._lock:
            self._resync_requests += 1
            if self._conn is conn:
                self._conn = None
            self._retiring.add(conn)
            job_id = self._job.job_id if self._job is not None else (self._configured_job or 0)
        logger.warning("shadow %s: asking rank 0 for fresh state: %s", self._name, why)
        try:
            self.send_on(conn, Goodbye(job_id, f"resync: {why}"), 1.0)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        return True

    def close(self) -> None:
        """Say goodbye to rank 0 (the shadow closes) and close its connection."""
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            self.send_on(conn, Goodbye(self.job_id(), "shadow closing"), 0.5)
        except OSError:
            pass
        conn.close()

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"resync_requests": self._resync_requests, "control_connected": self._conn is not None}
