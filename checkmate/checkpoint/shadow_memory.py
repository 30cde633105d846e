"""The shadows' memory as a state source: the client that fetches a consistent state from the shadows.

:class:`ShadowMemory` is the shadows' memory as a state source
(:class:`checkmate.checkpoint.source.StateSource`, next to the snapshot
directory); the functions below are what it does. It is the client side of the
shadows' restore service (which answers in :mod:`shadow.node_service`), used by
the workers (``hosts.resume``) and by anyone who reports the shadows' state, so it
lives with the checkpoint package and imports nothing of ``shadow/``.

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

The command a host runs to report the shadows' state (digests of parameters
and optimizer state, :mod:`checkmate.checkpoint.digest`)::

    python -m checkmate.checkpoint.shadow_memory digest \
        --shadow sh1=10.0.9.1:48880 --shadow sh2=10.0.9.2:48880 --iteration 99 --out FILE
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from checkmate.address import AddressError, parse_host_port
from checkmate.checkpoint.digest import optimizer_digest, parameters_digest
from checkmate.checkpoint.source import SOURCE_SHADOW_MEMORY, RestoredState, SourceError
from checkmate.control import (
    DEFAULT_CONTROL_PORT,
    ControlProtocolError,
    JobStart,
    Message,
    RestoreRefused,
    RestoreRequest,
    ShadowStatusError,
    job_state_of,
    query_status,
    recv_message,
    send_message,
)
from checkmate.control_frame import FrameAuthError, bind
from checkmate.job_state import JobState
from checkmate.network import Addr

logger = logging.getLogger(__name__)


class RestoreError(RuntimeError):
    """No consistent state could be fetched; the message says which shadow and why."""


def _ask(address: Addr, message: Message, timeout: float, name: str | None = None) -> Message:
    with socket.create_connection(address, timeout=timeout) as conn:
        if name is not None:  # else the first frame binds a session that checks no name
            bind(conn, None, int(getattr(message, "job_id", 0)), name=name)
        send_message(conn, message, timeout=timeout)
        return recv_message(conn, timeout=timeout)


def fetch_shard(
    address: Addr,
    iteration: int | None,
    wait: float,
    timeout: float,
    job_id: int = 0,
    name: str | None = None,
) -> JobStart | RestoreRefused:
    """One shadow's shard of the state after ``iteration`` (None: its latest), or its refusal.

    ``name``: the shadow meant; a node whose hello names another is refused before anything
    is sent (FrameAuthError), so a redirected connection cannot serve another shadow's state.
    """
    reply = _ask(address, RestoreRequest(job_id, iteration, wait), timeout + wait, name)
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
    iteration = first.start_iteration - 1
    verified = [int(v) for v in (s.extra.get("last_verified") for s in shards) if v is not None]
    if verified and min(verified) < iteration:
        logger.warning(
            "the shadows' state after iteration %d is unverified since iteration %d "
            "(the divergence check runs every CHECKMATE_FINGERPRINT_EVERY iterations); "
            "the snapshots on disk hold verified states only",
            iteration,
            min(verified),
        )
    return {
        "job_id": first.job_id,
        "iteration": iteration,
        "last_verified": min(verified) if verified else None,
        "optimizer_step": max(int(s.extra.get("optimizer_step", 0)) for s in shards),
        "data_position": _data_position(shards),
        "parameters": {p.name: parameters[p.name] for p in first.parameters},
        "optimizer_state": states,
        "optimizer": first.optimizer,
        "job_state": _job_state(shards),
        "shadows": {str(s.extra.get("shadow", "?")): s.start_iteration - 1 for s in shards},
    }


def fetch_state(
    addresses: Sequence[Addr],
    timeout: float = 10.0,
    job_id: int = 0,
    names: Sequence[str | None] | None = None,
) -> dict[str, Any]:
    """The latest state every shadow can serve, merged: parameters, optimizer state, step, data position.

    ``addresses`` are the shadows' control (TCP) addresses; ``names`` (one per address, None:
    not checked) the shadows meant there: a node that names itself otherwise is refused.
    Raises :class:`RestoreError` if the shadows cannot agree on an iteration within
    ``timeout``, their shards do not cover the model exactly once, or one is not the node named.
    """
    if not addresses:
        raise RestoreError("no shadow addresses")
    named: list[str | None] = list(names) if names is not None else [None] * len(addresses)
    if len(named) != len(addresses):
        raise ValueError(f"{len(named)} names for {len(addresses)} shadow addresses")
    deadline = time.monotonic() + timeout
    with ThreadPoolExecutor(max_workers=len(addresses)) as pool:
        try:
            statuses = list(pool.map(lambda a, n: query_status(a, timeout, name=n), addresses, named))
        except ShadowStatusError as exc:
            raise RestoreError(str(exc)) from None
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
            try:
                replies = list(
                    pool.map(
                        fetch_shard, addresses, [target] * n, [wait] * n, [timeout] * n, [job_id] * n, named
                    )
                )
            except FrameAuthError as exc:
                raise RestoreError(f"refused a shadow: {exc}") from None
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


# ---- the shadows' memory as a state source -------------------------------------------------
def state_of_merged(state: Mapping[str, Any], detail: str) -> RestoredState:
    """A :func:`merge_shards` / :func:`fetch_state` result as a source's :class:`RestoredState`."""
    optimizer = dict(state.get("optimizer") or {})
    return RestoredState(
        iteration=int(state["iteration"]),
        source=SOURCE_SHADOW_MEMORY,
        parameters=dict(state["parameters"]),
        optimizer_state={n: dict(s) for n, s in state["optimizer_state"].items()},
        optimizer_step=int(state.get("optimizer_step") or 0),
        data_position=state.get("data_position"),
        detail=detail,
        job_state=state.get("job_state"),
        optimizer_kind=optimizer.get("kind"),
        lost_iterations=0,
        optimizer=optimizer,
    )


