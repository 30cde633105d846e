"""How experiments call the project's tools: ``checkmate-net``, ``checkmate-ctl``, the shadow, as processes.

An experiment drives the emulated network the way a user would, through the
command lines (``checkmate-net up/exec/down``, ``checkmate-ctl job ...``,
``checkmate-shadow run``), not through their Python internals. This module
says how each is started (the console script next to this Python, else
``python -m``), runs one to completion within a timeout (:func:`run_command`:
:class:`JobError` with its output when it fails), and gives a process the job
secret from a job file alone (:func:`secret_env`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# The first torch optimizer a process builds imports torch._dynamo (seconds on a busy 2-core
# machine); a shadow builds its first one when the job's first bucket layout arrives, while it
# holds the lock its receive thread needs, and falls behind for good. Importing it before the
# shadow starts avoids that until shadow/ warms up by itself.
SHADOW_BOOT = "import sys, torch._dynamo; from shadow.cli import main; sys.exit(main())"


class JobError(RuntimeError):
    """A step of a job run failed; the message says which and where to look."""


def tool(name: str, module: str) -> list[str]:
    """The argv prefix of console script ``name``: the one next to this Python, else ``python -m module``."""
    binary = BIN / name
    return [str(binary)] if binary.exists() else [sys.executable, "-m", module]


NET = tool("checkmate-net", "topologies.cli")
CTL = tool("checkmate-ctl", "controller.cli")


def run_command(argv: Sequence[str], timeout: float, what: str) -> subprocess.CompletedProcess[str]:
    """Run a command to completion within ``timeout``; JobError with its output when it fails."""
    try:
        result = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False
        )
    except subprocess.TimeoutExpired:
        raise JobError(f"{what}: `{' '.join(argv)}` did not finish within {timeout:.0f} s") from None
    if result.returncode != 0:
        raise JobError(f"{what} failed ({result.returncode}):\n{(result.stderr or result.stdout).strip()}")
    return result


def secret_env(job_file: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (None: this environment) with the job secret coming from ``job_file`` alone: another
    secret inherited from here (CHECKMATE_JOB_SECRET, ..._FILE) would be refused as a mismatch."""
    env = dict(os.environ if base is None else base)
    env.update(CHECKMATE_JOB_FILE=str(job_file), CHECKMATE_JOB_SECRET="", CHECKMATE_JOB_SECRET_FILE="")
    return env


def free_tcp_port() -> int:
    """A TCP port on loopback that nothing listens on now (for a switch's P4Runtime server)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def renamed(end: str, old: str, new: str) -> str:
    """A link end (``s1-p3`` or a host name) with switch ``old`` renamed to ``new``."""
    return new + end[len(old) :] if end == old or end.startswith(f"{old}-p") else end
