"""The control channel's framing, without torch: what a frame looks like on the TCP stream.

Protocol version 3 (docs/protocol.md, "Control channel"; docs/security.md). The
accepting side (a shadow) speaks first, once per connection, with a *hello*::

    magic "CMH3" | nonce: 16 random bytes | id_len: u8 | identity (UTF-8, the server's name)

and from then on every frame in either direction is authenticated with a
per-connection key (:mod:`checkmate.auth`)::

    magic "CMC3" | json_len: u32 | blob_len: u64            (16 bytes, big-endian)
    job: u32 | run: 16 bytes | seq: u64                     (28 bytes: the replay guard)
    head_tag: 16 bytes   HMAC-SHA256(key, the 44 bytes above), truncated
    JSON (UTF-8) | blob
    tag: 32 bytes        HMAC-SHA256(key, head | head_tag | JSON | blob)

``key`` = HMAC-SHA256(direction key, "session" | server nonce | client run |
identity): the direction key is derived from the job secret (client -> server
and server -> client differ, so a frame reflected back to its sender does not
verify); the server's nonce makes a connection recorded at one shadow useless at
any other shadow and at the same shadow later (version 2 keyed frames with the
secret alone: a recorded connection could be replayed to another shadow of the
job); the client's run (its first frame's, 8 bytes of wall-clock milliseconds and
8 random) makes a server's answers useless on another connection; the identity
binds the key to the node the client meant to reach (a client that names it,
:func:`bind` ``name``, refuses a hello from another node). ``seq`` counts the
sender's frames on the connection from 0.

A receiver checks the head tag before it allocates anything (an oversized or
garbage frame from someone without the key costs it 60 bytes), then that
``run`` is within :data:`MAX_CLOCK_SKEW_S` of its clock and new (the first
frame) or the connection's, that ``seq`` is the next one and ``job`` the
connection's; then the frame tag. Any failure is a :class:`FrameAuthError` and
the connection is closed. The whole 60-byte head must arrive within one timeout
(a client dripping bytes is cut off).

Which key a socket uses: :func:`bind` gives it a :class:`ControlAuth`'s session
(shadows and rank 0's links do, with their configured secret; a server's
``bind`` writes the hello, a client's reads it); an unbound socket gets a client
session of :func:`process_auth` on first use, which reads the hello then. The
secret reaches :class:`ControlAuth` as a value from the entry point
(docs/configuration.md); :func:`process_auth` without one is the compatibility
default for scripts that pass none (:func:`checkmate.auth.secret_or_env`).
:mod:`checkmate.control` builds its
messages on this; tools that only exchange JSON with a shadow (``checkmate-ctl
job show``) use it directly and so do not import torch.
"""

from __future__ import annotations

import hmac
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Final

from checkmate.auth import derive_key, secret_or_env

MAGIC: Final = b"CMC3"
HELLO_MAGIC: Final = b"CMH3"
PROTOCOL_VERSION: Final = 3
"""Version 1 (magic ``CMC1``) had no authentication, version 2 (``CMC2``) no per-connection
nonce; frames of either are refused by name."""
HELLO: Final = struct.Struct("!4s16sB")
"""Hello magic, the server's nonce, the length of its identity (which follows)."""
HELLO_TIMEOUT: Final = 10.0
"""How long a client waits for the server's hello when its socket has no timeout of its own."""
PREFIX: Final = struct.Struct("!4sIQ")
"""Magic, JSON length, blob length."""
GUARD: Final = struct.Struct("!I16sQ")
"""Job, run, sequence."""
HEAD_TAG_BYTES: Final = 16
FRAME_TAG_BYTES: Final = 32
HEAD_BYTES: Final = PREFIX.size + GUARD.size + HEAD_TAG_BYTES
MAX_JSON_BYTES: Final = 64 << 20
MAX_BLOB_BYTES: Final = 1 << 40
MAX_CLOCK_SKEW_S: Final = 300.0
"""A connection's first frame must carry a run stamped within this many seconds of the receiver's clock."""
SMALL_FRAME_BYTES: Final = 256 << 10
"""Frames up to this size are written and MACed as one buffer (commits, status, certified)."""
DEFAULT_CONTROL_PORT: Final = 48880
"""TCP port a shadow listens on for its control channel, unless the job says otherwise."""

