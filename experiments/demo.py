"""``make demo``: train through the emulated switch, kill a worker, recover from the shadows, verify.

    python -m experiments.demo [--iterations 100] [--kill-at 40] [--no-reference] [--work-dir DIR]

Steps (each a progress bar):

1. **network**: ``checkmate-net up`` of ``topologies/single.json`` on the
   embedded target, in a private run directory (``--work-dir``, default
   ``/tmp/checkmate-demo``; a network left there by an earlier demo is taken
   down first) with a free P4Runtime port and a private controller registry;
2. **job**: ``checkmate-ctl job add`` (workers h1-h3 in ring order, shadows
   sh1, sh2): the switch now copies the job's tagged all-gather packets;
3. **shadows**: ``checkmate-shadow run`` in sh1 and sh2, snapshotting every
   iteration into one shared directory;
4. **training**: :class:`~experiments.launcher.Launcher` runs
   ``examples/train_lm.py`` (TinyLM, AdamW, cosine LR, clipping)
   in h1-h3, kills one worker with SIGKILL during ``--kill-at``, and restarts
   all three from the shadows' latest certified state;
5. **verify**: the shadows' state after the last iteration, fetched from
   their memory, is compared bit for bit (SHA-256 of every parameter and
   optimizer tensor) with the workers' final state;
6. **reference** (unless ``--no-reference``): the same job without the
   failure; the recovered run must end bit-identical to it;
7. **teardown**: shadows stopped, ``checkmate-net down`` — always, also after
   an error or Ctrl-C.

Then a summary table, ``results/demo.json`` and ``results/demo.png`` (loss over
iterations with the failure and the recovery marked, and the shadows' lag).
:class:`DemoRun` does the work (tests drive it with small settings);
:class:`RichObserver` draws it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

from checkmate.control import DEFAULT_CONTROL_PORT
from checkmate.network import Network
from checkmate.wire import CHECKMATE_UDP_PORT
from controller.job_secrets import JobSecrets
from experiments.launcher import KillPlan, LaunchConfig, Launcher, LaunchError, LaunchResult, tail
from topologies.cleanup import cleanup
from topologies.runstate import RunState, RunStateError

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEFAULT_WORK_DIR = Path("/tmp/checkmate-demo")

# The first torch optimizer a process builds imports torch._dynamo (seconds on a busy 2-core
# machine); a shadow builds its first one when the job's first bucket layout arrives, while it
# holds the lock its receive thread needs, and falls behind for good. Importing it before the
# shadow starts avoids that until shadow/ warms up by itself.
SHADOW_BOOT = "import sys, torch._dynamo; from shadow.cli import main; sys.exit(main())"


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and where to look."""


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs; the defaults are ``make demo``'s."""

    iterations: int = 100
    kill_iteration: int | None = 40
    """The iteration during which a worker is killed (None: no failure)."""
    kill_rank: int = 1
    elastic: bool = False
    """Restart without the failed worker's host (N-1 workers; the job is resized at the switch)
    instead of all N: the job continues, but is no longer bit-identical to the reference."""
    shadows_fail_too: bool = False
    """Stop the shadows together with the failed worker: the job must restore from their snapshots."""
    reference: bool = True
    """Also run the job without the failure and compare the final parameters bit for bit."""
    workers: tuple[str, ...] = ("h1", "h2", "h3")
    shadows: tuple[str, ...] = ("sh1", "sh2")
    job_id: int = 1
    global_batch: int = 48
    model_args: tuple[str, ...] = ()
    """Extra train_lm arguments (e.g. a smaller model: ``--width 32 --layers 1``)."""
    topology: Path = REPO / "topologies" / "single.json"
    rename_switches: tuple[tuple[str, str], ...] = ()
    """(old, new) switch names in the private copy of the topology, so that it can run next to
    another network built from the same description (switch port interfaces are named after
    their switch, in the root namespace)."""
    target: str = "embedded"
    work_dir: Path = DEFAULT_WORK_DIR
    results_dir: Path | None = REPO / "results"
    """Where demo.json and demo.png go (None: nowhere)."""
    network_timeout: float = 150.0
    shadow_start_timeout: float = 60.0
    train_timeout: float = 480.0
    verify_timeout: float = 60.0
    max_restarts: int = 3

    @property
    def python(self) -> str:
        return sys.executable


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
            self.times.setdefault(incarnation, {})[iteration] = float(record["time"])

    def mean_loss(self, incarnation: int) -> dict[int, float]:
        return {i: statistics.fmean(v) for i, v in sorted(self.losses.get(incarnation, {}).items())}

    def lag(self, incarnation: int) -> dict[int, int]:
        """Iterations rank 0 was ahead of the shadows right after each step (where known)."""
        return {i: i - c for i, c in sorted(self.certified.get(incarnation, {}).items()) if c is not None}


