"""``checkmate-switch``: the embedded target, started like ``simple_switch_grpc``.

    checkmate-switch --no-p4 -i 1@veth1 -i 2@veth2 --grpc-server-addr 127.0.0.1:9559 --cpu-port 255

Options are those of ``simple_switch_grpc`` (a ``--`` between the bmv2 and the
target options is accepted and ignored), plus:

``--p4info PATH``
    Load the pipeline from this P4Info at start, so the data path and the
    P4Runtime server work before any controller pushes a config.
``--metrics-port PORT`` (``--metrics-address ADDR``)
    Serve Prometheus metrics (docs/metrics.md); a port in use stops the start (status 1).
``--drop-egress PORT:FRACTION`` (repeatable), ``--drop-seed N``
    Fault injection: drop FRACTION (0..1) of the frames leaving PORT, chosen by a
    generator seeded from (N, PORT); counted as drop reason FAULT_INJECTION.
``--insecure-grpc-server``
    Serve P4Runtime to anyone who reaches it: TLS without ``--grpc-server-with-client-auth``,
    or plaintext on an address other than loopback or a unix socket. Refused without this
    flag (status 2); with it, logged as insecure. The default address is 127.0.0.1:9559
    (simple_switch_grpc's is 0.0.0.0:9559); ``--metrics-address`` defaults to 127.0.0.1.
``--datapath native|python``
    The data path (embedded_switch.native): ``native`` (default; C, batched I/O) or
    ``python`` (the reference). Without the built extension ``native`` warns once and
    runs ``python``.

The positional config path: the embedded target runs exactly one program
(p4src/v1model/checkmate.p4). A ``.json`` path (BMv2's compiled program) is
accepted for command-line compatibility: it must exist and parse as JSON, its
contents are not interpreted, and the committed P4Info is preloaded as with
``--p4info``. A ``.txt`` path is taken as a P4Info to preload. ``--no-p4``
starts without a pipeline; frames are dropped (and counted) until a
controller pushes one. One of the three is required, as with simple_switch_grpc.

Bad arguments exit with status 2 and a message naming the problem; a switch
that cannot start (no permission for raw sockets, gRPC address in use, a P4Info
of another program) exits with status 1. SIGTERM or SIGINT stops the switch
cleanly; port and drop statistics are logged on exit.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from checkmate.metrics import DEFAULT_BIND, MetricsServer, parse_metrics_port
from checkmate.p4.p4info import P4InfoError, load_p4info
from checkmate.p4.program import P4INFO_PATH
from checkmate.tls import DEFAULT_P4RUNTIME_ADDRESS, TlsConfigError, TlsFiles, check_files, exposure
from embedded_switch.metrics import switch_collector
from embedded_switch.native import DATAPATHS
from embedded_switch.ports import MAX_PORT, PortBinding, PortError, PortsConfig, SwitchPorts
from embedded_switch.program import ProgramMismatchError, build_state, check_program

logger = logging.getLogger(__name__)

LOG_LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "off": logging.CRITICAL + 10,
}


@dataclass
class SwitchConfig:
    """Everything the command line says, checked."""

    bindings: tuple[PortBinding, ...]
    p4info: Path | None
    device_id: int = 0
    grpc_address: str = DEFAULT_P4RUNTIME_ADDRESS
    cpu_port: int | None = None
    log_file: Path | None = None
    log_console: bool = False
    log_level: int = logging.INFO
    pcap_dir: Path | None = None
    drop_egress: dict[int, float] = field(default_factory=dict)
    drop_seed: int = 0
    profile_path: Path | None = None
    tls: TlsFiles | None = None
    """P4Runtime over TLS (--grpc-server-ssl and its files); None: plaintext."""
    client_auth: bool = False
    insecure: bool = False
    """--insecure-grpc-server: TLS without client certificates or plaintext off loopback allowed."""
    metrics_port: int | None = None
    """Prometheus endpoint (--metrics-port); None: none."""
    metrics_address: str = DEFAULT_BIND
    datapath: str = DATAPATHS[0]
    """``native`` or ``python`` (--datapath)."""


def _port_number(text: str, what: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: {text!r} is not a port number") from None
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"{what}: port {value} is out of range 0..{MAX_PORT}")
    return value


def _binding(text: str) -> PortBinding:
    port, sep, iface = text.partition("@")
    if not sep or not iface:
        raise argparse.ArgumentTypeError(f"-i {text!r}: expected PORT@IFACE, e.g. 1@veth1")
    return PortBinding(_port_number(port, f"-i {text}"), iface)


def _drop_spec(text: str) -> tuple[int, float]:
    port, sep, fraction = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--drop-egress {text!r}: expected PORT:FRACTION, e.g. 2:0.01")
    try:
        value = float(fraction)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--drop-egress {text!r}: {fraction!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"--drop-egress {text!r}: fraction must lie in [0, 1]")
    return _port_number(port, f"--drop-egress {text}"), value


def _port_or_zero(text: str) -> int:
    try:
        return int(parse_metrics_port(text, "--metrics-port") or 0)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="checkmate-switch",
        description="Checkmate's embedded P4 target (p4src/v1model/checkmate.p4) with a P4Runtime server; "
        "takes the options of simple_switch_grpc.",
    )
    parser.add_argument(
        "config", nargs="?", type=Path, help="BMv2 JSON (checked, not interpreted) or P4Info .txt"
    )
    parser.add_argument("--no-p4", action="store_true", help="start without a program; wait for a controller")
    parser.add_argument("--p4info", type=Path, help="preload the pipeline from this P4Info (text format)")
    parser.add_argument(
        "-i",
        "--interface",
        dest="interfaces",
        action="append",
        type=_binding,
        default=[],
        metavar="PORT@IFACE",
        help="bind switch port PORT to interface IFACE (repeatable)",
    )
    parser.add_argument("--device-id", type=int, default=0)
    parser.add_argument(
        "--grpc-server-addr",
        default=DEFAULT_P4RUNTIME_ADDRESS,
        help=f"P4Runtime address (host:port or unix:PATH; default {DEFAULT_P4RUNTIME_ADDRESS})",
    )
    parser.add_argument(
        "--cpu-port",
        type=lambda t: _port_number(t, "--cpu-port"),
        default=None,
        help="port number whose packets go to the controller as packet-in",
    )
    parser.add_argument("--log-file", type=Path, help="write the log to this file")
    parser.add_argument("--log-console", action="store_true", help="log to stderr (default)")
    parser.add_argument("--log-level", "-L", choices=sorted(LOG_LEVELS), default="info")
    parser.add_argument("--log-flush", action="store_true", help="accepted (logs always flush)")
    parser.add_argument(
        "--pcap",
        type=Path,
        nargs="?",
        const=Path("."),
        metavar="DIR",
        help="write <iface>_{in,out}.pcap (in DIR)",
    )
    parser.add_argument("--thrift-port", type=int, help="accepted and ignored (no Thrift runtime)")
    parser.add_argument(
        "--drop-egress",
        action="append",
        type=_drop_spec,
        default=[],
        metavar="PORT:FRACTION",
        help="fault injection: drop FRACTION of the frames leaving PORT (repeatable)",
    )
    parser.add_argument("--drop-seed", type=int, default=0, help="seed of the fault injection")
    parser.add_argument("--grpc-server-ssl", action="store_true", help="serve P4Runtime over TLS")
    parser.add_argument("--grpc-server-cacert", type=Path, help="CA that signs client certificates (PEM)")
    parser.add_argument("--grpc-server-cert", type=Path, help="this switch's certificate (PEM)")
    parser.add_argument("--grpc-server-key", type=Path, help="this switch's private key (PEM)")
    parser.add_argument(
        "--grpc-server-with-client-auth",
        action="store_true",
        help="accept only clients with a certificate signed by --grpc-server-cacert (mutual TLS)",
    )
    parser.add_argument(
        "--insecure-grpc-server",
        action="store_true",
        help="allow P4Runtime that anyone who reaches it can program: TLS without client "
        "certificates, or plaintext on an address other than loopback (logged as insecure)",
    )
    parser.add_argument(
        "--profile", type=Path, metavar="PATH", help="write a cProfile of the I/O thread at exit"
    )
    parser.add_argument(
        "--metrics-port",
        type=_port_or_zero,
        default=None,
        help="serve Prometheus metrics on this TCP port (docs/metrics.md); in use: refuse to start",
    )
    parser.add_argument(
        "--metrics-address", default=DEFAULT_BIND, help=f"address for --metrics-port (default {DEFAULT_BIND})"
    )
    parser.add_argument(
        "--datapath",
        choices=DATAPATHS,
        default=DATAPATHS[0],
        help="native (C, batched I/O; the default) or python (the reference data path)",
    )
    return parser


def parse_config(argv: Sequence[str]) -> SwitchConfig:
    """Parse and check the command line; exits with status 2 and a message on bad arguments."""
    parser = build_parser()
    args = parser.parse_args([a for a in argv if a != "--"])
    p4info: Path | None = args.p4info
    if args.config is not None:
        if args.no_p4:
            parser.error("give a config path or --no-p4, not both")
        if not args.config.is_file():
            parser.error(f"config {str(args.config)!r} does not exist")
        if args.config.suffix == ".json":
            try:
                json.loads(args.config.read_text())
            except (OSError, ValueError) as exc:
                parser.error(f"config {str(args.config)!r} is not JSON: {exc}")
            p4info = p4info or P4INFO_PATH
        else:
            if p4info is not None and p4info != args.config:
                parser.error("a P4Info config path and a different --p4info")
            p4info = args.config
    elif not args.no_p4 and p4info is None:
        parser.error("give a config path (BMv2 JSON or P4Info), --p4info PATH, or --no-p4")
    if p4info is not None and not p4info.is_file():
        parser.error(f"--p4info {str(p4info)!r} does not exist")
    bindings: list[PortBinding] = args.interfaces
    ports = [b.port for b in bindings]
    for items, what in (([str(p) for p in ports], "port"), ([b.iface for b in bindings], "interface")):
        dupes = sorted({x for x in items if items.count(x) > 1})
        if dupes:
            parser.error(f"-i: {what} {', '.join(dupes)} bound more than once")
    for b in bindings:
        try:
            socket.if_nametoindex(b.iface)
        except OSError:
            parser.error(f"-i {b.port}@{b.iface}: no interface named {b.iface!r}")
    if args.cpu_port is not None and args.cpu_port in ports:
        parser.error(f"--cpu-port {args.cpu_port} is also bound to an interface")
    drop_egress: dict[int, float] = {}
    for port, fraction in args.drop_egress:
        if port not in ports:
            parser.error(f"--drop-egress {port}:{fraction}: port {port} is not bound with -i")
        drop_egress[port] = fraction
    tls: TlsFiles | None = None
    if args.grpc_server_ssl:
        if args.grpc_server_cert is None or args.grpc_server_key is None:
            parser.error("--grpc-server-ssl needs --grpc-server-cert and --grpc-server-key")
        if args.grpc_server_with_client_auth and args.grpc_server_cacert is None:
            parser.error("--grpc-server-with-client-auth needs --grpc-server-cacert")
        tls = TlsFiles(
            args.grpc_server_cacert or args.grpc_server_cert, args.grpc_server_cert, args.grpc_server_key
        )
        try:
            check_files(tls)
        except TlsConfigError as exc:
            parser.error(str(exc))
    elif any((args.grpc_server_cacert, args.grpc_server_cert, args.grpc_server_key)):
        parser.error("--grpc-server-cacert/-cert/-key need --grpc-server-ssl")
    why = exposure(args.grpc_server_addr, tls is not None, args.grpc_server_with_client_auth)
    if why is not None and not args.insecure_grpc_server:
        parser.error(
            f"refusing to serve P4Runtime with {why}: add --grpc-server-with-client-auth (mutual TLS) "
            "or, to accept that, --insecure-grpc-server"
        )
    return SwitchConfig(
        tls=tls,
        client_auth=args.grpc_server_with_client_auth,
        insecure=args.insecure_grpc_server,
        bindings=tuple(bindings),
        p4info=p4info,
        device_id=args.device_id,
        grpc_address=args.grpc_server_addr,
        cpu_port=args.cpu_port,
        log_file=args.log_file,
        log_console=args.log_console,
        log_level=LOG_LEVELS[args.log_level],
        pcap_dir=args.pcap,
        drop_egress=drop_egress,
        drop_seed=args.drop_seed,
        profile_path=args.profile,
        metrics_port=args.metrics_port,
        metrics_address=args.metrics_address,
        datapath=args.datapath,
    )


def _configure_logging(config: SwitchConfig) -> None:
    handlers: list[logging.Handler] = []
    if config.log_file is not None:
        config.log_file.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(config.log_file))
    if config.log_console or config.log_file is None:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(
        level=config.log_level, handlers=handlers, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def run(config: SwitchConfig, stop: threading.Event) -> int:
    """Start ports and P4Runtime server, serve until ``stop`` is set, shut down."""
    from embedded_switch.p4runtime_server import P4RuntimeServer

    state = None
    info = None
    if config.p4info is not None:
        try:
            info = load_p4info(config.p4info)
        except P4InfoError as exc:
            raise ProgramMismatchError(str(exc)) from None
        check_program(info)
        state = build_state(info)
    ports = SwitchPorts(
        PortsConfig(
            bindings=config.bindings,
            cpu_port=config.cpu_port,
            pcap_dir=config.pcap_dir,
            drop_egress=config.drop_egress,
            drop_seed=config.drop_seed,
            profile_path=config.profile_path,
            datapath=config.datapath,
        ),
        state=state,
    )
    server = P4RuntimeServer(
        config.device_id,
        config.grpc_address,
        cpu_port=config.cpu_port,
        on_pipeline=ports.set_state,
        on_packet_out=ports.inject,
        tls=config.tls,
        client_auth=config.client_auth,
        insecure=config.insecure,
    )
    ports.on_packet_in = server.send_packet_in
    if info is not None:
        server.load_pipeline(info)
        if server.state is not None:
            ports.set_state(server.state)  # the pipeline must read what the server writes
    ports.start()
    metrics: MetricsServer | None = None
    try:
        bound = server.start()
        if config.metrics_port is not None:
            collector = switch_collector(
                config.device_id, ports, lambda: server.state, lambda: server.refusals
            )
            metrics = MetricsServer(collector, config.metrics_port, config.metrics_address)
    except Exception:
        server.stop(grace=0)
        ports.stop()
        raise
    for b in config.bindings:
        logger.info("port %d bound to %s", b.port, b.iface)
    logger.info(
        "device %d: P4Runtime on %s (port %s), cpu port %s, pipeline %s",
        config.device_id,
        config.grpc_address,
        bound,
        config.cpu_port,
        config.p4info or "none (waiting for a controller)",
    )
    if config.pcap_dir is not None:
        logger.info("pcap files: %s/<iface>_{in,out}.pcap", config.pcap_dir)
    if config.log_file is not None:
        logger.info("log file: %s", config.log_file)
    for port, fraction in sorted(config.drop_egress.items()):
        logger.info(
            "fault injection: dropping %.4g of frames leaving port %d (seed %d)",
            fraction,
            port,
            config.drop_seed,
        )
    try:
        while not stop.wait(1.0):
            pass
    finally:
        logger.info("shutting down")
        if metrics is not None:
            metrics.close()
        server.stop(grace=1.0)
        ports.stop()
        logger.info("final counts: %s", ports.describe())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(sys.argv[1:] if argv is None else argv)
    _configure_logging(config)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        logger.info("signal %s", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return run(config, stop)
    except (PortError, OSError, ProgramMismatchError) as exc:
        logger.error("cannot start: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
