"""The shadow node's state service: the shard's state, resume from its own snapshot, restore answers.

The :class:`StateService` owns the state this shadow holds for its shard: the epoch's
optimizer (parameters and optimizer state), the iteration it reflects, the workers' data
position and job state after it, whether it is known to match rank 0's (the last verified
iteration, a divergence), and the restore requests waiting for an iteration. Its ``_lock``
(a condition: notified whenever the state moves) is held while the state changes or is
captured, so an answer holds one whole iteration. The apply thread steps it
(:meth:`StateService.step`), the control server re-seeds it (:meth:`StateService.install`).

At start (``ShadowConfig.resume``) a shadow loads its shard of the latest complete
snapshot and serves it until rank 0 re-seeds it. On the control port, a restore request
gets the state after the iteration asked for (now, or when the apply thread reaches it:
the request waits, bounded), never a state known to differ from the workers'.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file

from checkmate import checkpoint as fmt
from checkmate.control import (
    JobStart,
    ParamSpec,
    RestoreRefused,
    RestoreRequest,
    attach_job_state,
    job_state_of,
    torch_dtype,
)
from checkmate.fingerprint import cache_for as checksum_cache_for
from checkmate.fingerprint import fingerprint as state_fingerprint
from checkmate.fingerprint import mismatches as fingerprint_mismatches
from checkmate.job_state import JobState
from shadow.iteration_window import IterationWindow
from shadow.node_state import (
    Capture,
    CommitEntry,
    Drops,
    Epoch,
    Job,
    ShadowConfig,
    checked_position,
    make_optimizer,
)
from shadow.optimizer_apply import OptimizerSpec, StepRecord
from shadow.snapshots import Snapshot

logger = logging.getLogger(__name__)

FINGERPRINT_CACHE_CALLS = 16
"""Fingerprint calls whose tensors' views a shadow keeps: rank 0 may send them in turns
(:class:`~checkmate.fingerprint.FingerprintTurns`), each naming other parameters."""


class Resumed(NamedTuple):
    """What a shadow resumed from its snapshot: the job and epoch the other components start with."""

    job: Job
    epoch: Epoch
    step: int


class Stepped(NamedTuple):
    """One iteration applied to the state."""

    divergence: dict[str, Any] | None
    """The report when the state differs from rank 0's fingerprint (the state is halted), else None."""
    elements: int
    """Elements stepped (the owned parameters')."""


