"""Control channel: message round trips, malformed frames, a down shadow never blocks, resync on connect."""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch

from checkmate.control import (
    MAX_DATA_POSITION_BYTES,
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
    send_message,
    validate_data_position,
)
from checkmate.control_frame import bind
from hosts.control_channel import ControlChannel, ControlConfig
from tests.hosts.fake_shadow import FakeShadow


def _roundtrip(message: object) -> object:
    a, b = socket.socketpair()
    bind(b, server=True)
    with a, b:
        send_message(a, message, timeout=2.0)  # type: ignore[arg-type]
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


def _frame_json(message: object) -> dict[str, object]:
    parts = encode_message(message)  # type: ignore[arg-type]
    return json.loads(bytes(parts[1]))


def test_commit_data_position_round_trips_and_is_absent_when_unset() -> None:
    position = {"epoch": 2, "batch": 117, "sampler": {"seed": 7, "offsets": [0, 3, 9]}, "name": "shard-ü"}
    commit = Commit(3, 8, [0.1], optimizer_step=9, data_position=position)
    assert _frame_json(commit)["data_position"] == position
    got = _roundtrip(commit)
    assert isinstance(got, Commit) and got == commit and got.data_position == position
    for scalar in (0, 117, "epoch-2/batch-117", [2, 117], 1.5, False):
        assert decode_message(bytes(encode_message(Commit(3, 8, [0.1], data_position=scalar))[1])) == Commit(
            3, 8, [0.1], data_position=scalar
        )

    plain = Commit(3, 9, [0.1], optimizer_step=10)
    assert "data_position" not in _frame_json(plain)  # what an older shadow reads, unchanged
    got = _roundtrip(plain)
    assert isinstance(got, Commit) and got.data_position is None and got == plain
    # a commit from an older agent (no field) decodes as "unchanged"
    old = b'{"type":"commit","job_id":3,"iteration":4,"learning_rates":[0.1],"optimizer_step":5}'
    decoded = decode_message(old)
    assert isinstance(decoded, Commit) and decoded.data_position is None and decoded.optimizer_step == 5


def test_data_position_validation_names_the_problem() -> None:
    source = {"epoch": 1, "order": (3, 1, 2), 5: "five"}
    copy = validate_data_position(source)
    assert copy == {"epoch": 1, "order": [3, 1, 2], "5": "five"}  # as JSON gives it back
    source["epoch"] = 99
    assert copy["epoch"] == 1  # a private copy: later changes do not travel
    biggest = "x" * (MAX_DATA_POSITION_BYTES - 2)  # plus the two quotes: exactly the limit
    assert validate_data_position(biggest) == biggest

    circular: list[object] = []
    circular.append(circular)
    bad = [
        (None, "cannot be None"),
        ({"loss": float("nan")}, "not JSON-serialisable"),
        ([float("inf")], "not JSON-serialisable"),
        ({1, 2}, "not JSON-serialisable"),
        ({"sampler": object()}, "not JSON-serialisable"),
        (torch.tensor([1]), "not JSON-serialisable"),
        (circular, "not JSON-serialisable"),
        ("x" * (MAX_DATA_POSITION_BYTES - 1), f"is {MAX_DATA_POSITION_BYTES + 1} bytes as JSON"),
        ("ü" * (MAX_DATA_POSITION_BYTES // 2), f"the limit is {MAX_DATA_POSITION_BYTES} bytes"),  # UTF-8
    ]
    for value, says in bad:
        with pytest.raises(ValueError, match=says):
            validate_data_position(value)
    # encoding a commit whose position is not JSON fails as a protocol error, not a crash
    with pytest.raises(ControlProtocolError, match="not JSON-serialisable"):
        encode_message(Commit(3, 8, [0.1], data_position={"sampler": object()}))


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
    shadow = FakeShadow(("127.0.0.31", port), name="s")
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


def _voluntary_switches(native_id: int | None) -> int:
    assert native_id is not None
    for line in open(f"/proc/self/task/{native_id}/status").read().splitlines():
        if line.startswith("voluntary_ctxt_switches"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")


def test_an_idle_link_does_not_wake_and_a_message_wakes_it_at_once() -> None:
    """The link thread sleeps until a message is queued or the shadow writes (no timed polling)."""
    probe = socket.socket()
    probe.bind(("127.0.0.32", 0))
    port = probe.getsockname()[1]
    probe.close()
    shadow = FakeShadow(("127.0.0.32", port), name="s")
    channel = ControlChannel(1, {"s": ("127.0.0.32", port)}, ControlConfig(connect_timeout=2.0))
    try:
        assert channel.wait_connected(3.0) == 1
        channel.post_state(lambda: _state(0))  # type: ignore[arg-type,return-value]
        assert channel.flush(3.0)
        link = channel.links[0]
        time.sleep(0.1)  # the JobStart's answer, if any, is read
        before = _voluntary_switches(link._thread.native_id)
        time.sleep(0.5)  # idle: the old link woke every 50 ms (10 times here)
        idle_wakeups = _voluntary_switches(link._thread.native_id) - before
        assert idle_wakeups <= 1
        channel.post(Commit(1, 0, [0.1]))
        deadline = time.monotonic() + 3
        while channel.certified_through() != 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert channel.certified_through() == 0  # sent at once, and the answer read
        assert link.counters.get("sent.commit") == 1
    finally:
        channel.close(1.0)
        shadow.close()


def test_rank0_refuses_a_shadow_that_names_another_node() -> None:
    """A connection redirected to the job's other shadow is refused at the hello (issue 29)."""
    other = FakeShadow(("127.0.0.35", 0), name="sb")
    config = ControlConfig(connect_timeout=1.0, reconnect_interval=0.1)
    channel = ControlChannel(1, {"sa": other.address}, config)
    try:
        assert channel.wait_connected(1.0) == 0
        deadline = time.monotonic() + 3
        while channel.stats()["sa"].get("wrong_identity", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert channel.stats()["sa"].get("wrong_identity", 0) >= 1
        channel.post_state(lambda: _state(0))  # type: ignore[arg-type,return-value]
        time.sleep(0.3)
        assert not other.messages, "rank 0 sent its state to a shadow that is not the one it named"
    finally:
        channel.close(1.0)
    # a name the user never gave (CHECKMATE_SHADOWS entry without NAME=) cannot be checked
    unchecked = ControlChannel(1, {"shadow0": other.address}, config, unnamed={"shadow0"})
    try:
        assert unchecked.wait_connected(3.0) == 1
    finally:
        unchecked.close(1.0)
        other.close()
