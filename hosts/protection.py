"""Never silently unprotected: rank 0 watches the shadows' certificates; every rank learns a verdict.

A job is *protected* while the shadows hold a certified state at most ``max_lag``
iterations behind the workers. Rank 0 (:class:`ProtectionWatch`, called from the
model's forward pre-hook after the previous iteration's commit went out) finds it
*unprotected* when

* a shadow refused the job (its ``goodbye`` "refused: ..."; e.g. an optimizer it cannot
  replay), or
* no shadow certified an iteration within ``certify_timeout`` seconds of the start, or
* certification stopped: no certificate advanced for ``certify_timeout`` seconds while
  the workers went on.

**Bounded lag.** With ``on_lag="wait"`` (the default) rank 0 waits at that forward pass
until every shadow has certified the iteration ``max_lag`` before the one just
committed (backpressure: the job runs at the shadows' pace when they fall behind), so
a failure redoes at most ``max_lag + 1`` iterations. With ``on_lag="continue"`` it does
not wait; a lag beyond ``max_lag`` is an unprotected episode like the ones above.

**Every rank knows.** With ``unprotected="raise"`` (the default) rank 0 publishes the
verdict (the reason, and the iteration at whose forward pass it was found) in the
default process group's store, and every rank raises :class:`UnprotectedError` with
the shadow's reason at the first forward pass of iteration ``i`` with
``(i - start) % CHECK_EVERY == 0`` and ``i`` after the verdict's iteration. That is the
same iteration on every rank: a verdict found at iteration ``p``'s forward pass is in
the store before rank 0 joins ``p``'s all-reduce, so before any rank can begin
``p + 1``; no rank is left waiting in an all-reduce for a rank that raised. The other
ranks pay one store lookup every ``CHECK_EVERY`` iterations. With
``unprotected="log"`` training goes on and rank 0 logs one error line per episode
(an episode ends when the certificates catch up again).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hosts.control_channel import ControlChannel

logger = logging.getLogger(__name__)

LAG_POLICIES = ("wait", "continue")
UNPROTECTED_POLICIES = ("raise", "log")
MAX_LAG_LIMIT = 1000
CHECK_EVERY = 4
"""Iterations between two store lookups of the verdict on ranks other than 0."""
READ_TIMEOUT_S = 30.0
"""Longest rank 0 waits, before raising, for the other ranks to read the verdict (its process may
host the store they read it from)."""
WAIT_SLICE_S = 0.05
"""While waiting for certificates rank 0 looks at the links (a shadow asking for state) this often."""


class UnprotectedError(RuntimeError):
    """No shadow holds a recent certified state (a refusal, no certificate, or certification stopped)."""


@dataclass(frozen=True)
class ProtectionPolicy:
    """What a job does about the shadows' lag and an unprotected episode (docs/shadow.md, "Protection")."""

    max_lag: int = 2
    """Most iterations the certified state may trail the last committed one (``CHECKMATE_MAX_LAG``)."""
    on_lag: str = "wait"
    """``"wait"``: rank 0 waits for the shadows (backpressure); ``"continue"``: the lag is reported."""
    unprotected: str = "raise"
    """``"raise"``: every rank raises UnprotectedError; ``"log"``: one error line per episode."""
    certify_timeout: float = 120.0
    """Seconds without a certificate (from the start, or since the last one) that make a job unprotected."""

    def __post_init__(self) -> None:
        if isinstance(self.max_lag, bool) or not isinstance(self.max_lag, int):
            raise ValueError(f"max_lag must be an integer, not {self.max_lag!r}")
        if not 0 <= self.max_lag <= MAX_LAG_LIMIT:
            raise ValueError(f"max_lag {self.max_lag} is out of range: 0 <= max_lag <= {MAX_LAG_LIMIT}")
        if self.on_lag not in LAG_POLICIES:
            raise ValueError(f"on_lag {self.on_lag!r}: expected one of {LAG_POLICIES}")
        if self.unprotected not in UNPROTECTED_POLICIES:
            raise ValueError(f"unprotected {self.unprotected!r}: expected one of {UNPROTECTED_POLICIES}")
        if not self.certify_timeout > 0:
            raise ValueError(f"certify_timeout must be positive, not {self.certify_timeout!r}")


