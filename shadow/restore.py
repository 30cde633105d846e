"""Restore client: fetch the latest consistent state from the shadows' memory.

Each shadow holds its shard (the parameters of the buckets it owns, with
their optimizer state). A consistent state is every shard *after the same
iteration*. :func:`fetch_state` asks every shadow for its status, picks the
latest iteration all of them can serve (a shadow behind it is given time to
reach it: the request's ``wait``), fetches the shards over the shadows'
control port (``restore_request`` -> ``job_start``-shaped answer, see
docs/shadow.md), and merges them, checking that every parameter of the model
is covered exactly once. The merged state's ``data_position`` is the workers'
data position after the restored iteration (what they set with
``CheckmateAgent.set_data_position``), or None when no shadow knows it; its
``job_state`` holds the buffers, stateful objects and param groups after it
(:mod:`checkmate.job_state`), or None when the workers sent none.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from checkmate.control import (
    JobStart,
    Message,
    RestoreRefused,
    RestoreRequest,
    StatusReport,
    StatusRequest,
    job_state_of,
    recv_message,
    send_message,
)
from checkmate.job_state import JobState

logger = logging.getLogger(__name__)

Addr = tuple[str, int]


class RestoreError(RuntimeError):
    """No consistent state could be fetched; the message says which shadow and why."""


def _ask(address: Addr, message: Message, timeout: float) -> Message:
    with socket.create_connection(address, timeout=timeout) as conn:
        send_message(conn, message, timeout=timeout)
        return recv_message(conn, timeout=timeout)


def shadow_status(address: Addr, timeout: float = 5.0) -> dict[str, Any]:
    """One shadow's status document (docs/shadow.md)."""
    reply = _ask(address, StatusRequest(), timeout)
    if not isinstance(reply, StatusReport):
        raise RestoreError(f"shadow at {address[0]}:{address[1]} answered {reply.TYPE} to a status request")
    return reply.status


def fetch_shard(
    address: Addr, iteration: int | None, wait: float, timeout: float, job_id: int = 0
) -> JobStart | RestoreRefused:
    reply = _ask(address, RestoreRequest(job_id, iteration, wait), timeout + wait)
    if not isinstance(reply, (JobStart, RestoreRefused)):
        raise RestoreError(f"shadow at {address[0]}:{address[1]} answered {reply.TYPE} to a restore request")
    return reply


def _data_position(shards: Sequence[JobStart]) -> Any:
    """The data position the shards' shadows hold for their iteration (None: unknown or disputed).

    Every shadow is told the same position with the iteration's commit record; one
    may not know it (resumed from an older snapshot, or it refused a bad one), so the
    others' is taken. Shadows that disagree are a bug somewhere: no position is
    better than a wrong one.
    """
    known = {
        json.dumps(p, sort_keys=True): p
        for p in (s.extra.get("data_position") for s in shards)
        if p is not None
    }
    if len(known) > 1:
        holders = {str(s.extra.get("shadow", "?")): s.extra.get("data_position") for s in shards}
        logger.warning("shadows disagree on the data position, restoring none: %s", holders)
        return None
    return next(iter(known.values()), None)


def _job_state(shards: Sequence[JobStart]) -> JobState | None:
    """The job state the shards' shadows hold (every shadow gets the same); RestoreError if they differ."""
    held = [(str(s.extra.get("shadow", "?")), job_state_of(s)) for s in shards]
    known = [(who, state) for who, state in held if state is not None]
    if not known:
        return None
    first_who, first = known[0]
    for who, state in known[1:]:
        if not first.equals(state):
            raise RestoreError(f"shadows {first_who} and {who} hold different job states for one iteration")
    return first