Buffer = bytes | bytearray | memoryview


class ControlProtocolError(ValueError):
    """A control-channel frame or message that does not follow docs/protocol.md."""


class FrameAuthError(ControlProtocolError):
    """A frame that is not authenticated with the job's key, or a replay."""


def frame_prefix(json_len: int, blob_len: int) -> bytes:
    """The first 16 bytes of a frame (magic and lengths; the replay guard and tags follow)."""
    return PREFIX.pack(MAGIC, json_len, blob_len)


def parse_prefix(prefix: bytes | bytearray | memoryview) -> tuple[int, int]:
    """``(json_len, blob_len)`` of a frame; ControlProtocolError for a wrong magic or a frame too large."""
    magic, json_len, blob_len = PREFIX.unpack(bytes(prefix[: PREFIX.size]))
    if magic != MAGIC:
        if magic in (b"CMC1", b"CMC2"):
            what = "unauthenticated" if magic == b"CMC1" else "no per-connection nonce"
            raise ControlProtocolError(
                f"control protocol version {magic[3] - 48} frame ({what}): the peer runs an older "
                f"Checkmate; this build speaks version {PROTOCOL_VERSION}"
            )
        raise ControlProtocolError(f"bad frame magic {magic!r}, expected {MAGIC!r}")
    if json_len > MAX_JSON_BYTES or blob_len > MAX_BLOB_BYTES:
        raise ControlProtocolError(f"frame too large: json {json_len} bytes, blob {blob_len} bytes")
    return json_len, blob_len


class ControlAuth:
    """The control keys and the runs its receivers have seen (shared by all of one endpoint's connections)."""

    def __init__(self, secret: bytes, max_skew: float = MAX_CLOCK_SKEW_S) -> None:
        self.keys = {
            False: derive_key(secret, "control/client"),
            True: derive_key(secret, "control/server"),
        }
        """Direction key of the frames a client (False) or a server (True) sends; each connection's
        keys are derived from these (:meth:`session_keys`)."""
        self.max_skew = max_skew
        self._seen: dict[bytes, float] = {}
        self._lock = threading.Lock()

    def session(
        self, job_id: int | None = None, server: bool = False, name: str | None = None
    ) -> ControlSession:
        return ControlSession(self, job_id, server, name)

    def session_keys(self, nonce: bytes, client_run: bytes, identity: bytes) -> dict[bool, bytes]:
        """One connection's keys per direction (False: the client's frames, True: the server's)."""
        label = b"session" + nonce + client_run + identity
        return {side: hmac.digest(key, label, "sha256") for side, key in self.keys.items()}

    @staticmethod
    def new_run() -> bytes:
        return int(time.time() * 1000).to_bytes(8, "big") + os.urandom(8)

    def claim_run(self, run: bytes) -> None:
        """Accept ``run`` as a new connection's, once; FrameAuthError if stale, from the future or seen."""
        now = time.time()
        stamp = int.from_bytes(run[:8], "big") / 1000.0
        if abs(now - stamp) > self.max_skew:
            raise FrameAuthError(
                f"connection run stamped {now - stamp:+.0f} s from this clock (more than "
                f"{self.max_skew:g} s): a replay, or the clocks differ"
            )
        with self._lock:
            if run in self._seen:
                raise FrameAuthError("connection run seen before: a replayed connection")
            if len(self._seen) > 4096:
                horizon = now - 2 * self.max_skew
                self._seen = {r: t for r, t in self._seen.items() if t >= horizon}
            self._seen[run] = now


