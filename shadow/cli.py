"""``checkmate-shadow``: run a shadow node, or ask one for its status.

checkmate-shadow run --name shadow0 [--control 0.0.0.0:48880] [--data 0.0.0.0:48879]
                     [--job-id N] [--shard-keys 0,2] [--snapshot-dir DIR
                     --snapshot-every K --snapshot-seconds T --keep M --snapshot-timeout S --resume]
                     [--status-file PATH] [--metrics-port PORT [--metrics-address ADDR]]
checkmate-shadow status HOST[:PORT] [--timeout S]
checkmate-shadow certified HOST[:PORT] [HOST[:PORT] ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from checkmate import nfs
from checkmate.address import AddressError, parse_host_port
from checkmate.auth import AuthConfigError, secret_from_env
from checkmate.checkpoint.shadow_memory import RestoreError
from checkmate.control import DEFAULT_CONTROL_PORT, query_status
from checkmate.control_frame import ControlProtocolError, process_auth
from checkmate.metrics import DEFAULT_BIND, MetricsServer, parse_metrics_port
from checkmate.wire import CHECKMATE_UDP_PORT
from shadow.cluster import certified_from_statuses
from shadow.metrics import shadow_collector
from shadow.node import ShadowConfig, ShadowNode
from shadow.repair import RepairPolicy
from shadow.snapshots import SnapshotPolicy

logger = logging.getLogger(__name__)


def parse_address(text: str, default_port: int) -> tuple[str, int]:
    """``HOST[:PORT]`` or ``[IPv6][:PORT]`` (checkmate.address); an empty host is 0.0.0.0."""
    try:
        return parse_host_port(text, default_port, default_host="0.0.0.0", allow_zero=True)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _address(default_port: int) -> Callable[[str], str]:
    """An argparse type that checks HOST[:PORT] (usage error, exit 2) and keeps the text."""

    def check(text: str) -> str:
        parse_address(text, default_port)
        return text

    return check


def _shard_keys(text: str) -> str:
    try:
        keys = [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of shard keys") from None
    if any(not 0 <= k <= 0xFFFF for k in keys):
        raise argparse.ArgumentTypeError(f"{text!r}: shard keys lie in 0..65535")
    return text


def _metrics_port(text: str) -> int:
    try:
        return int(parse_metrics_port(text, "--metrics-port") or 0)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    """A finite, non-negative number of seconds (the repair timings)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be finite and not negative")
    return value


def _positive_seconds(text: str) -> float:
    """A finite number of seconds above zero (a timeout)."""
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a timeout must be above zero seconds")
    return value


_LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="checkmate-shadow", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=_LOG_LEVELS)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a shadow node (until interrupted)")
    run.add_argument("--name", required=True, help="this shadow's name in the job's shard map")
    run.add_argument(
        "--control",
        default=f"0.0.0.0:{DEFAULT_CONTROL_PORT}",
        type=_address(DEFAULT_CONTROL_PORT),
        help="TCP HOST:PORT",
    )
    run.add_argument(
        "--data",
        default=f"0.0.0.0:{CHECKMATE_UDP_PORT}",
        type=_address(CHECKMATE_UDP_PORT),
        help="UDP HOST:PORT for copies",
    )
    run.add_argument("--job-id", type=int, default=None)
    run.add_argument(
        "--shard-keys", default=None, type=_shard_keys, help="comma-separated; default: from the job"
    )
    run.add_argument(
        "--snapshot-dir",
        type=nfs.location_argument,
        default=None,
        help="where snapshots go: a directory, or remote storage as nfs://SERVER/EXPORT/PATH (NFSv3, "
        "written over the network; the status file and a staged --resume step then stay in a local "
        "directory under the system's temporary directory)",
    )
    run.add_argument("--snapshot-every", type=int, default=1, help="iterations (0: never by count)")
    run.add_argument("--snapshot-seconds", type=float, default=0.0, help="seconds (0: never by time)")
    run.add_argument("--keep", type=int, default=3)
    run.add_argument(
        "--snapshot-timeout",
        type=_positive_seconds,
        default=nfs.DEFAULT_TIMEOUT_S,
        help="remote --snapshot-dir: an NFS call not answered in this many seconds fails that snapshot "
        f"write (logged, counted in status, tried again; default {nfs.DEFAULT_TIMEOUT_S:g})",
    )
    run.add_argument("--resume", action="store_true", help="load this shadow's latest snapshot first")
    run.add_argument("--status-file", type=Path, default=None)
    run.add_argument("--horizon", type=int, default=8, help="iterations in flight")
    run.add_argument(
        "--repair-grace", type=_seconds, default=0.02, help="seconds after a commit before its gaps are asked"
    )
    run.add_argument(
        "--repair-max-grace",
        type=_seconds,
        default=0.5,
        help="seconds the grace may grow to while copies keep arriving after their repair was asked "
        "(late, not lost); equal to --repair-grace for a fixed grace",
    )
    run.add_argument("--repair-timeout", type=_seconds, default=0.1)
    run.add_argument("--threads", type=int, default=1, help="torch threads for the optimizer")
    run.add_argument(
        "--apply-threads",
        type=int,
        default=None,
        help="threads that step a large Adam/AdamW shard, bit for bit as one (default: the cores)",
    )
    run.add_argument(
        "--metrics-port",
        type=_metrics_port,
        default=None,
        help="serve Prometheus metrics on this TCP port (docs/metrics.md); in use: refuse to start",
    )
    run.add_argument(
        "--metrics-address", default=DEFAULT_BIND, help=f"address for --metrics-port (default {DEFAULT_BIND})"
    )
    status = sub.add_parser("status", help="print a shadow's status JSON")
    status.add_argument("address", type=_address(DEFAULT_CONTROL_PORT))
    status.add_argument("--timeout", type=float, default=5.0)
    certified = sub.add_parser("certified", help="the iteration every given shadow has applied")
    certified.add_argument("addresses", nargs="+", type=_address(DEFAULT_CONTROL_PORT))
    certified.add_argument("--timeout", type=float, default=5.0)
    return parser


