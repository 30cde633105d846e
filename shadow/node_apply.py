"""The shadow node's apply thread: optimizer steps in iteration order, the divergence check, certification.

The :class:`Applier` takes the next ready iteration (its commit here, every owned bucket
complete) from the :class:`~shadow.node_receive.Receiver`, has the
:class:`~shadow.node_service.StateService` apply it and compare the state with rank 0's
fingerprint, then certifies the iteration to rank 0 when its state is known to match, or
reports a divergence (the state service then refuses to step until rank 0 re-seeds the
shadow); a certified iteration is offered to the :class:`~shadow.snapshots.Snapshotter`
(which writes on its own thread). It owns the certified iteration, the apply counters,
the snapshotter and the snapshot clock, under its own ``_lock`` (taken last, held briefly).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from checkmate.control import Certified, Diverged
from shadow.gradient_check import GradientCheck
from shadow.node_link import ControlLink
from shadow.node_receive import Receiver
from shadow.node_service import StateService
from shadow.node_state import ComponentThread, Epoch, ShadowConfig
from shadow.snapshots import Snapshotter, disk_status

logger = logging.getLogger(__name__)


class Applier:
    """The apply thread: apply, check, certify, snapshot (``_lock`` for its counters and certification)."""

    def __init__(
        self,
        config: ShadowConfig,
        receiver: Receiver,
        state: StateService,
        link: ControlLink,
        gradient_check: GradientCheck,
        wake_maintenance: Callable[[], None],
        stop: threading.Event,
    ) -> None:
        self._name = config.name
        self._receiver = receiver
        self._state = state
        self._link = link
        self._gradient_check = gradient_check
        self._wake_maintenance = wake_maintenance
        self._stop = stop
        self.snapshotter = Snapshotter(config.snapshots) if config.snapshots is not None else None
        self._lock = threading.Lock()
        self._certified = -1
        self._applied_iterations = 0
        self._apply_seconds = 0.0
        self._applied_elements = 0
        self._last_apply_seconds = 0.0
        self._last_commit_to_apply_seconds = 0.0
        self._last_snapshot_time = time.monotonic()
        self._thread = ComponentThread(self._name, "apply", self._apply_loop)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def close(self, timeout: float) -> None:
        if self.snapshotter is not None:
            self.snapshotter.close(timeout)

    def _apply_loop(self) -> None:
        while not self._stop.is_set():
            if self._state.diverged():  # halted until rank 0 re-seeds this shadow
                self._receiver.wait(0.05)
                continue
            ready = self._receiver.next_ready(0.05)
            if ready is None:
                continue
            epoch, pending, entry = ready.epoch, ready.pending, ready.entry
            assert pending.step is not None
            forged = self._gradient_check.forged(self._link.job_id(), entry.gradient_digests, pending)
            if forged:  # never applied: copies from outside the job (docs/security.md)
                self._refuse_forged(epoch, pending.iteration, forged)
                continue
            started = time.perf_counter()
            stepped = self._state.step(epoch, pending.step, ready.gradients, entry)
            if stepped is None:
                continue  # re-seeded meanwhile: this iteration is part of the new state
            elapsed = time.perf_counter() - started
            # Re-seeded meanwhile (rank 0's fresh state replaced this epoch): nothing of this
            # iteration is reported, certified or persisted.
            current = self._receiver.finish(epoch, pending.iteration)
            with self._lock:
                self._applied_iterations += 1
                self._apply_seconds += elapsed
                self._last_apply_seconds = elapsed
                self._applied_elements += stepped.elements
                self._last_commit_to_apply_seconds = time.monotonic() - entry.arrival
                if current and stepped.divergence is not None:
                    self._certified = min(self._certified, stepped.divergence["last_verified"])
            if stepped.divergence is not None:
                if current:
                    self._report_divergence(stepped.divergence)
                continue  # neither certified nor persisted: rank 0 re-seeds this shadow
            if current and self.certify(pending.iteration, epoch):
                self._maybe_snapshot(epoch, pending.iteration)

    def _refuse_forged(self, epoch: Epoch, iteration: int, forged: list[tuple[int, str]]) -> None:
        """Buckets of ``iteration`` whose copies fail rank 0's gradient tags: repair them, never apply them.

        Their copies are thrown away and the buckets filled again from the workers' repair
        answers (authenticated by the job's MAC; copies that arrive meanwhile are refused), so
        an injector costs the shadow a repair round trip per iteration, not a re-seed. Only if a
        repaired bucket fails its tag too (the workers themselves disagree with rank 0) is the
        iteration dropped and rank 0 asked for fresh state.
        """
        repairing, reseed = self._receiver.refuse_forged(epoch, iteration, forged)
        bucket_id, why = forged[0]
        if not reseed:
            logger.warning(
                "shadow %s: iteration %d NOT applied yet: bucket %d: %s; its copies are refused and "
                "%d bucket(s) repaired from the workers",
                self._name,
                iteration,
                bucket_id,
                why,
                repairing,
            )
            self._wake_maintenance()  # the maintenance thread plans the repair now
            return
        logger.warning(
            "shadow %s: iteration %d NOT applied: bucket %d: %s, also after its repair; asking rank 0 for "
            "fresh state",
            self._name,
            iteration,
            bucket_id,
            why,
        )
        self._link.request_fresh_state(f"forged gradient copies in iteration {iteration}")

    def _report_divergence(self, report: dict[str, Any]) -> None:
        """Tell rank 0 (its log, ``agent.divergences``) and ask it for fresh state."""
        iteration, last, differs = report["iteration"], report["last_verified"], report["mismatches"]
        logger.error(
            "shadow %s: DIVERGED: after iteration %d its state differs from rank 0's fingerprint in %d "
            "tensors (%s); certification after iteration %d withdrawn; asking rank 0 for fresh state",
            self._name,
            iteration,
            report["mismatched_tensors"],
            ", ".join(differs[:5]),
            last,
        )
        if self._link.connected():
            self._link.send(Diverged(self._link.job_id(), self._name, iteration, last, differs))
            self._link.request_fresh_state(f"state diverged from rank 0's after iteration {iteration}")

    def certify(self, iteration: int, epoch: Epoch | None = None, again: bool = False) -> bool:
        """Certify ``iteration`` to rank 0 if its state is known to match the workers'; True if it is.

        Known to match: :meth:`~shadow.node_service.StateService.verified` (a certificate covers
        every earlier iteration, so the iterations between two fingerprint checks are certified
        by the later check). Once (unless ``again``: the state rank 0 re-seeded); never for a
        replaced ``epoch``.
        """
        if not self._state.verified(iteration, epoch):
            return False  # nothing is certified until rank 0 re-seeds this shadow, or a check matches
        with self._lock:
            if iteration < self._certified or (iteration == self._certified and not again):
                return iteration <= self._certified
            self._certified = iteration
        self._link.send(Certified(self._link.job_id(), self._name, iteration))
        return True

    def reseeded(self, start_iteration: int) -> None:
        """Rank 0 re-seeded the state before ``start_iteration``: certificates restart from there.

        Certificates name the job's iterations: after a re-seed at t (a restart may resume
        before what an earlier run certified) the next certificate is t - 1's.
        """
        with self._lock:
            self._certified = min(self._certified, start_iteration - 1)

    def resumed(self, step: int) -> None:
        """A snapshot's state is served (snapshots hold certified states): certified through ``step``."""
        with self._lock:
            self._certified = step

    def _maybe_snapshot(self, epoch: Epoch, iteration: int) -> None:
        snapshotter = self.snapshotter
        source = self._state.snapshot_source()
        if snapshotter is None or source is None or self._state.diverged():
            return
        job = source[1]
        policy = snapshotter.policy
        by_count = policy.every_iterations > 0 and (iteration + 1) % policy.every_iterations == 0
        with self._lock:
            since = time.monotonic() - self._last_snapshot_time
        by_time = policy.every_seconds > 0 and since >= policy.every_seconds
        if not (by_count or by_time):
            return
        if snapshotter.offer(iteration, lambda: self._state.snapshot(job, epoch, iteration)):
            with self._lock:
                self._last_snapshot_time = time.monotonic()

    def snapshot_now(self, timeout: float = 30.0) -> int | None:
        """Write a snapshot of the current state and wait for it; the step written, or None."""
        if self.snapshotter is None or not self.snapshotter.flush(timeout):
            return None
        source = self._state.snapshot_source()
        if source is None:
            return None
        epoch, job, iteration = source
        if not self.snapshotter.offer(
            iteration, lambda: self._state.snapshot(job, epoch, iteration), force=True
        ):
            return None
        return iteration if self.snapshotter.flush(timeout) else None

    def status(self, applied: int) -> dict[str, Any]:
        """The status document's fields about applying, certification and snapshots."""
        with self._lock:
            rate = self._applied_elements / self._apply_seconds if self._apply_seconds else 0.0
            fields: dict[str, Any] = {
                "certified_iteration": self._certified,
                "apply": {
                    "iterations": self._applied_iterations,
                    "seconds": round(self._apply_seconds, 6),
                    "last_seconds": round(self._last_apply_seconds, 6),
                    "elements_per_second": round(rate),
                    "last_commit_to_apply_seconds": round(self._last_commit_to_apply_seconds, 6),
                },
            }
        snapshotter = self.snapshotter
        fields["snapshots"] = dict(vars(snapshotter.stats)) if snapshotter else None
        fields["disk"] = disk_status(snapshotter.policy.directory, applied) if snapshotter else None
        return fields
