"""``topologies/examples/train_lm.py`` with a per-iteration record of the workers' exact state.

The fault-injection suite (:mod:`tests.reliability.faultjob`) runs this module
instead of ``train_lm`` itself. It is ``train_lm.main`` unchanged, plus:

* after every iteration, a line in ``FAULTJOB_DIGESTS`` (``{rank}`` is replaced) with
  the SHA-256 of the parameters and of the optimizer state right after the step
  (:func:`checkmate.checkpoint.digest.state_digests`);
* after a restore, a line with the digests of the state the workers restored;
* at the end, the host agent's transport counters (faults injected, retransmissions);
* duplicated and reordered datagrams from ``FAULTJOB_DUPLICATE`` / ``FAULTJOB_REORDER``
  (fractions; the host transport's :class:`hosts.faults.FaultConfig`, which the
  job's environment otherwise configures only with ``CHECKMATE_LOSS``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import hosts
from checkmate.checkpoint.digest import state_digests
from examples import train_lm
from hosts import ddp
from hosts.recovery import optimizer_states_by_name

DIGESTS_ENV = "FAULTJOB_DIGESTS"
DUPLICATE_ENV = "FAULTJOB_DUPLICATE"
REORDER_ENV = "FAULTJOB_REORDER"
GATE_ENV = "FAULTJOB_GATE"
"""A file: while it exists, every rank waits before its next iteration (the suite holds the job
while it restarts a process that takes longer to boot than the whole small job takes to run)."""
STEP_SECONDS_ENV = "FAULTJOB_STEP_SECONDS"
"""Seconds every rank sleeps after each iteration (stands in for a real model's compute)."""


class _Tracker:
    def __init__(self) -> None:
        self.module: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.agent: Any = None
        self.out: IO[str] | None = None

    def open(self) -> None:
        template = os.environ.get(DIGESTS_ENV)
        if template:
            path = Path(template.format(rank=os.environ.get("RANK", "0")))
            path.parent.mkdir(parents=True, exist_ok=True)
            self.out = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed at exit

    def write(self, **record: Any) -> None:
        if self.out is not None:
            self.out.write(json.dumps(record) + "\n")
            self.out.flush()

    def digests(self) -> tuple[str, str]:
        assert self.module is not None and self.optimizer is not None
        return state_digests(
            dict(self.module.named_parameters()), optimizer_states_by_name(self.module, self.optimizer)
        )


TRACKER = _Tracker()


class _TrackedLM(train_lm.TinyLM):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        TRACKER.module = self


def _on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    TRACKER.optimizer = optimizer


class _DigestLog(train_lm.JsonLog):
    def write(self, **record: Any) -> None:
        super().write(**record)
        if "loss" in record and TRACKER.module is not None and TRACKER.optimizer is not None:
            params, optim = TRACKER.digests()
            TRACKER.write(iteration=int(record["iteration"]), params=params, optimizer=optim)
            _between_iterations()


def _between_iterations() -> None:
    time.sleep(float(os.environ.get(STEP_SECONDS_ENV, "0")))
    gate = os.environ.get(GATE_ENV)
    if gate:
        waited = 0.0
        while os.path.exists(gate) and waited < 300.0:
            time.sleep(0.05)
            waited += 0.05
        if waited:
            TRACKER.write(event="held", seconds=round(waited, 2), time=time.time())


_original_resume = hosts.resume


def _resume(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    """``hosts.resume`` (what train_lm calls to restore), recording the restored state's digests."""
    point = _original_resume(model, optimizer, *args, **kwargs)
    if point.restored:
        module = getattr(model, "module", model)
        params, optim = state_digests(
            dict(module.named_parameters()), optimizer_states_by_name(module, optimizer)
        )
        TRACKER.write(
            event="restored",
            iteration=point.restored_iteration,
            source=point.source,
            params=params,
            optimizer=optim,
        )
    return point


_original_enable = hosts.enable_checkmate


def _enable(*args: Any, **kwargs: Any) -> Any:
    TRACKER.agent = _original_enable(*args, **kwargs)
    return TRACKER.agent


_original_from_env = ddp.CheckmateConfig.from_env.__func__  # type: ignore[attr-defined]


def _from_env(
    cls: type[ddp.CheckmateConfig], environ: Mapping[str, str] | None = None
) -> ddp.CheckmateConfig:
    config: ddp.CheckmateConfig = _original_from_env(cls, environ)
    duplicate = float(os.environ.get(DUPLICATE_ENV, "0"))
    reorder = float(os.environ.get(REORDER_ENV, "0"))
    if duplicate or reorder:
        config = replace(config, faults=replace(config.faults, duplicate=duplicate, reorder=reorder))
    return config


def _agent_stats() -> dict[str, Any]:
    agent = TRACKER.agent
    if agent is None:
        return {}
    try:
        stats: dict[str, Any] = agent.stats()
    except (RuntimeError, OSError, AttributeError) as exc:
        return {"error": str(exc)}
    return stats


def main(argv: Sequence[str] | None = None) -> int:
    TRACKER.open()
    TRACKER.write(event="env", gate=os.environ.get(GATE_ENV), step_seconds=os.environ.get(STEP_SECONDS_ENV))
    train_lm.TinyLM = _TrackedLM  # type: ignore[misc]
    train_lm.JsonLog = _DigestLog  # type: ignore[misc]
    hosts.resume = _resume  # type: ignore[attr-defined]
    hosts.enable_checkmate = _enable
    ddp.CheckmateConfig.from_env = classmethod(_from_env)  # type: ignore[method-assign,assignment]
    handle = register_optimizer_step_post_hook(_on_step)
    try:
        status = train_lm.main(argv)
        TRACKER.write(event="done", stats=_agent_stats())
        return status
    finally:
        handle.remove()
        if TRACKER.out is not None:
            TRACKER.out.close()


if __name__ == "__main__":
    sys.exit(main())