class ControlSession:
    """One connection's state: the hello, the connection's keys, this side's run and next
    sequence, the peer's run and expected sequence."""

    def __init__(
        self, auth: ControlAuth, job_id: int | None = None, server: bool = False, name: str | None = None
    ) -> None:
        self.auth = auth
        self.job_id = job_id
        self.server = server
        """This end accepted the connection (it sends with the server key, reads with the client's)."""
        self.name = name
        """A server's identity (in its hello); a client's expected server identity (None: any)."""
        self._run = auth.new_run()
        self._send_seq = 0
        self._peer_run: bytes | None = None
        self._recv_seq = 0
        self._send_lock = threading.Lock()
        self._hello_lock = threading.Lock()
        self._nonce = os.urandom(16) if server else b""
        self._identity = (name or "").encode()[:255] if server else b""
        self._keys: dict[bool, bytes] | None = None
        self._hello_done = False
        self._hello_error: Exception | None = None
        self.peer_identity: str | None = None
        """The identity the server's hello named (clients)."""

    # ---- the hello ----------------------------------------------------------------------
    def hello(self) -> bytes:
        """The server's hello (what :func:`bind` writes on an accepted socket)."""
        return HELLO.pack(HELLO_MAGIC, self._nonce, len(self._identity)) + self._identity

    def send_hello(self, sock: socket.socket, timeout: float) -> None:
        """Server: write the hello (once); an error is kept and raised by the first send or recv."""
        with self._hello_lock:
            if self._hello_done or self._hello_error is not None:
                return
            try:
                sock.settimeout(timeout)
                sock.sendall(self.hello())
                self._hello_done = True
            except OSError as exc:
                self._hello_error = exc

    def read_hello(self, sock: socket.socket, timeout: float | None = None) -> None:
        """Client: read and check the server's hello (once); an error is kept and raised again."""
        with self._hello_lock:
            if self._hello_error is not None:
                raise self._hello_error
            if self._hello_done:
                return
            try:
                wait = timeout if timeout is not None else (sock.gettimeout() or HELLO_TIMEOUT)
                sock.settimeout(wait)
                try:
                    magic = bytes(_recv_exact(sock, len(HELLO_MAGIC)))
                    if magic != HELLO_MAGIC:  # checked before waiting for more
                        raise ControlProtocolError(f"bad hello magic {magic!r}, expected {HELLO_MAGIC!r}")
                    head = magic + _recv_exact(sock, HELLO.size - len(HELLO_MAGIC))
                except TimeoutError:
                    raise TimeoutError(
                        f"no hello from the server within {wait:g} s (control protocol "
                        f"{PROTOCOL_VERSION}; a Checkmate older than that says nothing first)"
                    ) from None
                _, nonce, id_len = HELLO.unpack(bytes(head))
                identity = bytes(_recv_exact(sock, id_len)) if id_len else b""
                try:
                    self.peer_identity = identity.decode()
                except UnicodeDecodeError:
                    raise ControlProtocolError("the server's identity in its hello is not UTF-8") from None
                if self.name is not None and self.peer_identity != self.name:
                    raise FrameAuthError(
                        f"the server says it is {self.peer_identity!r}, not {self.name!r}: "
                        "connected to another node"
                    )
                self._keys = self.auth.session_keys(nonce, self._run, identity)
                self._hello_done = True
                # the proof: an empty frame, so the server knows at once that this client holds
                # the key (it closes connections that do not prove it within a short time)
                self._send_frame(sock, (b"",), self.job_id or 0, wait)
            except (OSError, ControlProtocolError) as exc:
                self._hello_error = exc
                raise

    def _ready(self, sock: socket.socket, timeout: float) -> None:
        if self._hello_error is not None:
            raise self._hello_error
        if not self._hello_done:
            if self.server:
                self.send_hello(sock, timeout)
                if self._hello_error is not None:
                    raise self._hello_error
            else:
                self.read_hello(sock, timeout)

    def _key(self, sender_is_server: bool) -> bytes:
        if self._keys is None:
            raise ControlProtocolError(
                "no connection key yet: a server speaks only after the client's first frame"
            )
        return self._keys[sender_is_server]

    # ---- frames -------------------------------------------------------------------------
    def send(self, sock: socket.socket, parts: Sequence[Buffer], job_id: int, timeout: float) -> None:
        """Write one frame of ``parts`` (JSON first, then blobs)."""
        self._ready(sock, timeout)
        self._send_frame(sock, parts, job_id, timeout)

    def _send_frame(self, sock: socket.socket, parts: Sequence[Buffer], job_id: int, timeout: float) -> None:
        text, blobs = parts[0], parts[1:]
        blob_len = sum(len(b) for b in blobs)
        with self._send_lock:
            key = self._key(self.server)
            guard = GUARD.pack(job_id & 0xFFFFFFFF, self._run, self._send_seq)
            self._send_seq += 1
            head = frame_prefix(len(text), blob_len) + guard
            head += hmac.digest(key, head, "sha256")[:HEAD_TAG_BYTES]
            sock.settimeout(timeout)
            if len(text) + blob_len <= SMALL_FRAME_BYTES:  # one buffer, one MAC call, one write
                frame = head + b"".join(parts)
                sock.sendall(frame + hmac.digest(key, frame, "sha256"))
                return
            mac = hmac.new(key, head, "sha256")
            for part in parts:
                mac.update(part)
            sock.sendall(head)
            for part in parts:
                sock.sendall(part)
            sock.sendall(mac.digest())

    def open_head(self, head: Buffer) -> tuple[int, int]:
        """Check a frame's head (tag, magic, lengths, replay guard): ``(json_len, blob_len)``."""
        body, tag = head[: HEAD_BYTES - HEAD_TAG_BYTES], head[HEAD_BYTES - HEAD_TAG_BYTES :]
        if bytes(head[:4]) != MAGIC:
            parse_prefix(head)  # names a version-1/2 or garbage frame
        job, run, seq = GUARD.unpack_from(bytes(head), PREFIX.size)
        if self.server and self._keys is None:  # the client's first frame: its run completes the keys
            self._keys = self.auth.session_keys(self._nonce, run, self._identity)
        expected = hmac.digest(self._key(not self.server), body, "sha256")[:HEAD_TAG_BYTES]
        if not hmac.compare_digest(expected, bytes(tag)):
            if self.server and self._peer_run is None:
                self._keys = None  # the next try (there is none: the connection closes) starts over
            raise FrameAuthError(
                "frame not authenticated with this connection's key (wrong or no secret, or a connection "
                "recorded elsewhere or earlier and replayed)"
            )
        json_len, blob_len = parse_prefix(head)
        if self.job_id and job and job != self.job_id:  # 0: a shadow that has no job yet
            raise FrameAuthError(f"frame for job {job} on a connection of job {self.job_id}")
        if self._peer_run is None:
            self.auth.claim_run(run)
            self._peer_run = run
        elif run != self._peer_run:
            raise FrameAuthError("frame of another connection's run: spliced or replayed")
        if seq != self._recv_seq:
            raise FrameAuthError(f"frame sequence {seq}, expected {self._recv_seq}: replayed or dropped")
        self._recv_seq += 1
        return json_len, blob_len

    @property
    def authenticated(self) -> bool:
        """The peer has sent at least one frame that verified."""
        return self._recv_seq > 0

    def check_body(self, head: Buffer, parts: Sequence[Buffer], tag: Buffer) -> None:
        key = self._key(not self.server)
        if sum(len(p) for p in parts) <= SMALL_FRAME_BYTES:
            digest = hmac.digest(key, b"".join((head, *parts)), "sha256")
        else:
            mac = hmac.new(key, head, "sha256")
            for part in parts:
                mac.update(part)
            digest = mac.digest()
        if not hmac.compare_digest(digest, bytes(tag)):
            raise FrameAuthError("frame body not authenticated (altered in transit, or a forged frame)")

    def recv(
        self,
        sock: socket.socket,
        timeout: float,
        max_bytes: int | None = None,
        head_timeout: float | None = None,
    ) -> tuple[bytearray, bytearray]:
        """Read one frame: ``(JSON bytes, blob)``; empty for a client's proof (:meth:`read_hello`).

        The head must arrive within ``head_timeout`` (None: ``timeout``) in all, each later read
        within ``timeout``; ``max_bytes``: refuse a frame announcing more (ControlProtocolError).
        """
        self._ready(sock, timeout)
        first = timeout if head_timeout is None else head_timeout
        sock.settimeout(first)
        head = _recv_head(sock, time.monotonic() + first, timeout)
        if first != timeout:
            sock.settimeout(timeout)
        json_len, blob_len = self.open_head(head)
        if max_bytes is not None and json_len + blob_len > max_bytes:
            raise ControlProtocolError(f"{json_len + blob_len} bytes announced; at most {max_bytes} expected")
        if json_len + blob_len <= SMALL_FRAME_BYTES:  # one read for body and tag
            rest = _recv_exact(sock, json_len + blob_len + FRAME_TAG_BYTES)
            text, blob = rest[:json_len], rest[json_len : json_len + blob_len]
            tag = rest[json_len + blob_len :]
        else:
            text = _recv_exact(sock, json_len)
            blob = _recv_exact(sock, blob_len) if blob_len else bytearray()
            tag = _recv_exact(sock, FRAME_TAG_BYTES)
        self.check_body(head, (text, blob), tag)
        return text, blob


