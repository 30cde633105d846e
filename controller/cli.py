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

This module is the entry point: it reads the environment and runs what was parsed. The
parser is :mod:`controller.cli_parser`; ``job add`` is :mod:`controller.job_add`, ``job show``
:mod:`controller.job_show`, ``plan`` :mod:`controller.capacity_cli`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from checkmate.job import JobSpecError
from checkmate.network import Network, NetworkError
from checkmate.p4.program import Target
from checkmate.tls import TlsFiles
from controller.capacity_cli import run_plan
from controller.cli_parser import PROG, build_parser
from controller.controller import Controller
from controller.errors import ControllerError
from controller.job_add import add_jobs, job_specs
from controller.job_registry_cli import forget_job, list_jobs
from controller.job_secrets import JobSecrets
from controller.job_show import print_job_line, show_job
from controller.pipeline import PipelineConfig

logger = logging.getLogger(__name__)


def default_state_dir() -> Path:
    if os.environ.get("CHECKMATE_STATE_DIR"):
        return Path(os.environ["CHECKMATE_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "checkmate"


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
    specs = job_specs(args, parser) if args.command == "job" and args.action == "add" else []
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
            print_job_line(record.spec, record.slot)
            return 0
        if args.action == "add":
            add_jobs(ctl, state_dir, specs, args.secret_file)
            return 0
        if args.action == "resize":
            record = ctl.resize_job(args.job_id, tuple(args.workers))
            print(f"job {args.job_id}: workers now {','.join(record.spec.workers)}")
            print_job_line(record.spec, record.slot)
            return 0
        if args.action == "remove":
            ctl.remove_job(args.job_id)
            JobSecrets(state_dir).remove(args.job_id)
            print(f"job {args.job_id} removed")
            return 0
        if args.action == "show":
            ids = args.job_ids or [r.spec.job_id for r in ctl.jobs()]
            shown = [show_job(ctl, network, args, job_id, state_dir) for job_id in ids]
            if args.json:
                print(json.dumps(shown[0] if len(args.job_ids) == 1 else {"jobs": shown}, indent=2))
            elif not ids:
                print(f"no jobs registered (registry: {state_dir})")
            return 0
    parser.error(f"unknown command {args.command}")
    return 2


def _quiet_p4runtime_shell(record: logging.LogRecord) -> bool:
    """Drop p4runtime-shell's root-logger CRITICAL lines about streams: our error says it better."""
    return "p4runtime_sh" not in record.pathname


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``checkmate-ctl``; returns the exit status."""
    parser = build_parser(os.environ)
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
