"""Job secrets and the control framing's authentication: bad secrets named, forged and replayed frames
refused."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from checkmate.auth import AuthConfigError, DatagramAuth, GradientDigests, parse_secret, secret_from_env
from checkmate.control import Commit, StatusRequest, encode_message, recv_message, send_message
from checkmate.control_frame import (
    FRAME_TAG_BYTES,
    HEAD_BYTES,
    ControlAuth,
    ControlProtocolError,
    ControlSession,
    FrameAuthError,
    bind,
)
from controller.cli import main as ctl
from controller.job_secrets import JobSecretError, JobSecrets

SECRET = bytes(range(32))
PROOF_BYTES = HEAD_BYTES + FRAME_TAG_BYTES
"""The client's first frame (empty: it proves the key)."""
OTHER = bytes(range(1, 33))


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "is empty"), ("zz" * 32, "not hexadecimal"), ("ab" * 8, "8 bytes; at least 16"), (7, "hex string")],
)
def test_bad_secrets_are_refused_naming_the_source(text: object, message: str) -> None:
    with pytest.raises(AuthConfigError, match=f"^job file /x/job.json: .*{message}"):
        parse_secret(text, "job file /x/job.json")


def test_secret_sources_and_their_errors(tmp_path: Path) -> None:
    with pytest.raises(AuthConfigError, match="no job secret: set CHECKMATE_JOB_FILE"):
        secret_from_env({})
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps({"job": {}, "secret": SECRET.hex()}))
    for mode in (0o644, 0o640, 0o604, 0o660):  # readable or writable by others: refused, as ssh does
        os.chmod(job_file, mode)
        with pytest.raises(
            AuthConfigError, match=rf"job file {job_file} is accessible by .* \(mode 0{mode:o}\)"
        ):
            secret_from_env({"CHECKMATE_JOB_FILE": str(job_file)})
    os.chmod(job_file, 0o600)
    assert secret_from_env({"CHECKMATE_JOB_FILE": str(job_file)}) == SECRET
    assert (
        secret_from_env({"CHECKMATE_JOB_SECRET": SECRET.hex(), "CHECKMATE_JOB_FILE": str(job_file)}) == SECRET
    )
    with pytest.raises(
        AuthConfigError,
        match=f"the job secret in job file {job_file} differs from the one in CHECKMATE_JOB_SECRET",
    ):
        secret_from_env({"CHECKMATE_JOB_SECRET": OTHER.hex(), "CHECKMATE_JOB_FILE": str(job_file)})
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"job": {}}))
    with pytest.raises(AuthConfigError, match=f'job file {bare} has no "secret"'):
        secret_from_env({"CHECKMATE_JOB_FILE": str(bare)})
    secret_file = tmp_path / "s"
    secret_file.write_text(OTHER.hex() + "\n")
    with pytest.raises(AuthConfigError, match=f"job secret file {secret_file} is accessible"):
        secret_from_env({"CHECKMATE_JOB_SECRET_FILE": str(secret_file)})
    os.chmod(secret_file, 0o400)
    assert secret_from_env({"CHECKMATE_JOB_SECRET_FILE": str(secret_file)}) == OTHER


def test_registry_keeps_secrets_private_and_checks_job_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secrets = JobSecrets(tmp_path)
    path = secrets.create(4)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    secret = secrets.read(4)
    assert len(secret) == 32
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"job": {}, "secret": secret.hex()}))
    bad.write_text(json.dumps({"job": {}, "secret": OTHER.hex()}))
    os.chmod(good, 0o600)
    os.chmod(bad, 0o600)
    secrets.check_job_file(4, good)
    with pytest.raises(JobSecretError, match=f"job file {bad}: its secret differs from job 4's"):
        secrets.check_job_file(4, bad)
    assert ctl(["--state-dir", str(tmp_path), "job", "secret", "4", "--check", str(good)]) == 0
    assert ctl(["--state-dir", str(tmp_path), "job", "secret", "4", "--check", str(bad)]) == 1
    assert f"job file {bad}: its secret differs" in capsys.readouterr().err
    os.chmod(path, 0o644)
    with pytest.raises(JobSecretError, match="readable by others"):
        secrets.read(4)
    with pytest.raises(JobSecretError, match="job 5 has no secret in the registry"):
        secrets.read(5)


def _pair(
    client: bytes = SECRET, server: bytes = SECRET, name: str = "s0", expect: str | None = None
) -> tuple[socket.socket, socket.socket, ControlSession]:
    """A connected pair: ``a`` the client (bound after the server wrote its hello), ``b`` the server."""
    a, b = socket.socketpair()
    server_session = bind(b, ControlAuth(server), 7, server=True, name=name)
    bind(a, ControlAuth(client), 7, name=expect)
    return a, b, server_session


def _raw(sock: socket.socket) -> bytes:
    """Whatever is waiting on ``sock`` (what a tap on the wire would have recorded)."""
    sock.settimeout(0.5)
    data = bytearray()
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except TimeoutError:
        pass
    return bytes(data)


