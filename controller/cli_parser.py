"""``checkmate-ctl``'s command line: :func:`build_parser` and the argparse types of its options.

Only parsing: :mod:`controller.cli` (the entry point) runs what was parsed and hands
this module the environment that gives some defaults.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from checkmate.address import AddressError, parse_host_port
from checkmate.job import PARALLELISMS
from checkmate.network import Addr
from checkmate.p4.program import P4INFO_PATH
from controller.capacity_cli import add_plan_parser, parameter_count, positive_int
from controller.shadow_status import DEFAULT_SHADOW_TIMEOUT_S, SHADOW_CONTROL_PORT
from controller.switch_connection import DEFAULT_TIMEOUT_S

PROG = "checkmate-ctl"


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no hosts (expected e.g. h1,h2,h3)")
    return names


def _shard(text: str) -> tuple[int, str]:
    key, sep, shadow = text.partition("=")
    if not sep or not shadow:
        raise argparse.ArgumentTypeError(f"{text!r} must be SHARD=SHADOW, e.g. 0=sh1")
    try:
        return int(key), shadow
    except ValueError:
        raise argparse.ArgumentTypeError(f"shard key {key!r} is not an integer") from None


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is outside 1..65535")
    return value


def _shadow_address(text: str) -> tuple[str, Addr]:
    """``NAME=HOST[:PORT]`` (the port defaults to the shadow control port; IPv6 as ``[ADDR]:PORT``)."""
    name, sep, where = text.partition("=")
    if not sep or not name or not where:
        raise argparse.ArgumentTypeError(f"{text!r} must be SHADOW=HOST[:PORT], e.g. sh1=127.0.0.1:48880")
    try:
        return name, parse_host_port(where, SHADOW_CONTROL_PORT)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def _tp_degree(text: str) -> int:
    """argparse type of --tp-degree: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{value}: a tensor-parallel degree is at least 1 (1: no tensor parallelism)"
        )
    return value


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """``checkmate-ctl``'s parser; ``environ`` (the entry point's environment) gives the defaults
    of --network and --tls-* (``CHECKMATE_NETWORK``, ``CHECKMATE_P4RT_CA``/``_CERT``/``_KEY``)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Program Checkmate switches over P4Runtime: pipeline, forwarding, and per-job "
        "replication "
        "of tagged gradient packets to shadow nodes.",
    )
    parser.add_argument(
        "--network",
        type=Path,
        default=environ.get("CHECKMATE_NETWORK"),
        help="network description (topology JSON); default: $CHECKMATE_NETWORK",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="directory of the job registry; default: $CHECKMATE_STATE_DIR or ~/.local/state/checkmate",
    )
    parser.add_argument(
        "--election-id", type=positive_int, default=1, help="P4Runtime election id (default 1)"
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for a switch to connect or answer an RPC (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--max-groups",
        type=positive_int,
        default=None,
        help="cap on multicast groups per switch, below the network description's max_multicast_groups",
    )
    parser.add_argument(
        "--no-reconcile",
        action="store_true",
        help="do not reconcile the switches with the registry before changing them",
    )
    parser.add_argument(
        "--tls-ca",
        type=Path,
        default=environ.get("CHECKMATE_P4RT_CA"),
        help="P4Runtime over TLS: the CA that signs the switches' certificates (default $CHECKMATE_P4RT_CA; "
        "none: plaintext, the tutorial workflow)",
    )
    parser.add_argument(
        "--tls-cert",
        type=Path,
        default=environ.get("CHECKMATE_P4RT_CERT"),
        help="this controller's certificate, for switches that require client certificates (mutual TLS)",
    )
    parser.add_argument(
        "--tls-key", type=Path, default=environ.get("CHECKMATE_P4RT_KEY"), help="its private key"
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv: debug)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    pipeline = commands.add_parser(
        "pipeline", help="push the P4 pipeline", description="Push the P4 pipeline."
    )
    pipeline_cmds = pipeline.add_subparsers(dest="action", metavar="ACTION", required=True)
    push = pipeline_cmds.add_parser(
        "push",
        help="push P4Info and device config to every switch, then reinstall forwarding and jobs",
        description="Push the pipeline to every switch (their entries are wiped), then reconcile: "
        "forwarding and "
        "every registered job are installed again. Without --bmv2-json or --tofino-* only the P4Info is "
        "pushed, which is what the embedded target takes.",
    )
    push.add_argument("--p4info", type=Path, default=P4INFO_PATH, help=f"P4Info file (default {P4INFO_PATH})")
    push.add_argument("--bmv2-json", type=Path, help="BMv2 JSON from p4c (target bmv2)")
    push.add_argument(
        "--tofino-bin", type=Path, help="tofino.bin from bf-p4c (target tofino; with --tofino-context)"
    )
    push.add_argument("--tofino-context", type=Path, help="context.json from bf-p4c (target tofino)")

    forwarding = commands.add_parser("forwarding", help="IPv4 forwarding", description="IPv4 forwarding.")
    forwarding_cmds = forwarding.add_subparsers(dest="action", metavar="ACTION", required=True)
    forwarding_cmds.add_parser(
        "install",
        help="make route_ipv4 hold exactly the network's routes",
        description="Install a /32 route to every host at every switch "
        "(and remove routes the network lacks).",
    )

    job = commands.add_parser("job", help="training jobs", description="Add, remove, list and show jobs.")
    job_cmds = job.add_subparsers(dest="action", metavar="ACTION", required=True)
    add = job_cmds.add_parser(
        "add",
        help="register a job and install its replication",
        description="Register a job: its workers in ring order, its shadows, and which shadow owns "
        "which shard "
        "key (default: shard k -> k-th shadow). Either --spec or --job-id/--workers/--shadows.",
    )
    add.add_argument("--spec", type=Path, help="job description JSON (checkmate.job.JobSpec)")
    add.add_argument("--job-id", type=int, help="job id (1..2^32-1)")
    add.add_argument("--workers", type=_names, help="worker hosts in ring order, e.g. h1,h2,h3")
    add.add_argument("--shadows", type=_names, help="shadow hosts, e.g. sh1,sh2")
    add.add_argument(
        "--shard",
        type=_shard,
        action="append",
        default=[],
        metavar="K=SHADOW",
        help="shard key K goes to SHADOW",
    )
    add.add_argument("--shadow-port", type=int, help="UDP port the shadows receive copies on (default 48879)")
    add.add_argument(
        "--secret-file",
        type=Path,
        help="take the job's secret from this file (hex); default: create one. Either way it is kept "
        "in the registry (mode 0600); never give a secret on a command line. With --tp-degree T > 1 "
        "and no --tp-index, each lane's secret is derived from it (a lane's secret opens no other lane)",
    )
    add.add_argument(
        "--tp-degree",
        type=_tp_degree,
        metavar="T",
        help="tensor-parallel degree of a TP x DP job: one Checkmate job (lane) per TP index. Without "
        "--tp-index, --workers are the job's ranks in order (rank = dp_index * T + tp_index) and "
        "--shadows are dealt the same way: lane t is job --job-id + t with workers[t::T] and "
        "shadows[t::T], each with its own secret",
    )
    add.add_argument(
        "--tp-index",
        type=int,
        metavar="t",
        help="add only lane t of a --tp-degree T job (its job id, its workers in ring order, its shadows); "
        "it must match the lanes already registered",
    )
    add.add_argument(
        "--parallelism",
        help=f"how the workers reduce gradients: {' or '.join(PARALLELISMS)} (default ddp; fsdp2: "
        "hosts.c10d_fsdp.enable_checkmate_fsdp)",
    )
    add.add_argument(
        "--model-params",
        type=parameter_count,
        help="parameters of the whole model, e.g. 7B: with --optimizer and --shadow-memory-gib the job is "
        "refused when a shadow cannot hold its share of the state (docs/capacity.md)",
    )
    add.add_argument("--optimizer", help="the optimizer as checkmate-ctl plan names it, e.g. adamw")
    add.add_argument("--grad-dtype", help="the gradients' dtype on the wire: fp32 (default), bf16, fp16")
    add.add_argument("--shadow-memory-gib", type=float, help="memory each shadow may use for the job, GiB")
    secret = job_cmds.add_parser(
        "secret",
        help="where a job's secret is kept; check a job file against it",
        description="Print the path of the job's secret in the registry (hex, mode 0600; put it in job "
        'files as "secret" or hand it over as CHECKMATE_JOB_SECRET_FILE). With --check FILE, fail '
        "unless FILE's secret is the registry's. No switch access.",
    )
    secret.add_argument("job_id", type=int)
    secret.add_argument("--check", type=Path, metavar="JOB_FILE", help="compare this job file's secret")
    remove = job_cmds.add_parser(
        "remove",
        help="remove a job from the switches and the registry",
        description="Remove a job from every switch, then from the registry. With --forget: from the "
        "registry only, no switch contacted (switches gone, e.g. after checkmate-net down); the next "
        "reconcile deletes what it left on a live switch and nothing installs it again.",
    )
    remove.add_argument("job_id", type=int)
    remove.add_argument("--forget", action="store_true", help="registry only; touch no switch")
    resize = job_cmds.add_parser(
        "resize",
        help="give a job another worker ring (elastic restart)",
        description="Replace a job's workers (ring order) after an elastic restart with more or fewer "
        "workers; shadows and shard map stay. One batch per switch.",
    )
    resize.add_argument("job_id", type=int)
    resize.add_argument("--workers", type=_names, required=True, help="worker hosts in ring order")
    listing = job_cmds.add_parser(
        "list", help="list registered jobs", description="List registered jobs (no switch access)."
    )
    listing.add_argument("--json", action="store_true", help="print JSON")
    show = job_cmds.add_parser(
        "show",
        help="show a job, its per-switch counters and its shadows' status",
        description="Show a job, what it holds at each switch, its counters since it was added, and "
        "the status of each of its shadows (asked on their control port). A shadow that does not "
        "answer is reported on its line; it does not make the command fail.",
    )
    show.add_argument(
        "job_ids", type=int, nargs="*", metavar="JOB_ID", help="job ids (none: every registered job)"
    )
    show.add_argument("--json", action="store_true", help='print JSON (several jobs: {"jobs": [...]})')
    show.add_argument(
        "--shadow-timeout",
        type=_positive_float,
        default=DEFAULT_SHADOW_TIMEOUT_S,
        metavar="S",
        help=f"seconds each shadow has to answer (default {DEFAULT_SHADOW_TIMEOUT_S:g}); asked in parallel",
    )
    show.add_argument(
        "--shadow-control-port",
        type=_port,
        default=SHADOW_CONTROL_PORT,
        metavar="PORT",
        help=f"TCP port of the shadows' control channel (default {SHADOW_CONTROL_PORT})",
    )
    show.add_argument(
        "--shadow-address",
        type=_shadow_address,
        action="append",
        default=[],
        metavar="SHADOW=HOST[:PORT]",
        help="ask SHADOW there instead of at its IP in the network description (repeatable)",
    )
    show.add_argument("--no-shadows", action="store_true", help="do not ask the shadows for their status")

    shadow = commands.add_parser(
        "shadow", help="shadow assignment", description="Change which shadow gets a shard."
    )
    shadow_cmds = shadow.add_subparsers(dest="action", metavar="ACTION", required=True)
    move = shadow_cmds.add_parser(
        "move",
        help="re-point a job's shard to another shadow",
        description="Re-point one shard of a job to another shadow "
        "(control plane only; workers are untouched).",
    )
    move.add_argument("--job", type=int, required=True, help="job id")
    move.add_argument("--shard", type=int, required=True, help="shard key")
    move.add_argument("--to", required=True, help="the shadow host that gets the shard")

    add_plan_parser(commands)
    commands.add_parser(
        "reconcile",
        help="make every switch match the registry and network",
        description="Read every switch back; add missing entries, fix differing ones, remove stale ones.",
    )
    return parser