def merge_shards(shards: Sequence[JobStart]) -> dict[str, Any]:
    """One state from shards of the same iteration; every parameter covered exactly once."""
    if not shards:
        raise RestoreError("no shards to merge")
    first = shards[0]
    iterations = {s.start_iteration - 1 for s in shards}
    if len(iterations) != 1:
        raise RestoreError(f"shards are of different iterations: {sorted(iterations)}")
    jobs = {s.job_id for s in shards}
    if len(jobs) != 1:
        raise RestoreError(f"shards are of different jobs: {sorted(jobs)}")
    expected = {p.name: tuple(p.shape) for p in first.parameters}
    parameters: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, Any]] = {}
    holders: dict[str, str] = {}
    for shard in shards:
        who = str(shard.extra.get("shadow", "?"))
        for key, tensor in shard.tensors.items():
            kind, _, rest = key.partition("/")
            if kind == "jobstate":
                continue  # the job state's tensors: see _job_state
            if kind == "param":
                if rest not in expected:
                    raise RestoreError(f"shadow {who} holds {rest!r}, which is not in the model")
                if rest in parameters:
                    raise RestoreError(f"parameter {rest!r} is held by both {holders[rest]} and {who}")
                if tuple(tensor.shape) != expected[rest]:
                    raise RestoreError(
                        f"shadow {who}: {rest} has shape {tuple(tensor.shape)}, "
                        f"the model says {expected[rest]}"
                    )
                parameters[rest] = tensor
                holders[rest] = who
            elif kind == "state":
                name, _, state = rest.rpartition("/")
                states.setdefault(name, {})[state] = tensor
        for name, scalars in shard.optimizer_scalars.items():
            states.setdefault(name, {}).update(scalars)
    missing = sorted(set(expected) - set(parameters))
    if missing:
        raise RestoreError(f"no shadow holds parameter(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return {
        "job_id": first.job_id,
        "iteration": first.start_iteration - 1,
        "optimizer_step": max(int(s.extra.get("optimizer_step", 0)) for s in shards),
        "data_position": _data_position(shards),
        "parameters": {p.name: parameters[p.name] for p in first.parameters},
        "optimizer_state": states,
        "optimizer": first.optimizer,
        "job_state": _job_state(shards),
        "shadows": {str(s.extra.get("shadow", "?")): s.start_iteration - 1 for s in shards},
    }


def fetch_state(addresses: Sequence[Addr], timeout: float = 10.0, job_id: int = 0) -> dict[str, Any]:
    """The latest state every shadow can serve, merged: parameters, optimizer state, step, data position.

    ``addresses`` are the shadows' control (TCP) addresses. Raises
    :class:`RestoreError` if the shadows cannot agree on an iteration within
    ``timeout`` or their shards do not cover the model exactly once.
    """
    if not addresses:
        raise RestoreError("no shadow addresses")
    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(max_workers=len(addresses)) as pool:
        statuses = list(pool.map(lambda a: shadow_status(a, timeout), addresses))
        applied = [int(s["applied_iteration"]) for s in statuses]
        if min(applied) < 0:
            raise RestoreError(
                f"a shadow holds no state yet: {dict(zip(map(str, addresses), applied, strict=True))}"
            )
        target = max(applied)
        refusals: list[RestoreRefused] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                reasons = "; ".join(f"{r.shadow}: {r.reason}" for r in refusals)
                raise RestoreError(f"shadows could not agree on an iteration within {timeout}s ({reasons})")
            wait = max(0.0, min(left / 2, left - 0.5))
            n = len(addresses)
            replies = list(
                pool.map(fetch_shard, addresses, [target] * n, [wait] * n, [timeout] * n, [job_id] * n)
            )
            refusals = [r for r in replies if isinstance(r, RestoreRefused)]
            if not refusals:
                shards = [r for r in replies if isinstance(r, JobStart)]
                state = merge_shards(shards)
                logger.info("restored state after iteration %d from %d shadows", target, len(shards))
                return state
            ahead = [r.iteration for r in refusals if r.iteration > target]
            if ahead:
                target = max(ahead) + 1  # moving: meet them at an iteration none has passed yet
            elif all(r.iteration < target for r in refusals):
                # Someone cannot reach the target (no more data comes): settle for the common minimum.
                target = min(r.iteration for r in refusals)
