"""What a job run measured: each training run's log (:class:`RunSeries`) and the run (:class:`JobResult`).

:class:`RunSeries` collects what the workers logged while one training run
(all its incarnations) went on; :class:`JobResult` holds it with what the run
fetched besides (the shadows' final digest and status, the switch's counters)
and computes the figures of ``results/demo.json`` (:meth:`JobResult.summary`,
see README, "Reading the demo's output"). Pure: nothing here starts or reads
a process.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from experiments.launcher import LaunchResult

if TYPE_CHECKING:
    from experiments.job_config import JobConfig


@dataclass
class RunSeries:
    """What one training run (all incarnations) logged."""

    name: str
    losses: dict[int, dict[int, list[float]]] = field(default_factory=dict)
    """incarnation -> iteration -> the ranks' losses."""
    certified: dict[int, dict[int, int | None]] = field(default_factory=dict)
    """incarnation -> iteration -> rank 0's view of the last iteration every shadow applied."""
    times: dict[int, dict[int, float]] = field(default_factory=dict)
    """incarnation -> iteration -> when rank 0 logged it (epoch seconds)."""
    starts: dict[int, dict[str, Any]] = field(default_factory=dict)
    """incarnation -> rank 0's start record."""
    restored: dict[int, dict[str, Any]] = field(default_factory=dict)
    """incarnation -> rank 0's record of the state it restored (its digests)."""
    unprotected: dict[int, dict[int, str]] = field(default_factory=dict)
    """incarnation -> iteration -> why rank 0 found the job unprotected then (hosts.protection)."""
    digests: dict[int, dict[int, str]] = field(default_factory=dict)
    """incarnation -> iteration -> rank 0's parameter digest after it (``--log-digests`` runs)."""
    result: LaunchResult | None = None

    def add(self, incarnation: int, rank: int, record: dict[str, Any]) -> None:
        if record.get("event") == "start" and rank == 0:
            self.starts[incarnation] = record
        if record.get("event") == "restored" and rank == 0:
            self.restored[incarnation] = record
        if "loss" not in record:
            return
        iteration = int(record["iteration"])
        if rank == 0 and "params_sha256" in record:
            self.digests.setdefault(incarnation, {})[iteration] = str(record["params_sha256"])
        self.losses.setdefault(incarnation, {}).setdefault(iteration, []).append(float(record["loss"]))
        if rank == 0:
            self.certified.setdefault(incarnation, {})[iteration] = record.get("certified")
            if record.get("unprotected"):
                self.unprotected.setdefault(incarnation, {})[iteration] = str(record["unprotected"])
            self.times.setdefault(incarnation, {})[iteration] = float(record["time"])

    def mean_loss(self, incarnation: int) -> dict[int, float]:
        return {i: statistics.fmean(v) for i, v in sorted(self.losses.get(incarnation, {}).items())}

    def lag(self, incarnation: int) -> dict[int, int]:
        """Iterations rank 0 was ahead of the shadows right after each step (where known)."""
        return {i: i - c for i, c in sorted(self.certified.get(incarnation, {}).items()) if c is not None}


