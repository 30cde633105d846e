"""Where a Checkmate process's configuration comes from, and who may read the environment.

Every process builds one configuration object at its entry point, validates it there once
and passes it (and the job secret, as a value) down; nothing below an entry point reads
the environment (tests/test_configuration.py walks the library for ``os.environ``,
``os.getenv`` and :func:`checkmate.auth.secret_from_env` outside :data:`ENTRY_POINTS`).

=====================  ====================================================================
process                its configuration object and where it is built
=====================  ====================================================================
a training rank        ``hosts.CheckmateConfig`` (``CheckmateConfig.from_env``, or given to
                       ``hosts.enable_checkmate``); ``hosts.resume``'s arguments
``checkmate-shadow``   ``shadow.node.ShadowConfig`` (``shadow/cli.py``: flags, the secret)
``checkmate-ctl``      the controller's arguments (``controller/cli.py``: flags over variables)
``checkmate-net``      ``topologies.preflight.Plan`` (``topologies/cli.py``, the supervisor)
``checkmate-switch``   ``embedded_switch.cli.SwitchConfig`` (``embedded_switch/cli.py``: flags)
=====================  ====================================================================

Precedence, where one setting has several sources: a command-line flag or an argument
given in code, over the environment (:data:`ENVIRONMENT_VARIABLES`), over the job file
(``CHECKMATE_JOB_FILE``), over the default; the job's id and ring are the job file's when
there is one. The job secret is the exception: every source that gives one must give the
same (two that differ are an :class:`~checkmate.auth.AuthConfigError`), and it is never a flag.

``python -m checkmate.config`` prints the table of variables that docs/configuration.md
holds (a test keeps the two equal).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

TRAINING: Final = "training ranks"
SHADOW: Final = "checkmate-shadow"
CONTROLLER: Final = "checkmate-ctl"
NET: Final = "checkmate-net"
BACKEND: Final = 'init_process_group(backend="checkmate")'
RESUME: Final = "hosts.resume"
EXAMPLES: Final = "examples/train_lm.py, train_tp.py"


@dataclass(frozen=True)
class EnvironmentVariable:
    """One ``CHECKMATE_*`` variable: its default, what it means, and which processes read it."""

    name: str
    default: str
    meaning: str
    read_by: tuple[str, ...]


def _var(name: str, default: str, meaning: str, *read_by: str) -> EnvironmentVariable:
    return EnvironmentVariable(name, default, meaning, read_by)


ENVIRONMENT_VARIABLES: Final[tuple[EnvironmentVariable, ...]] = (
    # The job and the secret.
    _var(
        "CHECKMATE_JOB_FILE",
        "unset",
        "the job file (JSON: job, worker addresses in ring order, shadow control addresses, "
        "secret); `{tp_index}` becomes the rank's TP index. Rank 0 re-reads it to follow a shadow move",
        TRAINING,
        SHADOW,
    ),
    _var(
        "CHECKMATE_JOB_SECRET",
        "unset",
        "the job secret (hex, at least 16 bytes); or one of the next two. Sources that disagree are refused",
        TRAINING,
        SHADOW,
        BACKEND,
        RESUME,
    ),
    _var(
        "CHECKMATE_JOB_SECRET_FILE",
        "unset",
        "a file holding the job secret (hex, mode 0600); `{tp_index}` as in the job file",
        TRAINING,
        SHADOW,
        BACKEND,
        RESUME,
    ),
    _var(
        "CHECKMATE_JOB_ID",
        "1",
        "the job id (without a job file); lane t of a TP job is this + t",
        TRAINING,
        BACKEND,
        RESUME,
    ),
    _var(
        "CHECKMATE_TP_DEGREE",
        "1",
        "tensor-parallel degree T: each TP index is its own lane",
        TRAINING,
        RESUME,
    ),
    _var(
        "CHECKMATE_SHADOWS",
        "none",
        "the shadows' control addresses, `name=ip:port,...` or `ip:port,...` (without a job file)",
        TRAINING,
        RESUME,
    ),
    _var("CHECKMATE_SHADOWS_TP<t>", "CHECKMATE_SHADOWS", "lane t's shadows in a TP job", TRAINING, RESUME),
    # The data path.
    _var(
        "CHECKMATE_BIND",
        "127.0.0.(10+RANK) when MASTER_ADDR is loopback",
        "this rank's data address `ip[:port]`",
        TRAINING,
        BACKEND,
    ),
    _var(
        "CHECKMATE_BACKEND_BIND",
        "CHECKMATE_BIND's IP, a free port",
        "the torch.distributed backend's data address `ip[:port]`",
        BACKEND,
    ),
    _var(
        "CHECKMATE_TRANSPORT", "native", "the transport's data path: `native` or `python`", TRAINING, BACKEND
    ),
    _var(
        "CHECKMATE_REPLICATION",
        "switch",
        "who copies the reduced chunks to the shadows: `switch` or `host` (no switch)",
        TRAINING,
    ),
    _var("CHECKMATE_COMPRESS", "unset", "all-reduce fp32 buckets as `bf16` or `fp16`", TRAINING),
    _var("CHECKMATE_TIMEOUT", "300", "seconds an all-reduce may take", TRAINING),
    _var(
        "CHECKMATE_PEER_TIMEOUT", "30", "seconds without an acknowledgement before a peer is dead", TRAINING
    ),
    # Resuming.
    _var(
        "CHECKMATE_START_ITERATION",
        "0",
        "the job's iteration number of this process's first all-reduce",
        TRAINING,
    ),
    _var("CHECKMATE_OPTIMIZER_STEP", "0", "optimizer steps taken before it", TRAINING),
    _var(
        "CHECKMATE_SNAPSHOT_DIR",
        "unset",
        "the shadows' snapshot directory `hosts.resume` falls back to",
        RESUME,
    ),
    _var("CHECKMATE_RESUME", "0", "the example training scripts resume first (as `--resume`)", EXAMPLES),
    # Protection.
    _var(
        "CHECKMATE_FINGERPRINT_EVERY",
        "1 (CPU parameters), 0 (GPU)",
        "rank 0 sends a fingerprint of its state with every K-th commit (0: never)",
        TRAINING,
    ),
    _var(
        "CHECKMATE_FINGERPRINT_BYTES",
        "33554432 (32 MiB)",
        "parameter bytes one fingerprint covers; a larger model is fingerprinted in turns (0: whole)",
        TRAINING,
    ),
    _var("CHECKMATE_MAX_LAG", "2", "iterations the shadows may lag before the policy acts", TRAINING),
    _var("CHECKMATE_ON_LAG", "wait", "what a lag beyond the bound does: `wait` or `continue`", TRAINING),
    _var("CHECKMATE_UNPROTECTED", "raise", "what an unprotected job does: `raise` or `log`", TRAINING),
    _var("CHECKMATE_CERTIFY_TIMEOUT", "120", "seconds to wait for the shadows' certificates", TRAINING),
    _var("CHECKMATE_METRICS_PORT", "unset", "rank 0 serves Prometheus metrics on this TCP port", TRAINING),
    # Tests.
    _var("CHECKMATE_LOSS", "0", "tests: the fraction of data datagrams a rank drops on send", TRAINING),
    _var("CHECKMATE_FAULT_SEED", "0", "tests: the seed of those drops", TRAINING),
    # The network and the controller.
    _var("CHECKMATE_NETWORK", "unset", "the network description (`--network`)", CONTROLLER),
    _var(
        "CHECKMATE_STATE_DIR",
        "$XDG_STATE_HOME/checkmate or ~/.local/state/checkmate",
        "the job registry (`--state-dir`)",
        CONTROLLER,
    ),
    _var("CHECKMATE_P4RT_CA", "unset", "P4Runtime over TLS: the switches' CA (`--tls-ca`)", CONTROLLER),
    _var("CHECKMATE_P4RT_CERT", "unset", "the controller's client certificate (`--tls-cert`)", CONTROLLER),
    _var("CHECKMATE_P4RT_KEY", "unset", "its private key (`--tls-key`)", CONTROLLER),
    _var("CHECKMATE_NET_DIR", "a directory under /tmp", "where `checkmate-net up` keeps its runs", NET),
    _var(
        "CHECKMATE_NET_RUN",
        "set by checkmate-net",
        "marks the processes of a run (not for users; `checkmate-net down` finds them by it)",
        NET,
    ),
)
"""Every ``CHECKMATE_*`` variable, once (docs/configuration.md is generated from this)."""

ENTRY_POINTS: Final[Mapping[str, str]] = {
    "controller/cli.py": "checkmate-ctl: flags over CHECKMATE_NETWORK, _STATE_DIR, _P4RT_*",
    "topologies/cli.py": "checkmate-net: CHECKMATE_NET_DIR; its children's environment",
    "topologies/supervisor.py:main": "the network's supervisor process: its switches' environment",
    "shadow/cli.py": "checkmate-shadow: the job secret, once",
    "hosts/ddp_config.py:CheckmateConfig.from_env": "a training rank's configuration",
    "hosts/ddp_config.py:_secret_env": "CheckmateConfig.from_env's job secret (from the mapping it reads)",
    "hosts/ddp_config.py:ResumeConfig.from_env": "hosts.resume: CHECKMATE_JOB_ID, _TP_DEGREE, _SNAPSHOT_DIR",
    "hosts/ddp.py:enable_checkmate": "the job secret of a configuration built without one",
    "hosts/c10d_fsdp.py:enable_checkmate_fsdp": "the job secret of a configuration built without one",
    "hosts/c10d_backend.py:create_checkmate_backend": 'init_process_group(backend="checkmate"): its options',
    "hosts/benchmark.py": "python -m hosts.benchmark: gives its ranks a secret (to move with the benchmarks)",
    "checkmate/auth.py:secret_from_env": "the job secret: what the entry points call",
    "checkmate/auth.py:secret_or_env": "the secret of a component a script built without one (compatibility)",
}
"""Where the library may read the environment: ``path`` (the whole module: a command line's) or
``path:function`` -> why. tests/test_configuration.py fails on a read anywhere else."""


def environment_table() -> str:
    """The Markdown table of :data:`ENVIRONMENT_VARIABLES` (docs/configuration.md holds it)."""
    rows = ["| variable | default | meaning | read by |", "|---|---|---|---|"]
    for var in ENVIRONMENT_VARIABLES:
        meaning = var.meaning.replace("|", "\\|")
        rows.append(f"| `{var.name}` | {var.default} | {meaning} | {', '.join(var.read_by)} |")
    return "\n".join(rows) + "\n"


def main() -> int:
    sys.stdout.write(environment_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
