"""Rank 0's messages to the shadows: the job's start state, commit records, fingerprints, job state.

:class:`ShadowMessages` is the agent's part that talks to the shadows over the control
channel (:class:`~hosts.control_channel.ControlChannel`). Everything here runs on the
training thread, from the optimizer's step post-hook (:meth:`_after_step`: commit, follow
the job file), the model's forward pre-hook (:meth:`_before_forward`: send the last commit
with its final job state) and the GradScaler's ``update`` (a skipped step), and takes no
lock of its own: :meth:`ControlChannel.post` queues a message for each link's sender
thread under the channel's lock. Messages:

* :class:`~checkmate.control.JobStart`: parameters, optimizer state and the job
  description, at enable and to every shadow that (re)connects or is added by a job file
  change; then the :class:`~checkmate.control.BucketLayout` it needs;
* :class:`~checkmate.control.Commit` per iteration: learning rates, hyperparameters that
  changed, gradient multiplications, parameters without a gradient, the data position,
  the job state when it changed, and every K-th iteration a fingerprint of rank 0's state.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from checkmate.auth import GradientDigests
from checkmate.control import (
    BucketLayout,
    BucketSpec,
    Commit,
    JobStart,
    Message,
    ParamSpec,
    attach_job_state,
    dtype_name,
    validate_data_position,
)
from checkmate.fingerprint import cache_for as checksum_cache_for
from checkmate.fingerprint import fingerprint as state_fingerprint
from checkmate.job_state import JobState
from checkmate.job_state import capture as capture_job_state
from checkmate.job_state import merge as merge_job_states
from checkmate.optimizers import describe, non_elementwise_state
from hosts.control_channel import ControlChannel, ControlConfig
from hosts.ddp_config import CheckmateConfig, CheckmateConfigError, _file_stamp, read_job_file
from hosts.ddp_gradients import CheckmateStateError
from hosts.protection import ProtectionWatch
from hosts.ring_allreduce import RingAllReduce
from hosts.transport import Addr

logger = logging.getLogger(__name__)


# ---- the job state's late part -----------------------------------------------------------
LATE_STATEFUL = (
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
    torch.amp.GradScaler,
)
"""Stateful objects a loop steps after ``optimizer.step()``: their state is taken at the next forward."""


def _plain(value: Any) -> Any:
    """A param-group value as plain JSON for the shadows' optimizer (tensors as numbers or lists).

    Lossless where ``step()`` reads it (the shadows give the constructor's keys back their
    types); any other key reaches the workers again through the job state, which keeps types.
    """
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def hyperparameter_changes(
    optimizer: torch.optim.Optimizer, last: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per param group, the hyperparameters (``lr`` aside) that changed since ``last``, which is updated."""
    changed: list[dict[str, Any]] = []
    for i, group in enumerate(optimizer.param_groups):
        now = {k: _plain(v) for k, v in group.items() if k not in ("params", "lr")}
        before = last[i] if i < len(last) else {}
        changed.append({k: v for k, v in now.items() if before.get(k) != v})
        if i < len(last):
            last[i].update(now)
    return changed


