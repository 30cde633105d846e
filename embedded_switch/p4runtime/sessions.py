"""StreamChannel sessions and client arbitration of the embedded switch's server.

Arbitration is per (device id, role) with election ids, as in PI: the highest election
id is the primary; every client gets a MasterArbitrationUpdate with status OK (primary),
ALREADY_EXISTS (backup while a primary exists) or NOT_FOUND (no primary). A wrong device
id ends the stream with NOT_FOUND, an election id already held by another stream with
INVALID_ARGUMENT. When the primary's stream ends, the next highest becomes primary and
all clients are told. Like PI, a Write or SetForwardingPipelineConfig that carries no
election id is accepted while no controller holds a stream for its role.

Lock: ``Arbiter.lock`` guards the sessions and their arbitration state; methods named
``_locked`` expect the caller to hold it, every other method takes it itself. A
session's outbox is a thread-safe queue and is written without it.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field

from google.rpc import code_pb2
from p4.v1 import p4runtime_pb2

from embedded_switch.p4runtime.errors import INVALID, NOT_FOUND, OK, Failure, set_uint128, uint128

logger = logging.getLogger(__name__)

MAX_STREAMS = 16
"""Most controller streams at once, as in PI."""
DEFAULT_ROLE = ""


@dataclass(frozen=True, slots=True)
class End:
    """Ends a stream: OK when the client is done, an error code to reject it."""

    code: int = OK
    message: str = ""


@dataclass(eq=False)
class Session:
    """One StreamChannel."""

    sid: int
    peer: str
    outbox: queue.Queue[p4runtime_pb2.StreamMessageResponse | End] = field(default_factory=queue.Queue)
    arbitrated: bool = False
    role: str = DEFAULT_ROLE
    election_id: int | None = None
    closed: bool = False


class Arbiter:
    """The StreamChannel sessions of one device and who is primary for each role."""

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self.lock = threading.Lock()
        self._sessions: dict[int, Session] = {}
        self._session_ids = itertools.count(1)

    def sessions(self) -> list[Session]:
        with self.lock:
            return list(self._sessions.values())

    def primary(self, role: str) -> Session | None:
        """The primary session of ``role`` (None: none)."""
        with self.lock:
            return self._primary_locked(role)

    def send_to_primary(
        self, message: p4runtime_pb2.StreamMessageResponse, role: str, max_queued: int
    ) -> str | None:
        """Queue ``message`` for the primary of ``role``; None, or why it was not queued."""
        with self.lock:
            primary = self._primary_locked(role)
            if primary is None:
                return "no primary controller"
            if primary.outbox.qsize() >= max_queued:
                return "controller too slow"
            primary.outbox.put(message)
            return None

    def standing(self, session: Session) -> tuple[bool, bool]:
        """(has the session arbitrated, is it the primary of its role)."""
        with self.lock:
            return session.arbitrated, self._primary_locked(session.role) is session

    def _primary_locked(self, role: str) -> Session | None:
        best: Session | None = None
        for s in self._sessions.values():
            if s.arbitrated and not s.closed and s.role == role and s.election_id is not None:
                if best is None or s.election_id > (best.election_id or 0):
                    best = s
        return best

    def _notify_locked(self, session: Session, primary: Session | None) -> None:
        msg = p4runtime_pb2.StreamMessageResponse()
        arb = msg.arbitration
        arb.device_id = self.device_id
        if session.role:
            arb.role.name = session.role
        if primary is not None and primary.election_id is not None:
            set_uint128(arb.election_id, primary.election_id)
        if primary is session:
            arb.status.code = OK
            arb.status.message = "Is primary"
        elif primary is not None:
            arb.status.code = code_pb2.ALREADY_EXISTS
            arb.status.message = "Is backup: another controller is primary"
        else:
            arb.status.code = NOT_FOUND
            arb.status.message = "Is backup: there is no primary"
        session.outbox.put(msg)

    def _notify_role_locked(self, role: str) -> None:
        primary = self._primary_locked(role)
        for s in self._sessions.values():
            if s.arbitrated and not s.closed and s.role == role:
                self._notify_locked(s, primary)

    def arbitrate(self, session: Session, arb: p4runtime_pb2.MasterArbitrationUpdate) -> End | None:
        role = arb.role.name
        election_id = uint128(arb.election_id) if arb.HasField("election_id") else None
        with self.lock:
            if arb.device_id != self.device_id:
                if not session.arbitrated:
                    return End(
                        NOT_FOUND,
                        f"device id {arb.device_id} not found: this switch is device {self.device_id}",
                    )
                return End(code_pb2.FAILED_PRECONDITION, "Invalid device id: a stream cannot change device")
            if session.arbitrated and role != session.role:
                return End(code_pb2.FAILED_PRECONDITION, "a stream cannot change its role")
            if election_id is not None:
                for other in self._sessions.values():
                    if (
                        other is not session
                        and other.arbitrated
                        and not other.closed
                        and other.role == role
                        and other.election_id == election_id
                    ):
                        return End(
                            INVALID,
                            f"Election id already exists: election id {election_id} is held "
                            f"by another stream for device {self.device_id} role '{role}'",
                        )
            if not session.arbitrated and sum(s.arbitrated for s in self._sessions.values()) >= MAX_STREAMS:
                return End(code_pb2.RESOURCE_EXHAUSTED, f"Too many connections (at most {MAX_STREAMS})")
            before = self._primary_locked(role)
            session.arbitrated, session.role, session.election_id = True, role, election_id
            after = self._primary_locked(role)
            if before is not after:
                logger.info(
                    "device %d role '%s': primary is now %s (election id %s)",
                    self.device_id,
                    role,
                    after.peer if after else None,
                    after.election_id if after else None,
                )
                self._notify_role_locked(role)
            else:
                self._notify_locked(session, after)
        return None

    def open_session(self, peer: str) -> Session:
        with self.lock:
            session = Session(next(self._session_ids), peer)
            self._sessions[session.sid] = session
        return session

    def close_session(self, session: Session) -> None:
        with self.lock:
            if session.closed:
                return
            was_primary = session.arbitrated and self._primary_locked(session.role) is session
            session.closed = True
            del self._sessions[session.sid]
            if was_primary:
                after = self._primary_locked(session.role)
                logger.info(
                    "device %d role '%s': primary %s left; primary is now %s",
                    self.device_id,
                    session.role,
                    session.peer,
                    after.peer if after else None,
                )
                self._notify_role_locked(session.role)
        session.outbox.put(End())

    def check_primary(self, role: str, election_id: int | None) -> None:
        with self.lock:
            primary = self._primary_locked(role)
            anyone = any(s.arbitrated and not s.closed and s.role == role for s in self._sessions.values())
        if primary is None and not anyone and election_id is None:
            return  # as PI: no controller connected, a request without election id is accepted
        if primary is None or election_id != primary.election_id:
            raise Failure(
                code_pb2.PERMISSION_DENIED,
                f"Not primary: election id {election_id} is not the primary's "
                f"({primary.election_id if primary else 'none'}) for device {self.device_id} "
                f"role '{role}'",
            )

    def check_device(self, device_id: int) -> None:
        if device_id != self.device_id:
            raise Failure(
                NOT_FOUND, f"device id {device_id} not found: this switch is device {self.device_id}"
            )
