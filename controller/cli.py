"""``checkmate-ctl``: the controller's command line.

    checkmate-ctl --network topologies/single.json pipeline push
    checkmate-ctl --network topologies/single.json forwarding install
    checkmate-ctl --network topologies/single.json job add --job-id 7 --workers h1,h2,h3,h4 --shadows sh1,sh2
    checkmate-ctl --network topologies/single.json job add --job-id 9 --workers h1,h2,h3,h4 \
        --shadows sh1,sh2 --tp-degree 2      # TP=2 x DP=2: lanes 9 (h1,h3 -> sh1), 10 (h2,h4 -> sh2)
    checkmate-ctl --network topologies/single.json job show 7 [--json] [--shadow-timeout 2] [--no-shadows]
    checkmate-ctl --network topologies/single.json shadow move --job 7 --shard 1 --to sh1
    checkmate-ctl --network topologies/single.json job remove 7
    checkmate-ctl plan --model-params 70e9 --optimizer adamw --iteration-time 10 --dp 128 --tp 8

Commands that change switches first reconcile them with the registry (the
controller's "start"), unless ``--no-reconcile`` is given. Errors print one
line naming the cause and exit with status 1; usage errors exit with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from checkmate.address import AddressError, parse_host_port
from checkmate.job import PARALLELISMS, JobSpec, JobSpecError
from checkmate.network import Addr, Network, NetworkError
from checkmate.p4 import names
from checkmate.p4.program import P4INFO_PATH, Target
from checkmate.tls import TlsFiles
from controller.capacity_cli import add_plan_parser, parameter_count, positive_int, run_plan
from controller.capacity_job import check_shadow_memory, shadow_shares
from controller.controller import Controller
from controller.errors import ControllerError
from controller.job_registry_cli import forget_job, lane_line, lane_summary, list_jobs
from controller.job_secrets import JobSecretError, JobSecrets
from controller.jobs import check_lanes, lane_job_ids, split_lanes
from controller.pipeline import PipelineConfig
from controller.shadow_status import (
    DEFAULT_SHADOW_TIMEOUT_S,
    SHADOW_CONTROL_PORT,
    ShadowStatus,
    protection,
    protection_line,
    query_shadows,
    shadow_addresses,
    summary_line,
)
from controller.switch_connection import DEFAULT_TIMEOUT_S

logger = logging.getLogger(__name__)

PROG = "checkmate-ctl"


def default_state_dir() -> Path:
    if os.environ.get("CHECKMATE_STATE_DIR"):
        return Path(os.environ["CHECKMATE_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "checkmate"


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Program Checkmate switches over P4Runtime: pipeline, forwarding, and per-job "
        "replication "
        "of tagged gradient packets to shadow nodes.",
    )
    parser.add_argument(
        "--network",
        type=Path,
        default=os.environ.get("CHECKMATE_NETWORK"),
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
        default=os.environ.get("CHECKMATE_P4RT_CA"),
        help="P4Runtime over TLS: the CA that signs the switches' certificates (default $CHECKMATE_P4RT_CA; "
        "none: plaintext, the tutorial workflow)",
    )
    parser.add_argument(
        "--tls-cert",
        type=Path,
        default=os.environ.get("CHECKMATE_P4RT_CERT"),
        help="this controller's certificate, for switches that require client certificates (mutual TLS)",
    )
    parser.add_argument(
        "--tls-key", type=Path, default=os.environ.get("CHECKMATE_P4RT_KEY"), help="its private key"
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


def _job_specs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[JobSpec]:
    """The job(s) ``job add`` registers: one, or one per lane of a TP job (controller.jobs.split_lanes);
    each checked against its shadows' memory when sized (controller.capacity_job)."""
    specs = _lanes(args, parser)
    for spec in specs:
        check_shadow_memory(spec)
    return specs