class ShadowMemory:
    """The state the shadows hold in memory, fetched over their control port.

    ``shadows``: name -> control (TCP) address. :meth:`latest` is the latest
    iteration every shadow can serve; :meth:`at` exactly one iteration.
    """

    kind = SOURCE_SHADOW_MEMORY

    def __init__(self, shadows: Mapping[str, Addr], job_id: int = 0, unnamed: Collection[str] = ()) -> None:
        """``unnamed``: names in ``shadows`` that were made up for an address given without one
        (``CHECKMATE_SHADOWS`` entries without ``NAME=``); every other name is checked against
        the node's hello, and a node that names itself otherwise is refused."""
        self.shadows = dict(shadows)
        self.job_id = job_id
        self.unnamed = frozenset(unnamed)

    def _name(self, name: str) -> str | None:
        return None if name in self.unnamed else name

    def describe(self) -> str:
        return "the memory of shadows " + ", ".join(sorted(self.shadows))

    def latest(self, timeout: float) -> RestoredState:
        if not self.shadows:
            raise SourceError("no shadow addresses")
        try:
            state = fetch_state(
                list(self.shadows.values()),
                timeout=timeout,
                job_id=self.job_id,
                names=[self._name(n) for n in self.shadows],
            )
        except (RestoreError, OSError, ControlProtocolError) as exc:
            raise SourceError(f"the shadows cannot serve a state: {exc}") from None
        return state_of_merged(
            state, ", ".join(f"{name}@{it}" for name, it in sorted(state["shadows"].items()))
        )

    def at(self, iteration: int, timeout: float) -> RestoredState:
        """Every shadow's shard of the state after exactly ``iteration`` (waiting up to ``timeout``)."""
        if not self.shadows:
            raise SourceError("no shadow addresses")
        names = list(self.shadows)
        with ThreadPoolExecutor(max_workers=len(names)) as pool:
            try:
                replies = list(
                    pool.map(
                        lambda n: fetch_shard(
                            self.shadows[n], iteration, timeout, timeout, self.job_id, self._name(n)
                        ),
                        names,
                    )
                )
            except (RestoreError, OSError, ControlProtocolError) as exc:
                raise SourceError(f"cannot fetch iteration {iteration} from the shadows: {exc}") from None
        refused = [
            f"{n}: {r.reason}" for n, r in zip(names, replies, strict=True) if not isinstance(r, JobStart)
        ]
        if refused:
            raise SourceError(f"shadows refused iteration {iteration}: {'; '.join(refused)}")
        try:
            state = merge_shards([r for r in replies if isinstance(r, JobStart)])
        except RestoreError as exc:
            raise SourceError(str(exc)) from None
        return state_of_merged(state, ", ".join(names))


# ---- the digest command (run inside a host that reaches the shadows) ----------------------
def _address(text: str) -> tuple[str, Addr]:
    name, sep, rest = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=HOST[:PORT]")
    try:
        return name, parse_host_port(rest, DEFAULT_CONTROL_PORT)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=HOST[:PORT]: {exc}") from None


def _digest_command(args: argparse.Namespace) -> int:
    source = ShadowMemory(dict(args.shadow))
    started = time.monotonic()
    document: dict[str, Any] = {"shadows": sorted(source.shadows), "iteration": args.iteration}
    try:
        if args.iteration is None:
            state = source.latest(args.timeout)
        else:
            state = source.at(args.iteration, args.timeout)
        document.update(
            ok=True,
            iteration=state.iteration,
            optimizer_step=state.optimizer_step,
            params_sha256=parameters_digest(state.parameters),
            optimizer_sha256=optimizer_digest(state.optimizer_state),
            parameters=len(state.parameters),
        )
    except SourceError as exc:
        document.update(ok=False, error=str(exc))
    document["seconds"] = round(time.monotonic() - started, 3)
    text = json.dumps(document, indent=1, sort_keys=True)
    if args.out is not None:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.out)
    else:
        sys.stdout.write(text + "\n")
    return 0 if document["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m checkmate.checkpoint.shadow_memory",
        description="Report the state the shadows hold in memory.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    digest = commands.add_parser("digest", help="digests of the shadows' state (parameters, optimizer)")
    digest.add_argument("--shadow", type=_address, action="append", required=True, help="NAME=HOST[:PORT]")
    digest.add_argument(
        "--iteration", type=int, default=None, help="exactly this iteration (default: latest)"
    )
    digest.add_argument("--timeout", type=float, default=30.0)
    digest.add_argument("--out", type=Path, default=None, help="write the JSON here (default stdout)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    return _digest_command(args)


if __name__ == "__main__":
    sys.exit(main())
