"""A job's shadows as processes in the emulated hosts: start, wait until ready, status, stop.

:class:`ShadowProcesses` starts ``checkmate-shadow run`` for a shadow inside
its host (``checkmate-net exec``, so ``checkmate-net down`` also sweeps a
shadow left behind), snapshotting every iteration into one shared directory,
with the job's secret from the job file alone. A shadow is ready when its
status file says it waits for the job. With ``snapshot_url`` set
(``nfs://SERVER/EXPORT/PATH``) the shadows persist their snapshots there instead
(:mod:`checkmate.checkpoint.remote`) and keep their status files in ``snapshot_dir``
(``--status-file``), where :meth:`ShadowProcesses.status` reads them. ``hosts`` says where
each of the job's shadows runs; the job files and the final verification use its addresses
(:meth:`ShadowProcesses.control`), so a caller that moves a shadow to another
host updates it.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkmate.control import DEFAULT_CONTROL_PORT
from checkmate.wire import CHECKMATE_UDP_PORT
from experiments.commands import NET, REPO, SHADOW_BOOT, JobError, secret_env
from experiments.launcher import tail
from experiments.progress import Observer

if TYPE_CHECKING:
    from experiments.job_config import JobConfig

logger = logging.getLogger(__name__)


class ShadowProcesses:
    """The shadows of one job run (``processes``: name -> the running ``checkmate-shadow``)."""

    def __init__(
        self,
        config: JobConfig,
        net_dir: Path,
        snapshot_dir: Path,
        log_dir: Path,
        job_file: Path,
        address: Callable[[str], str],
        observer: Observer,
    ) -> None:
        self.config = config
        self.net_dir = net_dir
        self.snapshot_dir = snapshot_dir
        self.log_dir = log_dir
        self.job_file = job_file
        self.address = address
        self.observer = observer
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.hosts: dict[str, str] = {name: name for name in config.shadows}
        """The job's shadows now: name -> the host it runs in."""
        self.snapshot_every = 1
        """``--snapshot-every`` of the shadows started from now on (0: never by count)."""
        self.snapshot_seconds = 0.0
        """``--snapshot-seconds`` of the shadows started from now on (0: never by time)."""
        self.nice = 0
        """Niceness of the shadows started from now on (``nice -n``; 0: as this process)."""
        self.snapshot_url: str | None = None
        """``nfs://SERVER/EXPORT/PATH``: where shadows started from now on persist (None: snapshot_dir)."""

    def __bool__(self) -> bool:
        """Whether any shadow process was started and not yet stopped."""
        return bool(self.processes)

    def control(self) -> dict[str, str]:
        """The job's shadows' control addresses, by name (where ``hosts`` says each runs)."""
        return {name: f"{self.address(host)}:{DEFAULT_CONTROL_PORT}" for name, host in self.hosts.items()}

    def start(self, name: str, host: str | None = None, resume: bool = False) -> None:
        """``checkmate-shadow run`` for shadow ``name`` in ``host`` (default: its ``hosts`` entry);
        ``resume``: from its snapshots."""
        config = self.config
        host = host or self.hosts.get(name, name)
        ip = self.address(host)
        self.snapshot_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        argv = [config.python, "-c", SHADOW_BOOT, "run", "--name", name, "--job-id", str(config.job_id)]
        if self.nice:
            argv = ["nice", "-n", str(self.nice), *argv]
        argv += ["--control", f"{ip}:{DEFAULT_CONTROL_PORT}", "--data", f"{ip}:{CHECKMATE_UDP_PORT}"]
        if self.snapshot_url is not None:  # remote snapshots; the status file stays where status() reads it
            argv += ["--snapshot-dir", self.snapshot_url]
            argv += ["--status-file", str(self.snapshot_dir / f"status-{name}.json")]
        else:
            argv += ["--snapshot-dir", str(self.snapshot_dir)]
        argv += ["--snapshot-every", str(self.snapshot_every)]
        argv += ["--snapshot-seconds", str(self.snapshot_seconds)]
        argv += ["--keep", str(config.snapshot_keep)]
        if resume:
            argv.append("--resume")
        with open(self.log_dir / f"{name}.log", "ab") as out:
            self.processes[name] = subprocess.Popen(
                [*NET, "exec", "--run-dir", str(self.net_dir), host, "--", *argv],
                env=secret_env(self.job_file),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )

    def wait_ready(self, names: Sequence[str], timeout: float | None = None) -> None:
        """Until each of ``names`` says it waits for the job (JobError when one exits or time is up)."""
        timeout = self.config.shadow_start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        ready: set[str] = set()
        while len(ready) < len(names):
            for name in names:
                process = self.processes[name]
                if process.poll() is not None:
                    raise JobError(
                        f"shadow {name} exited with status {process.returncode}:\n"
                        + tail(self.log_dir / f"{name}.log")
                    )
                if name not in ready and self.status(name).get("state") == "waiting_for_job":
                    ready.add(name)
                    self.observer.advance("shadows", len(ready), f"{name} ready")
            if time.monotonic() > deadline:
                missing = sorted(set(names) - ready)
                raise JobError(f"shadow(s) {missing} not ready within {timeout:.0f} s; see {self.log_dir}")
            time.sleep(0.1)

    def status(self, name: str) -> dict[str, Any]:
        """The status document shadow ``name`` last wrote ({} when there is none yet)."""
        try:
            document: dict[str, Any] = json.loads((self.snapshot_dir / f"status-{name}.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return document

    def kill(self, name: str) -> int:
        """SIGKILL shadow ``name`` now; its exit status."""
        process = self.processes[name]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        return process.returncode

    def stop(self) -> dict[str, dict[str, Any]]:
        """SIGTERM the shadows (they write their status on the way out); their last status documents."""
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for name, process in self.processes.items():
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
        statuses = {name: self.status(name) for name in self.processes}
        self.processes = {}
        return statuses