def _lanes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[JobSpec]:
    if args.tp_index is not None and args.tp_degree is None:
        parser.error("job add: --tp-index needs --tp-degree")
    if args.spec is not None and args.tp_degree is not None:
        parser.error('job add: with --spec, give "tp_degree" and "tp_index" in the spec file')
    spec = _job_spec(args, parser)
    if args.tp_degree is None:
        return [spec]
    if args.tp_index is not None:
        if not 0 <= args.tp_index < args.tp_degree:
            raise JobSpecError(f"--tp-index {args.tp_index} is outside 0..{args.tp_degree - 1} (--tp-degree)")
        return [dataclasses.replace(spec, tp_degree=args.tp_degree, tp_index=args.tp_index)]
    # split_lanes deals the ring fields; every lane carries the job's sizing (each holds 1/T of it)
    return [dataclasses.replace(lane, **spec.sizing_fields()) for lane in split_lanes(spec, args.tp_degree)]


def _sizing(args: argparse.Namespace) -> dict[str, Any]:
    """``job add``'s sizing options as JobSpec fields (those given)."""
    given = {
        "parallelism": args.parallelism,
        "model_params": args.model_params,
        "optimizer": args.optimizer,
        "grad_dtype": args.grad_dtype,
        "shadow_memory_gib": args.shadow_memory_gib,
    }
    return {name: value for name, value in given.items() if value is not None}


def _job_spec(args: argparse.Namespace, parser: argparse.ArgumentParser) -> JobSpec:
    inline = [args.job_id, args.workers, args.shadows]
    if args.spec is not None:
        if any(v is not None for v in inline) or args.shard or args.shadow_port is not None:
            parser.error("job add: give either --spec or --job-id/--workers/--shadows, not both")
        if _sizing(args):
            parser.error(
                "job add: with --spec, give the sizing fields (parallelism, model_params, optimizer, "
                "grad_dtype, shadow_memory_gib) in the spec file"
            )
        try:
            return JobSpec.loads(args.spec.read_text())
        except OSError as exc:
            raise JobSpecError(f"cannot read {args.spec}: {exc.strerror}") from None
    if any(v is None for v in inline):
        parser.error("job add: --job-id, --workers and --shadows are required (or --spec FILE)")
    shards: dict[int, str] = {}
    for key, shadow in args.shard:
        if key in shards:
            raise JobSpecError(f"shard {key} is given twice")
        shards[key] = shadow
    kwargs: dict[str, Any] = {} if args.shadow_port is None else {"shadow_port": args.shadow_port}
    kwargs.update(_sizing(args))
    return JobSpec(args.job_id, tuple(args.workers), tuple(args.shadows), shards, **kwargs)


