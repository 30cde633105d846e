"""Control channel: message round trips, malformed frames, a down shadow never blocks, resync on connect."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from checkmate.control import (
    BucketLayout,
    BucketSpec,
    Commit,
    ControlProtocolError,
    JobStart,
    ParamSlice,
    ParamSpec,
    decode_message,
    encode_message,
    recv_message,
)
from hosts.control_channel import ControlChannel, ControlConfig
from tests.hosts.fake_shadow import FakeShadow


def _roundtrip(message: object) -> object:
    parts = encode_message(message)  # type: ignore[arg-type]
    frame = b"".join(bytes(p) for p in parts)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame)
        return recv_message(b, timeout=2.0)


def test_messages_round_trip_exactly() -> None:
    start = JobStart(
        job_id=3,
        world_size=2,
        workers=[("127.0.0.10", 48879), ("127.0.0.11", 48879)],
        parameters=[ParamSpec("w", (2, 3), "float32"), ParamSpec("b", (3,), "bfloat16")],
        optimizer={
            "kind": "Adam",
            "param_groups": [{"lr": 0.001, "betas": [0.9, 0.999], "params": ["w", "b"]}],
        },
        start_iteration=7,
        tensors={
            "param/w": torch.randn(2, 3),
            "param/b": torch.randn(3).to(torch.bfloat16),
            "state/w/step": torch.tensor(7.0),
            "state/w/exp_avg": torch.zeros(2, 3),
        },
        optimizer_scalars={"b": {"note": 1}},
    )
    got = _roundtrip(start)
    assert isinstance(got, JobStart)
    assert got.parameters == start.parameters and got.workers == start.workers
    for key, tensor in start.tensors.items():
        assert got.tensors[key].dtype == tensor.dtype and torch.equal(got.tensors[key], tensor)
    layout = BucketLayout(
        3, 1, [BucketSpec(0, "float32", 9, 1, (ParamSlice("b", 0, 3), ParamSlice("w", 3, 6)))]
    )
    assert _roundtrip(layout) == layout
    coefficient = torch.tensor(0.123456789, dtype=torch.float32).item()
    commit = Commit(3, 8, [0.1, 0.01], clip_coefficient=coefficient, skip_step=False, optimizer_step=9)
    got_commit = _roundtrip(commit)
    assert got_commit == commit
    assert isinstance(got_commit, Commit) and got_commit.clip_coefficient == coefficient


def test_malformed_frames_raise_control_protocol_error() -> None:
    with pytest.raises(ControlProtocolError):
        decode_message(b'{"type": "launch_missiles"}')
    with pytest.raises(ControlProtocolError):
        decode_message(b"not json")
    with pytest.raises(ControlProtocolError):
        decode_message(b'{"type": "commit", "job_id": 1}')
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"XXXX" + bytes(12))
        with pytest.raises(ControlProtocolError):
            recv_message(b, timeout=1.0)


def _state(start: int) -> list[object]:
    return [JobStart(1, 2, [], [], {"kind": "SGD", "param_groups": []}, start)]


def test_down_shadow_never_blocks_and_is_resynchronised_when_it_appears() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.31", 0))
    port = probe.getsockname()[1]
    probe.close()  # nobody listens there now
    channel = ControlChannel(
        1, {"s": ("127.0.0.31", port)}, ControlConfig(connect_timeout=0.2, reconnect_interval=0.1)
    )
    start = time.monotonic()
    assert channel.wait_connected(0.3) == 0
    for iteration in range(50):
        channel.post(Commit(1, iteration, [0.1]))  # dropped, never blocking
        channel.post_state(lambda it=iteration: _state(it + 1))  # type: ignore[misc]
    assert time.monotonic() - start < 1.0
    stats = channel.stats()["s"]
    assert stats["connect_failures"] >= 1 and stats["dropped_unsynced"] == 50
    shadow = FakeShadow(("127.0.0.31", port))
    try:
        assert channel.wait_connected(3.0) == 1
        assert channel.needs_state()
        channel.post(Commit(1, 50, [0.1]))  # still unsynchronised: dropped
        channel.post_state(lambda: _state(51))  # type: ignore[arg-type,return-value]
        channel.post(Commit(1, 51, [0.1]))
        assert channel.flush(3.0)
        deadline = time.monotonic() + 3
        while len(shadow.messages) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        kinds = [
            (type(m).__name__, getattr(m, "start_iteration", getattr(m, "iteration", None)))
            for m in shadow.messages
        ]
        assert kinds[:2] == [("JobStart", 51), ("Commit", 51)]
        deadline = time.monotonic() + 3
        while channel.certified_through() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert channel.certified_through() == 51
    finally:
        channel.close(1.0)
        shadow.close()
