"""One Checkmate job on the emulated network, step by step: :class:`JobRun`.

A job run brings up a private copy of a topology (``checkmate-net up``),
registers the job at the switch (``checkmate-ctl job add``), starts the
shadows (``checkmate-shadow run`` in their hosts), trains with the DDP workers
under :class:`~experiments.launcher.Launcher` (``examples/train_lm.py`` by
default, a worker killed on request and the job restarted from the shadows),
fetches the shadows' final state, and always takes everything down again.

Each step is a public method, so an experiment can run them in its own order:

* :meth:`~JobRun.prepare`: the work folder, a network an earlier run left there
  taken down, a private copy of the topology (switches renamed, free P4Runtime ports);
* :meth:`~JobRun.bring_up_network`: ``checkmate-net up`` (with ``JobConfig.switch_args``);
* :meth:`~JobRun.add_job`: ``checkmate-ctl job add`` and the job files (0600);
* :meth:`~JobRun.start_shadows`: every shadow in its host, then wait until all are
  ready (``JobRun.shadows``, :class:`~experiments.shadows.ShadowProcesses`);
* :meth:`~JobRun.train`: one training run, all its incarnations, into a
  :class:`~experiments.results.RunSeries`;
* :meth:`~JobRun.verify_shadows`: the shadows' final state, digested inside a host;
* :meth:`~JobRun.switch_counters`, :meth:`~JobRun.run_reference` (the same job
  without the failure and without shadows), :meth:`~JobRun.teardown`.

:meth:`JobRun.run` is the demo's sequence of them (``make demo``). What a
caller adds to a step goes through :class:`JobHooks` (callables, each optional)
rather than by overriding the steps: the benchmark changes each training run's
command and samples CPU placement as iterations arrive; the reliability
suite's fault harness runs its own worker and fires faults at given
iterations.

What a run runs, :class:`~experiments.job_config.JobConfig`, lives in
:mod:`experiments.job_config` (so that the results and the shadows read it without
importing this module); ``from experiments.job import JobConfig`` still works.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkmate.network import Network
from checkmate.p4.names import ShadowCopies
from checkmate.wire import CHECKMATE_UDP_PORT
from controller.job_secrets import JobSecrets
from experiments.commands import (
    CTL,
    NET,
    REPO,
    JobError,
    free_tcp_port,
    renamed,
    run_command,
    secret_env,
)
from experiments.job_config import JobConfig
from experiments.launcher import KillPlan, LaunchConfig, Launcher, LaunchError, tail
from experiments.progress import Observer
from experiments.results import JobResult, RunSeries
from experiments.shadows import ShadowProcesses
from topologies.cleanup import cleanup
from topologies.runstate import RunState, RunStateError

logger = logging.getLogger(__name__)


def _nothing(*args: Any) -> None:
    return None


def _unchanged(launch: LaunchConfig) -> LaunchConfig:
    return launch


@dataclass(frozen=True)
class JobHooks:
    """What a caller adds to :class:`JobRun`'s steps; each hook is optional (the default does nothing)."""

    launch: Callable[[LaunchConfig], LaunchConfig] = _unchanged
    """Called by :meth:`JobRun.train` with the workers' launch configuration just before they start;
    returns the one to use (another command, more environment, a CPU-pinning prefix)."""
    iteration: Callable[[str, int, dict[str, Any]], None] = _nothing
    """Called as rank 0 logs each iteration, after the progress display: (the series' name,
    ``main`` or ``reference``; the incarnation; rank 0's log record)."""
    before_verify: Callable[[], None] = _nothing
    """Called by :meth:`JobRun.verify_shadows` before it asks the shadows for their state."""