def _print_job_line(record_spec: JobSpec, slot: int) -> None:
    shards = ", ".join(f"{k}->{s}" for k, s in sorted(record_spec.shard_to_shadow.items()))
    print(
        f"job {record_spec.job_id}  slot {slot}  workers {','.join(record_spec.workers)}  "
        f"shadows {','.join(record_spec.shadows)}  shards {shards}"
    )


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.command == "plan":
        return run_plan(args, PROG)
    state_dir = args.state_dir if args.state_dir is not None else default_state_dir()
    if args.command == "job" and args.action == "list":
        print(list_jobs(state_dir, args.json))
        return 0
    if args.command == "job" and args.action == "remove" and args.forget:
        record = forget_job(state_dir, args.job_id)
        JobSecrets(state_dir).remove(args.job_id)
        print(
            f"job {args.job_id} forgotten: removed from the registry only (slot {record.slot}, "
            f"{len(record.groups)} group(s) on the switches left as they are; the next reconcile "
            "removes them from a live switch)"
        )
        return 0
    if args.command == "job" and args.action == "secret":
        secrets = JobSecrets(state_dir)
        secrets.read(args.job_id)  # present, private, well formed
        if args.check is not None:
            secrets.check_job_file(args.job_id, args.check)
            print(f"{args.check}: the secret is job {args.job_id}'s")
        else:
            print(secrets.path(args.job_id))
        return 0

    if args.network is None:
        parser.error("--network FILE is required for this command (or set $CHECKMATE_NETWORK)")
    network = Network.load(args.network)
    specs = _job_specs(args, parser) if args.command == "job" and args.action == "add" else []
    tls = None
    if args.tls_ca is not None:
        tls = TlsFiles(args.tls_ca, args.tls_cert, args.tls_key)
    elif args.tls_cert is not None or args.tls_key is not None:
        parser.error("--tls-cert/--tls-key need --tls-ca")
    with Controller(network, state_dir, args.election_id, args.timeout, args.max_groups, tls) as ctl:
        if args.command == "pipeline":
            if (args.tofino_bin is None) != (args.tofino_context is None):
                parser.error("pipeline push: --tofino-bin and --tofino-context go together")
            if args.bmv2_json is not None and args.tofino_bin is not None:
                parser.error("pipeline push: --bmv2-json and --tofino-* are for different targets")
            try:
                if args.bmv2_json is not None:
                    config = PipelineConfig.bmv2(args.p4info, args.bmv2_json)
                elif args.tofino_bin is not None:
                    config = PipelineConfig.tofino(args.p4info, args.tofino_bin, args.tofino_context)
                else:
                    config = PipelineConfig.embedded(args.p4info)
            except OSError as exc:
                raise ControllerError(f"cannot read the pipeline files: {exc}") from None
            report = ctl.push_pipeline(config, reconcile=not args.no_reconcile)
            print(f"pushed the {config.target.value} pipeline to {', '.join(sorted(network.switches))}")
            if config.target is Target.EMBEDDED:
                print("(P4Info only: the embedded target runs the Checkmate program it was built with)")
            if report is not None:
                print(f"reconciled: {report.summary()}")
            return 0
        if args.command == "reconcile":
            print(ctl.reconcile().summary())
            return 0
        if args.command == "forwarding":
            report = ctl.install_forwarding()
            print(f"forwarding: {report.summary()}")
            return 0
        writes = (
            args.command == "job" and args.action in ("add", "remove", "resize")
        ) or args.command == "shadow"
        if writes and not args.no_reconcile:
            report = ctl.reconcile()
            if report.changes or report.skipped_jobs:
                print(f"reconciled on start: {report.summary()}")
        if args.command == "shadow":
            record = ctl.move_shard(args.job, args.shard, args.to)
            print(f"job {args.job}: shard {args.shard} now goes to {args.to}")
            _print_job_line(record.spec, record.slot)
            return 0
        if args.action == "add":
            _add_jobs(ctl, state_dir, specs, args.secret_file)
            return 0
        if args.action == "resize":
            record = ctl.resize_job(args.job_id, tuple(args.workers))
            print(f"job {args.job_id}: workers now {','.join(record.spec.workers)}")
            _print_job_line(record.spec, record.slot)
            return 0
        if args.action == "remove":
            ctl.remove_job(args.job_id)
            JobSecrets(state_dir).remove(args.job_id)
            print(f"job {args.job_id} removed")
            return 0
        if args.action == "show":
            ids = args.job_ids or [r.spec.job_id for r in ctl.jobs()]
            shown = [_show(ctl, network, args, job_id) for job_id in ids]
            if args.json:
                print(json.dumps(shown[0] if len(args.job_ids) == 1 else {"jobs": shown}, indent=2))
            elif not ids:
                print(f"no jobs registered (registry: {state_dir})")
            return 0
    parser.error(f"unknown command {args.command}")
    return 2


def _add_jobs(ctl: Controller, state_dir: Path, specs: list[JobSpec], secret_file: Path | None) -> None:
    """Register ``specs`` (a job, or a TP job's lanes: all or none), each with its own secret."""
    secrets = JobSecrets(state_dir)
    if secret_file is not None:
        secrets.create(0, secret_file)  # refuse a bad secret before touching the switches
        secrets.remove(0)
    check_lanes(specs, [r.spec for r in ctl.jobs()])
    derive = len(specs) > 1  # several lanes from one secret file: one derived secret per lane
    if secret_file is not None and not derive and specs[0].tp_degree > 1:
        secrets.check_distinct(specs[0].job_id, secret_file, lane_job_ids(specs[0]))
    added: list[int] = []
    try:
        for spec in specs:
            record = ctl.add_job(spec)
            added.append(spec.job_id)
            path = secrets.create(spec.job_id, secret_file, derive_lane=derive)
            lane = f" (lane {spec.tp_index} of TP={spec.tp_degree})" if spec.tp_degree > 1 else ""
            print(
                f"job {spec.job_id}{lane} added: slot {record.slot}, {len(record.groups)} multicast "
                f"group(s), {len(record.rids)} shadow rewrite(s); secret kept in {path} (mode 0600)"
            )
            for share in shadow_shares(spec):
                print(
                    f"  shadow {share.shadow}: {share.parameters:,} parameters, "
                    f"{share.state_bytes / 2**30:,.1f} of {share.memory_bytes / 2**30:,.1f} GiB "
                    f"({spec.parallelism})"
                )
    except (ControllerError, NetworkError) as exc:
        for job_id in reversed(added):  # a TP job's lanes go in together or not at all
            ctl.remove_job(job_id)
            secrets.remove(job_id)
        if added:
            raise ControllerError(f"{exc} (lanes {added} added before it were removed again)") from exc
        raise