class StateService:
    """This shard's state, its snapshots' resume and the restore answers (``_lock``)."""

    def __init__(self, config: ShadowConfig, drops: Drops) -> None:
        self._config = config
        self._name = config.name
        self._drops = drops
        self._lock = threading.Condition(threading.Lock())
        """Held while the state changes or is captured; notified whenever it moves."""
        self._epoch: Epoch | None = None
        self._job: Job | None = None
        self._applied = -1
        self._optimizer_step = 0
        self._data_position: Any = None
        """The workers' data position after ``_applied`` (None: unknown)."""
        self._job_state: JobState | None = None
        """The job state after ``_applied`` (buffers, stateful objects; None: none sent)."""
        self._last_verified = -1
        """The last iteration whose state matched rank 0's fingerprint (or was seeded by rank 0)."""
        self._diverged: dict[str, Any] | None = None
        """Set when the state differed from rank 0's fingerprint, until rank 0 re-seeds this shadow."""
        self._last_divergence: dict[str, Any] | None = None
        self._divergences = 0
        self._fingerprints_checked = 0
        self._restored_from: int | None = None
        self._captures: dict[int, list[Capture]] = {}

    def resume(self, root: Path) -> Resumed | None:
        """Load this shadow's shard of the latest complete snapshot (served until rank 0 re-seeds)."""
        steps = fmt.complete_steps(root)
        for step in reversed(steps):
            directory = fmt.step_dir(root, step)
            global_state = json.loads((directory / "global.json").read_text())
            extra = global_state.get("extra", {})
            for manifest_path in sorted(directory.glob("shard-*-of-*.json")):
                if extra.get("shards", {}).get(manifest_path.stem) != self._name:
                    continue
                manifest = json.loads(manifest_path.read_text())
                tensors = load_file(str(directory / manifest["file"]))
                start = self._job_start_from_snapshot(global_state, manifest, tensors, extra, step)
                try:
                    attach_job_state(start, fmt.read_job_state(directory, global_state))
                except fmt.CheckpointError as exc:
                    logger.error("shadow %s: step %d's job state is unusable: %s", self._name, step, exc)
                return self._load_resumed(start, manifest, step)
        logger.info("shadow %s: no snapshot of its own to resume from in %s", self._name, root)
        return None

    @staticmethod
    def _job_start_from_snapshot(
        global_state: dict[str, Any],
        manifest: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        extra: dict[str, Any],
        step: int,
    ) -> JobStart:
        flat: dict[str, torch.Tensor] = {}
        for entry in manifest["entries"]:
            key = "param" if entry["state"] == fmt.PARAM_STATE else "state"
            shape = global_state["parameters"][entry["name"]]["shape"]
            value = tensors[entry["key"]]
            if key == "param":
                flat[f"param/{entry['name']}"] = value.reshape(shape)
            else:
                flat[f"state/{entry['name']}/{entry['state']}"] = value
        parameters = [
            ParamSpec(n, tuple(m["shape"]), m["dtype"].removeprefix("torch."))
            for n, m in global_state["parameters"].items()
        ]
        return JobStart(
            job_id=int(extra.get("job_id", 0)),
            world_size=0,
            workers=[],
            parameters=parameters,
            optimizer=global_state["optimizer"],
            start_iteration=step + 1,
            tensors=flat,
            extra=dict(extra),
        )

    def _load_resumed(self, start: JobStart, manifest: dict[str, Any], step: int) -> Resumed:
        owned = {k[len("param/") :] for k in start.tensors if k.startswith("param/")}
        optimizer = make_optimizer(start.optimizer, start, owned, self._config.threads())
        job = Job(
            job_id=start.job_id,
            world_size=0,
            workers=[],
            parameters=start.parameters,
            optimizer=start.optimizer,
            shard_keys=set(),
            shard_index=manifest["shard"],
            num_shards=manifest["num_shards"],
            spec=None,
        )
        window = IterationWindow(job.job_id, {}, set(), step + 1, horizon=self._config.horizon)
        epoch = Epoch(1, step + 1, {}, set(), window, optimizer, {}, step)
        saved = start.extra.get("data_position")
        position = None if saved is None else checked_position(self._name, self._drops, saved, step)
        with self._lock:
            self._epoch = epoch
            self._job = job
            self._applied = step
            self._last_verified = step  # a snapshot is written of a certified state only
            self._optimizer_step = int(start.extra.get("optimizer_step", 0))
            self._data_position = position
            self._job_state = job_state_of(start)
            self._restored_from = step
        logger.info(
            "shadow %s: resumed from its snapshot of step %d (%d parameters)",
            self._name,
            step,
            len(owned),
        )
        return Resumed(job, epoch, step)

    # -- what the control server and the apply thread change -----------------------------------

    def forget_epoch(self) -> None:
        """A job_start: the state it brings is installed with its layout; none is served meanwhile."""
        with self._lock:
            self._epoch = None

    def install(self, epoch: Epoch, job: Job, start: JobStart) -> None:
        """Re-seed: ``start``'s state (rank 0's, before ``epoch``'s first iteration) is this shadow's now."""
        with self._lock:
            self._epoch = epoch
            self._job = job
            self._applied = start.start_iteration - 1
            self._optimizer_step = int(start.extra.get("optimizer_step", self._optimizer_step))
            self._data_position = start.extra.get("data_position")
            self._job_state = job_state_of(start)
            self._restored_from = None
            self._last_verified = start.start_iteration - 1  # rank 0's own state
            self._diverged = None
            self._fulfil_captures()
            self._lock.notify_all()

    def step(
        self, epoch: Epoch, step: StepRecord, gradients: dict[str, torch.Tensor], entry: CommitEntry
    ) -> Stepped | None:
        """Apply one iteration, compare the state with rank 0's fingerprint; None if ``epoch`` was replaced.

        A state that differs from rank 0's is never handed out: the divergence is recorded
        (restores refused, nothing certified) until rank 0 re-seeds this shadow.
        """
        with self._lock:
            if self._epoch is not epoch:
                return None  # re-seeded meanwhile: this iteration is part of the new state
            optimizer = epoch.optimizer
            optimizer.apply(step, gradients)
            differs = None
            if entry.fingerprint is not None:
                # only what rank 0's fingerprint covers (all, or this turn's parameters and of them
                # the ones this shadow holds: fingerprint.mismatches compares names in both)
                mine = state_fingerprint(
                    optimizer.parameters.items(),
                    optimizer.optimizer.state,
                    checksum_cache_for(optimizer),
                    names=entry.fingerprint.keys(),
                    keep=FINGERPRINT_CACHE_CALLS,
                )
                differs = fingerprint_mismatches(entry.fingerprint, mine)
            self._applied = step.iteration
            self._optimizer_step = entry.optimizer_step
            if entry.sets_position:
                self._data_position = entry.data_position
            if entry.job_state is not None:
                self._job_state = entry.job_state
            report = None
            if differs:
                report = self._diverge(step.iteration, differs)
            else:
                if differs is not None:
                    self._fingerprints_checked += 1
                    self._last_verified = step.iteration
                self._fulfil_captures()
            self._lock.notify_all()
            return Stepped(report, sum(p.numel() for p in optimizer.parameters.values()))

    def _diverge(self, iteration: int, differs: list[str]) -> dict[str, Any]:
        """The state after ``iteration`` differs from rank 0's (lock held): the divergence report."""
        self._fingerprints_checked += 1
        self._divergences += 1
        report = {
            "iteration": iteration,
            "last_verified": self._last_verified,
            "mismatches": differs[:20],
            "mismatched_tensors": len(differs),
            "time": time.time(),
        }
        self._diverged = report
        self._last_divergence = report
        return report

    # -- what the others read ------------------------------------------------------------------

    @property
    def applied(self) -> int:
        """The last iteration whose state this shadow holds (-1: none)."""
        with self._lock:
            return self._applied

    def wait_applied(self, iteration: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._applied < iteration:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.1))
            return True

    def diverged(self) -> bool:
        """Whether the state is known to differ from the workers' (halted until rank 0 re-seeds)."""
        with self._lock:
            return self._diverged is not None

    def verified(self, iteration: int, epoch: Epoch | None = None) -> bool:
        """Whether the state after ``iteration`` is known to match the workers' (certifiable).

        While rank 0 sends fingerprints (every K-th iteration and the last one it waits for)
        only an iteration up to the last verified one (seeded by rank 0, or its fingerprint
        matched); without fingerprints (K = 0, GPU parameters) on trust. Never while diverged,
        nor for a replaced ``epoch``.
        """
        with self._lock:
            if self._diverged is not None or (epoch is not None and self._epoch is not epoch):
                return False
            job = self._job
            return job is None or job.fingerprint_every <= 0 or iteration <= self._last_verified

    def snapshot_source(self) -> tuple[Epoch, Job, int] | None:
        """The epoch, job and iteration of the state held now (None: none, or diverged)."""
        with self._lock:
            if self._epoch is None or self._job is None or self._applied < 0:
                return None
            return self._epoch, self._job, self._applied

    def snapshot(self, job: Job, epoch: Epoch, iteration: int) -> Snapshot:
        """The snapshot of ``epoch``'s state, taken as of now (called by the snapshotter's writer)."""
        with self._lock:
            named = list(epoch.optimizer.parameters.items())
            states = fmt.capture_states(named, epoch.optimizer.optimizer)
            for name, tensor in epoch.static.items():
                states[name] = {fmt.PARAM_STATE: tensor.clone()}
            groups = _groups_now(job, epoch)
            position = self._data_position
            job_state = self._job_state
            optimizer_step = self._optimizer_step
        parameters = {p.name: (list(p.shape), str(torch_dtype(p.dtype))) for p in job.parameters}
        return Snapshot(
            step=iteration,
            shard=job.shard_index,
            num_shards=job.num_shards,
            states=states,
            parameters=parameters,
            optimizer={**OptimizerSpec.from_json(job.optimizer).class_fields(), "param_groups": groups},
            extra={
                "job_id": job.job_id,
                "iteration": iteration,
                "optimizer_step": optimizer_step,
                "data_position": position,
                "shards": self._shard_owners(job),
                **(job.spec.tp_fields() if job.spec is not None else {}),  # which TP shard (a TP x DP lane)
            },
            job_state=job_state,
        )

    def _shard_owners(self, job: Job) -> dict[str, str]:
        """Shard file stem -> shadow name, so a restarted shadow finds its own shard."""
        owners = sorted(set(job.spec.shard_to_shadow.values())) if job.spec is not None else [self._name]
        return {fmt.shard_stem(i, len(owners)): name for i, name in enumerate(owners)}

    def parameters(self) -> dict[str, torch.Tensor]:
        """Clones of the owned parameters (bucketed and static)."""
        with self._lock:
            epoch = self._epoch
            if epoch is None:
                return {}
            out = {n: p.detach().clone() for n, p in epoch.optimizer.parameters.items()}
            out.update({n: t.clone() for n, t in epoch.static.items()})
            return out

    def optimizer_states(self) -> dict[str, dict[str, torch.Tensor]]:
        with self._lock:
            epoch = self._epoch
            if epoch is None:
                return {}
            return {
                n: {k: torch.as_tensor(v).clone() for k, v in epoch.optimizer.optimizer_state(n).items()}
                for n in epoch.optimizer.parameters
            }

    def waiting_restores(self) -> list[int]:
        """The iterations restore requests wait for."""
        with self._lock:
            return sorted(self._captures)

    def status(self) -> dict[str, Any]:
        """The status document's fields about the state held."""
        with self._lock:
            epoch = self._epoch
            return {
                "applied_iteration": self._applied,
                "verified_iteration": self._last_verified,
                "divergence": self._diverged,
                "last_divergence": self._last_divergence,
                "divergences": self._divergences,
                "fingerprints_checked": self._fingerprints_checked,
                "optimizer_step": self._optimizer_step,
                "restored_from_snapshot": self._restored_from,
                "parameters": len(epoch.optimizer.parameters) + len(epoch.static) if epoch else 0,
                "elements": sum(p.numel() for p in epoch.optimizer.parameters.values()) if epoch else 0,
            }

    def close(self) -> None:
        """Stop the optimizer's apply threads (an epoch replaced earlier: collected)."""
        with self._lock:
            epoch = self._epoch
        if epoch is not None:
            epoch.optimizer.close()

    # -- restore answers -----------------------------------------------------------------------

    def restore(self, request: RestoreRequest, job_id: int) -> JobStart | RestoreRefused:
        """The state after the iteration asked for (waiting for it, bounded), or why not."""
        if request.job_id and job_id and request.job_id != job_id:
            why = f"this shadow serves job {job_id}"
            return RestoreRefused(request.job_id, self._name, self._applied, why)
        capture = Capture(request.iteration if request.iteration is not None else -1)
        with self._lock:
            if self._epoch is None:
                return RestoreRefused(job_id, self._name, self._applied, "no state yet")
            if self._diverged is not None:
                at = self._diverged["iteration"]
                why = f"state diverged from the workers' after iteration {at}; waiting to be re-seeded"
                return RestoreRefused(job_id, self._name, self._applied, why)
            target = self._applied if request.iteration is None else request.iteration
            if target == self._applied:
                return self._capture_state()
            if target < self._applied:
                return RestoreRefused(
                    job_id, self._name, self._applied, f"ahead: state after iteration {self._applied}"
                )
            capture.iteration = target
            self._captures.setdefault(target, []).append(capture)
        if capture.done.wait(max(0.0, min(request.wait, 600.0))) and capture.result is not None:
            return capture.result
        with self._lock:
            waiting = self._captures.get(target, [])
            if capture in waiting:
                waiting.remove(capture)
        if capture.result is not None:
            return capture.result
        return RestoreRefused(
            job_id, self._name, self._applied, f"did not reach iteration {target} within {request.wait}s"
        )

    def _fulfil_captures(self) -> None:
        """Serve restore requests waiting for the state just reached (lock held)."""
        for target in [t for t in self._captures if t <= self._applied]:
            waiting = self._captures.pop(target)
            same = target == self._applied and self._diverged is None
            result = self._capture_state() if same else None
            for capture in waiting:
                capture.result = result
                capture.done.set()

    def _capture_state(self) -> JobStart:
        """This shard's state after ``self._applied`` (lock held)."""
        epoch, job = self._epoch, self._job
        assert epoch is not None and job is not None
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for name, parameter in epoch.optimizer.parameters.items():
            tensors[f"param/{name}"] = parameter.detach().clone()
            for key, value in epoch.optimizer.optimizer_state(name).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"state/{name}/{key}"] = value.detach().clone()
                else:
                    scalars.setdefault(name, {})[key] = value
        for name, tensor in epoch.static.items():
            tensors[f"param/{name}"] = tensor.clone()
        answer = JobStart(
            job_id=job.job_id,
            world_size=job.world_size,
            workers=list(job.workers),
            parameters=list(job.parameters),
            optimizer={
                **OptimizerSpec.from_json(job.optimizer).class_fields(),
                "param_groups": _groups_now(job, epoch),
            },
            start_iteration=self._applied + 1,
            tensors=tensors,
            optimizer_scalars=scalars,
            job=job.spec.to_json() if job.spec is not None else None,
            extra={
                "shadow": self._name,
                "iteration": self._applied,
                # with the divergence check on, the last iteration whose state matched the workers'
                "last_verified": self._last_verified if job.fingerprint_every > 0 else None,
                "optimizer_step": self._optimizer_step,
                "data_position": self._data_position,
                "shard_keys": sorted(job.shard_keys),
            },
        )
        return attach_job_state(answer, self._job_state)


def _groups_now(job: Job, epoch: Epoch) -> list[dict[str, Any]]:
    """Param groups with the hyperparameters now in force and every parameter's name."""
    groups = []
    for spec_group, live in zip(
        job.optimizer["param_groups"], epoch.optimizer.optimizer.param_groups, strict=True
    ):
        group = {k: (list(v) if isinstance(v, tuple) else v) for k, v in live.items() if k != "params"}
        group["params"] = list(spec_group["params"])
        groups.append(group)
    return groups
