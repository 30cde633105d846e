"""An emulated network for host-side benchmarks: up beside other networks, one command per host, down.

:class:`BenchNetwork` reuses the demo's bring-up (the ``prepare``, ``bring_up_network`` and
``teardown`` steps of :class:`experiments.job.JobRun`) the way :mod:`experiments.bench.run`
does: a private copy of the topology with every switch renamed (``hb1``, ``hb2``, ... so
that its port interfaces, which live in the root namespace, do not clash with another
network built from the same description), its own run directory and controller state,
the embedded switch target by default. No job is registered at the switch.

:meth:`BenchNetwork.run_on_hosts` starts one command in each of several hosts' namespaces
(``checkmate-net exec``, so ``checkmate-net down`` also sweeps anything left), waits for all of
them within a timeout and stops the others as soon as one fails. :meth:`BenchNetwork.close`
stops what is still running, takes the network down (also after a failed or interrupted
bring-up) and returns the switches' drop counters from their final log line.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from experiments.commands import NET, REPO
from experiments.job import JobConfig, JobRun
from experiments.launcher import tail
from experiments.progress import LogObserver
from topologies.hosts import HOST_INTERFACE
from topologies.runstate import RunState, RunStateError

logger = logging.getLogger(__name__)

DEFAULT_WORK_DIR = Path("/tmp/checkmate-hosts-bench")
STOP_GRACE_S = 5.0
POLL_INTERVAL_S = 0.1


class HostCommandError(RuntimeError):
    """A command run in a host failed or did not finish in time; the message has its output."""


def switch_drops(log_file: Path) -> dict[str, int]:
    """``REASON@PORT`` -> frames, from the embedded switch's last ``final counts`` log line ({} if none)."""
    try:
        text = log_file.read_text(errors="replace")
    except OSError:
        return {}
    lines = [line for line in text.splitlines() if "final counts:" in line]
    if not lines:
        return {}
    _, _, drops = lines[-1].partition("drops:")
    return {key: int(value) for key, value in re.findall(r"(\w+@\d+)=(\d+)", drops)}


def host_environment() -> dict[str, str]:
    """What a process in an emulated host needs besides this one's environment (as the launcher sets)."""
    return {
        **os.environ,
        "GLOO_SOCKET_IFNAME": HOST_INTERFACE,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
        # No DNS server is reachable from an emulated host: fail c10d's lookups fast.
        "RES_OPTIONS": os.environ.get("RES_OPTIONS", "timeout:1 attempts:1"),
    }


class BenchNetwork:
    """One emulated network for a benchmark; use as a context manager (``close`` always runs)."""

    def __init__(
        self,
        topology: Path,
        work_dir: Path = DEFAULT_WORK_DIR,
        target: str = "embedded",
        switch_prefix: str = "hb",
        network_timeout: float = 150.0,
    ) -> None:
        switches = list(json.loads(topology.read_text()).get("switches", {}))
        renames = tuple((old, f"{switch_prefix}{i + 1}") for i, old in enumerate(switches))
        config = JobConfig(
            kill_iteration=None,
            reference=False,
            topology=topology,
            rename_switches=renames,
            target=target,
            work_dir=work_dir,
            results_dir=None,
            network_timeout=network_timeout,
        )
        self.job = JobRun(config, LogObserver())
        self.config = config
        self.work = self.job.work
        """The work folder (the network's run directory and controller state are in it)."""
        self.switch_logs: dict[str, Path] = {}

    def __enter__(self) -> BenchNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def up(self) -> None:
        """Bring the network up (JobError on failure; :meth:`close` takes down what was made)."""
        self.job.prepare()
        self.job.bring_up_network()
        try:
            state = RunState.load(self.job.net_dir)
        except RunStateError as exc:
            logger.warning("cannot read the network's run state: %s", exc)
            return
        self.switch_logs = {name: Path(record.log_file) for name, record in state.switches.items()}

    @property
    def workers(self) -> list[str]:
        """The topology's worker hosts, in its order."""
        assert self.job.network is not None, "up() first"
        return self.job.network.hosts_with_role("worker")

    def address(self, host: str) -> str:
        return self.job.address(host)

    def run_on_hosts(
        self,
        commands: Mapping[str, Sequence[str]],
        log_dir: Path,
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Run ``commands[host]`` in each host, all at once; return when all exited 0.

        Output goes to ``log_dir/<host>.out``. HostCommandError (with the outputs' tails) when one
        exits non-zero, or when they are not all done within ``timeout`` seconds; the others are
        stopped first (SIGTERM, then SIGKILL after a grace period).
        """
        shutil.rmtree(log_dir, ignore_errors=True)
        log_dir.mkdir(parents=True)
        running: dict[str, tuple[subprocess.Popen[bytes], IO[bytes]]] = {}
        full_env = {**host_environment(), **(env or {})}
        try:
            for host, argv in commands.items():
                output = open(log_dir / f"{host}.out", "wb")  # noqa: SIM115 - closed in the finally
                try:
                    process = subprocess.Popen(
                        [*NET, "exec", "--run-dir", str(self.job.net_dir), host, "--", *argv],
                        stdin=subprocess.DEVNULL,
                        stdout=output,
                        stderr=subprocess.STDOUT,
                        env=full_env,
                        cwd=REPO,
                        start_new_session=True,
                    )
                except OSError as exc:
                    output.close()
                    raise HostCommandError(f"cannot start {argv[0]} in {host}: {exc}") from None
                running[host] = (process, output)
            deadline = time.monotonic() + timeout
            while True:
                codes = {host: p.poll() for host, (p, _) in running.items()}
                failed = {host: code for host, code in codes.items() if code not in (None, 0)}
                if failed:
                    self._stop(running)
                    raise HostCommandError(self._failure(f"exited with {failed}", log_dir, running))
                if all(code == 0 for code in codes.values()):
                    return
                if time.monotonic() > deadline:
                    self._stop(running)
                    raise HostCommandError(
                        self._failure(f"not done within {timeout:.0f} s", log_dir, running)
                    )
                time.sleep(POLL_INTERVAL_S)
        finally:
            self._stop(running)
            for _, stream in running.values():
                stream.close()

    @staticmethod
    def _failure(
        why: str, log_dir: Path, running: Mapping[str, tuple[subprocess.Popen[bytes], IO[bytes]]]
    ) -> str:
        outputs = "\n".join(f"--- {host} ---\n{tail(log_dir / f'{host}.out', 15)}" for host in running)
        return f"commands in {', '.join(running)}: {why}\n{outputs}"

    @staticmethod
    def _stop(running: Mapping[str, tuple[subprocess.Popen[bytes], IO[bytes]]]) -> None:
        """SIGTERM each still-running command's process group, then SIGKILL after the grace period."""
        alive = [p for p, _ in running.values() if p.poll() is None]
        for signum in (signal.SIGTERM, signal.SIGKILL):
            for process in alive:
                try:
                    os.killpg(process.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + STOP_GRACE_S
            for process in alive:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            alive = [p for p in alive if p.poll() is None]
            if not alive:
                return
        for process in alive:
            logger.error("pid %d survives SIGKILL; checkmate-net down sweeps it", process.pid)

    def close(self) -> dict[str, dict[str, int]]:
        """Take the network down; each switch's drop counters (``REASON@PORT`` -> frames)."""
        self.job.teardown()
        return {name: switch_drops(path) for name, path in self.switch_logs.items()}
