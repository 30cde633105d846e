"""Per-job authentication: the job secret, the keys derived from it, and the datagram MAC.

Every job has a secret (32 random bytes, hex in files and the environment) that
``checkmate-ctl job add`` creates or takes and keeps in the registry (mode 0600).
Workers and shadows find it, in this order, in ``CHECKMATE_JOB_SECRET`` (hex),
``CHECKMATE_JOB_SECRET_FILE`` (a file holding the hex) or the ``"secret"`` of the
job file named by ``CHECKMATE_JOB_FILE``; never on a command line. In a TP x DP job, where
every lane has its own secret, ``{tp_index}`` in either path becomes this rank's TP index
(``RANK % CHECKMATE_TP_DEGREE``), as in ``hosts.CheckmateConfig.from_env``. A file holding
the secret must be private to its owner (mode 0600 or stricter, as ssh requires of
private keys). A missing,
short or malformed secret, or two sources that disagree, is an
:class:`AuthConfigError` naming the file or variable: nothing falls back to
running unauthenticated. Only the entry points read it (:func:`secret_from_env`); every
component below them takes it as a value from its caller (docs/configuration.md).

Keys are derived per purpose (HMAC-SHA256 of the secret and a label), so a
control-channel MAC can never be replayed as a datagram MAC:

* control frames: :mod:`checkmate.control_frame` (key ``control``);
* transport control datagrams (ACK, NACK, REPAIR_REQUEST, REPAIR_DATA):
  :class:`DatagramAuth` here (key ``transport/<job id>``), a 16-byte tag after the
  payload over the whole datagram. Gradient DATA datagrams carry no tag
  (docs/security.md says why and what protects them instead);
* the fully reduced gradient: :class:`GradientDigests` (key ``gradient/<job id>``), one
  GMAC tag per bucket and iteration in rank 0's authenticated commit, which a shadow
  checks before it applies the copies it assembled.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import stat
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

logger = logging.getLogger(__name__)

SECRET_ENV: Final = "CHECKMATE_JOB_SECRET"
SECRET_FILE_ENV: Final = "CHECKMATE_JOB_SECRET_FILE"
JOB_FILE_ENV: Final = "CHECKMATE_JOB_FILE"
SECRET_BYTES: Final = 32
"""Bytes of a secret ``checkmate-ctl job add`` creates."""
MIN_SECRET_BYTES: Final = 16
"""Shortest secret accepted (128 bits)."""
DATAGRAM_TAG_BYTES: Final = 16
AUTHENTICATED_TYPES: Final = frozenset({2, 3, 4, 5})
"""Wire message types that carry a tag: ACK, NACK, REPAIR_REQUEST, REPAIR_DATA (checkmate.wire)."""
_HEADER_BYTES: Final = 32

Buffer = bytes | bytearray | memoryview


class AuthConfigError(ValueError):
    """No usable job secret: the message names the file or variable and what is wrong."""


def generate_secret() -> str:
    """A fresh job secret as hex (what the registry and job files hold)."""
    return secrets.token_hex(SECRET_BYTES)


def parse_secret(text: object, source: str) -> bytes:
    """The secret's bytes from its hex text; AuthConfigError naming ``source`` if it will not do."""
    if not isinstance(text, str):
        raise AuthConfigError(f"{source}: the job secret must be a hex string, got {type(text).__name__}")
    text = text.strip()
    if not text:
        raise AuthConfigError(f"{source}: the job secret is empty")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise AuthConfigError(f"{source}: the job secret is not hexadecimal") from None
    if len(raw) < MIN_SECRET_BYTES:
        raise AuthConfigError(
            f"{source}: the job secret is {len(raw)} bytes; at least {MIN_SECRET_BYTES} are needed "
            "(checkmate-ctl job add creates one)"
        )
    return raw


def check_private(path: str | Path, what: str) -> None:
    """Refuse (AuthConfigError) a file holding a secret that its group or others may access, as ssh
    refuses such a private key: the mode must allow nothing beyond the owner (0600 or 0400)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise AuthConfigError(f"cannot read the {what} {path}: {exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthConfigError(
            f"the {what} {path} is accessible by its group or others (mode {stat.S_IMODE(mode):04o}): "
            "it holds the job secret; chmod 600 it"
        )


def read_secret_file(path: str | Path) -> bytes:
    """A secret file (hex, one line; mode 0600 or stricter)."""
    check_private(path, "job secret file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthConfigError(f"cannot read the job secret file {path}: {exc}") from None
    return parse_secret(text, f"job secret file {path}")


def secret_from_job_file(path: str | Path) -> bytes:
    """The ``"secret"`` of a job file; AuthConfigError naming the file if it has none or a bad one."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AuthConfigError(f"cannot read the job file {path}: {exc}") from None
    if not isinstance(document, dict) or "secret" not in document:
        raise AuthConfigError(
            f'job file {path} has no "secret": write it with the job\'s secret from the registry '
            "(checkmate-ctl job secret N) or set CHECKMATE_JOB_SECRET"
        )
    check_private(path, "job file")  # it holds the secret
    return parse_secret(document["secret"], f"job file {path}")


