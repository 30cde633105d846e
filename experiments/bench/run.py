"""One benchmark run: the demo's network, job and shadows, one training run per system and round.

:class:`BenchRun` drives a :class:`~experiments.job.JobRun` step by step: the
network up once (the topology with more workers when asked,
:func:`scaled_topology`), then per round and system the job registered at the
switch or removed (only ``checkmate`` has the switch copy), fresh shadows for
the systems that have them, one training run into its own log folder, and the
figures from rank 0's log (:func:`experiments.bench.figures.figures`). Two
:class:`~experiments.job.JobHooks` do the rest: ``launch`` gives each run its
system's train_lm options, environment and CPU pinning; ``iteration`` reads
back, once past the warmup, which CPUs every process of the run may use
(:mod:`experiments.bench.partition`) and counts, from then on, the CPU time of
each role and CPU set (:mod:`experiments.bench.cpu_time`). The network goes down at the end, also
after a failure.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from checkmate import nfs
from experiments.bench import partition
from experiments.bench.config import (
    BASELINE_KINDS,
    GLOO,
    SHADOW_NICE,
    BenchConfig,
    BenchError,
    System,
    worker_names,
)
from experiments.bench.cpu_time import CpuClock
from experiments.bench.figures import LogFigures, figures, read_log
from experiments.bench.report import BenchResult, atomic_write_text, machine_info
from experiments.bench.storage_host import (
    SHADOW_SNAPSHOTS,
    StorageHost,
    StorageHostError,
    cited_rate,
    storage_url,
    with_storage_host,
)
from experiments.bench.worker_account import (
    AccountSample,
    SyscallWindow,
    account,
    agent_counters,
    take_account,
)
from experiments.commands import REPO, JobError
from experiments.job import JobConfig, JobHooks, JobRun
from experiments.launcher import LaunchConfig
from experiments.progress import Observer, PhaseRenamer
from experiments.results import RunSeries
from topologies.runstate import RunState, RunStateError

logger = logging.getLogger(__name__)

TOPOLOGY = REPO / "topologies" / "single.json"
STORAGE_STALL_MARGIN_S = 30.0
"""--storage remote: the launcher's stall watchdog waits this long beyond the NFS client's timeout."""


def scaled_topology(base: Mapping[str, Any], workers: int) -> dict[str, Any]:
    """``base`` (single.json) with worker hosts added up to ``workers`` (h5, h6 on new switch ports)."""
    data = json.loads(json.dumps(base))
    hosts = data["hosts"]
    switch = next(iter(data["switches"]))
    used = [int(end.rsplit("-p", 1)[1]) for link in data["links"] for end in link[:2] if "-p" in str(end)]
    port = max(used, default=0)
    for i in range(1, workers + 1):
        name = f"h{i}"
        if name in hosts:
            continue
        hosts[name] = {"ip": f"10.0.1.{i}/8", "mac": f"08:00:00:00:01:{i:02x}", "role": "worker"}
        port += 1
        data["links"].append([name, f"{switch}-p{port}"])
    return data


class BenchRun:
    """One (workload, placement) benchmark run; :meth:`run_all` runs every selected system per round."""

    def __init__(self, config: BenchConfig, observer: Observer | None = None) -> None:
        self.bench = config
        self.renamer = PhaseRenamer(observer or Observer())
        topology = TOPOLOGY
        workers = worker_names(config.workers)
        base = json.loads(TOPOLOGY.read_text())
        if any(w not in base["hosts"] for w in workers) or config.storage == "remote":
            data = scaled_topology(base, config.workers)
            name = f"topology-{config.workers}-workers"
            if config.storage == "remote":  # the storage host on its own switch port (storage_host)
                data, name = with_storage_host(data), f"{name}-storage"
            topology = config.work_dir.resolve() / f"{name}.json"
            atomic_write_text(topology, json.dumps(data, indent=2))
        job_config = JobConfig(
            iterations=config.iterations,
            kill_iteration=None,
            reference=False,
            workers=workers,
            global_batch=config.global_batch,
            model_args=config.model_args,
            topology=topology,
            rename_switches=config.rename_switches,
            target=config.target,
            work_dir=config.work_dir,
            results_dir=None,
            train_timeout=config.train_timeout,
            max_restarts=0,
        )
        hooks = JobHooks(launch=self._launch, iteration=self._on_iteration)
        self.job = JobRun(job_config, self.renamer, hooks)
        self._system: System | None = None
        self._log_dir = self.job.log_dir
        self._job_at_switch = False
        self._result: BenchResult | None = None
        self._sampled = False
        self._clock = CpuClock()
        self._account_first: AccountSample | None = None
        self._account: dict[str, Any] | None = None
        self._syscalls: SyscallWindow | None = None
        self._storage: StorageHost | None = None
        self._checkpoint_size: int | None = None

    def run_all(self) -> BenchResult:
        """Every selected system, ``rounds`` times (later rounds in alternating order); teardown always."""
        started = time.monotonic()
        result = BenchResult(self.bench, machine=machine_info())
        self._result = result
        systems = self.bench.selected()
        pinned = self.bench.partition if self.bench.placement == "partitioned" else None
        own_mask = partition.available_cpus()
        try:
            if pinned is not None:
                # the supervisor, switch, host shells and shadows are started from here: they inherit it
                partition.pin_process(0, pinned.infrastructure)
            if self.bench.measure_emulation:
                result.emulation = self._measure_emulation()
            self.job.prepare()
            self.job.bring_up_network()
            if self.bench.storage == "remote":
                self._start_storage(result)
            self.job.add_job()
            self._job_at_switch = True
            for round_number in range(self.bench.rounds):
                order = systems if round_number % 2 == 0 else list(reversed(systems))
                for system in order:
                    try:
                        figs = self._run_system(system, round_number, result)
                    except (JobError, ValueError) as exc:
                        result.errors[f"{system.name} (round {round_number + 1})"] = str(exc)[:2000]
                        self.renamer.say(f"{system.name} failed: {str(exc)[:300]}")
                        continue
                    result.runs.setdefault(system.name, []).append(figs)
        finally:
            if self._storage is not None:
                self._storage.stop()
            self.job.teardown()
            if pinned is not None:
                partition.pin_process(0, own_mask)
            result.machine["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
            result.seconds = time.monotonic() - started
        return result

    def _measure_emulation(self) -> dict[str, Any]:
        """The fabric and the peers' storage, before any system runs (issue 27, item 1)."""
        from experiments.bench.emulation import checkpoint_bytes, measure

        self.renamer.say("measuring the emulation: the fabric through the emulated switch, the storage")
        pinned = self.bench.partition if self.bench.placement == "partitioned" else None
        prefix = partition.exec_prefix(pinned.workers, self.job.config.python) if pinned is not None else ()
        try:
            size: int | None = checkpoint_bytes(self.bench.model_args)
        except (ImportError, ValueError, TypeError) as exc:
            logger.warning("no checkpoint size for %s: %s", self.bench.model_args, exc)
            size = None
        self._checkpoint_size = size
        return measure(
            self.job.config.topology,
            self.bench.workers,
            self.job.work / "checkpoints",
            size,
            self.bench.work_dir.resolve() / "emulation",
            prefix,
        )

    def _start_storage(self, result: BenchResult) -> None:
        """The storage host serving, its link shaped, its write rate measured from a worker (issue 27).

        BenchError (the whole run fails, nothing written) when it cannot serve: every peer would fail.
        """
        from experiments.bench.emulation import remote_storage_rate

        emulation = result.emulation if result.emulation is not None else {"errors": {}}
        result.emulation = emulation
        fabric = emulation.get("fabric") or {}
        try:
            if self.bench.storage_mbit is not None:
                rate_mbit, shaped_by = self.bench.storage_mbit, "--storage-mbit"
            else:
                cited = cited_rate(
                    fabric.get("gloo_busbw_MBps") or 0.0, self.bench.workers, self.bench.storage_cluster
                )
                rate_mbit, shaped_by = cited.rate_mbit, cited.describe()
            assert self.job.network is not None
            self._storage = StorageHost(self.job.net_dir, self.job.network, self.job.work / "storage")
            self.renamer.say(f"storage host: NFS (nfs-ganesha), link shaped to {rate_mbit:.3g} Mbit/s")
            self._storage.start(rate_mbit)
        except StorageHostError as exc:
            raise BenchError(f"--storage remote: {exc}") from None
        remote: dict[str, Any] = {
            "link_mbit": round(rate_mbit, 3),
            "shaped_by": shaped_by,
            "url": storage_url(),
        }
        if self._checkpoint_size is None:
            emulation["errors"]["remote_storage"] = "the workload states no checkpoint size"
        else:
            pinned = self.bench.partition if self.bench.placement == "partitioned" else None
            python = self.job.config.python
            prefix = (
                (*partition.exec_prefix(pinned.workers, python), python) if pinned is not None else (python,)
            )
            try:
                remote.update(
                    remote_storage_rate(
                        self.job.net_dir, self.job.config.workers[0], storage_url(".probe"),
                        self._checkpoint_size, prefix=prefix,
                    )
                )  # fmt: skip
            except (RuntimeError, ValueError) as exc:
                raise BenchError(f"--storage remote: the storage host does not take writes: {exc}") from None
        emulation["remote_storage"] = remote

    def _run_system(self, system: System, round_number: int, result: BenchResult) -> LogFigures:
        job = self.job
        self._system = system
        self.renamer.current = f"{system.name} ({round_number + 1}/{self.bench.rounds})"
        self._sampled = False
        self._clock = CpuClock()
        self._account_first, self._account, self._syscalls = None, None, None
        self._log_dir = job.log_dir / f"round{round_number + 1}-{system.name}"
        shutil.rmtree(self._log_dir, ignore_errors=True)
        self._log_dir.mkdir(parents=True, exist_ok=True)
        if system.switch_replicates != self._job_at_switch:
            if system.switch_replicates:
                job.add_job()
            else:
                job.ctl("job", "remove", str(job.config.job_id))
            self._job_at_switch = system.switch_replicates
        if system.shadows:
            shutil.rmtree(job.snapshot_dir, ignore_errors=True)
            if self._storage is not None:  # --storage remote: the shadows persist to the storage host too
                shutil.rmtree(self._storage.local_path(SHADOW_SNAPSHOTS), ignore_errors=True)
                job.shadows.snapshot_url = storage_url(SHADOW_SNAPSHOTS)
            job.shadows.log_dir = self._log_dir
            job.shadows.snapshot_every = system.shadow_disk_every
            job.shadows.snapshot_seconds = system.shadow_disk_seconds
            job.shadows.nice = SHADOW_NICE if self.bench.placement == "partitioned" else 0
            job.start_shadows()
        series = RunSeries("main")
        # the switch counts copies since the job was added, which may span several runs: the difference
        before = job.switch_counters().get("packets") if system.switch_replicates else None
        try:
            job.train(series, None, system.shadows, log_dir=self._log_dir)
            if system.switch_replicates:
                after = job.switch_counters().get("packets")
                copies = None if before is None or after is None else after - before
                result.switch_copies[system.name] = copies
        finally:
            if job.shadows:
                statuses = job.shadows.stop()
                if system.shadows:
                    result.shadow_snapshots.setdefault(system.name, []).append(self._persisted(statuses))
        result.cpu.setdefault(system.name, []).append(self._clock.shares(self._cpu_sets()))
        if self._account is not None:
            self._account["agent_counters"] = agent_counters(
                [r for rank in range(len(job.config.workers)) for r in self._done_events(rank)]
            )
        result.worker_account.setdefault(system.name, []).append(self._account)
        return figures(read_log(self._log_dir / "rank0.jsonl"), system, self.bench.warmup)

    def _persisted(self, statuses: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """What each shadow's snapshot writer did in this run (from its last status), said when it failed."""
        persisted: dict[str, Any] = {}
        for name, status in sorted(statuses.items()):
            stats = status.get("snapshots") or {}
            persisted[name] = {
                key: stats.get(key)
                for key in (
                    "storage",
                    "written",
                    "failed",
                    "superseded",
                    "last_step",
                    "last_seconds",
                    "failing",
                )
            }
            if stats.get("failed"):
                self.renamer.say(
                    f"shadow {name}: {stats['failed']} snapshot write(s) failed; last: {stats.get('failing')}"
                )
        return persisted

    def _run_iterations(self, system: System) -> int:
        """Iterations for ``system``: enough for at least 3 of its checkpoints after the warmup."""
        every = system.every or 1
        return max(self.bench.iterations, self.bench.warmup + 3 * every + 2)

    # ---- the JobRun hooks -------------------------------------------------------------------
    def _launch(self, launch: LaunchConfig) -> LaunchConfig:
        """The demo's launch configuration plus this system's train_lm options and environment."""
        system = self._system
        if system is None:
            return launch
        extra: list[str] = []
        env = dict(launch.env)
        env.update(system.worker_env)
        if system.transport == GLOO:
            extra.append("--no-checkmate")
        extra += ["--iterations", str(self._run_iterations(system))]  # the last --iterations counts
        if system.checkpoint in BASELINE_KINDS:
            assert system.every is not None
            checkpoints = self.job.work / "checkpoints" / system.name
            where = str(checkpoints)
            if self._storage is not None:  # the export's directory on this machine's disk
                checkpoints, where = self._storage.local_path(system.name), storage_url(system.name)
            shutil.rmtree(checkpoints, ignore_errors=True)
            extra += ["--checkpoint", system.checkpoint, "--checkpoint-every", str(system.every)]
            extra += ["--checkpoint-dir", where]
        if system.checkpoint == "host-replication" or system.name == "ideal-cm-transport":
            # host mode never tags; without shadows in the job file it copies nothing either
            env["CHECKMATE_REPLICATION"] = "host"
        command = (*launch.command, *extra)
        if self.bench.placement == "partitioned" and self.bench.partition is not None:
            command = (*partition.exec_prefix(self.bench.partition.workers, self.job.config.python), *command)
        stall = launch.stall_timeout
        if self._storage is not None:
            # a worker waiting on a silent storage host fails with the NFS client's own error (naming the
            # file and its timeout) before the launcher's watchdog calls it a stall
            stall = max(stall, nfs.DEFAULT_TIMEOUT_S + STORAGE_STALL_MARGIN_S)
        return replace(launch, command=command, env=env, stall_timeout=stall)

    def _on_iteration(self, series: str, incarnation: int, record: dict[str, Any]) -> None:
        """Once past the warmup, read back where every process of this run may run and start counting
        its CPU time (:mod:`experiments.bench.cpu_time`); later, sample that CPU time."""
        iteration = int(record.get("iteration", -1))
        if iteration < self.bench.warmup:
            return
        if self._sampled:
            if self._system is None:
                return
            end = self._run_iterations(self._system) - 1
            window = self.bench.syscall_iterations
            if self._syscalls is not None:  # counting system calls: the CPU figures are taken
                if iteration >= end:
                    self._finish_syscalls(iteration)
                return
            if window and iteration >= end - window:
                self._clock.tick(iteration, final=True)
                self._finish_account(iteration)
                self._syscalls = SyscallWindow()
                self._syscalls.start(self._clock.roles.get("workers", []), iteration)
                return
            last = iteration >= end
            self._clock.tick(iteration, final=last)
            if last:
                self._finish_account(iteration)
            return
        self._sampled = True
        try:
            roles = self._placement_roles()
            self._sample_placement(roles)
            self._clock.start(roles, iteration)
            self._account_first = take_account(roles["workers"], iteration)
        except (OSError, ValueError) as exc:  # a process that ended while being read
            logger.warning("reading back the CPU placement: %s", exc)

    def _finish_account(self, iteration: int) -> None:
        """The workers' per-iteration account from the first sample to now (:mod:`worker_account`)."""
        if self._account_first is None:
            return
        last = take_account(list(self._account_first.threads), iteration)
        self._account = account(self._account_first, last, len(self.job.config.workers))

    def _finish_syscalls(self, iteration: int) -> None:
        window, self._syscalls = self._syscalls, None
        if window is None:
            return
        counted = window.stop(iteration, len(self.job.config.workers))
        if self._account is not None:
            self._account["syscalls"] = counted

    def _cpu_sets(self) -> dict[str, frozenset[int]]:
        pinned = self.bench.partition
        if self.bench.placement == "partitioned" and pinned is not None:
            return {"workers": pinned.workers, "infrastructure": pinned.infrastructure}
        return {"all": partition.available_cpus()}

    def _done_events(self, rank: int) -> list[dict[str, Any]]:
        """``rank``'s last ``done`` record of this run (empty: it has none)."""
        done = [r for r in read_log(self._log_dir / f"rank{rank}.jsonl") if r.get("event") == "done"]
        return done[-1:]

    # ---- CPU placement ------------------------------------------------------------------------
    def _placement_roles(self) -> dict[str, list[int]]:
        """The pids of what runs now: workers, shadows, switch, supervisor (and host shells), this process."""
        roles: dict[str, list[int]] = {
            "workers": [],
            "shadows": [],
            "switch": [],
            "supervisor": [],
            "bench": [],
        }
        children = partition.children_map()
        for rank in range(len(self.job.config.workers)):
            for record in read_log(self._log_dir / f"rank{rank}.jsonl"):
                if record.get("event") == "start" and isinstance(record.get("pid"), int):
                    pid = int(record["pid"])
                    roles["workers"] += [pid, *partition.descendants(pid, children)]
                    break
        for process in self.job.shadows.processes.values():
            roles["shadows"] += [process.pid, *partition.descendants(process.pid, children)]
        try:
            state = RunState.load(self.job.net_dir)
            roles["switch"] = [record.pid for record in state.switches.values()]
            roles["supervisor"] = [state.supervisor_pid, *(h.pid for h in state.hosts.values())]
        except RunStateError as exc:
            logger.warning("no network state to read back the placement from: %s", exc)
        roles["bench"] = [os.getpid()]
        return roles

    def _sample_placement(self, roles: dict[str, list[int]]) -> None:
        result, system = self._result, self._system
        if result is None or system is None or system.name in result.placement:
            return
        observed = partition.read_back(roles)
        result.placement[system.name] = observed
        pinned = self.bench.partition
        if self.bench.placement == "partitioned" and pinned is not None:
            required = (
                "workers",
                "switch",
                "supervisor",
                "bench",
                *(("shadows",) if self.job.shadows else ()),
            )
            problems = partition.check_placement(observed, pinned, required)
            result.placement_problems += [f"{system.name}: {p}" for p in problems]