class Observer:
    """What the demo reports as it goes; the default does nothing (tests), see :class:`RichObserver`."""

    def phase(self, name: str, total: int | None = None) -> None:
        """A step starts (``total``: its units, e.g. iterations)."""

    def advance(self, name: str, completed: int | None = None, info: str = "") -> None:
        """Progress within a step."""

    def phase_done(self, name: str, info: str = "") -> None:
        """A step ends."""

    def say(self, text: str) -> None:
        """Something worth a line of its own."""


@dataclass
class DemoResult:
    """Everything the demo measured; :meth:`summary` is ``results/demo.json``."""

    config: DemoConfig
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


# ---- helpers ------------------------------------------------------------------------------
def _free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _renamed(end: str, old: str, new: str) -> str:
    """A link end (``s1-p3`` or a host name) with switch ``old`` renamed to ``new``."""
    return new + end[len(old) :] if end == old or end.startswith(f"{old}-p") else end


def _tool(name: str, module: str) -> list[str]:
    binary = BIN / name
    return [str(binary)] if binary.exists() else [sys.executable, "-m", module]


NET = _tool("checkmate-net", "topologies.cli")
CTL = _tool("checkmate-ctl", "controller.cli")


def _run(argv: Sequence[str], timeout: float, what: str) -> subprocess.CompletedProcess[str]:
    """Run a command to completion within ``timeout``; DemoError with its output when it fails."""
    try:
        result = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False
        )
    except subprocess.TimeoutExpired:
        raise DemoError(f"{what}: `{' '.join(argv)}` did not finish within {timeout:.0f} s") from None
    if result.returncode != 0:
        raise DemoError(f"{what} failed ({result.returncode}):\n{(result.stderr or result.stdout).strip()}")
    return result