class JobRun:
    """One job on a private emulated network; :meth:`run` (the demo) always tears down what it started.

    Attributes a caller may read: ``work`` (the work folder) and in it ``net_dir``,
    ``state_dir`` (the controller's registry), ``snapshot_dir``, ``log_dir``,
    ``reference_log_dir``, ``network_file``; after :meth:`prepare` ``network``; after
    :meth:`add_job` ``job`` (``checkmate-ctl job show``'s document) and ``secret``;
    ``shadows`` (:class:`~experiments.shadows.ShadowProcesses`: start, wait, status, kill; its
    ``hosts`` say where each of the job's shadows runs, for the job files and the final check).
    """

    def __init__(
        self, config: JobConfig, observer: Observer | None = None, hooks: JobHooks | None = None
    ) -> None:
        self.config = config
        self.observer = observer or Observer()
        self.hooks = hooks or JobHooks()
        work = config.work_dir.resolve()
        self.work = work
        self.net_dir = work / "network"
        self.state_dir = work / "controller"
        self.snapshot_dir = work / "snapshots"
        self.log_dir = work / "logs"
        self.reference_log_dir = work / "reference-logs"
        self.network_file = work / "single.json"
        self.network: Network | None = None
        self.job: dict[str, Any] | None = None
        self.secret = ""
        """The job's secret (hex), from the registry once the job is added."""
        self.shadows = ShadowProcesses(
            config, self.net_dir, self.snapshot_dir, self.log_dir, work / "job-file.json", self.address,
            self.observer,
        )  # fmt: skip
        self.shadow_live: dict[str, dict[str, Any]] = {}
        self._launcher: Launcher | None = None
        self._network_up = False
        self._workers_ran = False
        self._last_status_read = 0.0

    # ---- the demo: every step in order ----------------------------------------------------
    def run(self) -> JobResult:
        """Network, job, shadows, training (with the failure), verify, reference run; teardown always."""
        started = time.monotonic()
        result = JobResult(self.config, RunSeries("main"))
        try:
            self._timed(result, "prepare", self.prepare)
            self._timed(result, "network", self.bring_up_network)
            self._timed(result, "job", self.add_job)
            self._timed(result, "shadows", self.start_shadows)
            self._timed(result, "training", lambda: self.train(result.main, self.config.kill_iteration))
            if self.shadows:
                result.shadow_digest = self._timed(result, "verify", self.verify_shadows)
            else:
                result.notes.append(
                    "the shadows were stopped with the failure: shadow_equals_workers not checked"
                )
            result.switch_counters = self.switch_counters()
            result.shadow_status = self.shadows.stop()
            if self.config.reference:
                reference = result.reference = RunSeries("reference")
                self._timed(result, "reference", lambda: self.run_reference(reference))
        finally:
            self._timed(result, "teardown", self.teardown)
            result.seconds = time.monotonic() - started
        return result

    @staticmethod
    def _timed(result: JobResult, name: str, step: Callable[[], Any]) -> Any:
        began = time.monotonic()
        try:
            return step()
        finally:
            result.phases[name] = result.phases.get(name, 0.0) + time.monotonic() - began

    # ---- network and job --------------------------------------------------------------------
    def prepare(self) -> None:
        """The work folder, emptied of an earlier run's state, and a private copy of the topology."""
        self.observer.phase("prepare", 1)
        self.work.mkdir(parents=True, exist_ok=True)
        try:
            RunState.load(self.net_dir)
            found = True
        except RunStateError:
            found = False
        if found:
            report = cleanup(self.net_dir)
            what = []
            if report.supervisor_stopped:
                what.append("stopped its supervisor")
            if report.killed:
                what.append(f"killed {', '.join(report.killed)}")
            if report.deleted_interfaces:
                what.append(f"deleted interfaces {', '.join(report.deleted_interfaces)}")
            self.observer.say(
                f"took down a network an earlier demo left in {self.net_dir}: "
                + ("; ".join(what) or "nothing was left running")
            )
            if report.leftovers:
                raise JobError(f"could not remove what an earlier demo left: {report.leftovers}")
        for folder in (self.state_dir, self.snapshot_dir, self.log_dir, self.reference_log_dir):
            shutil.rmtree(folder, ignore_errors=True)
        data = json.loads(self.config.topology.read_text())
        for old, new in self.config.rename_switches:
            data["switches"][new] = data["switches"].pop(old)
            data["links"] = [
                [renamed(end, old, new) for end in link[:2]] + link[2:] for link in data["links"]
            ]
        for switch in data["switches"].values():
            switch["grpc"] = f"127.0.0.1:{free_tcp_port()}"
        self.network_file.write_text(json.dumps(data, indent=2))
        self.network = Network.load(self.network_file)
        self.observer.phase_done("prepare", str(self.work))

    def bring_up_network(self) -> None:
        """``checkmate-net up`` of the private topology; from here on :meth:`teardown` takes it down."""
        self.observer.phase("network", 1)
        argv = [*NET, "up", str(self.network_file), "--target", self.config.target]
        argv += ["--run-dir", str(self.net_dir), "--state-dir", str(self.state_dir)]
        argv += ["--timeout", str(self.config.network_timeout - 10)]
        argv += [f"--switch-args={value}" for value in self.config.switch_args]
        self._network_up = True  # from here on, teardown takes it down (also a half-made one)
        run_command(argv, self.config.network_timeout, "checkmate-net up")
        self.observer.phase_done("network", f"{self.network_file.name} on the {self.config.target} target")

    def ctl(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """``checkmate-ctl ARGS`` on this network and registry; JobError when it fails."""
        argv = [*CTL, "--network", str(self.network_file), "--state-dir", str(self.state_dir), *args]
        return run_command(argv, timeout, f"checkmate-ctl {' '.join(args[:2])}")

    def show_job(self) -> dict[str, Any]:
        """``checkmate-ctl job show --json`` of this job."""
        document: dict[str, Any] = json.loads(
            self.ctl("job", "show", str(self.config.job_id), "--json").stdout
        )
        return document

    def add_job(self) -> None:
        """Register the job at the switch; write the job files the workers and shadows read."""
        config = self.config
        self.observer.phase("job", 1)
        self.ctl(
            "job", "add", "--job-id", str(config.job_id),
            "--workers", ",".join(config.workers), "--shadows", ",".join(config.shadows),
        )  # fmt: skip
        shown = self.show_job()
        self.job = shown["job"]
        # The job's secret, from the registry, goes to workers and shadows in the job files (0600).
        self.secret = JobSecrets(self.state_dir).read(config.job_id).hex()
        self.write_job_file(self.work / "job-file.json", with_shadows=True)
        self.write_job_file(self.work / "job-file-no-shadows.json", with_shadows=False)
        self.ctl("job", "secret", str(config.job_id), "--check", str(self.work / "job-file.json"))
        groups = len(shown.get("groups", []))
        self.observer.phase_done("job", f"job {config.job_id}: {groups} multicast groups installed")

    def address(self, host: str) -> str:
        """A host's address in the network (after :meth:`prepare`)."""
        assert self.network is not None, "prepare() first"
        return str(self.network.host(host).address)

    def write_job_file(
        self,
        path: Path,
        with_shadows: bool,
        job: dict[str, Any] | None = None,
        workers: Sequence[str] | None = None,
    ) -> None:
        """The job file (0600): the job, its workers' ring, its shadows' control addresses, the secret."""
        ring = self.config.workers if workers is None else workers
        document = {
            "job": self.job if job is None else job,
            "worker_addresses": [f"{self.address(w)}:{CHECKMATE_UDP_PORT}" for w in ring],
            "shadow_control": self.shadows.control() if with_shadows else {},
            "secret": self.secret,
        }
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # also when an earlier run left the file with another mode
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(document, indent=1))

    def start_shadows(self) -> None:
        """Start every shadow of the job in its host and wait until all are ready."""
        self.observer.phase("shadows", len(self.config.shadows))
        for name in self.config.shadows:
            self.shadows.start(name)
        self.shadows.wait_ready(self.config.shadows)
        where = ", ".join(f"{n} at {self.address(self.shadows.hosts[n])}" for n in self.config.shadows)
        self.observer.phase_done("shadows", where)

    # ---- training ---------------------------------------------------------------------------
    def launch_config(
        self, log_dir: Path, job_file: Path, kills: tuple[KillPlan, ...], reference: bool
    ) -> LaunchConfig:
        """How :meth:`train` starts the workers (before :attr:`JobHooks.launch` changes it)."""
        config = self.config
        args = ["--iterations", str(config.iterations), "--global-batch", str(config.global_batch)]
        # the workers' fallback when the shadows' memory is gone: where the shadows persist
        fallback = self.shadows.snapshot_url or str(self.snapshot_dir)
        args += ["--log", str(log_dir / "rank{rank}.jsonl"), "--snapshot-dir", fallback]
        if config.elastic and reference:
            args.append("--log-digests")  # to check the state the elastic restart restored
        return LaunchConfig(
            run_dir=self.net_dir,
            workers=config.workers,
            master_addr=self.address(config.workers[0]),
            host_addresses={w: self.address(w) for w in config.workers},
            shrink_on_failure=config.elastic and not reference,
            min_workers=2,
            command=(config.python, "-m", config.worker_module, *args, *config.model_args),
            log_dir=log_dir,
            env={
                **secret_env(job_file, {}),
                "CHECKMATE_TIMEOUT": "30",
                "CHECKMATE_PEER_TIMEOUT": "10",
            },
            max_restarts=config.max_restarts,
            total_timeout=config.train_timeout,
            kills=kills,
            net_command=tuple(NET),
        )

    def train(
        self,
        series: RunSeries,
        kill_iteration: int | None = None,
        with_shadows: bool = True,
        log_dir: Path | None = None,
    ) -> None:
        """One training run into ``series`` (``main`` or ``reference``): the workers under the launcher,
        rank ``kill_rank`` killed during ``kill_iteration``, restarted from the shadows' latest
        certified state. ``with_shadows``: the workers' job file lists the shadows. ``log_dir``:
        where the workers log (default: ``log_dir``, or ``reference_log_dir`` for the reference)."""
        config = self.config
        kills = (KillPlan(config.kill_rank, kill_iteration),) if kill_iteration is not None else ()
        job_file = self.work / ("job-file.json" if with_shadows else "job-file-no-shadows.json")
        if log_dir is None:
            log_dir = self.log_dir if series.name == "main" else self.reference_log_dir
        phase = "training" if series.name == "main" else "reference"
        self.observer.phase(phase, config.iterations)

        def on_record(incarnation: int, rank: int, record: dict[str, Any]) -> None:
            series.add(incarnation, rank, record)
            if rank == 0 and "loss" in record:
                self._show_progress(series, phase, incarnation, record)
                self.hooks.iteration(series.name, incarnation, record)
            elif rank == 0 and record.get("event") == "start" and incarnation > 0:
                source = record.get("source") or "nowhere (from scratch)"
                self.observer.say(
                    f"rank 0 restored the state after iteration {record.get('restored_from')} from "
                    f"{source} ({record.get('detail') or '-'}); training resumes at iteration "
                    f"{record['start_iteration']}"
                )

        def on_event(kind: str, details: dict[str, Any]) -> None:
            if kind == "kill":
                self.observer.say(
                    f"kill -{details['signal'].removeprefix('SIG')} rank {details['rank']} "
                    f"({details['host']}, pid {details['pid']}) during iteration {details['iteration']}"
                )
            elif kind == "failure":
                self.observer.say(f"failure detected: {details['failure']}; stopping the other workers")
                if with_shadows and config.shadows_fail_too and self.shadows:
                    self.observer.say(
                        "the shadows fail too: stopping them (recovery must use their snapshots)"
                    )
                    self.shadows.stop()
            elif kind == "restart":
                workers = details.get("workers", config.workers)
                if len(workers) == len(config.workers):
                    self.observer.say(
                        f"restarting all {len(workers)} workers from the latest certified state"
                    )
                else:
                    self.observer.say(
                        f"restarting with {len(workers)} workers ({', '.join(workers)}) from the latest "
                        "certified state; the job is resized at the switch"
                    )

        def before_start(incarnation: int, workers: tuple[str, ...]) -> dict[str, str] | None:
            env: dict[str, str] = {}
            if with_shadows and config.shadows_fail_too and incarnation > 0:
                # The shadows were stopped on purpose: the rest of the run is unprotected by design,
                # so it trains on and says so (hosts.protection would otherwise stop it, loudly).
                env.update(CHECKMATE_UNPROTECTED="log", CHECKMATE_ON_LAG="continue")
            if not with_shadows or tuple(workers) == tuple(config.workers):
                return env or None
            # Another ring: the switch must copy on the new ring links, and the workers need
            # a job file listing it.
            self.ctl("job", "resize", str(config.job_id), "--workers", ",".join(workers))
            path = self.work / f"job-file-{incarnation}.json"
            self.write_job_file(path, with_shadows=True, job=self.show_job()["job"], workers=workers)
            return {**env, "CHECKMATE_JOB_FILE": str(path)}

        launch = self.launch_config(log_dir, job_file, kills, reference=series.name != "main")
        self._launcher = Launcher(self.hooks.launch(launch), on_record, on_event, before_start)
        self._workers_ran = True
        try:
            series.result = self._launcher.run()
        except LaunchError as exc:
            outputs = "\n".join(
                f"--- rank {r} ---\n{tail(log_dir / f'rank{r}.out', 15)}" for r in range(len(config.workers))
            )
            raise JobError(f"{phase}: {exc}\n{outputs}") from None
        finally:
            self._launcher = None
        final = series.mean_loss(len(series.result.incarnations) - 1)
        self.observer.phase_done(
            phase,
            f"{config.iterations} iterations, {series.result.restarts} restart(s), "
            f"final loss {final[max(final)]:.3f}"
            if final
            else "",
        )

    def _show_progress(self, series: RunSeries, phase: str, incarnation: int, record: dict[str, Any]) -> None:
        iteration = int(record["iteration"])
        losses = series.losses.get(incarnation, {}).get(iteration, [])
        info = f"loss {statistics.fmean(losses):.3f}" if losses else ""
        certified = record.get("certified")
        if certified is not None:
            info += f" · certified {certified} · lag {iteration - certified}"
        now = time.monotonic()
        if self.shadows and now - self._last_status_read > 0.5:
            self._last_status_read = now
            self.shadow_live = {n: self.shadows.status(n) for n in self.shadows.processes}
        if self.shadows and self.shadow_live:
            applied = " ".join(f"{n}@{s.get('applied_iteration', '?')}" for n, s in self.shadow_live.items())
            info += f" · shadows {applied}"
        if incarnation:
            info += f" · restart {incarnation}"
        self.observer.advance(phase, iteration + 1, info)

    def run_reference(self, series: RunSeries) -> None:
        """The same job without the failure and without shadows (its replication removed at the switch)."""
        self.ctl("job", "remove", str(self.config.job_id))
        self.train(series, None, with_shadows=False)

    # ---- checks and teardown ------------------------------------------------------------------
    def verify_shadows(self) -> dict[str, Any]:
        """The shadows' state after the last iteration, digested inside a host (the shadows' network)."""
        self.hooks.before_verify()
        config = self.config
        self.observer.phase("verify", 1)
        out = self.work / "shadow-digest.json"
        out.unlink(missing_ok=True)
        argv = [
            config.python,
            "-m",
            "checkmate.checkpoint.shadow_memory",
            "digest",
            "--iteration",
            str(config.iterations - 1),
        ]
        argv += ["--timeout", str(config.verify_timeout / 2), "--out", str(out)]
        for name, address in self.shadows.control().items():
            argv += ["--shadow", f"{name}={address}"]
        try:
            subprocess.run(
                [*NET, "exec", "--run-dir", str(self.net_dir), config.workers[0], "--", *argv],
                env=secret_env(self.work / "job-file.json"),
                capture_output=True,
                timeout=config.verify_timeout,
                cwd=REPO,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise JobError(
                f"fetching the shadows' state did not finish within {config.verify_timeout:.0f} s"
            ) from None
        try:
            digest: dict[str, Any] = json.loads(out.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise JobError(f"the shadows' state could not be fetched: {exc}") from None
        info = (
            f"shadows hold iteration {digest['iteration']}: sha256 {digest['params_sha256'][:16]}"
            if digest.get("ok")
            else f"shadows could not serve the state: {digest.get('error')}"
        )
        self.observer.phase_done("verify", info)
        return digest

    def switch_counters(self) -> dict[str, Any]:
        """The switch's copies to the shadows (``packets``, summed; ``per_switch``); {} when unreadable."""
        try:
            shown = self.show_job()
        except (JobError, json.JSONDecodeError) as exc:
            logger.warning("cannot read the switch counters: %s", exc)
            return {}
        counters = shown.get("counters", {})
        packets = sum(s.get(ShadowCopies.NAME, {}).get("packets", 0) for s in counters.values())
        return {"packets": packets, "per_switch": counters}

    def teardown(self) -> None:
        """Stop workers and shadows and take the network down; a second Ctrl-C does not cut it short."""
        self.observer.phase("teardown", 1)
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        done = []
        try:
            try:
                if self._launcher is not None:
                    self._launcher.close()
                if self._workers_ran:
                    done.append("workers stopped")
                if self.shadows:
                    self.shadows.stop()
                    done.append("shadows stopped")
            except OSError as exc:
                self.observer.say(f"stopping workers and shadows: {exc} (checkmate-net down sweeps them)")
            if self._network_up:
                try:
                    result = subprocess.run(
                        [*NET, "down", "--run-dir", str(self.net_dir)],
                        capture_output=True,
                        text=True,
                        timeout=120,
                        cwd=REPO,
                        check=False,
                    )
                    if result.returncode != 0:
                        self.observer.say(f"checkmate-net down: {(result.stdout + result.stderr).strip()}")
                    done.append("network down")
                except subprocess.TimeoutExpired:
                    self.observer.say(
                        f"checkmate-net down did not finish: run it by hand (--run-dir {self.net_dir})"
                    )
                self._network_up = False
        finally:
            signal.signal(signal.SIGINT, previous)
        self.observer.phase_done("teardown", ", ".join(done) or "nothing to undo")