def secret_from_env(environ: Mapping[str, str] | None = None) -> bytes:
    """The job secret this process was given (module docstring); AuthConfigError if none or two differ."""
    env = os.environ if environ is None else environ
    found: list[tuple[str, bytes]] = []
    if env.get(SECRET_ENV):
        found.append((SECRET_ENV, parse_secret(env[SECRET_ENV], f"${SECRET_ENV}")))
    if env.get(SECRET_FILE_ENV):
        path = lane_path(env[SECRET_FILE_ENV], env)
        found.append((f"{SECRET_FILE_ENV}={path}", read_secret_file(path)))
    job_file = lane_path(env[JOB_FILE_ENV], env) if env.get(JOB_FILE_ENV) else None
    if job_file and not found:
        found.append((f"job file {job_file}", secret_from_job_file(job_file)))
    elif job_file:
        try:
            in_file: bytes | None = secret_from_job_file(job_file)
        except AuthConfigError:
            in_file = None  # a job file without a secret is fine when the secret comes from elsewhere
        if in_file is not None:
            found.append((f"job file {job_file}", in_file))
    if not found:
        raise AuthConfigError(
            f'no job secret: set {JOB_FILE_ENV} to a job file with a "secret" (checkmate-ctl job add '
            f"keeps one per job), or {SECRET_ENV} / {SECRET_FILE_ENV}; Checkmate does not run "
            "unauthenticated"
        )
    first_source, first = found[0]
    for source, other in found[1:]:
        if not hmac.compare_digest(first, other):
            raise AuthConfigError(f"the job secret in {source} differs from the one in {first_source}")
    return first


def secret_or_env(secret: bytes | None, user: str) -> bytes:
    """``secret``, the value a caller passed down; for a caller that passed none, this process's.

    Checkmate's entry points (the CLIs, :func:`hosts.enable_checkmate`,
    ``CheckmateConfig.from_env``, :func:`hosts.resume`; docs/configuration.md) read the
    secret once with :func:`secret_from_env` and hand it down as a value, so inside the
    project this returns ``secret``. A script that builds a component itself without one
    (``user`` names the component) keeps working as before: it gets the secret from the
    environment, as the component used to read it. tests/test_configuration.py keeps the
    list of components that may fall back here.
    """
    if secret is not None:
        return secret
    logger.debug("%s was given no job secret: reading this process's from the environment", user)
    return secret_from_env()


def lane_path(path: str, environ: Mapping[str, str]) -> str:
    """``path`` with ``{tp_index}`` replaced by this rank's TP index (``RANK % CHECKMATE_TP_DEGREE``)."""
    if "{tp_index}" not in path:
        return path
    try:
        tp_index = int(environ.get("RANK", "0")) % int(environ.get("CHECKMATE_TP_DEGREE") or "1")
    except (ValueError, ZeroDivisionError):
        raise AuthConfigError(
            f"{path}: {{tp_index}} needs RANK and CHECKMATE_TP_DEGREE as integers (>= 1)"
        ) from None
    return path.replace("{tp_index}", str(tp_index))


def derive_key(secret: bytes, purpose: str, job_id: int | None = None) -> bytes:
    """A 32-byte key for one purpose: HMAC-SHA256(secret, "checkmate/<purpose>[/<job>]")."""
    label = f"checkmate/{purpose}" + ("" if job_id is None else f"/{job_id}")
    return hmac.digest(secret, label.encode(), "sha256")


class DatagramAuth:
    """Tags and checks one job's transport control datagrams (16-byte HMAC-SHA256 after the payload).

    The tag covers the whole datagram (header and payload), so the job, iteration,
    bucket, sender rank and sequence (the replay guard: a cumulative ACK or a
    repair answer is only accepted for a sequence or request the receiver has
    outstanding) cannot be changed without the key.
    """

    def __init__(self, secret: bytes, job_id: int) -> None:
        self.job_id = job_id
        self._key = derive_key(secret, "transport", job_id)

    def tag(self, parts: Sequence[Buffer]) -> bytes:
        message = b"".join(parts)
        return hmac.digest(self._key, message, "sha256")[:DATAGRAM_TAG_BYTES]

    def seal(self, parts: Sequence[Buffer]) -> tuple[Buffer, ...]:
        """``parts`` of a datagram with its tag appended (for ``sendmsg``)."""
        return (*parts, self.tag(parts))

    def open(self, datagram: memoryview) -> memoryview | None:
        """The datagram without its tag, or None if the tag is missing or wrong."""
        if len(datagram) < _HEADER_BYTES + DATAGRAM_TAG_BYTES:
            return None
        body = datagram[:-DATAGRAM_TAG_BYTES]
        expected = hmac.digest(self._key, body, "sha256")[:DATAGRAM_TAG_BYTES]
        if not hmac.compare_digest(expected, datagram[-DATAGRAM_TAG_BYTES:]):
            return None
        return body