def _secret_env(job_file: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (None: this environment) with the job secret coming from ``job_file`` alone: another
    secret inherited from here (CHECKMATE_JOB_SECRET, ..._FILE) would be refused as a mismatch."""
    env = dict(os.environ if base is None else base)
    env.update(CHECKMATE_JOB_FILE=str(job_file), CHECKMATE_JOB_SECRET="", CHECKMATE_JOB_SECRET_FILE="")
    return env


class DemoRun:
    """Runs the demo once; :meth:`run` always tears down what it started."""

    def __init__(self, config: DemoConfig, observer: Observer | None = None) -> None:
        self.config = config
        self.observer = observer or Observer()
        work = config.work_dir.resolve()
        self.net_dir = work / "network"
        self.state_dir = work / "controller"
        self.snapshot_dir = work / "snapshots"
        self.log_dir = work / "logs"
        self.reference_log_dir = work / "reference-logs"
        self.network_file = work / "single.json"
        self.work = work
        self.network: Network | None = None
        self._shadows: dict[str, subprocess.Popen[bytes]] = {}
        self._launcher: Launcher | None = None
        self._network_up = False
        self._workers_ran = False
        self._last_status_read = 0.0
        self.shadow_live: dict[str, dict[str, Any]] = {}
        self.secret = ""
        """The job's secret (hex), from the registry once the job is added."""

    # ---- the whole thing ------------------------------------------------------------------
    def run(self) -> DemoResult:
        started = time.monotonic()
        result = DemoResult(self.config, RunSeries("main"))
        try:
            self._timed(result, "prepare", self._prepare)
            self._timed(result, "network", self._network_up_step)
            self._timed(result, "job", self._add_job)
            self._timed(result, "shadows", self._start_shadows)
            self._timed(
                result, "training", lambda: self._train(result.main, self.config.kill_iteration, True)
            )
            if self._shadows:
                result.shadow_digest = self._timed(result, "verify", self._verify)
            else:
                result.notes.append(
                    "the shadows were stopped with the failure: shadow_equals_workers not checked"
                )
            result.switch_counters = self._switch_counters()
            result.shadow_status = self._stop_shadows()
            if self.config.reference:
                result.reference = RunSeries("reference")
                self._timed(result, "reference", lambda: self._reference(result.reference))
        finally:
            self._timed(result, "teardown", self._teardown)
            result.seconds = time.monotonic() - started
        return result

    def _timed(self, result: DemoResult, name: str, step: Any) -> Any:
        began = time.monotonic()
        try:
            return step()
        finally:
            result.phases[name] = result.phases.get(name, 0.0) + time.monotonic() - began

    # ---- steps ----------------------------------------------------------------------------
    def _prepare(self) -> None:
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
                raise DemoError(f"could not remove what an earlier demo left: {report.leftovers}")
        for folder in (self.state_dir, self.snapshot_dir, self.log_dir, self.reference_log_dir):
            shutil.rmtree(folder, ignore_errors=True)
        data = json.loads(self.config.topology.read_text())
        for old, new in self.config.rename_switches:
            data["switches"][new] = data["switches"].pop(old)
            data["links"] = [
                [_renamed(end, old, new) for end in link[:2]] + link[2:] for link in data["links"]
            ]
        for switch in data["switches"].values():
            switch["grpc"] = f"127.0.0.1:{_free_tcp_port()}"
        self.network_file.write_text(json.dumps(data, indent=2))
        self.network = Network.load(self.network_file)
        self.observer.phase_done("prepare", str(self.work))

    def _network_up_step(self) -> None:
        self.observer.phase("network", 1)
        argv = [*NET, "up", str(self.network_file), "--target", self.config.target]
        argv += ["--run-dir", str(self.net_dir), "--state-dir", str(self.state_dir)]
        argv += ["--timeout", str(self.config.network_timeout - 10)]
        self._network_up = True  # from here on, teardown takes it down (also a half-made one)
        _run(argv, self.config.network_timeout, "checkmate-net up")
        self.observer.phase_done("network", f"{self.network_file.name} on the {self.config.target} target")

    def _ctl(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        argv = [*CTL, "--network", str(self.network_file), "--state-dir", str(self.state_dir), *args]
        return _run(argv, timeout, f"checkmate-ctl {' '.join(args[:2])}")

    def _add_job(self) -> None:
        config = self.config
        self.observer.phase("job", 1)
        self._ctl(
            "job", "add", "--job-id", str(config.job_id),
            "--workers", ",".join(config.workers), "--shadows", ",".join(config.shadows),
        )  # fmt: skip
        shown = json.loads(self._ctl("job", "show", str(config.job_id), "--json").stdout)
        self.job = shown["job"]
        # The job's secret, from the registry, goes to workers and shadows in the job files (0600).
        self.secret = JobSecrets(self.state_dir).read(config.job_id).hex()
        self._write_job_file(self.work / "job-file.json", with_shadows=True)
        self._write_job_file(self.work / "job-file-no-shadows.json", with_shadows=False)
        self._ctl("job", "secret", str(config.job_id), "--check", str(self.work / "job-file.json"))
        groups = len(shown.get("groups", []))
        self.observer.phase_done("job", f"job {config.job_id}: {groups} multicast groups installed")

    def _address(self, host: str) -> str:
        assert self.network is not None
        return str(self.network.host(host).address)

    def _write_job_file(
        self,
        path: Path,
        with_shadows: bool,
        job: dict[str, Any] | None = None,
        workers: Sequence[str] | None = None,
    ) -> None:
        ring = self.config.workers if workers is None else workers
        document = {
            "job": self.job if job is None else job,
            "worker_addresses": [f"{self._address(w)}:{CHECKMATE_UDP_PORT}" for w in ring],
            "shadow_control": self._shadow_control() if with_shadows else {},
            "secret": self.secret,
        }
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # also when an earlier run left the file with another mode
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(document, indent=1))

    def _shadow_control(self) -> dict[str, str]:
        return {s: f"{self._address(s)}:{DEFAULT_CONTROL_PORT}" for s in self.config.shadows}

    def _start_shadows(self) -> None:
        config = self.config
        self.observer.phase("shadows", len(config.shadows))
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for name in config.shadows:
            ip = self._address(name)
            argv = [config.python, "-c", SHADOW_BOOT, "run", "--name", name, "--job-id", str(config.job_id)]
            argv += ["--control", f"{ip}:{DEFAULT_CONTROL_PORT}", "--data", f"{ip}:{CHECKMATE_UDP_PORT}"]
            argv += ["--snapshot-dir", str(self.snapshot_dir), "--snapshot-every", "1", "--keep", "3"]
            with open(self.log_dir / f"{name}.log", "ab") as out:
                self._shadows[name] = subprocess.Popen(
                    [*NET, "exec", "--run-dir", str(self.net_dir), name, "--", *argv],
                    env=_secret_env(self.work / "job-file.json"),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=REPO,
                    start_new_session=True,
                )
        deadline = time.monotonic() + config.shadow_start_timeout
        ready: set[str] = set()
        while len(ready) < len(config.shadows):
            for name, process in self._shadows.items():
                if process.poll() is not None:
                    raise DemoError(
                        f"shadow {name} exited with status {process.returncode}:\n"
                        + tail(self.log_dir / f"{name}.log")
                    )
                if name not in ready and self._status_file(name).get("state") == "waiting_for_job":
                    ready.add(name)
                    self.observer.advance("shadows", len(ready), f"{name} ready")
            if time.monotonic() > deadline:
                missing = sorted(set(config.shadows) - ready)
                raise DemoError(
                    f"shadow(s) {missing} not ready within {config.shadow_start_timeout:.0f} s; "
                    f"see {self.log_dir}"
                )
            time.sleep(0.1)
        self.observer.phase_done("shadows", ", ".join(f"{n} at {self._address(n)}" for n in config.shadows))

    def _status_file(self, name: str) -> dict[str, Any]:
        try:
            document: dict[str, Any] = json.loads((self.snapshot_dir / f"status-{name}.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return document

    def _launch_config(
        self, log_dir: Path, job_file: Path, kills: tuple[KillPlan, ...], reference: bool
    ) -> LaunchConfig:
        config = self.config
        args = ["--iterations", str(config.iterations), "--global-batch", str(config.global_batch)]
        args += ["--log", str(log_dir / "rank{rank}.jsonl"), "--snapshot-dir", str(self.snapshot_dir)]
        if config.elastic and reference:
            args.append("--log-digests")  # to check the state the elastic restart restored
        return LaunchConfig(
            run_dir=self.net_dir,
            workers=config.workers,
            master_addr=self._address(config.workers[0]),
            host_addresses={w: self._address(w) for w in config.workers},
            shrink_on_failure=config.elastic and not reference,
            min_workers=2,
            command=(config.python, "-m", "examples.train_lm", *args, *config.model_args),
            log_dir=log_dir,
            env={
                **_secret_env(job_file, {}),
                "CHECKMATE_TIMEOUT": "30",
                "CHECKMATE_PEER_TIMEOUT": "10",
            },
            max_restarts=config.max_restarts,
            total_timeout=config.train_timeout,
            kills=kills,
            net_command=tuple(NET),
        )

    def _train(self, series: RunSeries, kill_iteration: int | None, with_shadows: bool) -> None:
        config = self.config
        kills = (KillPlan(config.kill_rank, kill_iteration),) if kill_iteration is not None else ()
        job_file = self.work / ("job-file.json" if with_shadows else "job-file-no-shadows.json")
        log_dir = self.log_dir if series.name == "main" else self.reference_log_dir
        phase = "training" if series.name == "main" else "reference"
        self.observer.phase(phase, config.iterations)

        def on_record(incarnation: int, rank: int, record: dict[str, Any]) -> None:
            series.add(incarnation, rank, record)
            if rank == 0 and "loss" in record:
                self._show_progress(series, phase, incarnation, record)
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
                if with_shadows and config.shadows_fail_too and self._shadows:
                    self.observer.say(
                        "the shadows fail too: stopping them (recovery must use their snapshots)"
                    )
                    self._stop_shadows()
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
            if not with_shadows or tuple(workers) == tuple(config.workers):
                return None
            # Another ring: the switch must copy on the new ring links, and the workers need
            # a job file listing it.
            self._ctl("job", "resize", str(config.job_id), "--workers", ",".join(workers))
            shown = json.loads(self._ctl("job", "show", str(config.job_id), "--json").stdout)
            path = self.work / f"job-file-{incarnation}.json"
            self._write_job_file(path, with_shadows=True, job=shown["job"], workers=workers)
            return {"CHECKMATE_JOB_FILE": str(path)}

        launch = self._launch_config(log_dir, job_file, kills, reference=series.name != "main")
        self._launcher = Launcher(launch, on_record, on_event, before_start)
        self._workers_ran = True
        try:
            series.result = self._launcher.run()
        except LaunchError as exc:
            outputs = "\n".join(
                f"--- rank {r} ---\n{tail(log_dir / f'rank{r}.out', 15)}" for r in range(len(config.workers))
            )
            raise DemoError(f"{phase}: {exc}\n{outputs}") from None
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
        if self._shadows and now - self._last_status_read > 0.5:
            self._last_status_read = now
            self.shadow_live = {n: self._status_file(n) for n in self._shadows}
        if self._shadows and self.shadow_live:
            applied = " ".join(f"{n}@{s.get('applied_iteration', '?')}" for n, s in self.shadow_live.items())
            info += f" · shadows {applied}"
        if incarnation:
            info += f" · restart {incarnation}"
        self.observer.advance(phase, iteration + 1, info)

    def _verify(self) -> dict[str, Any]:
        """The shadows' state after the last iteration, digested inside a host (the shadows' network)."""
        config = self.config
        self.observer.phase("verify", 1)
        out = self.work / "shadow-digest.json"
        out.unlink(missing_ok=True)
        argv = [
            config.python,
            "-m",
            "shadow.restore",
            "digest",
            "--iteration",
            str(config.iterations - 1),
        ]
        argv += ["--timeout", str(config.verify_timeout / 2), "--out", str(out)]
        for name, address in self._shadow_control().items():
            argv += ["--shadow", f"{name}={address}"]
        try:
            subprocess.run(
                [*NET, "exec", "--run-dir", str(self.net_dir), config.workers[0], "--", *argv],
                env=_secret_env(self.work / "job-file.json"),
                capture_output=True,
                timeout=config.verify_timeout,
                cwd=REPO,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise DemoError(
                f"fetching the shadows' state did not finish within {config.verify_timeout:.0f} s"
            ) from None
        try:
            digest: dict[str, Any] = json.loads(out.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise DemoError(f"the shadows' state could not be fetched: {exc}") from None
        info = (
            f"shadows hold iteration {digest['iteration']}: sha256 {digest['params_sha256'][:16]}"
            if digest.get("ok")
            else f"shadows could not serve the state: {digest.get('error')}"
        )
        self.observer.phase_done("verify", info)
        return digest

    def _switch_counters(self) -> dict[str, Any]:
        try:
            shown = json.loads(self._ctl("job", "show", str(self.config.job_id), "--json").stdout)
        except (DemoError, json.JSONDecodeError) as exc:
            logger.warning("cannot read the switch counters: %s", exc)
            return {}
        counters = shown.get("counters", {})
        packets = sum(s.get("shadow_copies", {}).get("packets", 0) for s in counters.values())
        return {"packets": packets, "per_switch": counters}

    def _stop_shadows(self) -> dict[str, dict[str, Any]]:
        """SIGTERM the shadows (they write their status on the way out); their last status documents."""
        for process in self._shadows.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for name, process in self._shadows.items():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                logger.warning("shadow %s did not stop on SIGTERM; killing it", name)
                process.kill()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    logger.error(
                        "shadow %s (pid %d) survives SIGKILL; checkmate-net down sweeps it", name, process.pid
                    )
        statuses = {name: self._status_file(name) for name in self._shadows}
        self._shadows = {}
        return statuses

    def _reference(self, series: RunSeries | None) -> None:
        assert series is not None
        # No shadows for the reference: the job's replication is removed so nothing is copied.
        self._ctl("job", "remove", str(self.config.job_id))
        self._train(series, None, with_shadows=False)

    def _teardown(self) -> None:
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
                if self._shadows:
                    self._stop_shadows()
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


# ---- results -----------------------------------------------------------------------------
def write_results(result: DemoResult, directory: Path) -> tuple[Path, Path]:
    """``demo.json`` and ``demo.png`` in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    summary = result.summary()
    json_path = directory / "demo.json"
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    png_path = directory / "demo.png"
    plot(result, summary, png_path)
    return json_path, png_path


def plot(result: DemoResult, summary: dict[str, Any], path: Path) -> None:
    """Loss over iterations (failure and recovery marked), the shadows' lag, and progress over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = result.main
    fig, (ax_loss, ax_lag, ax_time) = plt.subplots(
        3, 1, figsize=(9, 9), gridspec_kw={"height_ratios": [3, 1.3, 1.6]}
    )
    if result.reference is not None:
        ref = result.reference.mean_loss(0)
        ax_loss.plot(list(ref), list(ref.values()), color="0.75", lw=4, label="uninterrupted run (reference)")
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:purple"]
    for number in sorted(main.losses):
        losses = main.mean_loss(number)
        label = "before the failure" if number == 0 else f"after restart {number} (from the shadows)"
        ax_loss.plot(list(losses), list(losses.values()), color=colours[number % 4], lw=1.6, label=label)
    failure = summary.get("failure_iteration")
    resumed = summary.get("resumed_from_iteration")
    for ax in (ax_loss, ax_lag):
        if failure is not None:
            ax.axvline(failure, color="tab:red", ls="-", lw=1.2)
        if resumed is not None:
            ax.axvline(resumed, color="tab:green", ls="--", lw=1.2)
    if failure is not None:
        ax_loss.annotate(
            f"{summary['failed_worker']} killed (SIGKILL)\nduring iteration {failure}",
            xy=(failure, ax_loss.get_ylim()[1]),
            xytext=(6, -30),
            textcoords="offset points",
            color="tab:red",
            fontsize=9,
        )
    if resumed is not None:
        ax_loss.annotate(
            f"resumed at {resumed} from {summary['restore_source']}\n"
            f"lost work: {summary['lost_iterations']} iteration(s)",
            xy=(resumed, ax_loss.get_ylim()[1]),
            xytext=(6, -62),
            textcoords="offset points",
            color="tab:green",
            fontsize=9,
        )
    ax_loss.set_ylabel("training loss (mean over workers)")
    ax_loss.set_title(
        f"Checkmate demo: {summary['workers']} workers, {summary['shadows']} shadows, "
        f"{summary['iterations']} iterations, TinyLM"
    )
    ax_loss.legend(loc="upper right", fontsize=8)
    ax_loss.grid(alpha=0.3)
    for number in sorted(main.certified):
        lag = main.lag(number)
        ax_lag.step(list(lag), list(lag.values()), where="mid", color=colours[number % 4], lw=1.2)
    ax_lag.set_ylabel("shadow lag\n(iterations)")
    ax_lag.set_xlabel("iteration")
    ax_lag.set_ylim(bottom=0, top=max([2, *(v for n in main.certified for v in main.lag(n).values())]) + 0.5)
    ax_lag.yaxis.get_major_locator().set_params(integer=True)
    ax_lag.grid(alpha=0.3)
    start = min((t for per in main.times.values() for t in per.values()), default=0.0)
    for number in sorted(main.times):
        times = main.times[number]
        ax_time.plot([t - start for t in times.values()], list(times), color=colours[number % 4], lw=1.6)
    if result.reference is not None:
        ref_times = result.reference.times.get(0, {})
        if ref_times:
            ref_start = min(ref_times.values())
            ax_time.plot(
                [t - ref_start for t in ref_times.values()], list(ref_times), color="0.75", lw=3, zorder=0
            )
    if summary.get("recovery_seconds") is not None:
        ax_time.set_title(
            f"recovery (kill to first resumed iteration): {summary['recovery_seconds']:.1f} s", fontsize=9
        )
    ax_time.set_xlabel("seconds since the first iteration")
    ax_time.set_ylabel("iteration")
    ax_time.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the command line --------------------------------------------------------------------
class RichObserver(Observer):
    """Progress bars per step, live training figures, and event lines, with rich."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.table import Column

        self.console = Console()
        self.progress = Progress(
            SpinnerColumn(finished_text="[green]✓"),
            TextColumn("[bold]{task.description}", table_column=Column(min_width=9, no_wrap=True)),
            BarColumn(bar_width=16),
            MofNCompleteColumn(table_column=Column(min_width=7, no_wrap=True)),
            TimeElapsedColumn(table_column=Column(min_width=7, no_wrap=True)),
            TextColumn("{task.fields[info]}", table_column=Column(ratio=1, no_wrap=True, overflow="crop")),
            console=self.console,
            refresh_per_second=8,
            expand=True,
        )
        self.tasks: dict[str, Any] = {}

    def __enter__(self) -> RichObserver:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def phase(self, name: str, total: int | None = None) -> None:
        if name in self.tasks:
            self.progress.reset(self.tasks[name], total=total, info="")
        else:
            self.tasks[name] = self.progress.add_task(name, total=total, info="")

    def advance(self, name: str, completed: int | None = None, info: str = "") -> None:
        if name in self.tasks:
            self.progress.update(self.tasks[name], completed=completed, info=info)

    def phase_done(self, name: str, info: str = "") -> None:
        if name in self.tasks:
            task = self.tasks[name]
            total = self.progress.tasks[task].total or 1
            self.progress.update(task, completed=total, info=f"[dim]{info}")
            self.progress.stop_task(task)

    def say(self, text: str) -> None:
        self.progress.console.print(f"  [yellow]▸[/] {text}")


def print_summary(
    console: Any, summary: dict[str, Any], json_path: Path | None, png_path: Path | None
) -> None:
    from rich.table import Table

    def yes_no(value: bool | None) -> str:
        return "[dim]not checked" if value is None else ("[green]yes, bit for bit" if value else "[red]NO")

    table = Table(title="Checkmate demo", show_header=False, title_style="bold")
    table.add_column(style="bold")
    table.add_column()
    certified = str(summary["certified_iterations"])
    if summary["certified_iterations"] == summary["iterations"]:
        certified += " (a checkpoint of every iteration)"
    failure = "none"
    if summary["failure_iteration"] is not None:
        failure = f"{summary['failed_worker']} killed during iteration {summary['failure_iteration']}"
    resumed = "-"
    if summary["resumed_from_iteration"] is not None:
        resumed = (
            f"iteration {summary['resumed_from_iteration']} from {summary['restore_source']} "
            f"(the state after iteration {summary['restored_checkpoint_iteration']})"
        )
    recovery = "-"
    if summary["recovery_seconds"] is not None:
        recovery = f"{summary['recovery_seconds']:.1f} s (kill to first resumed iteration)"
    lag = summary["shadow_lag_iterations"]
    rows = [
        ("workers / shadows", f"{summary['workers']} / {summary['shadows']}"),
        ("iterations", str(summary["iterations"])),
        ("certified iterations", certified),
        ("failure", failure),
        ("resumed at", resumed),
        ("lost iterations", str(summary["lost_iterations"])),
        ("recovery time", recovery),
        ("shadow lag", f"mean {lag['mean']}, max {lag['max']} iteration(s)"),
        ("shadows == workers", yes_no(summary["shadow_equals_workers"])),
        ("recovered == uninterrupted", yes_no(summary["recovered_equals_uninterrupted"])),
        ("loss", f"{summary['first_loss']} -> {summary['final_loss']}"),
        ("iteration time", f"{summary['mean_iteration_ms']} ms"),
        ("copies to shadows", f"{summary['shadow_copies_packets']} packets (switch counter)"),
        ("total time", f"{summary['seconds']} s"),
    ]
    elastic = summary.get("elastic")
    if elastic:
        counts = " -> ".join(map(str, elastic["workers_per_incarnation"]))
        deviation = elastic["loss_max_relative_deviation_after_restart"]
        rows.insert(-4, ("elastic restart", f"workers {counts} (not bit-identical to the reference)"))
        rows.insert(-4, ("restored == uninterrupted", yes_no(elastic["restored_state_equals_reference"])))
        rows.insert(-4, ("loss after restart", f"max relative deviation from uninterrupted: {deviation}"))
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    if json_path is not None and png_path is not None:
        console.print(f"wrote {_shown(json_path)} and {_shown(png_path)}")


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def build_parser() -> argparse.ArgumentParser:
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(prog="python -m experiments.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=defaults.iterations)
    parser.add_argument(
        "--kill-at", type=int, default=defaults.kill_iteration, help="iteration during which a worker dies"
    )
    parser.add_argument("--kill-rank", type=int, default=defaults.kill_rank)
    parser.add_argument("--no-failure", action="store_true", help="run without killing a worker")
    parser.add_argument(
        "--shadows-fail-too", action="store_true", help="stop the shadows with the worker: restore from disk"
    )
    parser.add_argument(
        "--no-reference", action="store_true", help="skip the uninterrupted run (bit-identity check)"
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="restart without the failed worker's host (N-1 workers, job resized at the switch)",
    )
    parser.add_argument("--work-dir", type=Path, default=defaults.work_dir)
    parser.add_argument("--results", type=Path, default=defaults.results_dir)
    parser.add_argument("--target", choices=["embedded", "bmv2"], default=defaults.target)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR, format="%(levelname)s %(name)s: %(message)s"
    )
    from rich.console import Console

    console = Console()
    if os.geteuid() != 0:
        console.print(
            "[red]make demo needs root[/]: it creates network namespaces, veth pairs and a software switch "
            "(Mininet). Run it as root, e.g. `sudo make demo`."
        )
        return 1
    config = replace(
        DemoConfig(),
        iterations=args.iterations,
        kill_iteration=None if args.no_failure else args.kill_at,
        kill_rank=args.kill_rank,
        shadows_fail_too=args.shadows_fail_too,
        elastic=args.elastic,
        reference=not args.no_reference,
        work_dir=args.work_dir,
        results_dir=args.results,
        target=args.target,
    )
    if config.kill_iteration is not None and not 1 <= config.kill_iteration < config.iterations:
        console.print(f"[red]--kill-at must lie in 1..{config.iterations - 1}")
        return 2

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    console.print(
        f"[bold]Checkmate demo[/]: {len(config.workers)} DDP workers ({', '.join(config.workers)}) and "
        f"{len(config.shadows)} shadows ({', '.join(config.shadows)}) on one emulated P4 switch; "
        + (
            f"rank {config.kill_rank} is killed during iteration {config.kill_iteration}."
            if config.kill_iteration is not None
            else "no failure."
        )
    )
    try:
        with RichObserver() as observer:
            result = DemoRun(config, observer).run()
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: workers and shadows stopped, the network taken down.")
        return 130
    except DemoError as exc:
        console.print(f"[red]demo failed[/]: {exc}")
        console.print(f"everything the demo started was stopped; its logs are in {config.work_dir}")
        return 1
    summary = result.summary()
    paths: tuple[Path, Path] | tuple[None, None] = (None, None)
    if config.results_dir is not None:
        paths = write_results(result, config.results_dir)
    print_summary(console, summary, *paths)
    checks = [summary["shadow_equals_workers"], summary["recovered_equals_uninterrupted"]]
    if summary.get("elastic"):
        checks.append(summary["elastic"]["restored_state_equals_reference"])
    ok = all(c is not False for c in checks) and summary["lost_iterations"] <= 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
