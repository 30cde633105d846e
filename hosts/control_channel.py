"""Rank 0's control channel to the job's shadows: TCP, one background thread per shadow.

Messages (:mod:`checkmate.control`) are queued by the training thread and
written by a link thread, so a shadow that is slow, down or unreachable never
blocks training: connection attempts and writes have timeouts, failures are
logged and counted, and the link keeps retrying. A link that (re)connects
needs the *current* state before anything else: it reports
``needs_state`` and drops commits until the agent hands it a fresh
:class:`~checkmate.control.JobStart` (taken after an optimizer step) via
:meth:`ControlChannel.post_state`. Shadows answer with
:class:`~checkmate.control.Certified` records, which the channel tracks.
"""

from __future__ import annotations

import contextlib
import logging
import select
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from checkmate.control import (
    Certified,
    ControlProtocolError,
    Diverged,
    Goodbye,
    JobStart,
    Message,
    recv_message,
    send_message,
)
from checkmate.control_frame import ControlAuth, FrameAuthError, bind, process_auth
from hosts.transport import Addr

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControlConfig:
    connect_timeout: float = 2.0
    send_timeout: float = 10.0
    """Longest a single frame write may take before the link is dropped and retried."""
    reconnect_interval: float = 1.0
    queue_limit: int = 4096
    """Messages waiting per link beyond this are dropped (counted): training never waits."""