def needs_tag(datagram: Buffer) -> bool:
    """Whether a datagram's type is one that must carry a tag (false for DATA and for runts)."""
    return len(datagram) >= _HEADER_BYTES and datagram[1] in AUTHENTICATED_TYPES


def datagram_job(datagram: Buffer) -> int:
    """The job id field of a packed header (bytes 4..8)."""
    return int.from_bytes(bytes(datagram[4:8]), "big")


class DatagramKeys:
    """One secret's :class:`DatagramAuth` per job id, made on first use (thread-safe)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._by_job: dict[int, DatagramAuth] = {}
        self._lock = threading.Lock()

    def for_job(self, job_id: int) -> DatagramAuth:
        auth = self._by_job.get(job_id)
        if auth is None:
            auth = DatagramAuth(self._secret, job_id)
            with self._lock:
                if len(self._by_job) < 16:  # bounded: forged datagrams name any job id
                    auth = self._by_job.setdefault(job_id, auth)
        return auth

    def open(self, datagram: memoryview) -> memoryview | None:
        """``datagram`` as is if its type carries no tag; without its tag if the tag is right; else None."""
        if not needs_tag(datagram):
            return datagram
        return self.for_job(datagram_job(datagram)).open(datagram)


class GradientDigests:
    """GMAC tags of fully reduced gradient buckets: made by rank 0, checked by the shadows.

    Each tag is AES-128-GCM's tag over the bucket's bytes as associated data (no plaintext:
    GMAC) under the agent's key HMAC-SHA256(job gradient key, run)[:16] and the nonce
    ``counter``: ``run`` (16 random bytes per agent) makes the key the agent's own and
    ``counter`` (per tag) never repeats under it, as GCM requires; both travel with the tag
    in the commit, whose frame MAC covers them. Without the job secret nobody can make a
    tag, so copies injected from outside the job (a spoofed worker address, issue 29) are
    detected before they are applied, whatever ``CHECKMATE_FINGERPRINT_EVERY`` is. GMAC
    (AES-NI and carry-less multiplication in OpenSSL) was the cheapest MAC measured here:
    0.4-0.6 ms for TinyLM's 548 kB under load, against 1.4 ms for Poly1305 and SHA-256.
    """

    def __init__(self, secret: bytes, job_id: int) -> None:
        self._key = derive_key(secret, "gradient", job_id)
        self.run = os.urandom(16)
        self._counter = 0
        self._tags: dict[int, dict[str, list[Any]]] = {}
        self._ciphers: dict[bytes, Any] = {}
        self._lock = threading.Lock()

    def _cipher(self, run: bytes) -> Any:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        with self._lock:
            cipher = self._ciphers.get(run)
            if cipher is None:
                if len(self._ciphers) >= 16:  # bounded: one per rank-0 agent seen
                    self._ciphers.clear()
                cipher = self._ciphers[run] = AESGCM(hmac.digest(self._key, run, "sha256")[:16])
        return cipher

    def _mac(self, run: bytes, counter: int, data: Buffer) -> bytes:
        tag: bytes = self._cipher(run).encrypt(counter.to_bytes(12, "big"), b"", data)
        return tag

    def record(self, iteration: int, bucket: int, data: Buffer) -> None:
        """Tag ``data`` (the bucket's reduced bytes, as the shadows will assemble them)."""
        with self._lock:
            counter = self._counter
            self._counter += 1
        tag = self._mac(self.run, counter, data)
        with self._lock:
            self._tags.setdefault(iteration, {})[str(bucket)] = [counter, tag.hex()]
            for old in [i for i in self._tags if i < iteration - 64]:  # iterations never committed
                del self._tags[old]

    def take(self, iteration: int) -> dict[str, Any] | None:
        """The commit field for ``iteration`` (None if no bucket was tagged)."""
        with self._lock:
            tags = self._tags.pop(iteration, None)
        return {"run": self.run.hex(), "buckets": tags} if tags else None

    def check(self, digests: Mapping[str, Any], bucket: int, data: Buffer) -> str | None:
        """Why ``data`` is not bucket ``bucket`` as rank 0 tagged it, or None if it is."""
        try:
            run = bytes.fromhex(digests["run"])
            entry = digests["buckets"].get(str(bucket))
            if entry is None:
                return "rank 0 sent no tag for it"
            counter, tag = int(entry[0]), bytes.fromhex(entry[1])
            if len(run) != 16 or not 0 <= counter < 1 << 96:
                raise ValueError(counter)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            return "the commit's gradient tags are malformed"
        if not hmac.compare_digest(self._mac(run, counter, data), tag):
            return "its data is not what the workers reduced (injected or altered copies)"
        return None