class VerdictBoard:
    """Where rank 0 posts an unprotected verdict and every rank reads it (the process group's store)."""

    def __init__(self, store: Any, job_id: int) -> None:
        self._store = store
        self._key = f"checkmate/unprotected/{job_id}"
        self._acks = f"checkmate/unprotected/{job_id}/read"

    @classmethod
    def default(cls, job_id: int) -> VerdictBoard | None:
        """The default process group's store, or None without one (a single process: nothing to tell)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            return cls(_get_default_store(), job_id)
        except (RuntimeError, ValueError, ImportError) as exc:
            logger.warning("checkmate: no process-group store (%s): only rank 0 raises when unprotected", exc)
            return None

    def post(self, iteration: int, reason: str) -> None:
        self._store.set(self._key, json.dumps({"iteration": iteration, "reason": reason}))

    def read(self) -> tuple[int, str] | None:
        if not self._store.check([self._key]):
            return None
        value = json.loads(self._store.get(self._key))
        return int(value["iteration"]), str(value["reason"])

    def acknowledge(self) -> None:
        """A rank read the verdict it raises (rank 0 may host the store: it waits for these)."""
        self._store.add(self._acks, 1)

    def wait_read(self, ranks: int, timeout: float) -> bool:
        """Rank 0, before raising: wait (at most ``timeout``) until ``ranks`` other ranks read the verdict."""
        deadline = time.monotonic() + timeout
        while self._store.add(self._acks, 0) < ranks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True


class ProtectionWatch:
    """One rank's part: rank 0 judges and publishes, every rank raises on a published verdict."""

    def __init__(
        self,
        policy: ProtectionPolicy,
        rank: int,
        start_iteration: int,
        board: VerdictBoard | None,
        certificate_every: int = 1,
        world_size: int = 1,
    ) -> None:
        """``certificate_every``: rank 0's fingerprint interval K (shadows certify every K-th
        iteration), so the effective lag bound is ``max(max_lag, K)`` (else the wait could never end)."""
        self.policy = policy
        self.rank = rank
        self.world_size = world_size
        self.start_iteration = start_iteration
        self.board = board
        self.max_lag = max(policy.max_lag, certificate_every)
        if self.max_lag > policy.max_lag and rank == 0:
            logger.warning(
                "checkmate: the shadows certify every %d-th iteration (CHECKMATE_FINGERPRINT_EVERY), so the "
                "lag bound is %d iterations, not max_lag %d",
                certificate_every,
                self.max_lag,
                policy.max_lag,
            )
        self.started = time.monotonic()
        self.last_progress = self.started
        self.certified: int | None = None
        self.lag: int | None = None
        """Iterations committed but not certified by every shadow, at the last look (None: none certified)."""
        self.reason: str | None = None
        """Why the job is unprotected now (None: protected)."""
        self.episodes = 0
        self.waits = 0
        self.wait_seconds = 0.0
        self._published: tuple[int, str] | None = None
        self._checked: int | None = None

    # ---- rank 0 -----------------------------------------------------------------------
    def after_commit(
        self, channel: ControlChannel, committed: int, seed: Callable[[], None] | None = None
    ) -> None:
        """Rank 0, after ``committed``'s commit went out: wait (backpressure) and judge."""
        if self.policy.on_lag == "wait":
            target = committed - self.max_lag
            if target >= self.start_iteration and not self._certified_through(channel, target):
                began = time.monotonic()
                self.waits += 1
                while not channel.wait_certified(target, WAIT_SLICE_S):
                    self._look(channel, committed)
                    if self.reason is not None:
                        break  # unprotected: waiting longer would not help
                    if seed is not None:
                        seed()  # a shadow that restarted meanwhile asks for state
                self.wait_seconds += time.monotonic() - began
        self._look(channel, committed)
        if self.reason is not None and self.policy.unprotected == "raise" and self._published is None:
            self._published = (committed + 1, self.reason)
            if self.board is not None:
                self.board.post(committed + 1, self.reason)

    def _certified_through(self, channel: ControlChannel, target: int) -> bool:
        through = channel.certified_through()
        return through is not None and through >= target

    def _look(self, channel: ControlChannel, committed: int) -> None:
        now = time.monotonic()
        through = channel.certified_through()
        if through is not None and (self.certified is None or through > self.certified):
            self.certified = through
            self.last_progress = now
        self.lag = None if self.certified is None else committed - self.certified
        reason = self._refusal(channel)
        if reason is None and self.certified is None and now - self.started > self.policy.certify_timeout:
            reason = (
                f"no shadow certified an iteration within {self.policy.certify_timeout:g} s of the start "
                f"({self._links(channel)})"
            )
        if (
            reason is None
            and self.lag is not None
            and self.lag > self.max_lag
            and now - self.last_progress > self.policy.certify_timeout
        ):
            reason = (
                f"certification stopped: the shadows certified nothing for {now - self.last_progress:.0f} s "
                f"(certified through iteration {self.certified}, committed {committed}; "
                f"{self._links(channel)})"
            )
        if (
            reason is None
            and self.policy.on_lag == "continue"
            and self.lag is not None
            and self.lag > self.max_lag
        ):
            reason = f"the shadows are {self.lag} iterations behind, more than max_lag {self.max_lag}"
        if reason is not None and self.reason is None:
            self.episodes += 1
            logger.error("checkmate: UNPROTECTED: %s", reason)
        elif reason is None and self.reason is not None:
            logger.warning("checkmate: protected again: certified through iteration %s", self.certified)
        self.reason = reason

    @staticmethod
    def _refusal(channel: ControlChannel) -> str | None:
        for link in channel.links:
            if link.refusal is not None and channel.certified.get(link.name) is None:
                return f"shadow {link.name} {link.refusal}"
        return None

    @staticmethod
    def _links(channel: ControlChannel) -> str:
        parts = []
        for link in channel.links:
            state = "connected" if link.connected else "unreachable"
            certified = channel.certified.get(link.name)
            parts.append(f"{link.name}: {state}, certified {'-' if certified is None else certified}")
        return "; ".join(parts)

    # ---- every rank -------------------------------------------------------------------
    def before_forward(self, iteration: int) -> None:
        """Every rank, at ``iteration``'s forward pass: raise a published verdict (same iteration on all)."""
        if (iteration - self.start_iteration) % CHECK_EVERY or iteration == self._checked:
            return  # not a check iteration, or looked already (several forward passes per iteration)
        self._checked = iteration
        verdict = self._published if self.rank == 0 or self.board is None else self.board.read()
        if verdict is not None and verdict[0] < iteration:
            if self.board is not None:
                if self.rank != 0:
                    self.board.acknowledge()
                elif not self.board.wait_read(self.world_size - 1, READ_TIMEOUT_S):
                    logger.error("checkmate: not every rank confirmed reading the unprotected verdict")
            raise UnprotectedError(
                f"checkmate: the job is not protected by its shadows: {verdict[1]} (found at iteration "
                f"{verdict[0]}'s forward pass by rank 0; CHECKMATE_UNPROTECTED=log lets training go on "
                "with one error line per episode)"
            )

    def status(self) -> dict[str, Any]:
        return {
            "protected": self.reason is None and self.certified is not None,
            "reason": self.reason,
            "certified_iteration": self.certified,
            "lag_iterations": self.lag,
            "max_lag": self.max_lag,
            "on_lag": self.policy.on_lag,
            "unprotected_episodes": self.episodes,
            "backpressure_waits": self.waits,
            "backpressure_seconds": round(self.wait_seconds, 6),
        }