class ShadowLink:
    """The connection to one shadow, driven by its own thread."""

    def __init__(
        self,
        name: str,
        address: Addr,
        config: ControlConfig,
        job_id: int,
        on_certified: Callable[[str, Certified], None] | None = None,
        auth: ControlAuth | None = None,
        check_identity: bool = True,
    ) -> None:
        """``check_identity``: refuse a shadow whose hello names another node than ``name`` (the
        name is in the connection's keys, so a connection redirected to another shadow of the job
        is refused at the hello); False for names the user never gave (``CHECKMATE_SHADOWS``
        entries without ``NAME=``)."""
        self.name = name
        self._identity = name if check_identity else None
        self._auth = auth if auth is not None else process_auth()
        self.job_id = job_id
        self._busy = False
        self.address = address
        self.config = config
        self.on_certified = on_certified
        self.on_diverged: Callable[[str, Diverged], None] | None = None
        self.refusal: str | None = None
        """The last reason the shadow gave for refusing the job (``goodbye`` "refused: ..."), if any."""
        """Called with a shadow's divergence report (set by :class:`ControlChannel`)."""
        self.counters: dict[str, int] = {}
        self._queue: deque[Message] = deque()
        self._cond = threading.Condition()
        self._sock: socket.socket | None = None
        self._needs_state = True
        self._stop = threading.Event()
        self._last_warning = 0.0
        self._sleeping = False
        """The link thread waits in select (under ``_cond``): a queued message must wake it."""
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(target=self._run, name=f"cm-ctl-{name}", daemon=True)
        self._thread.start()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def needs_state(self) -> bool:
        """Connected, but the shadow has not yet been sent the state to start from."""
        return self._sock is not None and self._needs_state

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def post(self, message: Message) -> None:
        """Queue a message (never blocks). Dropped while the link is down or unsynchronised."""
        with self._cond:
            if self._sock is None or self._needs_state:
                self._count("dropped_unsynced")
                return
            self._enqueue(message)

    def post_state(self, messages: Sequence[Message]) -> None:
        """Queue a JobStart (and what must follow it) for a link that needs state."""
        with self._cond:
            self._queue.clear()
            for message in messages:
                self._enqueue(message)
            self._needs_state = False

    def _enqueue(self, message: Message) -> None:
        if len(self._queue) >= self.config.queue_limit:
            self._count("dropped_queue_full")
            return
        self._queue.append(message)
        if self._sleeping:
            self._sleeping = False
            self._wake()

    def wait_connected(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._sock is not None:
                return True
            time.sleep(0.01)
        return self._sock is not None

    def flush(self, timeout: float) -> bool:
        """Wait until the queue is written (or the link is down); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._cond:
                if (not self._queue and not self._busy) or self._sock is None:
                    return True
            time.sleep(0.005)
        return False

    def close(self, timeout: float = 2.0) -> None:
        with self._cond:
            if self._sock is not None and not self._needs_state:
                self._enqueue(Goodbye(job_id=self.job_id, reason="rank 0 closing"))
        self.flush(timeout)
        self._stop.set()
        self._wake()
        self._thread.join(timeout=timeout)
        self._drop_connection(None)
        if not self._thread.is_alive():
            self._wake_r.close()
            self._wake_w.close()

    # ---- thread ---------------------------------------------------------------------
    def _warn(self, text: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_warning > 30.0:
            self._last_warning = now
            logger.warning(text, *args)
        else:
            logger.debug(text, *args)

    def _drop_connection(self, reason: str | None) -> None:
        with self._cond:
            sock, self._sock = self._sock, None
            self._needs_state = True
            self._queue.clear()
        if sock is not None:
            sock.close()
            if reason is not None:
                self._count("disconnects")
                self._warn("control link to shadow %s at %s lost: %s", self.name, self.address, reason)

    def _connect(self) -> None:
        try:
            sock = socket.create_connection(self.address, timeout=self.config.connect_timeout)
        except OSError as exc:
            self._count("connect_failures")
            self._warn("cannot reach shadow %s at %s: %s (training continues)", self.name, self.address, exc)
            self._stop.wait(self.config.reconnect_interval)
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        session = bind(sock, self._auth, self.job_id, name=self._identity)
        try:
            session.read_hello(sock)
        except FrameAuthError as exc:  # another node answered: not ours to seed
            sock.close()
            self._count("wrong_identity")
            self._warn("refusing shadow %s at %s: %s", self.name, self.address, exc)
            self._stop.wait(self.config.reconnect_interval)
            return
        except (OSError, ControlProtocolError) as exc:
            sock.close()
            self._count("connect_failures")
            self._warn("shadow %s at %s: no valid hello (%s)", self.name, self.address, exc)
            self._stop.wait(self.config.reconnect_interval)
            return
        with self._cond:
            self._sock = sock
            self._needs_state = True
        self._count("connects")
        logger.info("control link to shadow %s at %s is up", self.name, self.address)

    def _run(self) -> None:
        """Connect, then write what is queued and read what the shadow says, waking only for either.

        The thread sleeps in one ``select`` on the socket and a wake-up socket that
        :meth:`_enqueue` and :meth:`close` write to: no timed polling, so an idle link costs
        no wake-ups and a busy one one per message or reply (docs/benchmarks.md, the
        workers' account).
        """
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                if self._sock is None:
                    self._connect()
                    continue
                self._serve(self._sock, selector)
        finally:
            selector.close()

    def _serve(self, sock: socket.socket, selector: selectors.BaseSelector) -> None:
        """One connection: until it drops or the link stops."""
        selector.register(sock, selectors.EVENT_READ)
        try:
            while not self._stop.is_set() and self._sock is sock:
                with self._cond:
                    message = self._queue.popleft() if self._queue else None
                    self._busy = message is not None
                    self._sleeping = message is None
                try:
                    if message is not None:
                        send_message(sock, message, timeout=self.config.send_timeout)
                        self._count(f"sent.{message.TYPE}")
                        if isinstance(message, Goodbye):
                            self._drop_connection(None)
                            self._stop.set()
                            return
                        ready = selector.select(0)  # replies waiting (no wait)
                    else:
                        ready = selector.select(
                            None
                        )  # until a message is queued or the shadow says something
                    for key, _ in ready:
                        if key.fileobj is self._wake_r:
                            self._drain_wake()
                        else:
                            self._read_replies(sock)
                except (OSError, ControlProtocolError) as exc:
                    self._drop_connection(str(exc))
                finally:
                    self._busy = False
                    self._sleeping = False
        finally:
            with contextlib.suppress(KeyError, ValueError, OSError):
                selector.unregister(sock)

    def _wake(self) -> None:
        """Wake the link thread if it sleeps (one byte on the wake-up socket; never blocks)."""
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass

    def _read_replies(self, sock: socket.socket) -> None:
        """Every reply already here: one is read whole, then the socket is asked again without waiting."""
        while True:
            reply = recv_message(sock, timeout=self.config.send_timeout)
            if isinstance(reply, Certified):
                self._count("certified")
                if self.on_certified is not None:
                    self.on_certified(self.name, reply)
            elif isinstance(reply, Diverged):
                self._count("diverged")
                if self.on_diverged is not None:
                    self.on_diverged(self.name, reply)
            elif isinstance(reply, Goodbye):
                if reply.reason.startswith("refused:"):  # the shadow cannot serve this job: loud, every time
                    self._count("refused")
                    self.refusal = reply.reason
                    logger.error("checkmate: shadow %s %s", self.name, reply.reason)
                raise ConnectionError(f"shadow said goodbye: {reply.reason}")
            else:
                self._count("unexpected_reply")
            if not _readable(sock):
                return


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has bytes (or EOF) to read now, without waiting (``poll``: no descriptor limit)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class ControlChannel:
    """Links from rank 0 to every shadow of a job."""

    def __init__(
        self,
        job_id: int,
        shadows: Mapping[str, Addr],
        config: ControlConfig | None = None,
        secret: bytes | None = None,
        unnamed: Collection[str] = (),
    ) -> None:
        """``secret``: the job's (None: this process's, :func:`checkmate.auth.secret_from_env`).

        Every link refuses a shadow whose hello names another node, except the links of
        ``unnamed`` (names this process made up because the user gave none)."""
        self.config = config or ControlConfig()
        self._auth = ControlAuth(secret) if secret is not None else process_auth()
        self.job_id = job_id
        self.certified: dict[str, int] = {}
        self.divergences: list[dict[str, object]] = []
        """Every divergence a shadow reported, oldest first (see :class:`~checkmate.control.Diverged`)."""
        self._lock = threading.Condition()
        self._unnamed = frozenset(unnamed)
        self._leaving: list[threading.Thread] = []
        """Links to shadows that moved, saying goodbye in the background (joined by :meth:`close`)."""
        self.links = [
            ShadowLink(n, a, self.config, job_id, self._on_certified, self._auth, n not in self._unnamed)
            for n, a in shadows.items()
        ]

        for link in self.links:
            link.on_diverged = self._on_diverged

    def _on_diverged(self, name: str, message: Diverged) -> None:
        """A shadow's state differs from rank 0's: withdraw its certificates after the last verified one."""
        logger.error(
            "checkmate: shadow %s DIVERGED from the workers: after iteration %d its state differs "
            "from rank 0's fingerprint (%s); its certification after iteration %d is withdrawn and it "
            "is being re-seeded. Something between the all-reduce and optimizer.step() changed the "
            "gradients in a way the shadows do not reproduce (docs/shadow.md, 'What the shadows reproduce').",
            name,
            message.iteration,
            ", ".join(message.mismatches[:5]) + (" ..." if len(message.mismatches) > 5 else ""),
            message.last_verified,
        )
        with self._lock:
            self.divergences.append(
                {
                    "shadow": name,
                    "iteration": message.iteration,
                    "last_verified": message.last_verified,
                    "mismatches": list(message.mismatches),
                }
            )
            if name in self.certified:
                self.certified[name] = min(self.certified[name], message.last_verified)
            self._lock.notify_all()

    def _on_certified(self, name: str, message: Certified) -> None:
        with self._lock:
            self.certified[name] = max(self.certified.get(name, -1), message.iteration)
            self._lock.notify_all()

    def _certified_locked(self) -> int | None:
        """The last iteration every current link's shadow has certified (a shadow that left,
        whose late replies may still arrive, does not count), or None."""
        values = [self.certified.get(link.name) for link in self.links]
        if not values or any(v is None for v in values):
            return None
        return min(v for v in values if v is not None)

    def certified_through(self) -> int | None:
        """The last iteration every shadow has certified, or None."""
        with self._lock:
            return self._certified_locked()

    def wait_certified(self, iteration: int, timeout: float) -> bool:
        """Wait (at most ``timeout``) until every shadow has certified ``iteration``."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while (through := self._certified_locked()) is None or through < iteration:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
            return True

    def wait_connected(self, timeout: float, names: Collection[str] | None = None) -> int:
        """Wait (at most ``timeout`` in all) for the links (those of ``names``) to connect; how many did."""
        deadline = time.monotonic() + timeout
        links = [link for link in self.links if names is None or link.name in names]
        return sum(link.wait_connected(max(0.0, deadline - time.monotonic())) for link in links)

    def needs_state(self) -> bool:
        return any(link.needs_state for link in self.links)

    def all_ready(self) -> bool:
        """Every link connected and none waiting for state (no shadow is new, restarted or away)."""
        return all(link.connected and not link.needs_state for link in self.links)

    def unreachable(self) -> list[str]:
        """The names of the links not connected now."""
        return [link.name for link in self.links if not link.connected]

    def post(self, message: Message) -> None:
        for link in self.links:
            link.post(message)

    def post_state(self, make: Callable[[], Sequence[Message]]) -> int:
        """Hand the state from ``make()`` (a JobStart first) to each link that needs it."""
        waiting = [link for link in self.links if link.needs_state]
        if not waiting:
            return 0
        messages = make()
        assert messages and isinstance(messages[0], JobStart)
        for link in waiting:
            link.post_state(messages)
        return len(waiting)

    def set_shadows(self, shadows: Mapping[str, Addr], timeout: float = 2.0) -> tuple[list[str], list[str]]:
        """Follow a new set of shadows (a shard moved): ``(added, removed)`` names.

        Links to shadows no longer named, or at another address, say goodbye and close in the
        background; links to new shadows open and, like any new link, wait for the state
        (:meth:`post_state`). Links that stay are untouched.
        """
        keep = [link for link in self.links if shadows.get(link.name) == link.address]
        leaving = [link for link in self.links if link not in keep]
        kept = {link.name for link in keep}
        new = [
            ShadowLink(
                name,
                address,
                self.config,
                self.job_id,
                self._on_certified,
                self._auth,
                name not in self._unnamed,
            )
            for name, address in shadows.items()
            if name not in kept
        ]
        for link in new:
            link.on_diverged = self._on_diverged
        with self._lock:
            self.links = keep + new
            for link in leaving:
                self.certified.pop(link.name, None)
        for link in leaving:
            closer = threading.Thread(
                target=link.close, args=(timeout,), name=f"cm-ctl-close-{link.name}", daemon=True
            )
            closer.start()
            self._leaving.append(closer)
        return [link.name for link in new], [link.name for link in leaving]

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(link.flush(max(0.0, deadline - time.monotonic())) for link in self.links)

    def stats(self) -> dict[str, dict[str, int]]:
        return {link.name: dict(link.counters, connected=int(link.connected)) for link in self.links}

    def close(self, timeout: float = 2.0) -> None:
        for link in self.links:
            link.close(timeout)
        # a moved shadow's goodbye is said before the process may exit (the closers are daemons)
        deadline = time.monotonic() + timeout
        for closer in self._leaving:
            closer.join(max(0.0, deadline - time.monotonic()))
        self._leaving = [closer for closer in self._leaving if closer.is_alive()]
