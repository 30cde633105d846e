"""The control channel's framing, without torch: what a frame looks like on the TCP stream.

Protocol version 2 (docs/protocol.md, "Control channel"; docs/security.md): every
frame is authenticated with the job's control key (:mod:`checkmate.auth`)::

    magic "CMC2" | json_len: u32 | blob_len: u64            (16 bytes, big-endian)
    job: u32 | run: 16 bytes | seq: u64                     (28 bytes: the replay guard)
    head_tag: 16 bytes   HMAC-SHA256(key, the 44 bytes above), truncated
    JSON (UTF-8) | blob
    tag: 32 bytes        HMAC-SHA256(key, head | head_tag | JSON | blob)

The key depends on the direction (client -> server, server -> client: a frame
reflected back to its sender does not verify). ``run`` is chosen by the sender per
connection (8 bytes of wall-clock
milliseconds, 8 random); ``seq`` counts the sender's frames on it from 0. A
receiver checks the head tag before it allocates anything (an oversized or
garbage frame from someone without the key costs it 60 bytes), then that
``run`` is fresh (within :data:`MAX_CLOCK_SKEW_S` of its clock and never seen
before by this receiver: a recorded connection cannot be replayed) or the one
this connection already uses, that ``seq`` is the next one, and that ``job``
is the connection's job; then the frame tag. Any failure is a
:class:`FrameAuthError` and the connection is closed. The whole 60-byte head
must arrive within one timeout (a client dripping bytes is cut off).

Which key a socket uses: :func:`bind` gives it a :class:`ControlAuth`'s session
(shadows and rank 0's links do, with their configured secret); an unbound socket
gets a session of the process's secret (:func:`checkmate.auth.secret_from_env`)
on first use. :mod:`checkmate.control` builds its messages on this; tools that
only exchange JSON with a shadow (``checkmate-ctl job show``) use it directly
and so do not import torch.
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

from checkmate.auth import derive_key, secret_from_env

MAGIC: Final = b"CMC2"
PROTOCOL_VERSION: Final = 2
"""Version 1 (magic ``CMC1``) had no authentication; a version-1 frame is refused by name."""
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
        if magic == b"CMC1":
            raise ControlProtocolError(
                "control protocol version 1 frame (unauthenticated): the peer runs an older Checkmate; "
                f"this build speaks version {PROTOCOL_VERSION}"
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
        """Key of the frames a client (False) or a server (True) sends."""
        self.max_skew = max_skew
        self._seen: dict[bytes, float] = {}
        self._lock = threading.Lock()

    def session(self, job_id: int | None = None, server: bool = False) -> ControlSession:
        return ControlSession(self, job_id, server)

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

    def head_tag(self, head: Buffer, server: bool) -> bytes:
        return hmac.digest(self.keys[server], head, "sha256")[:HEAD_TAG_BYTES]


class ControlSession:
    """One connection's state: this side's run and next sequence, the peer's run and expected sequence."""

    def __init__(self, auth: ControlAuth, job_id: int | None = None, server: bool = False) -> None:
        self.auth = auth
        self.job_id = job_id
        self.server = server
        """This end accepted the connection (it sends with the server key, reads with the client's)."""
        self._run = auth.new_run()
        self._send_seq = 0
        self._peer_run: bytes | None = None
        self._recv_seq = 0
        self._send_lock = threading.Lock()

    def send(self, sock: socket.socket, parts: Sequence[Buffer], job_id: int, timeout: float) -> None:
        """Write one frame of ``parts`` (JSON first, then blobs)."""
        text, blobs = parts[0], parts[1:]
        blob_len = sum(len(b) for b in blobs)
        with self._send_lock:
            guard = GUARD.pack(job_id & 0xFFFFFFFF, self._run, self._send_seq)
            self._send_seq += 1
            head = frame_prefix(len(text), blob_len) + guard
            head += self.auth.head_tag(head, self.server)
            key = self.auth.keys[self.server]
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
        if not hmac.compare_digest(self.auth.head_tag(body, not self.server), bytes(tag)):
            if bytes(head[:4]) != MAGIC:
                parse_prefix(head)  # names a version-1 or garbage frame
            raise FrameAuthError("frame not authenticated with this job's key (wrong or no secret)")
        json_len, blob_len = parse_prefix(head)
        job, run, seq = GUARD.unpack_from(bytes(head), PREFIX.size)
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

    def check_body(self, head: Buffer, parts: Sequence[Buffer], tag: Buffer) -> None:
        key = self.auth.keys[not self.server]
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
        self, sock: socket.socket, timeout: float, max_bytes: int | None = None
    ) -> tuple[bytearray, bytearray]:
        """Read one frame: ``(JSON bytes, blob)``. The head must arrive within ``timeout`` in all;
        ``max_bytes``: refuse a frame announcing more (ControlProtocolError)."""
        sock.settimeout(timeout)
        head = _recv_head(sock, time.monotonic() + timeout, timeout)
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
    sock: socket.socket, auth: ControlAuth | None = None, job_id: int | None = None, server: bool = False
) -> ControlSession:
    """Give ``sock`` a fresh session of ``auth`` (None: :func:`process_auth`) before its first frame;
    ``server``: ``sock`` came from ``accept()``."""
    session = (auth if auth is not None else process_auth()).session(job_id, server)
    with _sessions_lock:
        _sessions[sock] = session
    return session


def process_auth() -> ControlAuth:
    """The :class:`ControlAuth` of this process's job secret (AuthConfigError if it has none)."""
    secret = secret_from_env()
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
    """Read and authenticate one frame on ``sock``: ``(JSON bytes, blob)``."""
    return session_for(sock).recv(sock, timeout)