def _recv_head(sock: socket.socket, deadline: float, timeout: float) -> bytearray:
    """A frame's head, all of it by ``deadline``; a version-1 or garbage prefix is named as soon as
    its 16 bytes are in (without waiting for the rest)."""
    buf = bytearray(HEAD_BYTES)
    view = memoryview(buf)
    got = 0
    while got < HEAD_BYTES:
        if got:  # usually the whole head comes in one read: no extra timeout calls then
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"frame head incomplete: {got} of {HEAD_BYTES} bytes before the deadline")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], HEAD_BYTES - got)
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {HEAD_BYTES} bytes")
        if got < PREFIX.size <= got + k:
            parse_prefix(buf)
        got += k
    if k != HEAD_BYTES:
        sock.settimeout(timeout)  # each read of the body again waits up to ``timeout``
    return buf


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 22))
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


# ---- which session a socket uses ---------------------------------------------------------
_sessions: weakref.WeakKeyDictionary[socket.socket, ControlSession] = weakref.WeakKeyDictionary()
_sessions_lock = threading.Lock()
_env_auth: dict[bytes, ControlAuth] = {}


def bind(
    sock: socket.socket,
    auth: ControlAuth | None = None,
    job_id: int | None = None,
    server: bool = False,
    name: str | None = None,
    hello_timeout: float | None = None,
) -> ControlSession:
    """Give ``sock`` a fresh session of ``auth`` (None: :func:`process_auth`) before its first frame.

    ``server``: ``sock`` came from ``accept()``; the hello (with ``name``, this node's identity)
    is written now. A client reads the server's hello now (within ``hello_timeout``; None: the
    socket's timeout, or :data:`HELLO_TIMEOUT`) and, with ``name``, refuses a server that names
    itself otherwise. Never raises: a failed hello is raised by the session's first send or recv.
    """
    session = (auth if auth is not None else process_auth()).session(job_id, server, name)
    with _sessions_lock:
        _sessions[sock] = session
    if server:
        session.send_hello(sock, hello_timeout if hello_timeout is not None else HELLO_TIMEOUT)
    else:
        try:
            session.read_hello(sock, hello_timeout)
        except (OSError, ControlProtocolError):
            pass  # kept: the first send or recv raises it, where callers handle connection errors
    return session


