"""Job secrets and the control framing's authentication: bad secrets named, forged and replayed frames
refused."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from checkmate.auth import AuthConfigError, DatagramAuth, parse_secret, secret_from_env
from checkmate.control import Commit, StatusRequest, encode_message, recv_message, send_message
from checkmate.control_frame import ControlAuth, ControlProtocolError, ControlSession, FrameAuthError, bind
from controller.cli import main as ctl
from controller.job_secrets import JobSecretError, JobSecrets

SECRET = bytes(range(32))
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


def _pair(client: bytes = SECRET, server: bytes = SECRET) -> tuple[socket.socket, socket.socket, ControlAuth]:
    a, b = socket.socketpair()
    server_auth = ControlAuth(server)
    bind(a, ControlAuth(client), 7)
    bind(b, server_auth, 7, server=True)
    return a, b, server_auth


def test_frames_with_another_key_or_no_mac_are_refused() -> None:
    a, b, _ = _pair(client=OTHER)
    with a, b:
        send_message(a, StatusRequest(7), 1.0)
        with pytest.raises(FrameAuthError, match="wrong or no secret"):
            recv_message(b, 1.0)
    a, b, _ = _pair()
    with a, b:
        text = bytes(encode_message(StatusRequest(7))[1])
        a.sendall(b"CMC1" + len(text).to_bytes(4, "big") + bytes(8) + text)
        with pytest.raises(ControlProtocolError, match="version 1 frame"):
            recv_message(b, 1.0)


def test_replayed_reflected_and_reordered_frames_are_refused() -> None:
    class Capture:
        def __init__(self) -> None:
            self.data = bytearray()

        def settimeout(self, _: float) -> None:
            pass

        def sendall(self, chunk: bytes) -> None:
            self.data += bytes(chunk)

    server_auth = ControlAuth(SECRET)
    recorded = Capture()
    session = ControlSession(ControlAuth(SECRET), 7)
    for i in range(2):
        session.send(recorded, encode_message(Commit(7, i, [0.1]))[1:], 7, 1.0)  # type: ignore[arg-type]
    a, b = socket.socketpair()
    bind(b, server_auth, 7, server=True)
    with a, b:
        a.sendall(recorded.data)
        assert [recv_message(b, 1.0).iteration for _ in range(2)] == [0, 1]  # type: ignore[union-attr]
    a, b = socket.socketpair()  # the same bytes on a new connection: a replay
    bind(b, server_auth, 7, server=True)
    with a, b:
        a.sendall(recorded.data)
        with pytest.raises(FrameAuthError, match="seen before"):
            recv_message(b, 1.0)
    first_frame_len = len(recorded.data) // 2
    fresh = Capture()
    session = ControlSession(ControlAuth(SECRET), 7)
    for i in range(2):
        session.send(fresh, encode_message(Commit(7, i, [0.1]))[1:], 7, 1.0)  # type: ignore[arg-type]
    a, b = socket.socketpair()  # the second frame alone: out of sequence
    bind(b, server_auth, 7, server=True)
    with a, b:
        a.sendall(fresh.data[first_frame_len:])
        with pytest.raises(FrameAuthError, match="sequence 1, expected 0"):
            recv_message(b, 1.0)
    a, b = socket.socketpair()  # a server's frame sent back to a server: the other direction's key
    bind(a, server_auth, 7, server=True)
    bind(b, ControlAuth(SECRET), 7, server=True)
    with a, b:
        send_message(a, StatusRequest(7), 1.0)
        with pytest.raises(FrameAuthError):
            recv_message(b, 1.0)


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
