"""Rank 0's messages to the shadows: the job's start state, commit records, fingerprints, job state.

:class:`ShadowMessages` is the DDP agent's component that owns the iteration count and what
the shadows are told about each iteration: the iteration in progress and the one waiting for
its commit, the bucket layout sent, the commit waiting for its job state, the job state
(early and late parts, the last one sent), the data position, the hyperparameters last sent,
the gradient tags (:class:`~checkmate.auth.GradientDigests`) and the commit records. It runs
on the training thread, from the optimizer's step post-hook (:meth:`ShadowMessages.after_step`:
commit, follow the job file), the model's forward pre-hook
(:meth:`ShadowMessages.before_forward`: send the last commit with its final job state), the
GradScaler's ``update`` (a skipped step) and the communication hook (an iteration starts, an
iteration's buckets are all reduced), and takes no lock of its own. It calls the gradients
(:class:`~hosts.ddp_gradients.GradientGuard`: the multiplications and parameters without a
gradient), the links (:class:`~hosts.ddp_links.ShadowLinks`: post, seed, protection, the job
file) and the ring (release the iterations the shadows no longer repair from). Messages:

* :class:`~checkmate.control.JobStart`: parameters, optimizer state and the job
  description, at enable and to every shadow that (re)connects or is added by a job file
  change; then the :class:`~checkmate.control.BucketLayout` it needs;
* :class:`~checkmate.control.Commit` per iteration: learning rates, hyperparameters that
  changed, gradient multiplications, parameters without a gradient, the data position,
  the job state when it changed, and every K-th iteration a fingerprint of rank 0's state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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
from checkmate.fingerprint import FingerprintTurns
from checkmate.fingerprint import cache_for as checksum_cache_for
from checkmate.fingerprint import fingerprint as state_fingerprint
from checkmate.job_state import JobState
from checkmate.job_state import capture as capture_job_state
from checkmate.job_state import merge as merge_job_states
from checkmate.optimizers import describe, non_elementwise_state
from hosts.ddp_config import CheckmateConfig, CheckmateConfigError, _fingerprint_every
from hosts.ddp_gradients import CheckmateStateError, GradientGuard
from hosts.ddp_links import ShadowLinks
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


@dataclass(frozen=True)
class JobContext:
    """What :class:`ShadowMessages` needs of its rank, fixed at enable."""

    rank: int
    workers: tuple[Addr, ...]
    """Every rank's data address, in ring order."""
    initial_state: JobState
    """The job state before the first iteration (captured at enable: a state that cannot travel
    is refused there)."""
    data_position: Any
    """The data position of the first iteration (validated; None: unknown)."""
    release: Callable[[int], None]
    """Forget the ring's iterations through the given one (the shadows repair from the rest)."""


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

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        stateful: Mapping[str, Any],
        job: JobContext,
        gradients: GradientGuard,
        links: ShadowLinks,
    ) -> None:
        """``job``: what this component needs of the rank (its rank, ring, first iteration and
        state); ``module``: the model whose parameters the shadows hold (DDP's ``.module``)."""
        config = links.config
        self._module = module
        self._optimizer = optimizer
        self._stateful = stateful
        self._rank = job.rank
        self._workers = job.workers
        self._release = job.release
        self._gradients = gradients
        self._links = links
        self._start_iteration = config.start_iteration
        self._keep_iterations = config.keep_iterations
        self._iteration = config.start_iteration
        """The next all-reduce iteration."""
        self._uncommitted: int | None = None
        """The last all-reduced iteration whose commit is not made yet (its optimizer step pending)."""
        self._layout_sent: list[BucketSpec] | None = None
        self._job_state: tuple[int, JobState] | None = (config.start_iteration, job.initial_state)
        """(i, the job state before iteration i), captured at i's first forward pass."""
        self._early: tuple[int, JobState] | None = None
        """(t, iteration t's early job state: buffers, stateful objects stepped before the step)."""
        self._sent_job_state: JobState | None = None
        """The job state last sent in a commit or job_start (a commit whose state equals it omits it)."""
        self._pending_commit: Commit | None = None
        """Rank 0: the last step's commit, sent at the next forward pass (when the job state is final)."""
        self._state_checked = False
        self._fingerprint_every = _fingerprint_every(config.fingerprint_every, module)
        self._fingerprint_bytes = config.fingerprint_bytes
        self._turns: FingerprintTurns | None = None
        """Which parameters each fingerprint covers (made at the first fingerprint)."""
        self._last_hyper: list[dict[str, Any]] = []
        self._optimizer_steps = config.optimizer_step
        self._data_position: Any = None
        """Set by :meth:`set_data_position` since the last commit (None: not set)."""
        self._committed_position: Any = job.data_position
        """The data position after the last committed iteration (None: unknown)."""
        self._records: list[Commit] = []
        """Commit records made on this rank (rank 0), for inspection."""
        self._gradient_digests: GradientDigests | None = None
        """Rank 0 (with shadows): tags of each reduced bucket for the commit (checkmate.auth)."""

    # ---- what the agent shows -----------------------------------------------------------------
    @property
    def iteration(self) -> int:
        """The next all-reduce iteration."""
        return self._iteration

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (the job's count: the resumed steps included)."""
        return self._optimizer_steps

    @property
    def records(self) -> list[Commit]:
        """Commit records made on this rank (rank 0), oldest first."""
        return self._records

    @property
    def fingerprint_every(self) -> int:
        """K: rank 0 sends a fingerprint of its state with every K-th commit (0: never)."""
        return self._fingerprint_every

    @property
    def data_position(self) -> Any:
        """The data position after the last committed iteration (None: never set)."""
        return self._committed_position

    def set_data_position(self, position: Any) -> None:
        """The position after this iteration (validated: ValueError naming the problem)."""
        self._data_position = validate_data_position(position)

    # ---- the communication hook's events -------------------------------------------------------
    def gradient_tags(self) -> GradientDigests | None:
        """Rank 0 with shadows: where the reduced buckets' tags go (checkmate.auth); else None."""
        if not self._links.active:
            return None
        if self._gradient_digests is None:
            config = self._links.config
            if config.secret is None:
                raise CheckmateConfigError("the agent's configuration carries no job secret")
            self._gradient_digests = GradientDigests(config.secret, config.job_id)
        return self._gradient_digests

    def iteration_starts(self) -> None:
        """The first bucket of an iteration: one all-reduced without an optimizer step was skipped."""
        if self._uncommitted is not None:
            self._commit(self._uncommitted, skipped=True, capture=False)

    def iteration_reduced(self, layout: list[BucketSpec]) -> None:
        """The last bucket of :attr:`iteration` was handed to the ring: tell the shadows a changed
        layout, and count the iteration (its commit waits for the optimizer step)."""
        if layout != self._layout_sent:
            rebuilt = self._layout_sent is not None
            self._layout_sent = layout
            if self._links.active:
                if rebuilt:
                    # Buckets (and with them parameters) may move between shadows: re-seed every
                    # shadow with the state before this iteration's step, then the new layout
                    # (docs/protocol.md, "Bucket layout changes"). The parameters are untouched
                    # until this iteration's optimizer step, so this is exactly that state.
                    self._links.post(self._job_start(self._iteration))
                self._links.post(BucketLayout(self._links.config.job_id, self._iteration, layout))
        self._uncommitted = self._iteration
        self._iteration += 1

    # ---- the job start ------------------------------------------------------------------------
    def start_messages(self) -> list[Message]:
        """What the shadows get first: the state before the first iteration."""
        return [self._job_start(self._start_iteration)]

    def state_messages(self) -> list[Message]:
        """What a new or restarted shadow gets: the state before :attr:`iteration`, then the layout."""
        messages: list[Message] = [self._job_start(self._iteration)]
        if self._layout_sent is not None:
            messages.append(BucketLayout(self._links.config.job_id, self._iteration, self._layout_sent))
        return messages

    def _job_start(self, start_iteration: int) -> JobStart:
        config = self._links.config
        names = self._gradients.names
        tensors: dict[str, torch.Tensor] = {}
        params = []
        for name, p in self._module.named_parameters():
            params.append(ParamSpec(name, tuple(p.shape), dtype_name(p.dtype)))
            tensors[f"param/{name}"] = p.detach().to("cpu", copy=True)
        state = self._optimizer.state_dict()
        index_to_name: dict[int, str] = {}
        groups = []
        for group, saved in zip(self._optimizer.param_groups, state["param_groups"], strict=True):
            for p, index in zip(group["params"], saved["params"], strict=True):
                index_to_name[index] = names[id(p)]
            hyper = {k: _plain(v) for k, v in group.items() if k != "params"}
            hyper["params"] = [names[id(p)] for p in group["params"]]
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
            job_id=config.job_id,
            world_size=config.world_size,
            workers=list(self._workers),
            parameters=params,
            optimizer={**describe(self._optimizer), "param_groups": groups},
            start_iteration=start_iteration,
            tensors=tensors,
            optimizer_scalars=scalars,
            job=job_description(config, self._workers),
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
        return isinstance(self._stateful[name], LATE_STATEFUL)

    def _capture_early(self) -> JobState:
        early = {n: obj for n, obj in self._stateful.items() if not self._late(n)}
        return capture_job_state(self._module, early)

    def _job_state_before(self, iteration: int) -> JobState:
        """The job state before ``iteration``: iteration - 1's early part with the late part now."""
        if self._job_state is None or self._job_state[0] != iteration:
            early = self._early[1] if self._early is not None and self._early[0] == iteration - 1 else None
            late = {n: obj for n, obj in self._stateful.items() if self._late(n)}
            if early is None:
                state = capture_job_state(self._module, self._stateful, self._optimizer)
            else:
                late_state = capture_job_state(None, late, self._optimizer)
                state = merge_job_states(early, late_state, self._stateful)
            self._job_state = (iteration, state)
        return self._job_state[1]

    # ---- the hooks ----------------------------------------------------------------------------
    def before_forward(self, module: torch.nn.Module, args: Any) -> None:
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
        self._links.before_forward(self._iteration)  # every rank: a published unprotected verdict raises
        if not self._links.active:
            return
        if self._uncommitted is not None and (self._early is None or self._early[0] != self._uncommitted):
            self._early = (self._uncommitted, self._capture_early())
        self._flush_commit()
        self._seed_new_shadows()
        # bounded lag: wait here for the shadows (backpressure) and judge whether they protect the job
        self._links.after_commit(self._seed_new_shadows)

    def flush_at_exit(self) -> None:
        """At interpreter exit without close: send the last step's commit (best effort, 5 s)."""
        if not self._links.active or self._pending_commit is None:
            return
        try:
            self._flush_commit(final=True)
            self._links.flush(5.0)
        except Exception as exc:  # noqa: BLE001 - exiting anyway; say why the last commit may be missing
            logger.warning("checkmate: could not send the last commit at exit: %s", exc)

    def after_scaler_update(self) -> None:
        """A GradScaler's update(): an all-reduced iteration without an optimizer step was skipped."""
        if self._uncommitted is not None:
            self._commit(self._uncommitted, skipped=True)

    def after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step post-hook: commit the all-reduced iteration; rank 0 follows the job file."""
        self._optimizer_steps += 1
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
        if self._rank == 0:
            self._follow_job_file()
        self._release(iteration - self._keep_iterations)

    def finish(self) -> None:
        """At close: commit an iteration left without its step (skipped) and send the last commit."""
        if self._uncommitted is not None:
            self._commit(self._uncommitted, skipped=True, capture=False)
        self._flush_commit(final=True)

    def wait_certified(self, iteration: int, timeout: float) -> bool:
        """Rank 0: send the last step's commit now, then wait until every shadow certified ``iteration``."""
        if not self._links.active:
            return True
        self._flush_commit(final=True)
        return self._links.wait_certified(iteration, timeout, self._seed_new_shadows)

    # ---- commits ------------------------------------------------------------------------------
    def _flush_commit(self, final: bool = False) -> None:
        """Send the pending commit with the job state after its iteration, then state for new shadows.

        ``final`` (wait_certified, close): the commit carries a fingerprint even between two
        K-th iterations, so the shadows can verify, and certify, the iteration waited for.
        """
        commit, self._pending_commit = self._pending_commit, None
        if commit is None or not self._links.active:
            return
        if final and commit.fingerprint is None and self._fingerprint_every > 0:
            commit.fingerprint = self._fingerprint_of(None)  # the last one: the whole state
        state = self._job_state_before(commit.iteration + 1)
        if not state.equals(self._sent_job_state):  # unchanged: absent on the wire
            commit.job_state = self._sent_job_state = state
        self._links.post_commit(commit)
        self._seed_new_shadows()

    def _seed_new_shadows(self) -> None:
        """Links that need state (new or reconnected shadows) get the state before :attr:`iteration`."""
        self._links.seed_new_shadows(self.state_messages)

    def _follow_job_file(self) -> None:
        """Rank 0, after each step: if the job file changed, follow its shadows (a live shadow move)."""
        change = self._links.job_file_change(self._workers)
        if change is not None:
            self._links.follow(change, self._post_pending_before_move)

    def _post_pending_before_move(self) -> None:
        """The shadows leaving get the last step's commit now (its schedulers' state as it is);
        the new ones get the state before the next iteration at its forward pass."""
        pending, self._pending_commit = self._pending_commit, None
        if pending is not None:
            pending.job_state = self._job_state_before(pending.iteration + 1)
            self._sent_job_state = pending.job_state
            self._job_state = None  # taken early: the new shadows' state is taken again
            self._links.post(pending)

    def _commit(self, iteration: int, skipped: bool, capture: bool = True) -> None:
        """Commit ``iteration``; ``capture``: its early job state is final now (else taken earlier)."""
        self._flush_commit()
        self._uncommitted = None
        if self._rank == 0 and self._links.active:
            if capture or self._early is None or self._early[0] != iteration:
                self._early = (iteration, self._capture_early())
        coefficient, scaling = self._gradients.take_scaling()
        no_grad = self._gradients.take_no_grad()
        position, self._data_position = self._data_position, None
        if position is not None:
            self._committed_position = position
        if self._rank != 0:
            return
        changed = hyperparameter_changes(self._optimizer, self._last_hyper)
        commit = Commit(
            job_id=self._links.config.job_id,
            iteration=iteration,
            learning_rates=[float(_plain(g["lr"])) for g in self._optimizer.param_groups],
            clip_coefficient=None if skipped else coefficient,
            skip_step=skipped,
            hyperparameters=changed if any(changed) else [],
            optimizer_step=self._optimizer_steps,
            data_position=position,
            no_grad=[] if skipped else no_grad,
            gradient_scaling=[] if skipped else scaling,
            fingerprint=self._fingerprint(iteration),
            gradient_digests=self._gradient_digests.take(iteration) if self._gradient_digests else None,
        )
        self._records.append(commit)
        if self._links.active:
            # Sent with the job state after the iteration at the next forward pass, wait_certified
            # or close, when the schedulers and scalers have stepped.
            self._pending_commit = commit

    def _fingerprint(self, iteration: int) -> dict[str, dict[str, Any]] | None:
        """Rank 0's state after ``iteration`` (every K-th iteration), for the shadows to compare.

        The whole state, or for a model over ``fingerprint_bytes`` of parameters this turn's
        parameters (:class:`~checkmate.fingerprint.FingerprintTurns`, turn = iteration // K).
        """
        every = self._fingerprint_every
        if not self._links.active or every <= 0 or (iteration + 1) % every:
            return None
        return self._fingerprint_of(iteration // every)

    def _fingerprint_of(self, turn: int | None) -> dict[str, dict[str, Any]]:
        """The fingerprint of turn ``turn`` of the parameters (None: the whole state)."""
        if self._turns is None:
            self._turns = FingerprintTurns.of(self._module.named_parameters(), self._fingerprint_bytes)
        names = self._turns.names(turn) if turn is not None else None
        return state_fingerprint(
            self._module.named_parameters(),
            self._optimizer.state,
            checksum_cache_for(self._optimizer),
            names=names,
            keep=len(self._turns.groups) + 1,
        )


def job_description(config: CheckmateConfig, workers: Sequence[Addr]) -> dict[str, Any] | None:
    """The JobSpec, or without one the implicit shard map: shard key k -> k-th shadow listed."""
    if config.job is not None:
        return config.job.to_json()
    if not config.shadow_control:
        return None
    names = list(config.shadow_control)
    description: dict[str, Any] = {
        "job_id": config.job_id,
        "workers": [f"{h}:{p}" for h, p in workers],
        "shadows": names,
        "shard_to_shadow": {str(k): name for k, name in enumerate(names)},
    }
    if config.tp_degree > 1:  # which TP shard this lane's copies carry
        description.update(tp_degree=config.tp_degree, tp_index=config.tp_index)
    return description
