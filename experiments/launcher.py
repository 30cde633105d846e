"""The project's launcher: N DDP workers in emulated hosts, restarted from the shadows when one dies.

torchrun's elastic agent starts workers on its own machine; a Checkmate job in
Mininet runs one worker per host namespace. :class:`Launcher` starts rank ``r``
in host ``workers[r]`` through the network's exec mechanism
(``checkmate-net exec --run-dir DIR HOST -- ...``) with the variables torchrun
would set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) plus the job's (``CHECKMATE_JOB_FILE``, ...), and watches
them: their exit status and the JSON-lines log each worker appends to
(``<log_dir>/rank<r>.jsonl``, see :mod:`examples.train_lm`).

When a worker dies (any non-zero exit, a signal, a worker that stops making
progress for ``stall_timeout`` seconds, or a start that takes longer than
``start_timeout``), the launcher stops the others (SIGTERM, then SIGKILL after
``stop_grace``) and starts the job again with ``CHECKMATE_RESUME=1``: the
workers restore the shadows' latest certified state and continue after it
(``hosts.resume``, :mod:`hosts.recovery`). By default all N start again; with
``shrink_on_failure`` (elastic, like ``torchrun --nnodes=MIN:MAX``) the failed
worker's host is left out and the job continues with N-1 (never fewer than
``min_workers``). A ``before_start`` callback sees each incarnation's workers
before they start, to re-register the job (its ring changed) and hand them
other environment variables (a job file listing the new ring). At most
``max_restarts`` restarts; the whole run is bounded by ``total_timeout``.
Lost work is what a restart redoes: the iterations the workers had finished
beyond the state they resumed from.

For demos and tests, :class:`KillPlan` entries kill a worker with SIGKILL
while it works on a given iteration (as soon as it has logged the one before).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from topologies.cleanup import pid_alive

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
POLL_INTERVAL_S = 0.02


class LaunchError(RuntimeError):
    """The job could not be completed: restarts exhausted, timed out, or it could not start."""


@dataclass(frozen=True)
class KillPlan:
    """Fault injection: kill rank ``rank`` with ``signal`` during iteration ``iteration``.

    The rank is killed as soon as the launcher sees it has logged iteration
    ``iteration - 1`` (it polls every 20 ms), so it dies while working on
    ``iteration`` or, with iterations shorter than that, slightly later.
    """

    rank: int
    iteration: int
    incarnation: int = 0
    """Which start of the job to hit (0: the first)."""
    signal: int = signal.SIGKILL

    def __post_init__(self) -> None:
        if self.iteration < 1:
            raise ValueError(f"a worker can be killed during iteration 1 or later, not {self.iteration}")


@dataclass(frozen=True)
class LaunchConfig:
    """Where and how to run the workers, and the limits on waiting for them."""

    run_dir: Path
    """The network's run directory (``checkmate-net exec --run-dir``)."""
    workers: tuple[str, ...]
    """Worker host names in rank order."""
    master_addr: str
    """Rank 0's address, for the gloo rendezvous."""
    command: tuple[str, ...]
    """The worker's argv (e.g. ``python -m examples.train_lm ... --log DIR/rank{rank}.jsonl``)."""
    log_dir: Path
    """Where each worker appends ``rank<r>.jsonl`` (the command must write there) and ``rank<r>.out``."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for every worker (the job file, timeouts, ...)."""
    master_port: int = 29500
    """The first incarnation's rendezvous port; each restart uses the next one."""
    max_restarts: int = 3
    start_timeout: float = 120.0
    """Seconds from spawning the workers until every one has logged its start."""
    stall_timeout: float = 60.0
    """Seconds without a new log record from a running worker before it counts as failed."""
    total_timeout: float = 900.0
    stop_grace: float = 5.0
    """Seconds between SIGTERM and SIGKILL when stopping workers."""
    kills: tuple[KillPlan, ...] = ()
    shrink_on_failure: bool = False
    """Restart without the host of the worker that failed (when the failure names one)."""
    min_workers: int = 1
    """``shrink_on_failure`` never goes below this many workers (it restarts all instead)."""
    host_addresses: Mapping[str, str] = field(default_factory=dict)
    """Worker host -> address; rank 0's is the rendezvous address (else ``master_addr``)."""
    net_command: tuple[str, ...] = ()
    """How to call checkmate-net (default: the one next to this Python, else ``python -m topologies.cli``)."""

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def log_path(self, rank: int) -> Path:
        return self.log_dir / f"rank{rank}.jsonl"


