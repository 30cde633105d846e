"""Never silently unprotected: rank 0's judgement, backpressure, and the verdict every rank raises.

A fake control channel stands in for the shadows (certificates, refusals); a dict stands
in for the process group's store. Timeouts are tiny, and what is asserted is behaviour
(which iteration raises, what the error says, how many lines are logged), not time.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from hosts.ddp_config import CheckmateConfig, CheckmateConfigError
from hosts.protection import (
    CHECK_EVERY,
    ProtectionPolicy,
    ProtectionWatch,
    UnprotectedError,
    VerdictBoard,
)


@dataclass
class FakeLink:
    name: str
    refusal: str | None = None
    connected: bool = True


@dataclass
class FakeChannel:
    """What ProtectionWatch reads of a ControlChannel: links, certificates, wait_certified."""

    links: list[FakeLink]
    certified: dict[str, int] = field(default_factory=dict)
    on_wait: Any = None
    """Called at each wait_certified (a shadow catching up meanwhile)."""

    def certified_through(self) -> int | None:
        values = [self.certified.get(link.name) for link in self.links]
        return None if any(v is None for v in values) else min(v for v in values if v is not None)

    def wait_certified(self, iteration: int, timeout: float) -> bool:
        if self.on_wait is not None:
            self.on_wait(iteration)
        through = self.certified_through()
        if through is not None and through >= iteration:
            return True
        threading.Event().wait(timeout)
        return False


class FakeStore:
    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key].encode()

    def add(self, key: str, amount: int) -> int:
        self.values[key] = str(int(self.values.get(key, "0")) + amount)
        return int(self.values[key])


def _watches(policy: ProtectionPolicy, world: int = 2) -> tuple[list[ProtectionWatch], FakeStore]:
    store = FakeStore()
    return [
        ProtectionWatch(policy, r, 0, VerdictBoard(store, 7), world_size=world) for r in range(world)
    ], store


def _raises_at(watch: ProtectionWatch, iterations: range) -> int | None:
    for i in iterations:
        try:
            watch.before_forward(i)
        except UnprotectedError:
            return i
    return None


def test_a_refusing_shadow_makes_every_rank_raise_at_the_same_iteration_with_its_reason() -> None:
    (rank0, rank1), _ = _watches(ProtectionPolicy(max_lag=2, certify_timeout=60))
    channel = FakeChannel([FakeLink("s0"), FakeLink("s1", refusal="refused: cannot import module 'mine'")])
    channel.certified["s0"] = 0
    for committed in range(0, 2):  # forward passes 1 and 2: the refusal is found at 1
        rank0.after_commit(channel, committed)  # type: ignore[arg-type]
    assert rank0.reason is not None and "shadow s1 refused: cannot import module 'mine'" in rank0.reason
    assert not rank0.status()["protected"]
    # published at iteration 1's forward pass: every rank raises at the first check after it
    first = next(i for i in range(2, 20) if i % CHECK_EVERY == 0)
    assert _raises_at(rank1, range(0, 20)) == first  # rank 1 reads it (and says so) ...
    assert _raises_at(rank0, range(0, 20)) == first  # ... before rank 0, which may host the store, raises
    # several forward passes in one iteration (no_sync micro-batches) look the verdict up once
    later = first + CHECK_EVERY
    with pytest.raises(UnprotectedError, match="cannot import module 'mine'"):
        rank1.before_forward(later)
    rank1.before_forward(later)


def test_no_certificate_within_the_timeout_is_unprotected_and_a_verdict_never_applies_early() -> None:
    (rank0, rank1), store = _watches(ProtectionPolicy(max_lag=2, on_lag="continue", certify_timeout=0.01))
    channel = FakeChannel([FakeLink("s0", connected=False)])
    threading.Event().wait(0.02)
    rank0.after_commit(channel, CHECK_EVERY - 1)  # type: ignore[arg-type]
    assert rank0.reason is not None and "no shadow certified an iteration within" in rank0.reason
    assert "s0: unreachable" in rank0.reason
    # found at iteration CHECK_EVERY's forward pass: the check at CHECK_EVERY does not raise yet
    # (another rank might not see it there), the next one does, on every rank
    assert _raises_at(rank1, range(0, 3 * CHECK_EVERY)) == 2 * CHECK_EVERY
    assert _raises_at(rank0, range(0, 3 * CHECK_EVERY)) == 2 * CHECK_EVERY
    assert json.loads(store.values["checkmate/unprotected/7"])["iteration"] == CHECK_EVERY
    assert store.values["checkmate/unprotected/7/read"] == "1"  # rank 1 read it


def test_backpressure_waits_until_the_shadows_are_within_max_lag() -> None:
    (rank0,), _ = _watches(ProtectionPolicy(max_lag=2, certify_timeout=60), world=1)
    channel = FakeChannel([FakeLink("s0"), FakeLink("s1")])
    waited_for: list[int] = []

    def catch_up(target: int) -> None:  # the slow shadow certifies one more iteration per look
        waited_for.append(target)
        channel.certified["s1"] = channel.certified.get("s1", -1) + 1

    channel.certified["s0"] = 10
    channel.on_wait = catch_up
    rank0.after_commit(channel, 10)  # type: ignore[arg-type]
    assert waited_for and set(waited_for) == {8}
    assert channel.certified_through() == 8
    assert rank0.lag == 2 and rank0.reason is None and rank0.status()["protected"]
    assert rank0.status()["backpressure_waits"] == 1


def test_certification_that_stops_breaks_the_wait_and_is_unprotected() -> None:
    (rank0,), _ = _watches(ProtectionPolicy(max_lag=1, certify_timeout=0.05), world=1)
    channel = FakeChannel([FakeLink("s0")], certified={"s0": 3})
    rank0.after_commit(channel, 4)  # within max_lag: no wait
    assert rank0.reason is None and rank0.status()["backpressure_waits"] == 0
    rank0.after_commit(channel, 6)  # s0 stays at 3: waits, then certification stopped
    assert rank0.reason is not None and rank0.reason.startswith("certification stopped")
    assert "certified through iteration 3, committed 6" in rank0.reason


def test_the_log_policy_logs_one_error_line_per_episode_and_never_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    (rank0, rank1), store = _watches(
        ProtectionPolicy(max_lag=1, on_lag="continue", unprotected="log", certify_timeout=60)
    )
    channel = FakeChannel([FakeLink("s0")], certified={"s0": 0})
    with caplog.at_level(logging.WARNING, logger="hosts.protection"):
        for committed in range(1, 6):  # s0 stays at 0: lag 2..5 > max_lag, one episode
            rank0.after_commit(channel, committed)  # type: ignore[arg-type]
        channel.certified["s0"] = 5
        rank0.after_commit(channel, 5)  # caught up: the episode ends
        channel.certified["s0"] = 5
        rank0.after_commit(channel, 8)  # behind again: a second episode
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage().split(":")[1].strip() for r in errors] == ["UNPROTECTED", "UNPROTECTED"]
    assert rank0.status()["unprotected_episodes"] == 2
    assert not store.values
    assert _raises_at(rank0, range(0, 20)) is None and _raises_at(rank1, range(0, 20)) is None


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"max_lag": -1}, "max_lag -1 is out of range"),
        ({"max_lag": 100_000}, "max_lag 100000 is out of range"),
        ({"max_lag": 1.5}, "max_lag must be an integer"),
        ({"on_lag": "sometimes"}, "on_lag 'sometimes'"),
        ({"unprotected": "ignore"}, "unprotected 'ignore'"),
        ({"certify_timeout": 0}, "certify_timeout must be positive"),
    ],
)
def test_a_bad_policy_is_refused(kwargs: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        ProtectionPolicy(**kwargs)


@pytest.mark.parametrize(
    "env, problem",
    [
        ({"CHECKMATE_MAX_LAG": "-3"}, "max_lag -3 is out of range"),
        ({"CHECKMATE_MAX_LAG": "two"}, "CHECKMATE_MAX_LAG='two' is not an integer"),
        ({"CHECKMATE_MAX_LAG": "9"}, "max_lag 9 exceeds keep_iterations 4"),
        ({"CHECKMATE_ON_LAG": "skip"}, "on_lag 'skip'"),
        ({"CHECKMATE_UNPROTECTED": "quiet"}, "unprotected 'quiet'"),
    ],
)
def test_a_bad_policy_in_the_environment_is_refused(env: dict[str, str], problem: str) -> None:
    base = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    with pytest.raises(CheckmateConfigError, match=problem):
        CheckmateConfig.from_env({**base, **env})


def test_the_policy_is_read_from_the_environment() -> None:
    base = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    assert CheckmateConfig.from_env(base).protection == ProtectionPolicy(max_lag=2, on_lag="wait")
    config = CheckmateConfig.from_env(
        {**base, "CHECKMATE_MAX_LAG": "0", "CHECKMATE_ON_LAG": "continue", "CHECKMATE_UNPROTECTED": "log"}
    )
    assert config.protection == ProtectionPolicy(max_lag=0, on_lag="continue", unprotected="log")
