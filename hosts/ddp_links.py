"""Rank 0's links to the shadows: the control channel, the protection watch, the job file it follows.

:class:`ShadowLinks` is the agents' component that owns what reaches the shadows (the FSDP2
agent uses it without the protection watch or the job file): the
:class:`~hosts.control_channel.ControlChannel` (rank 0 only, when the job has shadows), the
:class:`~hosts.protection.ProtectionWatch` (every rank of a job with shadows: rank 0 judges
and publishes, every rank raises a published verdict) and the job's *current* configuration,
which a change of the job file (a live shadow move) replaces. Its methods run on the training
thread and take no lock of their own; the channel's per-link sender threads (``cm-ctl-<name>``)
send what :meth:`ShadowLinks.post` queues, under the channel's lock. It calls nothing of the
agent's: what to send a new shadow comes as a callable from its caller
(:class:`~hosts.ddp_commits.ShadowMessages`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from checkmate.control import Commit, Message
from checkmate.job import JobSpec
from hosts.control_channel import ControlChannel, ControlConfig
from hosts.ddp_config import CheckmateConfig, CheckmateConfigError, _file_stamp, read_job_file
from hosts.protection import ProtectionWatch, VerdictBoard
from hosts.transport import Addr

logger = logging.getLogger(__name__)

StateMessages = Callable[[], Sequence[Message]]
"""What a shadow that needs state is sent: a JobStart first, then its bucket layout."""


@dataclass(frozen=True)
class JobFileChange:
    """The job file names other shadows (or another job description) for the same job and workers."""

    path: str
    job: JobSpec
    shadows: dict[str, Addr]


class ShadowLinks:
    """The control channel to the shadows, the protection watch and the current configuration."""

    def __init__(self, config: CheckmateConfig, rank: int) -> None:
        self._config = config
        self._rank = rank
        self._channel: ControlChannel | None = None
        self._protection: ProtectionWatch | None = None
        self._job_file_stamp = _file_stamp(config.job_file)
        self._posted_through: int | None = None
        """The last iteration whose commit was posted to the shadows."""

    @property
    def config(self) -> CheckmateConfig:
        """The job's configuration now (a job file change replaces its job and shadows)."""
        return self._config

    @property
    def channel(self) -> ControlChannel | None:
        """Rank 0's control channel (None: another rank, or a job without shadows)."""
        return self._channel

    @property
    def active(self) -> bool:
        """Whether this rank talks to shadows (rank 0 of a job with shadows)."""
        return self._channel is not None

    def open(self, start_messages: StateMessages, certificate_every: int, protect: bool = True) -> None:
        """Rank 0: connect to the shadows and queue them the job's start; every rank: the protection watch.

        ``certificate_every``: the fingerprint interval K (the shadows certify every K-th iteration);
        ``protect``: watch the lag and judge the protection (:mod:`hosts.protection`).
        """
        config = self._config
        if self._rank == 0 and config.shadow_control:
            self._channel = ControlChannel(
                config.job_id,
                config.shadow_control,
                ControlConfig(connect_timeout=config.shadow_connect_timeout),
                secret=config.secret,
                unnamed=config.unnamed_shadows,
            )
            up = self._channel.wait_connected(config.shadow_connect_timeout)
            logger.info("%d of %d shadows reachable at start", up, len(config.shadow_control))
            self._channel.post_state(start_messages)
        # Never silently unprotected: rank 0 judges the shadows' certificates, every rank raises a verdict.
        if config.shadow_control and protect:
            policy = config.protection
            board = VerdictBoard.default(config.job_id) if policy.unprotected == "raise" else None
            self._protection = ProtectionWatch(
                policy,
                self._rank,
                config.start_iteration,
                board,
                certificate_every=certificate_every,
                world_size=config.world_size,
            )

    # ---- sending ------------------------------------------------------------------------------
    def post(self, message: Message) -> None:
        """Queue ``message`` for every shadow (nothing without a channel)."""
        if self._channel is not None:
            self._channel.post(message)

    def post_commit(self, commit: Commit) -> None:
        """Queue a commit record; the protection watch judges the lag from it at the next forward."""
        if self._channel is not None:
            self._channel.post(commit)
            self._posted_through = commit.iteration

    def seed_new_shadows(self, state: StateMessages) -> None:
        """Links that need state (new or reconnected shadows) get ``state()``."""
        if self._channel is not None and self._channel.needs_state():
            self._channel.post_state(state)

    def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until every queued message went out."""
        return self._channel.flush(timeout) if self._channel is not None else True

    # ---- protection ---------------------------------------------------------------------------
    def before_forward(self, iteration: int) -> None:
        """Every rank, at ``iteration``'s forward pass: raise a published unprotected verdict."""
        if self._protection is not None:
            self._protection.before_forward(iteration)

    def after_commit(self, seed: Callable[[], None]) -> None:
        """Rank 0, after a commit went out: bounded lag (wait for the shadows) and the judgement."""
        if self._protection is not None and self._channel is not None and self._posted_through is not None:
            self._protection.after_commit(self._channel, self._posted_through, seed)

    def protection_status(self) -> dict[str, Any] | None:
        """Rank 0: whether the shadows protect the job, the lag and why not; else None."""
        return self._protection.status() if self._protection is not None and self._rank == 0 else None

    # ---- what the shadows said ----------------------------------------------------------------
    @property
    def divergences(self) -> list[dict[str, Any]]:
        """Rank 0: every divergence a shadow reported (iteration, shadow, tensors that differ)."""
        return list(self._channel.divergences) if self._channel is not None else []

    def wait_certified(self, iteration: int, timeout: float, seed: Callable[[], None]) -> bool:
        """Wait (at most ``timeout``) until every shadow has certified ``iteration``; True without shadows.

        ``seed`` runs between short waits: a shadow that diverged (or restarted) meanwhile asks for
        state, and no forward pass will come to send it.
        """
        channel = self._channel
        if channel is None:
            return True
        deadline = time.monotonic() + timeout
        while not channel.wait_certified(iteration, min(0.05, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                return False
            seed()
        return True

    def stats(self) -> dict[str, Any]:
        """``control`` (per link counters) and ``protection`` (rank 0), where there are any."""
        out: dict[str, Any] = {}
        if self._channel is not None:
            out["control"] = self._channel.stats()
        status = self.protection_status()
        if status is not None:
            out["protection"] = status
        return out

    # ---- the job file -------------------------------------------------------------------------
    def job_file_change(self, workers: tuple[Addr, ...]) -> JobFileChange | None:
        """Rank 0, after each step: the job file's new shadows for this job and ``workers``, if it changed."""
        path = self._config.job_file
        stamp = _file_stamp(path)
        if path is None or stamp is None or stamp == self._job_file_stamp:
            return None
        self._job_file_stamp = stamp
        try:
            job, listed, shadows = read_job_file(path)
        except CheckmateConfigError as exc:
            logger.warning("checkmate: %s; keeping the current shadows", exc)
            return None
        if job.job_id != self._config.job_id or listed != workers:
            logger.warning(
                "checkmate: %s now names job %d with workers %s; a new job or other workers need a "
                "restart: keeping job %d's shadows",
                path,
                job.job_id,
                [f"{h}:{p}" for h, p in listed],
                self._config.job_id,
            )
            return None
        if job == self._config.job and shadows == dict(self._config.shadow_control):
            return None
        return JobFileChange(path, job, shadows)

    def follow(self, change: JobFileChange, before_move: Callable[[], None]) -> None:
        """Take ``change``'s shadows: open the channel, or move it (``before_move`` first: the
        shadows leaving get what is pending)."""
        self._config = dataclasses.replace(self._config, job=change.job, shadow_control=change.shadows)
        config = self._config
        if self._channel is None:
            if change.shadows:
                self._channel = ControlChannel(
                    config.job_id,
                    change.shadows,
                    ControlConfig(connect_timeout=config.shadow_connect_timeout),
                    secret=config.secret,
                )
                self._channel.wait_connected(config.shadow_connect_timeout)
            return
        before_move()
        added, removed = self._channel.set_shadows(change.shadows)
        # Like at start: give new shadows a moment to connect, so they get this step's state.
        self._channel.wait_connected(config.shadow_connect_timeout, names=added)
        logger.info(
            "checkmate: %s changed: shadows now %s (new: %s, left: %s); new ones get the state "
            "after the next step",
            change.path,
            sorted(change.shadows),
            added or "none",
            removed or "none",
        )

    # ---- the end ------------------------------------------------------------------------------
    def close(self, iteration: int, timeout: float, state: StateMessages) -> None:
        """Give rejoining shadows the final ``state()``, flush, wait for the last iteration's
        certificate (``iteration`` is the next one; at most ``timeout``), close the links."""
        channel = self._channel
        if channel is None:
            return
        self._final_state_to_rejoining_shadows(channel, iteration, timeout, state)
        channel.flush(timeout)
        # The last iteration's lost copies are repaired from the workers: the other ranks wait in
        # their barrier (their rings still answer) until the shadows certified it, or timeout.
        if iteration > self._config.start_iteration and channel.all_ready():
            channel.wait_certified(iteration - 1, timeout)
        channel.close(timeout)

    def close_now(self, timeout: float) -> None:
        """Close the links without sending anything more (an enable that failed half-way)."""
        if self._channel is not None:
            self._channel.close(timeout)

    @staticmethod
    def _final_state_to_rejoining_shadows(
        channel: ControlChannel, iteration: int, timeout: float, state: StateMessages
    ) -> None:
        """A shadow whose link is down or waiting for state (it restarted) gets the final state.

        During training a restarted shadow is re-seeded after the next optimizer step;
        one that comes back during the last steps would otherwise end without the
        job's final state. Waits at most ``timeout`` for such a link to connect.
        """
        if channel.all_ready():
            return
        channel.wait_connected(timeout)
        if channel.post_state(state):
            logger.info(
                "checkmate: gave the final state (after iteration %d) to a rejoining shadow", iteration - 1
            )
        missing = channel.unreachable()
        if missing:
            logger.warning(
                "checkmate: shadows %s unreachable at close: they do not hold the state after iteration %d",
                ", ".join(missing),
                iteration - 1,
            )