class ShadowMessages:
    """Rank 0's side of the control channel (other ranks keep the counters and send nothing)."""

    model: torch.nn.parallel.DistributedDataParallel
    optimizer: torch.optim.Optimizer
    config: CheckmateConfig
    rank: int
    names: dict[int, str]
    workers: tuple[Addr, ...]
    ring: RingAllReduce
    channel: ControlChannel | None
    iteration: int
    optimizer_steps: int
    commits: list[Commit]
    stateful: dict[str, Any]
    _job_state: tuple[int, JobState] | None
    _pending_commit: Commit | None
    _early: tuple[int, JobState] | None
    _sent_job_state: JobState | None
    _uncommitted: int | None
    _layout_sent: list[BucketSpec] | None
    _no_grad: list[str]
    _state_checked: bool
    _fingerprint_every: int
    _last_hyper: list[dict[str, Any]]
    _data_position: Any
    _committed_position: Any
    _job_file_stamp: tuple[int, int, int] | None
    _protection: ProtectionWatch | None
    _posted_through: int | None
    """The last iteration whose commit was posted to the shadows."""
    _gradient_digests: GradientDigests | None
    """CommHook's: the reduced buckets' tags (rank 0 with shadows)."""
    _gradient_scaling: Callable[[], tuple[float | None, list[dict[str, Any]]]]
    """GradientGuard's: this iteration's gradient multiplications."""

    def _job_start(self, start_iteration: int) -> JobStart:
        module = self.model.module
        tensors: dict[str, torch.Tensor] = {}
        params = []
        for name, p in module.named_parameters():
            params.append(ParamSpec(name, tuple(p.shape), dtype_name(p.dtype)))
            tensors[f"param/{name}"] = p.detach().to("cpu", copy=True)
        state = self.optimizer.state_dict()
        index_to_name: dict[int, str] = {}
        groups = []
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            for p, index in zip(group["params"], saved["params"], strict=True):
                index_to_name[index] = self.names[id(p)]
            hyper = {k: _plain(v) for k, v in group.items() if k != "params"}
            hyper["params"] = [self.names[id(p)] for p in group["params"]]
            groups.append(hyper)
        scalars: dict[str, dict[str, Any]] = {}
        for index, per_param in state["state"].items():
            name = index_to_name[index]
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"state/{name}/{key}"] = value.detach().to("cpu", copy=True)
                else:
                    scalars.setdefault(name, {})[key] = value
        self._last_hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        start = JobStart(
            job_id=self.config.job_id,
            world_size=self.config.world_size,
            workers=list(self.workers),
            parameters=params,
            optimizer={**describe(self.optimizer), "param_groups": groups},
            start_iteration=start_iteration,
            tensors=tensors,
            optimizer_scalars=scalars,
            job=self._job_description(),
            extra={
                **({} if self._committed_position is None else {"data_position": self._committed_position}),
                # the shadows certify only iterations a fingerprint verified while this is > 0
                **({"fingerprint_every": self._fingerprint_every} if self._fingerprint_every > 0 else {}),
            },
        )
        self._sent_job_state = self._job_state_before(start_iteration)
        return attach_job_state(start, self._sent_job_state)

    # ---- the job state: buffers, stateful objects, param groups -----------------------
    # Two moments: at the optimizer step (or a GradScaler's skip) the iteration's *early* part
    # is final: persistent buffers (the forward passes are done) and the stateful objects a loop
    # advances before the step (data loaders, samplers, cursors, RNG wrappers). The *late* part -
    # LR schedulers and GradScalers, which step after the optimizer, and the param groups they
    # change - is final at the next forward pass (or wait_certified/close): the commit goes then.
    def _late(self, name: str) -> bool:
        return isinstance(self.stateful[name], LATE_STATEFUL)

    def _capture_job_state(self) -> JobState:
        return capture_job_state(self.model.module, self.stateful, self.optimizer)

    def _capture_early(self) -> JobState:
        early = {n: obj for n, obj in self.stateful.items() if not self._late(n)}
        return capture_job_state(self.model.module, early)

    def _job_state_before(self, iteration: int) -> JobState:
        """The job state before ``iteration``: iteration - 1's early part with the late part now."""
        if self._job_state is None or self._job_state[0] != iteration:
            early = self._early[1] if self._early is not None and self._early[0] == iteration - 1 else None
            late = {n: obj for n, obj in self.stateful.items() if self._late(n)}
            if early is None:
                state = self._capture_job_state()
            else:
                state = merge_job_states(early, capture_job_state(None, late, self.optimizer), self.stateful)
            self._job_state = (iteration, state)
        return self._job_state[1]

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: the previous iteration is over; send its commit with its job state.

        Only forward passes with gradients enabled count (not evaluation under
        ``torch.no_grad()``). An all-reduced iteration still waiting for its step has its
        early part taken here (a step skipped without a GradScaler is found only at the
        next all-reduce, when this forward pass has changed the buffers). Raises
        JobStateError naming a stateful object whose state cannot travel; nothing is
        sent then, and the shadows keep the last certified state.
        """
        if not torch.is_grad_enabled():
            return
        if self._protection is not None:  # every rank: a published unprotected verdict raises here
            self._protection.before_forward(self.iteration)
        if self.channel is None:
            return
        if self._uncommitted is not None and (self._early is None or self._early[0] != self._uncommitted):
            self._early = (self._uncommitted, self._capture_early())
        self._flush_commit()
        self._seed_new_shadows()
        if self._protection is not None and self._posted_through is not None:
            # bounded lag: wait here for the shadows (backpressure) and judge whether they protect the job
            self._protection.after_commit(self.channel, self._posted_through, self._seed_new_shadows)

    def _flush_at_exit(self) -> None:
        """At interpreter exit without :meth:`close`: send the last step's commit (best effort, 5 s)."""
        if self.channel is None or self._pending_commit is None:
            return
        try:
            self._flush_commit(final=True)
            self.channel.flush(5.0)
        except Exception as exc:  # noqa: BLE001 - exiting anyway; say why the last commit may be missing
            logger.warning("checkmate: could not send the last commit at exit: %s", exc)

    def _after_scaler_update(self) -> None:
        """A GradScaler's update(): an all-reduced iteration without an optimizer step was skipped."""
        if self._uncommitted is not None:
            self._commit(self._uncommitted, skipped=True)

    def _flush_commit(self, final: bool = False) -> None:
        """Send the pending commit with the job state after its iteration, then state for new shadows.

        ``final`` (wait_certified, close): the commit carries a fingerprint even between two
        K-th iterations, so the shadows can verify, and certify, the iteration waited for.
        """
        commit, self._pending_commit = self._pending_commit, None
        if commit is None or self.channel is None:
            return
        if final and commit.fingerprint is None and self._fingerprint_every > 0:
            commit.fingerprint = state_fingerprint(
                self.model.module.named_parameters(), self.optimizer.state, checksum_cache_for(self.optimizer)
            )
        state = self._job_state_before(commit.iteration + 1)
        if not state.equals(self._sent_job_state):  # unchanged: absent on the wire
            commit.job_state = self._sent_job_state = state
        self.channel.post(commit)
        self._posted_through = commit.iteration
        self._seed_new_shadows()

    def _seed_new_shadows(self) -> None:
        """Links that need state (new or reconnected shadows) get the state before :attr:`iteration`."""
        if self.channel is not None and self.channel.needs_state():
            self.channel.post_state(lambda: self._state_messages(self.iteration))

    def _job_description(self) -> dict[str, Any] | None:
        """The JobSpec, or without one the implicit shard map: shard key k -> k-th shadow listed."""
        if self.config.job is not None:
            return self.config.job.to_json()
        if not self.config.shadow_control:
            return None
        names = list(self.config.shadow_control)
        description: dict[str, Any] = {
            "job_id": self.config.job_id,
            "workers": [f"{h}:{p}" for h, p in self.workers],
            "shadows": names,
            "shard_to_shadow": {str(k): name for k, name in enumerate(names)},
        }
        if self.config.tp_degree > 1:  # which TP shard this lane's copies carry
            description.update(tp_degree=self.config.tp_degree, tp_index=self.config.tp_index)
        return description

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizer_steps += 1
        if not self._state_checked:  # the optimizer's state exists from its first step on
            self._state_checked = True
            problem = non_elementwise_state(optimizer)
            if problem is not None:
                raise CheckmateStateError(
                    f"checkmate: {problem}: Checkmate's checkpoint stores optimizer state element by "
                    "element, so this optimizer's state could not be restored; nothing after the initial "
                    "state is certified"
                )
        if self._uncommitted is None:
            return
        iteration = self._uncommitted
        self._commit(iteration, skipped=False)
        if self.rank == 0:
            self._follow_job_file()
        self.ring.release_through(iteration - self.config.keep_iterations)

    def _follow_job_file(self) -> None:
        """Rank 0, after each step: if the job file changed, follow its shadows (a live shadow move)."""
        path = self.config.job_file
        stamp = _file_stamp(path)
        if path is None or stamp is None or stamp == self._job_file_stamp:
            return
        self._job_file_stamp = stamp
        try:
            job, workers, shadows = read_job_file(path)
        except CheckmateConfigError as exc:
            logger.warning("checkmate: %s; keeping the current shadows", exc)
            return
        if job.job_id != self.config.job_id or workers != self.workers:
            logger.warning(
                "checkmate: %s now names job %d with workers %s; a new job or other workers need a "
                "restart: keeping job %d's shadows",
                path,
                job.job_id,
                [f"{h}:{p}" for h, p in workers],
                self.config.job_id,
            )
            return
        if job == self.config.job and shadows == dict(self.config.shadow_control):
            return
        self.config = dataclasses.replace(self.config, job=job, shadow_control=shadows)
        if self.channel is None:
            if shadows:
                self.channel = ControlChannel(
                    self.config.job_id,
                    shadows,
                    ControlConfig(connect_timeout=self.config.shadow_connect_timeout),
                    secret=self.config.secret,
                )
                self.channel.wait_connected(self.config.shadow_connect_timeout)
        else:
            # The shadows leaving get the last step's commit now (its schedulers' state as it is);
            # the new ones get the state before the next iteration at its forward pass.
            pending, self._pending_commit = self._pending_commit, None
            if pending is not None:
                pending.job_state = self._job_state_before(pending.iteration + 1)
                self._sent_job_state = pending.job_state
                self._job_state = None  # taken early: the new shadows' state is taken again
                self.channel.post(pending)
            added, removed = self.channel.set_shadows(shadows)
            # Like at start: give new shadows a moment to connect, so they get this step's state.
            self.channel.wait_connected(self.config.shadow_connect_timeout, names=added)
            logger.info(
                "checkmate: %s changed: shadows now %s (new: %s, left: %s); new ones get the state "
                "after the next step",
                path,
                sorted(shadows),
                added or "none",
                removed or "none",
            )

    def _final_state_to_rejoining_shadows(self, channel: ControlChannel, timeout: float) -> None:
        """At close: a shadow whose link is down or waiting for state (it restarted) gets the final state.

        During training a restarted shadow is re-seeded after the next optimizer step;
        one that comes back during the last steps would otherwise end without the
        job's final state. Waits at most ``timeout`` for such a link to connect.
        """
        if all(link.connected and not link.needs_state for link in channel.links):
            return
        channel.wait_connected(timeout)
        if channel.post_state(lambda: self._state_messages(self.iteration)):
            logger.info(
                "checkmate: gave the final state (after iteration %d) to a rejoining shadow",
                self.iteration - 1,
            )
        missing = [link.name for link in channel.links if not link.connected]
        if missing:
            logger.warning(
                "checkmate: shadows %s unreachable at close: they do not hold the state after iteration %d",
                ", ".join(missing),
                self.iteration - 1,
            )

    def _state_messages(self, start_iteration: int) -> list[Message]:
        messages: list[Message] = [self._job_start(start_iteration)]
        if self._layout_sent is not None:
            messages.append(BucketLayout(self.config.job_id, start_iteration, self._layout_sent))
        return messages

    def _commit(self, iteration: int, skipped: bool, capture: bool = True) -> None:
        """Commit ``iteration``; ``capture``: its early job state is final now (else taken earlier)."""
        self._flush_commit()
        self._uncommitted = None
        if self.rank == 0 and self.channel is not None:
            if capture or self._early is None or self._early[0] != iteration:
                self._early = (iteration, self._capture_early())
        coefficient, scaling = self._gradient_scaling()
        no_grad, self._no_grad = self._no_grad, []
        position, self._data_position = self._data_position, None
        if position is not None:
            self._committed_position = position
        if self.rank != 0:
            return
        changed = hyperparameter_changes(self.optimizer, self._last_hyper)
        commit = Commit(
            job_id=self.config.job_id,
            iteration=iteration,
            learning_rates=[float(_plain(g["lr"])) for g in self.optimizer.param_groups],
            clip_coefficient=None if skipped else coefficient,
            skip_step=skipped,
            hyperparameters=changed if any(changed) else [],
            optimizer_step=self.optimizer_steps,
            data_position=position,
            no_grad=[] if skipped else no_grad,
            gradient_scaling=[] if skipped else scaling,
            fingerprint=self._fingerprint(iteration),
            gradient_digests=self._gradient_digests.take(iteration) if self._gradient_digests else None,
        )
        self.commits.append(commit)
        if self.channel is not None:
            # Sent with the job state after the iteration at the next forward pass, wait_certified
            # or close, when the schedulers and scalers have stepped.
            self._pending_commit = commit

    def _fingerprint(self, iteration: int) -> dict[str, dict[str, Any]] | None:
        """Rank 0's state after ``iteration`` (every K-th iteration), for the shadows to compare."""
        every = self._fingerprint_every
        if self.channel is None or every <= 0 or (iteration + 1) % every:
            return None
        named = self.model.module.named_parameters()
        return state_fingerprint(named, self.optimizer.state, checksum_cache_for(self.optimizer))

    @property
    def divergences(self) -> list[dict[str, Any]]:
        """Rank 0: every divergence a shadow reported (iteration, shadow, tensors that differ)."""
        return list(self.channel.divergences) if self.channel is not None else []

    def set_data_position(self, position: Any) -> None:
        """Record where to resume reading data if iteration t is the last one restored.

        Call it in iteration t *before* ``optimizer.step()`` (a call after the step
        belongs to iteration t + 1) with the position after t: the data iteration
        t + 1 starts with, e.g. ``{"epoch": 2, "batch": 118}`` or a sampler's state
        dict. Rank 0 sends it with iteration t's commit record; the shadows keep it
        with the state after t, and a restore of that state returns it as
        ``data_position`` (also stored in their snapshots' ``extra``). For a step
        that was skipped (a loss-scaler skip) the value set when the next
        iteration's gradients start to be reduced (or at :meth:`close`) is sent.
        An iteration without a call keeps the previous iteration's position. Only
        rank 0's value travels; other ranks may call it too (it is validated and
        otherwise ignored).

        ``position`` is any JSON value but None, at most 64 KiB as compact JSON
        (:data:`checkmate.control.MAX_DATA_POSITION_BYTES`), no NaN or infinities; it
        is copied at once (later changes to the object do not travel), and comes
        back as JSON gives it back (tuples as lists, dictionary keys as strings).
        Raises ValueError naming the problem otherwise.
        """
        self._data_position = validate_data_position(position)

    @property
    def data_position(self) -> Any:
        """The data position after the last committed iteration (None: never set)."""
        return self._committed_position

    def wait_certified(self, iteration: int, timeout: float) -> bool:
        """On rank 0: wait (at most ``timeout``) until every shadow has certified ``iteration``.

        Other ranks have no control channel and return True at once. The last step's
        commit is sent now if the next forward pass has not sent it yet, with the LR
        schedulers' and GradScalers' state as it is now: call this after
        ``scheduler.step()`` / ``scaler.update()``.
        """
        if self.channel is None:
            return True
        self._flush_commit(final=True)
        deadline = time.monotonic() + timeout
        while not self.channel.wait_certified(iteration, min(0.05, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                return False
            # A shadow that diverged (or restarted) meanwhile asks for state: no forward pass will
            # come to send it, so it gets the state after the last step now.
            self._seed_new_shadows()
        return True