@dataclass
class Incarnation:
    """One start of the job's workers."""

    number: int
    started: float
    workers: tuple[str, ...] = ()
    """Worker hosts in rank order."""
    start_iteration: int | None = None
    restored_from: int | None = None
    source: str | None = None
    completed_through: int = -1
    """The highest iteration any rank logged in this incarnation (-1: none)."""
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    failure: str | None = None
    failed_rank: int | None = None
    ended: float | None = None
    killed: dict[str, Any] | None = None
    """What a :class:`KillPlan` killed: rank, host, pid, during which iteration, when."""

    def to_json(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "workers": list(self.workers),
            "start_iteration": self.start_iteration,
            "restored_from": self.restored_from,
            "source": self.source,
            "completed_through": self.completed_through,
            "exit_codes": {str(r): c for r, c in self.exit_codes.items()},
            "failure": self.failure,
            "failed_rank": self.failed_rank,
            "killed": self.killed,
            "seconds": round((self.ended or time.time()) - self.started, 3),
        }


@dataclass
class LaunchResult:
    """How the job went: every incarnation, the final records of every rank, the time taken."""

    incarnations: list[Incarnation]
    done: dict[int, dict[str, Any]]
    """Rank -> its ``{"event": "done", ...}`` record."""
    seconds: float

    @property
    def restarts(self) -> int:
        return len(self.incarnations) - 1

    def lost_iterations(self) -> list[int]:
        """Per restart: the iterations finished before the failure and done again after it."""
        lost = []
        for before, after in zip(self.incarnations, self.incarnations[1:], strict=False):
            resumed = after.start_iteration if after.start_iteration is not None else 0
            lost.append(max(0, before.completed_through - resumed + 1))
        return lost


@dataclass
class _Worker:
    rank: int
    host: str
    process: subprocess.Popen[bytes]
    output: IO[bytes]
    log: Path
    offset: int = 0
    partial: bytes = b""
    pid: int | None = None
    """The worker's own pid (from its start record)."""
    started: bool = False
    done: bool = False
    last_progress: float = field(default_factory=time.monotonic)


RecordCallback = Callable[[int, int, dict[str, Any]], None]
"""(incarnation, rank, record) for every record a worker logs."""
EventCallback = Callable[[str, dict[str, Any]], None]
"""(kind, details): ``start``, ``kill``, ``failure``, ``restart``, ``done``."""
StartCallback = Callable[[int, tuple[str, ...]], Mapping[str, str] | None]
"""(incarnation, worker hosts in rank order) -> extra environment for its workers, before they start."""


def _default_net_command() -> tuple[str, ...]:
    binary = Path(sys.executable).parent / "checkmate-net"
    return (str(binary),) if binary.exists() else (sys.executable, "-m", "topologies.cli")


