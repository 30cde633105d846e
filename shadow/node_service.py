"""The shadow node's state service: resume from its own snapshot at start, and restore answers.

At start (``ShadowConfig.resume``) a shadow loads its shard of the latest complete
snapshot and serves it until rank 0 re-seeds it. On the control port, a restore request
gets the state after the iteration asked for (now, or when the apply thread reaches it:
the request waits, bounded), never a state known to differ from the workers'. Captures
take ``_state_lock``, so an answer holds one whole iteration.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

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
)
from shadow.iteration_window import IterationWindow
from shadow.node_state import Capture, Epoch, Job, NodeState
from shadow.optimizer_apply import OptimizerSpec

logger = logging.getLogger(__name__)


class StateService(NodeState):
    """Resume from a snapshot, and the restore answers of a shadow node (``_state_lock``)."""

    def _resume(self, root: Path) -> None:
        """Load this shadow's shard of the latest complete snapshot (served until rank 0 re-seeds)."""
        steps = fmt.complete_steps(root)
        for step in reversed(steps):
            directory = fmt.step_dir(root, step)
            global_state = json.loads((directory / "global.json").read_text())
            extra = global_state.get("extra", {})
            for manifest_path in sorted(directory.glob("shard-*-of-*.json")):
                if extra.get("shards", {}).get(manifest_path.stem) != self.name:
                    continue
                manifest = json.loads(manifest_path.read_text())
                tensors = load_file(str(directory / manifest["file"]))
                start = self._job_start_from_snapshot(global_state, manifest, tensors, extra, step)
                try:
                    attach_job_state(start, fmt.read_job_state(directory, global_state))
                except fmt.CheckpointError as exc:
                    logger.error("shadow %s: step %d's job state is unusable: %s", self.name, step, exc)
                self._load_resumed(start, manifest, step)
                return
        logger.info("shadow %s: no snapshot of its own to resume from in %s", self.name, root)

    def _job_start_from_snapshot(
        self,
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

    def _load_resumed(self, start: JobStart, manifest: dict[str, Any], step: int) -> None:
        owned = {k[len("param/") :] for k in start.tensors if k.startswith("param/")}
        optimizer = self._make_optimizer(start.optimizer, start, owned, self.config.threads())
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
        self._generation += 1
        window = IterationWindow(job.job_id, {}, set(), step + 1, horizon=self.config.horizon)
        self._epoch = Epoch(self._generation, step + 1, {}, set(), window, optimizer, {}, step)
        self._job = job
        self._applied = step
        self._certified = step
        self._last_verified = step  # a snapshot is written of a certified state only
        self._optimizer_step = int(start.extra.get("optimizer_step", 0))
        saved = start.extra.get("data_position")
        self._data_position = None if saved is None else self._checked_position(saved, step)
        self._job_state = job_state_of(start)
        self._restored_from = step
        self._blocked = "resumed from a snapshot: waiting for rank 0's state to rejoin the job"
        logger.info(
            "shadow %s: resumed from its snapshot of step %d (%d parameters)",
            self.name,
            step,
            len(owned),
        )

    def _restore(self, request: RestoreRequest) -> JobStart | RestoreRefused:
        job_id = self._job_id()
        if request.job_id and job_id and request.job_id != job_id:
            why = f"this shadow serves job {job_id}"
            return RestoreRefused(request.job_id, self.name, self._applied, why)
        capture = Capture(request.iteration if request.iteration is not None else -1)
        with self._state_lock:
            if self._epoch is None:
                return RestoreRefused(job_id, self.name, self._applied, "no state yet")
            if self._diverged is not None:
                at = self._diverged["iteration"]
                why = f"state diverged from the workers' after iteration {at}; waiting to be re-seeded"
                return RestoreRefused(job_id, self.name, self._applied, why)
            target = self._applied if request.iteration is None else request.iteration
            if target == self._applied:
                return self._capture_state()
            if target < self._applied:
                return RestoreRefused(
                    job_id, self.name, self._applied, f"ahead: state after iteration {self._applied}"
                )
            capture.iteration = target
            self._captures.setdefault(target, []).append(capture)
        if capture.done.wait(max(0.0, min(request.wait, 600.0))) and capture.result is not None:
            return capture.result
        with self._state_lock:
            waiting = self._captures.get(target, [])
            if capture in waiting:
                waiting.remove(capture)
        if capture.result is not None:
            return capture.result
        return RestoreRefused(
            job_id, self.name, self._applied, f"did not reach iteration {target} within {request.wait}s"
        )

    def _fulfil_captures_locked(self) -> None:
        """Serve restore requests waiting for the state just reached (state lock held)."""
        for target in [t for t in self._captures if t <= self._applied]:
            waiting = self._captures.pop(target)
            same = target == self._applied and self._diverged is None
            result = self._capture_state() if same else None
            for capture in waiting:
                capture.result = result
                capture.done.set()

    def _capture_state(self) -> JobStart:
        """This shard's state after ``self._applied`` (state lock held)."""
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
                "param_groups": self._groups_now(job, epoch),
            },
            start_iteration=self._applied + 1,
            tensors=tensors,
            optimizer_scalars=scalars,
            job=job.spec.to_json() if job.spec is not None else None,
            extra={
                "shadow": self.name,
                "iteration": self._applied,
                # with the divergence check on, the last iteration whose state matched the workers'
                "last_verified": self._last_verified if job.fingerprint_every > 0 else None,
                "optimizer_step": self._optimizer_step,
                "data_position": self._data_position,
                "shard_keys": sorted(job.shard_keys),
            },
        )
        return attach_job_state(answer, self._job_state)