def _show(ctl: Controller, network: Network, args: argparse.Namespace, job_id: int) -> dict[str, Any]:
    """Print one job (text), or return its JSON document (--json)."""
    status = ctl.job_status(job_id)
    record = status.record
    shadows = None
    if not args.no_shadows:
        overrides = dict(args.shadow_address)
        for name in sorted(set(overrides) - set(record.spec.shadows)):
            logger.warning("--shadow-address %s: job %d has no shadow %s", name, job_id, name)
        addresses = shadow_addresses(record.spec, network, args.shadow_control_port, overrides)
        state_dir = args.state_dir if args.state_dir is not None else default_state_dir()
        try:
            secret = JobSecrets(state_dir).read(job_id)
        except JobSecretError as exc:  # e.g. a job added before secrets existed: say so on each line
            shadows = [ShadowStatus(name, "", error=str(exc)) for name in addresses]
        else:
            shadows = query_shadows(addresses, args.shadow_timeout, record.spec.job_id, secret)
    if args.json:
        out = {
            "job": record.spec.to_json(),
            "slot": record.slot,
            "groups": [
                {"switch": s, "next_hop_port": p, "shadow": sh, "group_id": g}
                for (s, p, sh), g in sorted(record.groups.items())
            ],
            "rids": [{"switch": s, "shadow": sh, "rid": r} for (s, sh), r in sorted(record.rids.items())],
            "counters": {
                switch: {name: {"packets": v.packets, "bytes": v.bytes} for name, v in values.items()}
                for switch, values in status.counters.items()
            },
        }
        lanes = lane_summary(record.spec, {r.spec.job_id for r in ctl.jobs()})
        if lanes is not None:
            out["lanes"] = lanes
        if shadows is not None:
            out["shadows"] = {answer.shadow: answer.to_json() for answer in shadows}
            out["protection"] = protection(shadows, record.spec.job_id)
        return out
    _print_job_line(record.spec, record.slot)
    if record.spec.tp_degree > 1:
        print("  " + lane_line(record.spec, {r.spec.job_id for r in ctl.jobs()}))
    for (switch, port, shadow), group in sorted(record.groups.items()):
        rid = record.rids[(switch, shadow)]
        print(f"  {switch}: multicast group {group}: next hop port {port} + copy to {shadow} (rid {rid})")
    print("  counters since the job was added (packets / bytes):")
    for switch, values in sorted(status.counters.items()):
        parts = [f"{name} {v.packets} / {v.bytes}" for name, v in values.items()]
        print(f"    {switch}: " + ", ".join(parts))
    copies, rejected = status.total(names.ShadowCopies.NAME), status.total(names.RejectedReplications.NAME)
    print(
        f"  total: {names.ShadowCopies.NAME} {copies.packets} / {copies.bytes}, "
        f"{names.RejectedReplications.NAME} {rejected.packets}"
    )
    if shadows is not None:
        print(f"  shadows (status on their control port, {args.shadow_timeout:g} s timeout):")
        for answer in shadows:
            print(f"    {summary_line(answer, record.spec.job_id)}")
        print(f"  {protection_line(protection(shadows, record.spec.job_id))}")
    return {}


def _quiet_p4runtime_shell(record: logging.LogRecord) -> bool:
    """Drop p4runtime-shell's root-logger CRITICAL lines about streams: our error says it better."""
    return "p4runtime_sh" not in record.pathname


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``checkmate-ctl``; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose == 0:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_quiet_p4runtime_shell)
    try:
        return _run(args, parser)
    except SystemExit as exc:  # parser.error() after parsing
        return exc.code if isinstance(exc.code, int) else 2
    except (ControllerError, NetworkError, JobSpecError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