def test_frames_with_another_key_or_no_mac_are_refused() -> None:
    a, b, _ = _pair(client=OTHER)
    with a, b:
        send_message(a, StatusRequest(7), 1.0)
        with pytest.raises(FrameAuthError, match="wrong or no secret"):
            recv_message(b, 1.0)
    for version in (b"CMC1", b"CMC2"):
        a, b, _ = _pair()
        with a, b:
            text = bytes(encode_message(StatusRequest(7))[1])
            a.sendall(version + len(text).to_bytes(4, "big") + bytes(8) + text + bytes(60))
            with pytest.raises(ControlProtocolError, match=f"version {version[3] - 48} frame"):
                recv_message(b, 1.0)


def test_a_client_reads_the_hello_and_checks_the_server_it_meant() -> None:
    a, b, _ = _pair(expect="s0")
    with a, b:
        send_message(a, StatusRequest(7), 1.0)
        assert isinstance(recv_message(b, 1.0), StatusRequest)
    a, b, _ = _pair(name="s1", expect="s0")
    with a, b, pytest.raises(FrameAuthError, match="says it is 's1', not 's0'"):
        send_message(a, StatusRequest(7), 1.0)
    a, b = socket.socketpair()  # a server of protocol 2 says nothing first
    with a, b, pytest.raises(TimeoutError, match="no hello from the server within 0.2 s"):
        bind(a, ControlAuth(SECRET), 7, hello_timeout=0.2)
        send_message(a, StatusRequest(7), 1.0)


def test_replayed_reflected_and_reordered_frames_are_refused() -> None:
    a, b, server = _pair()
    with a, b:
        for i in range(2):
            send_message(a, Commit(7, i, [0.1]), 1.0)
        recorded = _raw(b)  # the client's two frames, as a tap saw them
        tap_a, tap_b = socket.socketpair()
        with tap_a, tap_b:
            tap_a.sendall(recorded)
            for _ in range(3):  # the proof and two commits: genuine on the connection they were made for
                server.recv(tap_b, 1.0)
    # the same bytes on a new connection, to the same node or another one: its nonce differs
    for name in ("s0", "s1"):
        c, d = socket.socketpair()
        bind(d, ControlAuth(SECRET), 7, server=True, name=name)
        with c, d:
            _raw(c)  # the hello
            c.sendall(recorded)
            with pytest.raises(FrameAuthError, match="recorded elsewhere or earlier and replayed"):
                recv_message(d, 1.0)
    a, b, server = _pair()  # the second frame alone: out of sequence
    with a, b:
        for i in range(2):
            send_message(a, Commit(7, i, [0.1]), 1.0)
        raw = _raw(b)
        proof, frames = raw[:PROOF_BYTES], raw[PROOF_BYTES:]
        tap_a, tap_b = socket.socketpair()
        with tap_a, tap_b:
            tap_a.sendall(proof + frames[len(frames) // 2 :])
            server.recv(tap_b, 1.0)  # the proof: the connection's frame 0
            with pytest.raises(FrameAuthError, match="sequence 2, expected 1"):
                server.recv(tap_b, 1.0)
    a, b, server = _pair()  # the server's own answer sent back to it: the other direction's key
    with a, b:
        send_message(a, StatusRequest(7), 1.0)
        recv_message(b, 1.0)
        send_message(b, StatusRequest(7), 1.0)
        reflected = _raw(a)
        tap_a, tap_b = socket.socketpair()
        with tap_a, tap_b:
            tap_a.sendall(reflected)
            with pytest.raises(FrameAuthError):
                server.recv(tap_b, 1.0)


def test_datagram_tags_cover_every_byte() -> None:
    auth = DatagramAuth(SECRET, 3)
    datagram = bytes(range(48))
    sealed = bytearray(datagram + auth.tag([datagram]))
    assert bytes(auth.open(memoryview(sealed)) or b"") == datagram
    for i in range(len(sealed)):
        flipped = bytearray(sealed)
        flipped[i] ^= 1
        assert auth.open(memoryview(flipped)) is None, i
    assert DatagramAuth(SECRET, 4).open(memoryview(sealed)) is None  # another job's key


def test_gradient_tags_cover_every_byte_and_only_the_job_makes_them() -> None:
    rank0, shadow = GradientDigests(SECRET, 3), GradientDigests(SECRET, 3)
    data = bytes(range(256)) * 5
    rank0.record(7, 0, data)
    rank0.record(7, 1, data[:100])
    digests = rank0.take(7)
    assert digests is not None and rank0.take(7) is None
    assert shadow.check(digests, 0, data) is None and shadow.check(digests, 1, data[:100]) is None
    for i in (0, 500, len(data) - 1):
        flipped = bytearray(data)
        flipped[i] ^= 1
        assert shadow.check(digests, 0, flipped) == (
            "its data is not what the workers reduced (injected or altered copies)"
        )
    assert shadow.check(digests, 1, data) is not None  # another bucket's tag
    assert shadow.check(digests, 2, data) == "rank 0 sent no tag for it"
    assert GradientDigests(OTHER, 3).check(digests, 0, data) is not None  # another job's key
    assert GradientDigests(SECRET, 4).check(digests, 0, data) is not None
    assert shadow.check({"run": "zz"}, 0, data) == "the commit's gradient tags are malformed"
    rank0.record(8, 0, data)  # the same bytes again: another counter, another tag
    again = rank0.take(8)
    assert again is not None and again["buckets"]["0"] != digests["buckets"]["0"]
