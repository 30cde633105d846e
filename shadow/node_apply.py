"""The shadow node's apply thread: optimizer steps in iteration order, the divergence check, certification.

It takes the next ready iteration (its commit here, every owned bucket complete) under
``_lock``, applies it with :class:`~shadow.optimizer_apply.ShadowOptimizer` and compares
the state with rank 0's fingerprint under ``_state_lock`` (never both at once), then
certifies the iteration to rank 0 when its state is known to match, or reports a
divergence and stops applying until rank 0 re-seeds the shadow; a certified iteration
is offered to the :class:`~shadow.snapshots.Snapshotter` (which writes on its own thread).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from checkmate import checkpoint as fmt
from checkmate.control import Certified, Diverged, torch_dtype
from checkmate.fingerprint import cache_for as checksum_cache_for
from checkmate.fingerprint import fingerprint as state_fingerprint
from checkmate.fingerprint import mismatches as fingerprint_mismatches
from shadow.node_state import Epoch, Job, NodeState
from shadow.optimizer_apply import OptimizerSpec
from shadow.snapshots import Snapshot

logger = logging.getLogger(__name__)


class Applier(NodeState):
    """The apply thread's part of a shadow node: apply, check, certify, snapshot."""

    def _apply_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                epoch = self._epoch
                pending = None
                if epoch is not None and self._diverged is None:  # diverged: halted until re-seeded
                    nxt = epoch.window.next_iteration
                    if nxt in self._commits:
                        waiting = epoch.window.pending.get(nxt)
                        if waiting is None or waiting.step is None:
                            epoch.window.commit(self._commits[nxt].record)
                    pending = epoch.window.ready()
                if pending is None:
                    self._lock.wait(0.05)
                    continue
                assert epoch is not None
                entry = self._commits[pending.iteration]
                gradients = epoch.window.gradients(pending)
            assert pending.step is not None
            forged = self._gradient_check.forged(self._job_id(), entry.gradient_digests, pending)
            if forged:  # never applied: copies from outside the job (docs/security.md)
                self._refuse_forged(epoch, pending.iteration, forged)
                continue
            started = time.perf_counter()
            with self._state_lock:
                if self._epoch is not epoch:
                    continue  # re-seeded meanwhile: this iteration is part of the new state
                epoch.optimizer.apply(pending.step, gradients)
                differs = None
                if entry.fingerprint is not None:
                    mine = state_fingerprint(
                        epoch.optimizer.parameters.items(),
                        epoch.optimizer.optimizer.state,
                        checksum_cache_for(epoch.optimizer),
                    )
                    differs = fingerprint_mismatches(entry.fingerprint, mine)
                self._applied = pending.iteration
                self._optimizer_step = entry.optimizer_step
                if entry.sets_position:
                    self._data_position = entry.data_position
                if entry.job_state is not None:
                    self._job_state = entry.job_state
                if not differs:  # a state that differs from rank 0's is never handed out
                    self._fulfil_captures_locked()
            elapsed = time.perf_counter() - started
            with self._lock:
                # Re-seeded meanwhile (rank 0's fresh state replaced this epoch): nothing of this
                # iteration is reported, certified or persisted.
                current = self._epoch is epoch
                if current:
                    epoch.window.advance()
                    self._commits.pop(pending.iteration, None)
                    if self._repairs is not None:
                        self._repairs.forget_before(pending.iteration + 1)
                    self._drain_stash()
                self._blocked = None
                self.stats.applied_iterations += 1
                self.stats.apply_seconds += elapsed
                self.stats.last_apply_seconds = elapsed
                self.stats.applied_elements += sum(p.numel() for p in epoch.optimizer.parameters.values())
                self.stats.last_commit_to_apply_seconds = time.monotonic() - entry.arrival
                report = None
                if current and differs:
                    report = self._diverge_locked(pending.iteration, differs)
                elif current and differs is not None:
                    self.stats.fingerprints_checked += 1
                    self._last_verified = pending.iteration
                self._lock.notify_all()
            if report is not None:
                self._report_divergence(report)
                continue  # neither certified nor persisted: rank 0 re-seeds this shadow
            if current and self._certify(pending.iteration, epoch):
                self._maybe_snapshot(epoch, pending.iteration)

    def _refuse_forged(self, epoch: Epoch, iteration: int, forged: list[tuple[int, str]]) -> None:
        """Buckets of ``iteration`` whose copies fail rank 0's gradient tags: repair them, never apply them.

        Their copies are thrown away and the buckets filled again from the workers' repair
        answers (authenticated by the job's MAC; copies that arrive meanwhile are refused), so
        an injector costs the shadow a repair round trip per iteration, not a re-seed. Only if a
        repaired bucket fails its tag too (the workers themselves disagree with rank 0) is the
        iteration dropped and rank 0 asked for fresh state.
        """
        with self._lock:
            current = self._epoch is epoch
            repairing = [b for b, _ in forged if current and epoch.window.refuse_copies(iteration, b)]
            reseed = current and len(repairing) < len(forged)
            if reseed:  # halted here until rank 0's fresh state replaces this epoch
                epoch.window.pending.pop(iteration, None)
                self._commits.pop(iteration, None)
            elif self._repairs is not None:
                for bucket_id in repairing:
                    self._repairs.restart(iteration, bucket_id)
            self._drop("forged_gradient")
            conn = self._control_conn
        bucket_id, why = forged[0]
        if not reseed:
            logger.warning(
                "shadow %s: iteration %d NOT applied yet: bucket %d: %s; its copies are refused and "
                "%d bucket(s) repaired from the workers",
                self.name,
                iteration,
                bucket_id,
                why,
                len(repairing),
            )
            self._wake.set()  # the maintenance thread plans the repair now
            return
        logger.warning(
            "shadow %s: iteration %d NOT applied: bucket %d: %s, also after its repair; asking rank 0 for "
            "fresh state",
            self.name,
            iteration,
            bucket_id,
            why,
        )
        if conn is not None:
            self._request_state(conn, f"forged gradient copies in iteration {iteration}")

    def _diverge_locked(self, iteration: int, differs: list[str]) -> dict[str, Any]:
        """The state after ``iteration`` differs from rank 0's: withdraw certification (lock held).

        Applying stops until rank 0 re-seeds this shadow (the apply loop takes no iteration while
        diverged), so one divergence is reported once, at the check that found it.
        """
        self.stats.fingerprints_checked += 1
        self.stats.divergences += 1
        report = {
            "iteration": iteration,
            "last_verified": self._last_verified,
            "mismatches": differs[:20],
            "mismatched_tensors": len(differs),
            "time": time.time(),
        }
        self._diverged = report
        self._last_divergence = report
        self._certified = min(self._certified, self._last_verified)
        return report

    def _report_divergence(self, report: dict[str, Any]) -> None:
        """Tell rank 0 (its log, ``agent.divergences``) and ask it for fresh state."""
        iteration, last, differs = report["iteration"], report["last_verified"], report["mismatches"]
        logger.error(
            "shadow %s: DIVERGED: after iteration %d its state differs from rank 0's fingerprint in %d "
            "tensors (%s); certification after iteration %d withdrawn; asking rank 0 for fresh state",
            self.name,
            iteration,
            report["mismatched_tensors"],
            ", ".join(differs[:5]),
            last,
        )
        conn = self._control_conn
        if conn is not None:
            self._send_control(Diverged(self._job_id(), self.name, iteration, last, differs))
            self._request_state(conn, f"state diverged from rank 0's after iteration {iteration}")

    def _certify(self, iteration: int, epoch: Epoch | None = None, again: bool = False) -> bool:
        """Certify ``iteration`` to rank 0 if its state is known to match the workers'; True if it is.

        Known to match: while rank 0 sends fingerprints (every K-th iteration and the last one
        it waits for) only an iteration up to the last verified one (seeded by rank 0, or its
        fingerprint matched); a certificate covers every earlier iteration, so the iterations
        between two checks are certified by the later check. Without fingerprints (K = 0, GPU
        parameters) on trust, when applied. Once (unless ``again``: the state rank 0 re-seeded);
        never for a replaced ``epoch``.
        """
        with self._lock:
            if self._diverged is not None or (epoch is not None and self._epoch is not epoch):
                return False  # nothing is certified until rank 0 re-seeds this shadow
            job = self._job
            if job is not None and job.fingerprint_every > 0 and iteration > self._last_verified:
                return False  # certified when a check at or after it matches
            if iteration < self._certified or (iteration == self._certified and not again):
                return iteration <= self._certified
            self._certified = iteration
        if self._send_control(Certified(self._job_id(), self.name, iteration)):
            with self._lock:
                self.stats.certified_sent += 1
        return True

    def _maybe_snapshot(self, epoch: Epoch, iteration: int) -> None:
        if self.snapshotter is None or self._job is None or self._diverged is not None:
            return
        policy = self.snapshotter.policy
        by_count = policy.every_iterations > 0 and (iteration + 1) % policy.every_iterations == 0
        since = time.monotonic() - self._last_snapshot_time
        by_time = policy.every_seconds > 0 and since >= policy.every_seconds
        if not (by_count or by_time):
            return
        job = self._job
        if self.snapshotter.offer(iteration, lambda: self._capture_snapshot(job, epoch, iteration)):
            self._last_snapshot_time = time.monotonic()

    def snapshot_now(self, timeout: float = 30.0) -> int | None:
        """Write a snapshot of the current state and wait for it; the step written, or None."""
        if self.snapshotter is None or not self.snapshotter.flush(timeout):
            return None
        with self._state_lock:
            epoch, job, iteration = self._epoch, self._job, self._applied
        if epoch is None or job is None or iteration < 0:
            return None
        if not self.snapshotter.offer(
            iteration, lambda: self._capture_snapshot(job, epoch, iteration), force=True
        ):
            return None
        return iteration if self.snapshotter.flush(timeout) else None

    def _capture_snapshot(self, job: Job, epoch: Epoch, iteration: int) -> Snapshot:
        with self._state_lock:
            named = list(epoch.optimizer.parameters.items())
            states = fmt.capture_states(named, epoch.optimizer.optimizer)
            for name, tensor in epoch.static.items():
                states[name] = {fmt.PARAM_STATE: tensor.clone()}
            groups = self._groups_now(job, epoch)
            position = self._data_position
            job_state = self._job_state
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
                "optimizer_step": self._optimizer_step,
                "data_position": position,
                "shards": self._shard_owners(job),
                **(job.spec.tp_fields() if job.spec is not None else {}),  # which TP shard (a TP x DP lane)
            },
            job_state=job_state,
        )

    def _shard_owners(self, job: Job) -> dict[str, str]:
        """Shard file stem -> shadow name, so a restarted shadow finds its own shard."""
        owners = sorted(set(job.spec.shard_to_shadow.values())) if job.spec is not None else [self.name]
        return {fmt.shard_stem(i, len(owners)): name for i, name in enumerate(owners)}

    @staticmethod
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