@dataclass
class JobResult:
    """Everything a job run measured; :meth:`summary` is ``results/demo.json``."""

    config: JobConfig
    main: RunSeries
    reference: RunSeries | None = None
    shadow_digest: dict[str, Any] | None = None
    shadow_status: dict[str, dict[str, Any]] = field(default_factory=dict)
    switch_counters: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """The figures of ``results/demo.json`` (see README, "Reading the demo's output")."""
        config, result = self.config, self.main.result
        assert result is not None
        incarnations = result.incarnations
        first_failed = next((i for i in incarnations if i.failure is not None), None)
        resumed = incarnations[1] if len(incarnations) > 1 else None
        done = result.done
        digests = {d["params_sha256"] for d in done.values()}
        opt_digests = {d["optimizer_sha256"] for d in done.values()}
        workers_agree = len(digests) == 1 and len(opt_digests) == 1
        shadow_equal: bool | None = None
        if self.shadow_digest is not None and self.shadow_digest.get("ok"):
            shadow_equal = (
                workers_agree
                and self.shadow_digest["params_sha256"] in digests
                and self.shadow_digest["optimizer_sha256"] in opt_digests
                and self.shadow_digest["iteration"] == config.iterations - 1
            )
        reference_equal: bool | None = None
        elastic = self.elastic_summary()
        if self.reference is not None and self.reference.result is not None and elastic is None:
            ref_done = self.reference.result.done
            reference_equal = workers_agree and {d["params_sha256"] for d in ref_done.values()} == digests
        lost = result.lost_iterations()
        killed = first_failed.killed if first_failed is not None else None
        recovery_seconds = None
        if killed is not None and resumed is not None and resumed.start_iteration is not None:
            first_after = self.main.times.get(1, {}).get(resumed.start_iteration)
            if first_after is not None:
                recovery_seconds = round(first_after - float(killed["time"]), 3)
        all_times = sorted(t for per in self.main.times.values() for t in per.values())
        steps = [b - a for a, b in zip(all_times, all_times[1:], strict=False) if b - a < 2.0]
        lags = [v for n in self.main.certified for v in self.main.lag(n).values()]
        final_losses = self.main.mean_loss(len(incarnations) - 1)
        return {
            "workers": len(config.workers),
            "shadows": len(config.shadows),
            "iterations": config.iterations,
            "certified_iterations": self.certified_iterations(),
            "failure_iteration": first_failed.completed_through + 1 if first_failed else None,
            "kill_planned_iteration": killed["iteration"] if killed else None,
            "failed_worker": f"rank {killed['rank']} ({killed['host']})" if killed else None,
            "resumed_from_iteration": resumed.start_iteration if resumed else None,
            "restored_checkpoint_iteration": resumed.restored_from if resumed else None,
            "restore_source": resumed.source if resumed else None,
            "lost_iterations": lost[0] if lost else 0,
            "lost_iterations_per_restart": lost,
            "restarts": result.restarts,
            "recovery_seconds": recovery_seconds,
            "shadow_equals_workers": shadow_equal,
            "recovered_equals_uninterrupted": reference_equal,
            "workers_agree": workers_agree,
            "final_loss": round(final_losses[max(final_losses)], 4) if final_losses else None,
            "first_loss": round(self.main.mean_loss(0).get(0, float("nan")), 4),
            "params_sha256": sorted(digests)[0] if len(digests) == 1 else sorted(digests),
            "shadow_params_sha256": (self.shadow_digest or {}).get("params_sha256"),
            "mean_iteration_ms": round(1000 * statistics.fmean(steps), 1) if steps else None,
            "unprotected_iterations": sum(len(per) for per in self.main.unprotected.values()),
            "unprotected_reason": next(
                (r for per in self.main.unprotected.values() for r in per.values()), None
            ),
            "shadow_lag_iterations": {
                "mean": round(statistics.fmean(lags), 2) if lags else None,
                "max": max(lags) if lags else None,
                "definition": "iteration - last iteration every shadow had applied, seen by rank 0 "
                "right after its optimizer step",
            },
            "snapshots_written": {
                name: (status.get("snapshots") or {}).get("written")
                for name, status in self.shadow_status.items()
            },
            "shadow_copies_packets": self.switch_counters.get("packets"),
            "incarnations": [i.to_json() for i in incarnations],
            "phases_seconds": {k: round(v, 2) for k, v in self.phases.items()},
            "seconds": round(self.seconds, 1),
            "target": config.target,
            "elastic": elastic,
            "notes": self.notes,
        }

    def elastic_summary(self) -> dict[str, Any] | None:
        """After a restart with another worker count: was the restored state right, is the loss continuous?

        None when every incarnation had the same workers. The restored state (rank 0's
        digest of what it loaded) is compared with the uninterrupted reference run's state
        after the same iteration (same worker count up to there, so bit-identical); the
        loss after the restart with the reference's loss at the same iterations (same
        global batch, other summation order: close, not equal).
        """
        result = self.main.result
        assert result is not None
        counts = [len(i.workers) for i in result.incarnations]
        if len(set(counts)) <= 1:
            return None
        last = len(result.incarnations) - 1
        restored = self.main.restored.get(last, {})
        restored_equal: bool | None = None
        deviations: list[float] = []
        if self.reference is not None:
            reference_digests = self.reference.digests.get(0, {})
            at = restored.get("iteration")
            if at is not None and int(at) in reference_digests:
                restored_equal = restored.get("params_sha256") == reference_digests[int(at)]
            reference_loss = self.reference.mean_loss(0)
            for iteration, loss in self.main.mean_loss(last).items():
                if iteration in reference_loss:
                    deviations.append(abs(loss - reference_loss[iteration]) / abs(reference_loss[iteration]))
        return {
            "workers_per_incarnation": counts,
            "restored_state_equals_reference": restored_equal,
            "loss_max_relative_deviation_after_restart": round(max(deviations), 6) if deviations else None,
            "loss_mean_relative_deviation_after_restart": (
                round(statistics.fmean(deviations), 6) if deviations else None
            ),
            "compared_iterations": len(deviations),
        }

    def certified_iterations(self) -> int:
        """Iterations whose state the shadows certified: a checkpoint of them existed at some point.

        Shadows apply iterations in order, so a certificate for t covers every
        iteration of that incarnation up to t. Rank 0 logs what it has heard right
        after each step; the state a restart restored, and the final
        verification, certify later iterations than it may have heard of.
        """
        result = self.main.result
        assert result is not None
        incarnations = result.incarnations
        covered: set[int] = set()
        for index, incarnation in enumerate(incarnations):
            values = [c for c in self.main.certified.get(incarnation.number, {}).values() if c is not None]
            top = max(values) if values else -1
            restored_next = incarnations[index + 1].restored_from if index + 1 < len(incarnations) else None
            if restored_next is not None:
                top = max(top, restored_next)
            if index == len(incarnations) - 1 and self.shadow_digest and self.shadow_digest.get("ok"):
                top = max(top, int(self.shadow_digest["iteration"]))
            first = incarnation.restored_from if incarnation.restored_from is not None else 0
            covered.update(range(first, top + 1))
        return len(covered)