def process_auth(secret: bytes | None = None) -> ControlAuth:
    """The :class:`ControlAuth` of ``secret``, one per secret in this process (None: this process's
    job secret, :func:`checkmate.auth.secret_or_env`; AuthConfigError if it has none)."""
    secret = secret_or_env(secret, "a control connection")
    with _sessions_lock:
        auth = _env_auth.get(secret)
        if auth is None:
            auth = _env_auth[secret] = ControlAuth(secret)
    return auth


def session_for(sock: socket.socket) -> ControlSession:
    """The session bound to ``sock``, or a new client session of :func:`process_auth`."""
    with _sessions_lock:
        session = _sessions.get(sock)
    if session is None:
        fresh = process_auth().session()
        with _sessions_lock:  # a reader and a writer thread may race to make the first session
            session = _sessions.setdefault(sock, fresh)
    return session


def send_frame(sock: socket.socket, parts: Sequence[Buffer], job_id: int, timeout: float) -> None:
    """Write one authenticated frame of ``parts`` (JSON, then blobs) on ``sock``."""
    session_for(sock).send(sock, parts, job_id, timeout)


def recv_frame(sock: socket.socket, timeout: float) -> tuple[bytearray, bytearray]:
    """Read and authenticate one frame on ``sock``: ``(JSON bytes, blob)`` (a client's empty proof
    frame is skipped)."""
    session = session_for(sock)
    while True:
        text, blob = session.recv(sock, timeout)
        if text or blob:
            return text, blob
