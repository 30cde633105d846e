"""A small real training job in the emulated network with faults injected, and the check that matters.

:class:`FaultJob` runs :meth:`experiments.job.JobRun.run` (``make demo``'s steps:
the ``single`` topology on the embedded switch in Mininet, ``checkmate-ctl job
add``, ``checkmate-shadow`` in the shadow hosts, ``train_lm`` workers under the
launcher, teardown always) through its hooks, with:

* the workers run :mod:`tests.reliability.fault_worker`: ``train_lm`` plus one
  line per iteration with the digests of their exact state after the step, and
  one per restore with the digests of what they restored;
* extra switch arguments (``--drop-egress PORT:FRACTION --drop-seed N``) and
  extra worker environment (host-transport loss, duplication, reordering);
* :class:`Action` s that fire while rank 0 works on a given iteration: kill -9
  a shadow (and restart it), the switch process, a ``checkmate-ctl`` in the
  middle of a write, move a shadow to another host, ...;
* every snapshot step kept on disk, so each one can be checked.

:meth:`FaultJob.verify` then checks the invariant — *every state the shadows
certified equals the workers' state at that iteration, bit for bit, or the
shadows refused to certify it*: every complete snapshot step on disk, every
state the workers restored after a failure, and the shadows' final in-memory
state, each against the workers' digests of the same iteration; the workers
agree with each other, also where a restart redid an iteration.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from checkmate.checkpoint import (
    PARAM_STATE,
    STEP_DIR,
    CheckpointError,
    CheckpointReader,
    complete_steps,
)
from checkmate.checkpoint.digest import state_digests
from experiments.commands import CTL, REPO
from experiments.job import JobConfig, JobHooks, JobRun
from experiments.launcher import LaunchConfig, tail
from experiments.progress import Observer
from experiments.results import JobResult
from tests.topologies.harness import root_interfaces
from topologies.runstate import RunState

logger = logging.getLogger(__name__)

SMALL_MODEL = ("--width", "32", "--layers", "1", "--heads", "2", "--context", "32", "--bucket-cap-mb", "0.01")
"""A TinyLM of ~20k parameters in DDP buckets of 10 KB: several buckets, so every shadow owns some."""
SINGLE_SPARE = Path(__file__).with_name("single_spare.json")
"""``single`` plus a third shadow host (sh3, port 7) to move a shadow to."""


class FaultJobError(AssertionError):
    """The invariant did not hold (or the job could not be checked)."""


@dataclass(frozen=True)
class Action:
    """Something done to the running job while rank 0 works on iteration ``iteration``."""

    iteration: int
    kind: str
    """``kill_shadow`` (SIGKILL ``target``, restart it with ``--resume`` after ``delay``),
    ``kill_switch``, ``kill_ctl`` (SIGKILL a ``checkmate-ctl`` ``args`` after ``delay``
    seconds, then run ``reconcile``), ``move_shadow`` (shard ``args[0]`` to host ``target``),
    ``kill_shadow_writing`` (SIGKILL ``target`` while its snapshot writer is busy)."""
    target: str = ""
    delay: float = 0.0
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class FaultJobConfig:
    switch: str
    """This job's switch name (unique per test: it names the switch's interfaces)."""
    work_dir: Path
    iterations: int = 16
    kill_worker_at: int | None = None
    kill_rank: int = 1
    actions: tuple[Action, ...] = ()
    switch_args: tuple[str, ...] = ()
    worker_env: Mapping[str, str] = field(default_factory=dict)
    shadows: tuple[str, ...] = ("sh1", "sh2")
    topology: Path = REPO / "topologies" / "single.json"
    train_timeout: float = 300.0
    max_restarts: int = 3
    step_seconds: float = 0.05
    """Every rank sleeps this long after each iteration (a real model's compute time)."""


@dataclass
class Verdict:
    """What :meth:`FaultJob.verify` compared."""

    iterations: int = 0
    """Iterations whose worker state was recorded (all ranks agreeing)."""
    redone: int = 0
    """Iterations done again after a restart (their digests matched the first time's)."""
    snapshots_compared: int = 0
    snapshots_partial: int = 0
    """Step directories on disk that are not complete checkpoints (ignored by readers)."""
    restores_compared: int = 0
    restore_sources: list[str] = field(default_factory=list)
    final_compared: bool = False
    certified_max: int | None = None
    """The highest iteration rank 0 heard every shadow certify."""
    uncertified: int = 0
    """Iterations the shadows never certified (refused or not yet when the job ended)."""
    repairs: dict[str, int] = field(default_factory=dict)
    reseeds: int = 0
    resyncs: int = 0
    transport: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    recovery_s: float | None = None
    events: list[str] = field(default_factory=list)
    switch_tx: dict[int, int] = field(default_factory=dict)
    injected_drops: dict[int, int] = field(default_factory=dict)
    """Frames the switch dropped on purpose (``--drop-egress``), per port."""
    actions: list[dict[str, Any]] = field(default_factory=list)
    final_refused: bool = False
    """The shadows refused the final iteration (not re-seeded before the workers closed)."""
    comparisons: int = 0
    """State comparisons made: ranks' digests per iteration, restored states, snapshot steps and the
    final shadow memory, each against the workers' digest of the same iteration."""
    differed: int = 0
    """How many of them differed (or had nothing to compare with: a missing iteration)."""
    differences: list[str] = field(default_factory=list)

    def count(self, differed: bool, what: str) -> None:
        self.comparisons += 1
        if differed:
            self.differed += 1
            self.differences.append(what)

    def figures(self) -> str:
        parts = [
            f"{self.iterations} iterations, workers bit-identical"
            + (f" (incl. {self.redone} redone after restarts)" if self.redone else ""),
            f"{self.snapshots_compared} snapshot steps == workers",
        ]
        if self.snapshots_partial:
            parts.append(f"{self.snapshots_partial} partial step dirs ignored")
        if self.restores_compared:
            parts.append(
                f"{self.restores_compared} restored states == workers ({', '.join(self.restore_sources)})"
            )
        if self.final_compared:
            parts.append("final shadow memory == workers")
        if self.uncertified:
            parts.append(f"{self.uncertified} iterations never certified (refused)")
        if self.injected_drops:
            parts.append(f"{sum(self.injected_drops.values())} frames dropped by the switch")
        repaired = self.repairs.get("elements_repaired", 0)
        if self.repairs.get("requests"):
            parts.append(f"{self.repairs['requests']} repair requests, {repaired} elements repaired")
        if self.reseeds or self.resyncs:
            parts.append(f"{self.reseeds} re-seeds, {self.resyncs} resyncs")
        retrans = self.transport.get("retransmits", 0) or self.transport.get("retransmissions", 0)
        if retrans:
            parts.append(f"{retrans} retransmissions")
        for key in ("fault.send_drop", "fault.duplicate", "fault.reorder"):
            if self.transport.get(key):
                parts.append(f"{self.transport[key]} {key.removeprefix('fault.').replace('send_', '')}")
        if self.restarts:
            parts.append(f"{self.restarts} restart(s)")
        return "; ".join(parts)


class _EventLog(Observer):
    """Keeps the lines the job run says (kills, failures, restarts) for the verdict."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def say(self, text: str) -> None:
        self.events.append(text)


class FaultJob:
    """One run of a small job with faults; :meth:`run_and_verify` is what a test calls.

    ``runner`` is the :class:`~experiments.job.JobRun` (``make demo``'s steps) the job runs
    with; three of its hooks make it a fault job: ``launch`` (the fault worker, its
    environment), ``iteration`` (fire the actions due at rank 0's iteration) and
    ``before_verify`` (wait for the actions to finish before the shadows' final state is read).
    """

    def __init__(self, config: FaultJobConfig) -> None:
        self.fault = config
        job = JobConfig(
            iterations=config.iterations,
            kill_iteration=config.kill_worker_at,
            kill_rank=config.kill_rank,
            reference=False,
            shadows=config.shadows,
            global_batch=12,
            model_args=SMALL_MODEL,
            topology=config.topology,
            rename_switches=(("s1", config.switch),),
            switch_args=(f"{config.switch}={' '.join(config.switch_args)}",) if config.switch_args else (),
            work_dir=config.work_dir,
            results_dir=None,
            snapshot_keep=100000,  # every snapshot step stays on disk, to be checked
            shadow_start_timeout=90.0,
            train_timeout=config.train_timeout,
            max_restarts=config.max_restarts,
        )
        self.events: list[str] = []
        hooks = JobHooks(launch=self._launch, iteration=self._on_iteration, before_verify=self.join_actions)
        self.runner = JobRun(job, _EventLog(self.events), hooks)
        self.config = job
        self.digest_dir = self.runner.work / "digests"
        self.gate = self.runner.work / "hold-workers"
        self._pending = sorted(config.actions, key=lambda a: a.iteration)
        self._threads: list[threading.Thread] = []
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self.action_log: list[dict[str, Any]] = []

    # ---- the JobRun hooks -------------------------------------------------------------------
    def _launch(self, base: LaunchConfig) -> LaunchConfig:
        """The fault worker instead of train_lm, with its digest log, gate and pace."""
        command = list(base.command)
        command[command.index(self.config.worker_module)] = "tests.reliability.fault_worker"
        self.digest_dir.mkdir(parents=True, exist_ok=True)
        env = {
            **base.env,
            **self.fault.worker_env,
            "FAULTJOB_DIGESTS": str(self.digest_dir / "rank{rank}.jsonl"),
            "FAULTJOB_GATE": str(self.gate),
            "FAULTJOB_STEP_SECONDS": str(self.fault.step_seconds),
        }
        return replace(base, command=tuple(command), env=env)

    def _on_iteration(self, series: str, incarnation: int, record: dict[str, Any]) -> None:
        if series == "main":
            self.reached(int(record["iteration"]) + 1)  # rank 0 logged iteration completed - 1

    # ---- actions ----------------------------------------------------------------------------
    def reached(self, completed: int) -> None:
        """Rank 0 has logged iteration ``completed - 1``: it now works on ``completed``."""
        with self._lock:
            due = [a for a in self._pending if a.iteration <= completed]
            self._pending = [a for a in self._pending if a.iteration > completed]
        for action in due:
            thread = threading.Thread(
                target=self._act, args=(action,), name=f"action-{action.kind}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def join_actions(self, timeout: float = 120.0) -> None:
        for thread in self._threads:
            thread.join(timeout)
            if thread.is_alive():
                self._errors.append(f"{thread.name} did not finish within {timeout:.0f} s")

    def _act(self, action: Action) -> None:
        began = time.time()
        record: dict[str, Any] = {"kind": action.kind, "iteration": action.iteration, "target": action.target}
        try:
            handler: Callable[[Action, dict[str, Any]], None] = getattr(self, f"_do_{action.kind}")
            handler(action, record)
        except Exception as exc:  # noqa: BLE001 - reported as the test's failure after the run
            logger.exception("action %s failed", action)
            self._errors.append(f"{action.kind} at iteration {action.iteration}: {type(exc).__name__}: {exc}")
        record["seconds"] = round(time.time() - began, 2)
        self.action_log.append(record)

    def restart_shadow(self, name: str, record: dict[str, Any]) -> None:
        """Start ``name`` again with ``--resume``, holding the workers between iterations until it
        serves (a shadow boots in seconds; the small job would be over by then)."""
        self.gate.touch()
        try:
            began = time.time()
            self.runner.shadows.start(name, self.runner.shadows.hosts[name], resume=True)
            status = self.runner.snapshot_dir / f"status-{name}.json"
            deadline = time.monotonic() + 90.0
            while not (
                status.exists() and status.stat().st_mtime > began and self.runner.shadows.status(name)
            ):
                if self.runner.shadows.processes[name].poll() is not None:
                    raise FaultJobError(
                        f"restarted shadow {name} exited: {tail(self.runner.log_dir / f'{name}.log')}"
                    )
                if time.monotonic() > deadline:
                    raise FaultJobError(f"restarted shadow {name} wrote no status within 90 s")
                time.sleep(0.1)
            record["restarted_after_s"] = round(time.time() - began, 2)
            record["resumed_from_snapshot"] = self.runner.shadows.status(name).get("restored_from_snapshot")
        finally:
            self.gate.unlink(missing_ok=True)

    def _do_hold(self, action: Action, record: dict[str, Any]) -> None:
        """Hold the workers between iterations for ``delay`` seconds."""
        self.gate.touch()
        record["held_at"] = time.time()
        time.sleep(action.delay)
        self.gate.unlink(missing_ok=True)

    def _do_kill_shadow(self, action: Action, record: dict[str, Any]) -> None:
        record["exit"] = self.runner.shadows.kill(action.target)  # at once: the workers go on
        record["killed_at"] = time.time()
        time.sleep(action.delay)  # the workers go on without it meanwhile
        self.restart_shadow(action.target, record)

    def _do_kill_shadow_writing(self, action: Action, record: dict[str, Any]) -> None:
        """SIGKILL the shadow as soon as a snapshot temp file of it shows up (a write in progress)."""
        deadline = time.monotonic() + 20.0
        hit = False
        while time.monotonic() < deadline:
            if any(
                p.name.startswith(".") and ".tmp-" in p.name
                for p in self.runner.snapshot_dir.glob("step-*/*")
            ):
                hit = True
                break
            time.sleep(0.002)
        record["during_write"] = hit
        record["exit"] = self.runner.shadows.kill(action.target)
        record["partial_files"] = sorted(
            str(p.relative_to(self.runner.snapshot_dir))
            for p in self.runner.snapshot_dir.glob("step-*/.*.tmp-*")
        )
        time.sleep(action.delay)
        self.restart_shadow(action.target, record)

    def _do_kill_switch(self, action: Action, record: dict[str, Any]) -> None:
        state = RunState.load(self.runner.net_dir)
        switch = state.switches[self.fault.switch]
        os.kill(switch.pid, signal.SIGKILL)
        record["pid"] = switch.pid
        record["killed_at"] = time.time()
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            now = RunState.load(self.runner.net_dir).switches[self.fault.switch]
            if now.pid != switch.pid:
                record["restarted_pid"] = now.pid
                record["restarted_after_s"] = round(time.time() - record["killed_at"], 2)
                return
            time.sleep(0.2)
        raise FaultJobError("the supervisor did not restart the killed switch within 60 s")

    def _do_kill_ctl(self, action: Action, record: dict[str, Any]) -> None:
        """SIGKILL ``checkmate-ctl shadow move --job J --shard K --to <target>`` ``delay`` seconds after
        it started (somewhere in its start, reconcile, registry write or switch writes), then run
        ``reconcile`` twice (the second must change nothing) and move the shard back where it was."""
        shard, to = action.args[0], action.target
        shown = self.runner.show_job()
        home = shown["job"]["shard_to_shadow"][shard]
        argv = [*CTL, "--network", str(self.runner.network_file), "--state-dir", str(self.runner.state_dir)]
        argv += ["shadow", "move", "--job", str(self.config.job_id), "--shard", shard, "--to", to]
        process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        time.sleep(action.delay)
        process.send_signal(signal.SIGKILL)
        output, _ = process.communicate(timeout=30)
        record["exit"] = process.returncode
        record["killed"] = process.returncode == -signal.SIGKILL
        record["killed_at"] = time.time()
        record["ctl_output"] = output.decode(errors="replace").strip()[-200:]
        first = self.runner.ctl("reconcile", timeout=120).stdout.strip()
        second = self.runner.ctl("reconcile", timeout=120).stdout.strip()
        record["reconcile"] = [first[-200:], second[-200:]]
        if not second.startswith("in sync"):
            raise FaultJobError(
                f"a second reconcile after the killed controller still changed entries: {second}"
            )
        shown = self.runner.show_job()
        record["owner_after_kill"] = owner = shown["job"]["shard_to_shadow"][shard]
        if owner not in (home, to):
            raise FaultJobError(
                f"after the killed move shard {shard} belongs to {owner}, neither {home} nor {to}"
            )
        if owner != home:
            self.runner.ctl(
                "shadow", "move", "--job", str(self.config.job_id), "--shard", shard, "--to", home
            )
        shown = self.runner.show_job()
        if shown["job"]["shard_to_shadow"][shard] != home:
            raise FaultJobError(f"shard {shard} could not be moved back to {home}: {shown['job']}")
        record["restored_at"] = time.time()

    def _do_move_shadow(self, action: Action, record: dict[str, Any]) -> None:
        """Shard ``args[0]`` to a new shadow in host ``target``, named after it: the new shadow starts,
        ``checkmate-ctl shadow move`` re-addresses the switch's copies, the job file names the new
        shadow. The workers hold between iterations meanwhile; rank 0 sees the changed job file
        after its next step, re-seeds the new shadow and says goodbye to the old one."""
        self.gate.touch()
        record["held_at"] = time.time()
        try:
            shard, new = action.args[0], action.target
            self.runner.shadows.start(new, new, resume=False)
            shown = self.runner.show_job()
            record["from"] = shown["job"]["shard_to_shadow"].get(shard)
            self.runner.shadows.wait_ready([new])
            moved = self.runner.ctl(
                "shadow", "move", "--job", str(self.config.job_id), "--shard", shard, "--to", new
            )
            record["ctl"] = moved.stdout.strip()[-300:]
            shown = self.runner.show_job()
            self.runner.job = shown["job"]
            hosts = {**self.runner.shadows.hosts, new: new}
            # The job files and the final check now list the job's shadows: the new one, not the old.
            self.runner.shadows.hosts = {name: hosts[name] for name in sorted(set(self._job_shadows()))}
            self.runner.write_job_file(self.runner.work / "job-file.json", with_shadows=True)
            record["shadows_now"] = list(self.runner.shadows.hosts)
            record["moved_at"] = time.time()
        finally:
            self.gate.unlink(missing_ok=True)

    def _job_shadows(self) -> list[str]:
        assert self.runner.job is not None
        return [str(v) for v in self.runner.job["shard_to_shadow"].values()]

    # ---- the check ---------------------------------------------------------------------------
    def run_and_verify(self, recorder: Any = None) -> tuple[JobResult, Verdict]:
        """Run the job and compare every state (:meth:`verify`); ``recorder`` (the ``reliability``
        fixture) is told the comparisons, so a failing trial's row has them too."""
        before = root_interfaces()
        shutil.rmtree(self.digest_dir, ignore_errors=True)
        self.gate.unlink(missing_ok=True)
        try:
            result = self.runner.run()
        finally:
            self.join_actions(10.0)
            left = {i for i in root_interfaces() - before if i.startswith(f"{self.fault.switch}-")}
        if left:
            raise FaultJobError(f"interfaces left behind: {sorted(left)}")
        if self._errors:
            raise FaultJobError("; ".join(self._errors))
        verdict = self.verify(result)
        if recorder is not None:
            recorder.compare(verdict.comparisons, verdict.differed)
        if verdict.differed:
            raise FaultJobError(
                f"{verdict.differed} of {verdict.comparisons} state comparisons differed: "
                + "; ".join(verdict.differences[:5])
            )
        return result, verdict

    def worker_digests(self) -> tuple[dict[int, set[tuple[str, str]]], list[dict[str, Any]], dict[str, int]]:
        per_iteration: dict[int, set[tuple[str, str]]] = {}
        counts: dict[int, int] = {}
        restored: list[dict[str, Any]] = []
        transport: dict[str, int] = {}
        for path in sorted(self.digest_dir.glob("rank*.jsonl")):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                if record.get("event") == "restored":
                    restored.append(record)
                elif record.get("event") == "done":
                    for key, value in (record.get("stats") or {}).get("transport", {}).items():
                        if isinstance(value, int):
                            transport[key] = transport.get(key, 0) + value
                elif "iteration" in record:
                    iteration = int(record["iteration"])
                    per_iteration.setdefault(iteration, set()).add((record["params"], record["optimizer"]))
                    counts[iteration] = counts.get(iteration, 0) + 1
        self._counts = counts
        return per_iteration, restored, transport

    def snapshot_digests(self) -> tuple[dict[int, tuple[str, str]], int]:
        digests: dict[int, tuple[str, str]] = {}
        for step in complete_steps(self.runner.snapshot_dir):
            try:
                reader = CheckpointReader(self.runner.snapshot_dir, step)
                parameters = {name: reader.parameter(name) for name in reader.parameters}
                states: dict[str, dict[str, Any]] = {
                    name: {s: reader.parameter(name, s) for s in reader.states_of(name) if s != PARAM_STATE}
                    for name in reader.parameters
                }
            except (CheckpointError, OSError, KeyError) as exc:
                raise FaultJobError(
                    f"snapshot step {step} is listed complete but cannot be read: {exc}"
                ) from None
            step_count = (reader.global_state.get("extra") or {}).get("optimizer_step")
            for state in states.values():
                if "step" not in state and step_count is not None:
                    state["step"] = float(step_count)
            digests[step] = state_digests(parameters, states)
        steps = set(complete_steps(self.runner.snapshot_dir))
        partial = sum(
            1
            for entry in self.runner.snapshot_dir.iterdir()
            if (match := STEP_DIR.match(entry.name)) and int(match.group(1)) not in steps
        )
        return digests, partial

    def switch_counts(self) -> dict[str, dict[int, int]]:
        """From the switch's last ``final counts`` log line: ``tx`` per port and ``FAULT_INJECTION``
        drops per port (summed over the switch's lives when it was restarted: a killed one logs none)."""
        counts: dict[str, dict[int, int]] = {"tx": {}, "injected_drops": {}}
        log = self.runner.net_dir / "logs" / f"{self.fault.switch}.log"
        try:
            lines = [line for line in log.read_text(errors="replace").splitlines() if "final counts:" in line]
        except OSError:
            return counts
        for line in lines:
            for port, tx in re.findall(r"(\d+)@\S+ rx=\d+/\d+B tx=(\d+)/", line):
                counts["tx"][int(port)] = counts["tx"].get(int(port), 0) + int(tx)
            for port, n in re.findall(r"FAULT_INJECTION@(\d+)=(\d+)", line):
                counts["injected_drops"][int(port)] = counts["injected_drops"].get(int(port), 0) + int(n)
        return counts

    def certified_seen(self, result: JobResult) -> set[int]:
        """Iterations rank 0 heard every shadow certify (a value of its per-iteration ``certified``)."""
        return {int(c) for per in result.main.certified.values() for c in per.values() if c is not None}

    def recovery_after(self, result: JobResult, when: float, iteration: int) -> float | None:
        """Seconds from ``when`` until rank 0 logged a certificate for ``iteration`` or later."""
        for incarnation, per in result.main.certified.items():
            times = result.main.times.get(incarnation, {})
            for it, certified in per.items():
                t = times.get(it)
                if t is not None and t > when and certified is not None and certified >= iteration:
                    return t - when
        return None

    def verify(self, result: JobResult) -> Verdict:
        config = self.config
        verdict = Verdict(events=list(self.events))
        workers, restored, transport = self.worker_digests()
        verdict.transport = transport
        for i in range(config.iterations):
            if i not in workers:
                verdict.count(True, f"no worker digests for iteration {i}")
            else:
                verdict.count(len(workers[i]) != 1, f"workers disagree (or a redone one differs) at {i}")
        truth = {i: next(iter(d)) for i, d in workers.items() if len(d) == 1}
        verdict.iterations = len(truth)
        world = len(config.workers)
        verdict.redone = sum(1 for i, n in self._counts.items() if n > world)

        for record in restored:
            iteration = int(record["iteration"])
            verdict.count(
                (record["params"], record["optimizer"]) != truth.get(iteration),
                f"the workers restored a state of iteration {iteration} (from {record['source']}) "
                "that is not the workers' state at that iteration",
            )
            verdict.restores_compared += 1
            verdict.restore_sources.append(str(record["source"]))

        snapshots, partial = self.snapshot_digests()
        for step, digest in sorted(snapshots.items()):
            verdict.count(truth.get(step) != digest, f"snapshot step {step} differs from the workers' state")
        verdict.snapshots_compared = len(snapshots)
        verdict.snapshots_partial = partial

        summary = result.summary()
        verdict.restarts = int(summary["restarts"])
        verdict.recovery_s = summary.get("recovery_seconds")
        if result.shadow_digest is not None:
            error = str(result.shadow_digest.get("error", ""))
            if not result.shadow_digest.get("ok") and "refused" in error:
                # A shadow restarted near the end had not been re-seeded when the workers closed:
                # it refuses the final iteration instead of serving a wrong state.
                verdict.final_refused = True
                return self._finish(verdict, result, restored, snapshots)
            if not result.shadow_digest.get("ok"):
                verdict.count(True, f"the shadows did not serve the final state: {result.shadow_digest}")
            else:
                verdict.count(
                    summary["shadow_equals_workers"] is not True,
                    f"the shadows' final state differs from the workers': {result.shadow_digest}",
                )
                verdict.final_compared = summary["shadow_equals_workers"] is True
        return self._finish(verdict, result, restored, snapshots)

    def _finish(
        self,
        verdict: Verdict,
        result: JobResult,
        restored: list[dict[str, Any]],
        snapshots: dict[int, tuple[str, str]],
    ) -> Verdict:
        config = self.config
        certified = [c for per in result.main.certified.values() for c in per.values() if c is not None]
        verdict.certified_max = max(certified) if certified else None
        seen = self.certified_seen(result) | set(snapshots)
        seen |= {int(r["iteration"]) for r in restored}
        if verdict.final_compared:
            seen.add(config.iterations - 1)
        verdict.uncertified = config.iterations - len(seen & set(range(config.iterations)))
        counts = self.switch_counts()
        verdict.switch_tx = counts["tx"]
        verdict.injected_drops = counts["injected_drops"]
        recoveries = []
        for action in self.action_log:
            when = action.get("killed_at")
            if isinstance(when, float):
                seconds = self.recovery_after(result, when, int(action["iteration"]))
                action["recovery_s"] = seconds
                if seconds is not None:
                    recoveries.append(seconds)
        if recoveries:
            verdict.recovery_s = max([*recoveries, *([verdict.recovery_s] if verdict.recovery_s else [])])
        verdict.actions = list(self.action_log)
        for status in result.shadow_status.values():
            for key, value in (status.get("repairs") or {}).items():
                if isinstance(value, int):
                    verdict.repairs[key] = verdict.repairs.get(key, 0) + value
            reseeds = status.get("reseeds")
            verdict.reseeds += int(reseeds) if isinstance(reseeds, int) else 0
            resyncs = status.get("resync_requests")
            verdict.resyncs += int(resyncs) if isinstance(resyncs, int) else 0
        return verdict


def seeded_iterations(seed: int, count: int, low: int, high: int) -> list[int]:
    """``count`` iterations in [low, high], drawn with ``seed`` (the suite's 'random iterations')."""
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(count)]


TRANSPORT_FAULTS = {
    "fault.send_drop": "dropped",
    "fault.duplicate": "duplicated",
    "fault.reorder": "reordered",
}


def summarize(verdicts: list[Verdict], shadow_ports: tuple[int, ...] = ()) -> str:
    """What a row's ``held`` says about its trials, with the figures."""
    iterations = sum(v.iterations for v in verdicts)
    snapshots = sum(v.snapshots_compared for v in verdicts)
    restores = sum(v.restores_compared for v in verdicts)
    finals = sum(1 for v in verdicts if v.final_compared)
    partial = sum(v.snapshots_partial for v in verdicts)
    refused = sum(v.uncertified for v in verdicts)
    parts = [
        f"{iterations} iterations over {len(verdicts)} runs, workers bit-identical at each",
        f"{snapshots} certified snapshot steps == workers' state at that iteration",
    ]
    if restores:
        parts.append(f"{restores} restored states (all ranks) == workers'")
    parts.append(f"final shadow memory == workers' in {finals}/{len(verdicts)} runs")
    refusals = sum(1 for v in verdicts if v.final_refused)
    if refusals:
        parts.append(f"final iteration refused (shadow not yet re-seeded) in {refusals} runs")
    if partial:
        parts.append(f"{partial} incomplete step dirs ignored")
    if refused:
        parts.append(f"{refused} iterations never certified (refused)")
    redone = sum(v.redone for v in verdicts)
    if redone:
        parts.append(f"{redone} iterations redone after restarts, bit-identical")
    drops = sum(sum(v.injected_drops.values()) for v in verdicts)
    if drops:
        if shadow_ports:
            copies = sum(v.switch_tx.get(p, 0) for v in verdicts for p in shadow_ports)
            parts.append(f"switch dropped {drops} of {copies + drops} copies")
        else:
            parts.append(f"switch dropped {drops} frames")
    requests = sum(v.repairs.get("requests", 0) for v in verdicts)
    elements = sum(v.repairs.get("elements_repaired", 0) for v in verdicts)
    if requests:
        parts.append(f"{requests} repair requests, {elements} elements repaired")
    transport: dict[str, int] = {}
    for v in verdicts:
        for key, value in v.transport.items():
            transport[key] = transport.get(key, 0) + value
    retransmits = sum(value for key, value in transport.items() if "retrans" in key)
    if retransmits:
        parts.append(f"{retransmits} retransmissions")
    for key, what in TRANSPORT_FAULTS.items():
        if transport.get(key):
            parts.append(f"{transport[key]} datagrams {what} by the host transport")
    restarts = sum(v.restarts for v in verdicts)
    if restarts:
        parts.append(f"{restarts} job restarts")
    return "; ".join(parts)


COMPARED = (
    "SHA-256 of params and optimizer state: every rank's per iteration, every restored state, every "
    "certified snapshot step and the shadows' final memory, each against the workers' at that iteration"
)
"""What a fault row's comparisons are (docs/reliability.md)."""


def counted(verdicts: list[Verdict]) -> dict[str, Any]:
    """The measured part of a fault row: ``record(..., **counted(verdicts))``."""
    return {
        "compared": COMPARED,
        "comparisons": sum(v.comparisons for v in verdicts),
        "differed": sum(v.differed for v in verdicts),
    }


def worst_recovery(verdicts: list[Verdict]) -> float | None:
    values = [v.recovery_s for v in verdicts if v.recovery_s is not None]
    return max(values) if values else None