class Launcher:
    """Runs one job to completion (or to a :class:`LaunchError`); :meth:`close` stops whatever runs."""

    def __init__(
        self,
        config: LaunchConfig,
        on_record: RecordCallback | None = None,
        on_event: EventCallback | None = None,
        before_start: StartCallback | None = None,
    ) -> None:
        if config.world_size < 1:
            raise ValueError("a job needs at least one worker")
        if not 1 <= config.min_workers <= config.world_size:
            raise ValueError(f"min_workers must lie in [1, {config.world_size}], not {config.min_workers}")
        self.config = config
        self.on_record = on_record
        self.on_event = on_event
        self.before_start = before_start
        self.incarnations: list[Incarnation] = []
        self._workers: list[_Worker] = []
        self._net = config.net_command or _default_net_command()

    # ---- life cycle -----------------------------------------------------------------------
    def run(self) -> LaunchResult:
        """Start the job and restart it after failures until every rank logs ``done``."""
        config = self.config
        started = time.monotonic()
        deadline = started + config.total_timeout
        config.log_dir.mkdir(parents=True, exist_ok=True)
        workers = tuple(config.workers)
        try:
            while True:
                number = len(self.incarnations)
                extra_env = dict(self.before_start(number, workers) or {}) if self.before_start else {}
                incarnation = Incarnation(number=number, started=time.time(), workers=workers)
                self.incarnations.append(incarnation)
                self._spawn(incarnation, resume=number > 0, extra_env=extra_env)
                self._emit("start", {"incarnation": number})
                done = self._watch(incarnation, deadline)
                incarnation.ended = time.time()
                if done is not None:
                    self._emit("done", {"incarnation": number})
                    return LaunchResult(list(self.incarnations), done, time.monotonic() - started)
                self._stop_all()
                incarnation.exit_codes = {w.rank: w.process.returncode for w in self._workers}
                self._emit("failure", {"incarnation": number, **incarnation.to_json()})
                if number >= config.max_restarts:
                    raise LaunchError(
                        f"the job failed {number + 1} times, the last at iteration "
                        f"{incarnation.completed_through + 1}: {incarnation.failure} "
                        f"(max_restarts={config.max_restarts}; worker output in {config.log_dir})"
                    )
                if time.monotonic() >= deadline:
                    raise LaunchError(f"the job did not finish within {config.total_timeout:.0f} s")
                workers = self._next_workers(incarnation)
                self._emit("restart", {"incarnation": number + 1, "workers": list(workers)})
        finally:
            self.close()

    def close(self) -> None:
        """Stop every worker still running (SIGTERM, then SIGKILL) and close their output files."""
        self._stop_all()

    def _next_workers(self, failed: Incarnation) -> tuple[str, ...]:
        """The hosts of the next incarnation: the same, or without the failed one (elastic)."""
        workers = failed.workers
        rank = failed.failed_rank
        if not self.config.shrink_on_failure or rank is None:
            return workers
        if len(workers) - 1 < self.config.min_workers:
            logger.warning(
                "not leaving out %s: the job needs at least %d workers",
                workers[rank],
                self.config.min_workers,
            )
            return workers
        logger.info("leaving out %s (rank %d), which failed", workers[rank], rank)
        return workers[:rank] + workers[rank + 1 :]

    # ---- spawning -------------------------------------------------------------------------
    def _spawn(self, incarnation: Incarnation, resume: bool, extra_env: Mapping[str, str]) -> None:
        config = self.config
        self._workers = []
        port = config.master_port + incarnation.number
        world = len(incarnation.workers)
        master = config.host_addresses.get(incarnation.workers[0], config.master_addr)
        for rank, host in enumerate(incarnation.workers):
            log = config.log_path(rank)
            offset = log.stat().st_size if log.exists() else 0
            env = {
                **os.environ,
                **config.env,
                **extra_env,
                "RANK": str(rank),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": "eth0",
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
                "CHECKMATE_RESUME": "1" if resume else "0",
                # No DNS server is reachable from an emulated host, and c10d looks up peer names
                # (for log messages): fail those lookups after 1 s instead of glibc's 5 s x 2.
                "RES_OPTIONS": os.environ.get("RES_OPTIONS", "timeout:1 attempts:1"),
            }
            argv = [
                *self._net,
                "exec",
                "--run-dir",
                str(config.run_dir),
                host,
                "--",
                *[a.replace("{rank}", str(rank)) for a in config.command],
            ]
            output = open(config.log_dir / f"rank{rank}.out", "ab")  # noqa: SIM115 - closed in _stop_all
            output.write(f"---- incarnation {incarnation.number} rank {rank} on {host}\n".encode())
            output.flush()
            try:
                process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=REPO,
                    start_new_session=True,
                )
            except OSError as exc:
                output.close()
                self._stop_all()
                raise LaunchError(f"cannot start rank {rank} in {host}: {exc}") from None
            self._workers.append(_Worker(rank, host, process, output, log, offset=offset))
            logger.info("incarnation %d: rank %d in %s, pid %d", incarnation.number, rank, host, process.pid)

    # ---- watching -------------------------------------------------------------------------
    def _watch(self, incarnation: Incarnation, deadline: float) -> dict[int, dict[str, Any]] | None:
        """Until every rank is done (their done records) or one fails (None; the reason recorded)."""
        config = self.config
        spawned = time.monotonic()
        done: dict[int, dict[str, Any]] = {}
        while True:
            now = time.monotonic()
            for worker in self._workers:
                for record in self._read(worker):
                    self._note(incarnation, worker, record, done)
            if len(done) == len(self._workers) and all(w.process.poll() is not None for w in self._workers):
                bad = {w.rank: w.process.returncode for w in self._workers if w.process.returncode != 0}
                if not bad:
                    incarnation.exit_codes = {w.rank: 0 for w in self._workers}
                    return done
                self._failed(incarnation, min(bad), f"exited with status {bad} after finishing")
                return None
            for worker in self._workers:
                code = worker.process.poll()
                if code is not None and code != 0:
                    how = f"killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
                    self._failed(incarnation, worker.rank, f"rank {worker.rank} in {worker.host} {how}")
                    return None
                if code == 0 and worker.rank not in done:
                    for record in self._read(worker):  # it may have logged "done" since the last read
                        self._note(incarnation, worker, record, done)
                    if worker.rank not in done:
                        self._failed(incarnation, worker.rank, f"rank {worker.rank} exited without finishing")
                        return None
            if now - spawned > config.start_timeout and not all(w.started for w in self._workers):
                late = [w.rank for w in self._workers if not w.started]
                self._failed(
                    incarnation, late[0], f"rank(s) {late} did not start within {config.start_timeout:.0f} s"
                )
                return None
            for worker in self._workers:
                if worker.started and not worker.done and now - worker.last_progress > config.stall_timeout:
                    self._failed(
                        incarnation,
                        worker.rank,
                        f"rank {worker.rank} made no progress for {config.stall_timeout:.0f} s",
                    )
                    return None
            if now >= deadline:
                self._failed(incarnation, None, f"the job ran past {config.total_timeout:.0f} s")
                return None
            time.sleep(POLL_INTERVAL_S)

    def _failed(self, incarnation: Incarnation, rank: int | None, why: str) -> None:
        """Record why (and by whom) the incarnation failed; the first reason wins."""
        if incarnation.failure is None:
            incarnation.failure = why
            incarnation.failed_rank = rank
        logger.warning("incarnation %d failed: %s", incarnation.number, why)

    def _read(self, worker: _Worker) -> list[dict[str, Any]]:
        """New complete JSON lines of the worker's log (unreadable lines are skipped, logged)."""
        try:
            with open(worker.log, "rb") as f:
                f.seek(worker.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        worker.offset += len(chunk)
        lines = (worker.partial + chunk).split(b"\n")
        worker.partial = lines.pop()
        records = []
        for line in lines:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                logger.warning("rank %d: unreadable log line %r", worker.rank, line[:200])
        return records

    def _note(
        self,
        incarnation: Incarnation,
        worker: _Worker,
        record: dict[str, Any],
        done: dict[int, dict[str, Any]],
    ) -> None:
        worker.last_progress = time.monotonic()
        event = record.get("event")
        if event == "start":
            worker.started = True
            worker.pid = int(record.get("pid", 0)) or None
            if worker.rank == 0:
                incarnation.start_iteration = int(record["start_iteration"])
                incarnation.restored_from = record.get("restored_from")
                incarnation.source = record.get("source")
        elif event == "done":
            worker.done = True
            done[worker.rank] = record
        elif "iteration" in record:
            iteration = int(record["iteration"])
            incarnation.completed_through = max(incarnation.completed_through, iteration)
            for plan in self.config.kills:
                if (
                    plan.rank == worker.rank
                    and plan.incarnation == incarnation.number
                    and iteration + 1 >= plan.iteration
                    and incarnation.killed is None
                ):
                    self._kill(worker, plan, incarnation, iteration + 1)
        if self.on_record is not None:
            self.on_record(incarnation.number, worker.rank, record)

    def _kill(self, worker: _Worker, plan: KillPlan, incarnation: Incarnation, iteration: int) -> None:
        pid = worker.pid if worker.pid is not None and pid_alive(worker.pid) else worker.process.pid
        incarnation.killed = {
            "rank": worker.rank,
            "host": worker.host,
            "pid": pid,
            "iteration": iteration,
            "signal": _signal_name(plan.signal),
            "time": time.time(),
        }
        try:
            os.kill(pid, plan.signal)
        except ProcessLookupError:
            logger.warning("rank %d (pid %d) was already gone when it was to be killed", worker.rank, pid)
            return
        logger.info("killed rank %d (pid %d) during iteration %d", worker.rank, pid, iteration)
        self._emit("kill", {"incarnation": incarnation.number, **incarnation.killed})

    # ---- stopping -------------------------------------------------------------------------
    def _stop_all(self) -> None:
        running = [w for w in self._workers if w.process.poll() is None]
        for worker in running:
            self._signal(worker, signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_grace
        for worker in running:
            try:
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(worker, signal.SIGKILL)
                try:
                    worker.process.wait(timeout=self.config.stop_grace)
                except subprocess.TimeoutExpired:
                    logger.error("rank %d (pid %d) survives SIGKILL", worker.rank, worker.process.pid)
        for worker in self._workers:
            if not worker.output.closed:
                worker.output.close()

    @staticmethod
    def _signal(worker: _Worker, signum: int) -> None:
        for pid in {worker.process.pid, worker.pid or worker.process.pid}:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def _emit(self, kind: str, details: dict[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(kind, details)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a text file ('' if it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def worker_command(python: str, module: str, args: Sequence[str]) -> tuple[str, ...]:
    """``python -m module args...``, for :attr:`LaunchConfig.command`."""
    return (python, "-m", module, *args)