def _run(args: argparse.Namespace) -> int:
    import torch

    os.umask(0o077)  # snapshots, status and logs hold the model: the owner's only (docs/security.md)
    torch.set_num_threads(args.threads)
    snapshots = None
    if args.snapshot_dir is not None:
        snapshots = SnapshotPolicy(
            args.snapshot_dir,  # a URL stays text: SnapshotPolicy keeps it as its remote
            args.snapshot_every,
            args.snapshot_seconds,
            args.keep,
            timeout=args.snapshot_timeout,
            stage_latest=args.resume,
        )
    keys = tuple(int(k) for k in args.shard_keys.split(",")) if args.shard_keys else None
    config = ShadowConfig(
        name=args.name,
        control_bind=parse_address(args.control, DEFAULT_CONTROL_PORT),
        data_bind=parse_address(args.data, CHECKMATE_UDP_PORT),
        job_id=args.job_id,
        shard_keys=keys,
        snapshots=snapshots,
        resume=args.resume,
        status_file=args.status_file,
        horizon=args.horizon,
        repair=RepairPolicy(
            grace=args.repair_grace,
            timeout=args.repair_timeout,
            max_grace=max(args.repair_grace, args.repair_max_grace),
        ),
        apply_threads=args.apply_threads,
        secret=secret_from_env(),  # read once, here: the node and its links take it as a value
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    metrics = None
    node = ShadowNode(config)
    if args.metrics_port is not None:
        # before the node's threads start: a port in use refuses the start (exit 1, one line)
        try:
            metrics = MetricsServer(shadow_collector(node.status), args.metrics_port, args.metrics_address)
        except OSError:
            node.close()
            raise
    try:
        node.start()
    except BaseException:
        if metrics is not None:
            metrics.close()
        raise
    try:
        while not stop.wait(0.5):
            pass
    finally:
        node.close()
        if metrics is not None:
            metrics.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "run":
            return _run(args)
        auth = process_auth(secret_from_env())  # the job secret, read once, handed to every query
        if args.command == "status":
            document = query_status(
                parse_address(args.address, DEFAULT_CONTROL_PORT), args.timeout, auth=auth
            )
            print(json.dumps(document, indent=1, sort_keys=True))
            return 0
        addresses = [parse_address(a, DEFAULT_CONTROL_PORT) for a in args.addresses]
        statuses = [query_status(address, args.timeout, auth=auth) for address in addresses]
        print(json.dumps({"certified_through": certified_from_statuses(statuses)}))
        return 0
    except (OSError, RestoreError, AuthConfigError, ControlProtocolError) as exc:
        print(f"checkmate-shadow: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
