"""``checkmate-net``: bring a Checkmate network up in Mininet, use it, take it down.

    checkmate-net up topologies/single.json [--target embedded|bmv2] [--run-dir DIR] [--pcap]
                     [--switch-args [SWITCH=]ARGS]...
    checkmate-net exec h1 -- ping -c1 10.0.1.2
    checkmate-net status
    checkmate-net down

``up`` checks everything first (a bad description, a missing switch binary or
a busy port: one clear error, nothing created), starts a supervisor process
that holds the network, waits until the switches are programmed, prints where
logs and pcaps are, and returns. ``down`` stops the supervisor and removes
whatever is left (interfaces, namespaces, processes), also after a crash.
A failed ``up`` takes down the part it created before it exits non-zero.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from checkmate.address import parse_host_port
from checkmate.network import Network
from checkmate.p4.program import Target
from checkmate.tls import make_test_pki
from topologies.cleanup import CleanupReport, cleanup
from topologies.preflight import Plan, PreflightError, check_machine, load_network, make_plan
from topologies.runstate import (
    DEFAULT_RUN_DIR,
    FAILED,
    RUN_ENV,
    STOPPED,
    UP,
    RunState,
    RunStateError,
    is_same_process,
)

logger = logging.getLogger(__name__)

PROG = "checkmate-net"
UP_TIMEOUT_S = 120.0
SUPERVISOR_LOG = "supervisor.log"


def default_run_dir() -> Path:
    return Path(os.environ.get("CHECKMATE_NET_DIR") or DEFAULT_RUN_DIR)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Bring a Checkmate network up in Mininet (BMv2 or the embedded target)."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def run_dir_option(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--run-dir",
            type=Path,
            default=None,
            help=f"the network's state, logs and pcaps (default $CHECKMATE_NET_DIR or {DEFAULT_RUN_DIR})",
        )

    up = commands.add_parser("up", help="bring a network description up", description="Bring a network up.")
    up.add_argument("network", type=Path, help="network description, e.g. topologies/single.json")
    up.add_argument(
        "--target",
        choices=[t.value for t in Target],
        default=Target.EMBEDDED.value,
        help="switch target (default embedded: checkmate-switch; bmv2: simple_switch_grpc)",
    )
    up.add_argument("--pcap", action="store_true", help="have the switches write per-port pcaps")
    up.add_argument(
        "--switch-args",
        action="append",
        default=[],
        metavar="[SWITCH=]ARGS",
        help="extra options for every switch's command line (or SWITCH's only), split like a shell "
        "would; repeatable. E.g. --switch-args 's1=--drop-egress 1:0.01 --drop-seed 7' "
        "(checkmate-switch's seeded egress loss). One word starting with - needs the = form: "
        "--switch-args=--drop-seed=7",
    )
    up.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="controller registry directory (default: checkmate-ctl's own default)",
    )
    up.add_argument(
        "--timeout",
        type=float,
        default=UP_TIMEOUT_S,
        help=f"seconds the whole bring-up may take (default {UP_TIMEOUT_S:g})",
    )
    tls = up.add_mutually_exclusive_group()
    tls.add_argument(
        "--tls",
        action="store_true",
        help="P4Runtime over mutual TLS with a test PKI written to RUN_DIR/tls (a CA, a certificate "
        "naming the switches' gRPC hosts, a controller client certificate; 30 days)",
    )
    tls.add_argument(
        "--tls-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="P4Runtime over mutual TLS with your PKI: DIR holds ca.pem, switch.pem, switch.key, "
        "controller.pem and controller.key",
    )
    run_dir_option(up)

    down = commands.add_parser(
        "down",
        help="take the network down and remove leftovers",
        description="Stop the network and remove what it left behind.",
    )
    run_dir_option(down)

    status = commands.add_parser("status", help="show the network", description="Show the network.")
    run_dir_option(status)

    run = commands.add_parser(
        "exec",
        help="run a command inside a host",
        description="Run a command in a host's namespaces: exec HOST -- CMD...",
    )
    run.add_argument("host")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="the command (after --)")
    run_dir_option(run)
    return parser


def _print_report(report: CleanupReport) -> None:
    if report.killed:
        print(f"  killed: {', '.join(report.killed)}")
    if report.deleted_interfaces:
        print(f"  deleted interfaces: {', '.join(report.deleted_interfaces)}")
    for leftover in report.leftovers:
        print(f"  LEFT BEHIND: {leftover}")


def _spawn_supervisor(plan: Plan, state_dir: Path | None) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "topologies.supervisor",
        str(plan.network_file),
        "--run-dir",
        str(plan.run_dir),
        "--target",
        plan.target.value,
    ]
    if plan.pcap:
        argv.append("--pcap")
    argv += [
        f"--switch-args={name}={shlex.join(config.extra_args)}"
        for name, config in plan.switches.items()
        if config.extra_args
    ]
    if state_dir is not None:
        argv += ["--state-dir", str(state_dir.resolve())]
    if plan.tls is not None:
        argv += ["--tls-dir", str(plan.tls.ca.parent)]
    log = plan.run_dir / SUPERVISOR_LOG
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, RUN_ENV: str(plan.run_dir)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH", "")]))
    with open(log, "wb") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )


def _wait_up(supervisor: subprocess.Popen[bytes], run_dir: Path, timeout: float) -> RunState:
    """The supervisor's state once it reports ``up``; RuntimeError when it fails, exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = RunState.load(run_dir)
        except RunStateError:
            state = None
        if state is not None and state.supervisor_pid == supervisor.pid:
            if state.status == UP:
                return state
            if state.status in (FAILED, STOPPED):
                raise RuntimeError(state.error or f"the bring-up stopped ({state.status})")
        code = supervisor.poll()
        if code is not None:
            raise RuntimeError(
                f"the supervisor exited with status {code}; see {run_dir / SUPERVISOR_LOG}:\n"
                + _tail(run_dir / SUPERVISOR_LOG)
            )
        time.sleep(0.1)
    raise RuntimeError(f"the network was not up within {timeout:.0f} s; see {run_dir / SUPERVISOR_LOG}")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _write_test_pki(directory: Path, network: Network) -> Path:
    """A fresh test PKI whose switch certificate names every switch's gRPC host."""
    hosts = sorted({parse_host_port(switch.grpc)[0] for switch in network.switches.values()})
    make_test_pki(directory, hosts=hosts)
    return directory


def cmd_up(args: argparse.Namespace) -> int:
    run_dir = (args.run_dir or default_run_dir()).resolve()
    tls_dir = args.tls_dir
    if args.tls:
        # checked first without TLS (a bad description fails before anything is written)
        make_plan(args.network, Target(args.target), run_dir, pcap=args.pcap, switch_args=args.switch_args)
        tls_dir = _write_test_pki(run_dir / "tls", load_network(args.network))
    plan = make_plan(
        args.network,
        Target(args.target),
        run_dir,
        pcap=args.pcap,
        switch_args=args.switch_args,
        tls_dir=tls_dir,
    )
    try:
        old = RunState.load(run_dir)
    except RunStateError:
        old = None
    if old is not None and not is_same_process(old.supervisor_pid, old.supervisor_start_time):
        print(f"{PROG}: cleaning up after an earlier network in {run_dir} whose supervisor is gone")
        _print_report(cleanup(run_dir))
    check_machine(plan)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    supervisor = _spawn_supervisor(plan, args.state_dir)
    try:
        state = _wait_up(supervisor, run_dir, args.timeout)
    except (RuntimeError, KeyboardInterrupt) as exc:
        message = "interrupted" if isinstance(exc, KeyboardInterrupt) else str(exc)
        print(f"{PROG}: error: bring-up failed: {message}", file=sys.stderr)
        print(f"{PROG}: taking down what was created", file=sys.stderr)
        report = cleanup(run_dir)
        supervisor.poll()
        _print_report(report)
        print(f"  supervisor log: {run_dir / SUPERVISOR_LOG}", file=sys.stderr)
        return 1
    _print_up(plan, state, time.monotonic() - started, args.state_dir)
    return 0


def _print_up(plan: Plan, state: RunState, seconds: float, state_dir: Path | None) -> None:
    network = plan.network
    print(f"{PROG}: {plan.network_file.name} is up on the {plan.target.value} target ({seconds:.1f} s)")
    for name, host in network.hosts.items():
        switch, port = network.attachment(name)
        print(f"  host   {name:<6} {host.role:<7} {str(host.ip):<16} {host.mac}  eth0 <-> {switch}-p{port}")
    for name, record in state.switches.items():
        print(f"  switch {name:<6} P4Runtime {record.grpc} device {record.device_id}  log {record.log_file}")
    print(f"  supervisor log: {plan.run_dir / SUPERVISOR_LOG}")
    print(f"  pcaps: {plan.pcap_dir}" if plan.pcap_dir else "  pcaps: off (up --pcap to record them)")
    if plan.tls is not None:
        print(f"  P4Runtime: mutual TLS, PKI in {plan.tls.ca.parent}; checkmate-ctl needs:")
        for name, value in plan.controller_env().items():
            print(f"    export {name}={value}")
    else:
        print("  P4Runtime: plaintext (up --tls for mutual TLS)")
    ctl = f"checkmate-ctl --network {_shown(plan.network_file)}"
    if state_dir is not None:
        ctl += f" --state-dir {state_dir}"
    workers = ",".join(network.hosts_with_role("worker"))
    shadows = ",".join(network.hosts_with_role("shadow"))
    run_dir = "" if plan.run_dir == default_run_dir().resolve() else f" --run-dir {plan.run_dir}"
    print("next:")
    if workers and shadows:
        print(f"  {ctl} job add --job-id 1 --workers {workers} --shadows {shadows}")
        print(f"  {ctl} job show 1")
    print(f"  {PROG} exec{run_dir} HOST -- COMMAND...")
    print(f"  {PROG} down{run_dir}")


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def cmd_down(args: argparse.Namespace) -> int:
    run_dir = (args.run_dir or default_run_dir()).resolve()
    report = cleanup(run_dir)
    if not report.found_state and not report.killed:
        print(f"{PROG}: no network recorded in {run_dir}; nothing to do")
        return 0
    print(f"{PROG}: network in {run_dir} is down" + ("" if report.clean else ", with leftovers"))
    _print_report(report)
    return 0 if report.clean else 1


def cmd_status(args: argparse.Namespace) -> int:
    run_dir = (args.run_dir or default_run_dir()).resolve()
    state = RunState.load(run_dir)
    alive = is_same_process(state.supervisor_pid, state.supervisor_start_time)
    status = state.status if alive else f"{state.status}, supervisor gone (run `{PROG} down`)"
    print(f"network {state.network_file} on {state.target}: {status}")
    if state.error:
        print(f"  error: {state.error}")
    for name, host in state.hosts.items():
        print(f"  host   {name:<6} {host.role:<7} {host.ip:<16} pid {host.pid}")
    for name, switch in state.switches.items():
        running = "running" if is_same_process(switch.pid, switch.start_time) else "NOT RUNNING"
        print(f"  switch {name:<6} {switch.grpc:<18} pid {switch.pid} {running}  log {switch.log_file}")
    return 0 if alive and state.status == UP else 1


def cmd_exec(args: argparse.Namespace) -> int:
    run_dir = (args.run_dir or default_run_dir()).resolve()
    state = RunState.load(run_dir)
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        print(f"{PROG}: exec: give a command after the host: exec {args.host} -- CMD...", file=sys.stderr)
        return 2
    host = state.hosts.get(args.host)
    if host is None:
        print(f"{PROG}: exec: no host {args.host!r}; hosts: {sorted(state.hosts)}", file=sys.stderr)
        return 2
    from topologies.runstate import netns_inode

    if state.status != UP or netns_inode(host.pid) != host.netns:
        print(f"{PROG}: exec: host {args.host} is not running (network {state.status})", file=sys.stderr)
        return 1
    argv = ["nsenter", f"--target={host.pid}", "--net", "--mount", f"--wd={os.getcwd()}", "--", *command]
    os.execvpe(argv[0], argv, {**os.environ, RUN_ENV: state.run_dir})


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    handlers = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "exec": cmd_exec}
    try:
        return handlers[args.command](args)
    except (PreflightError, RunStateError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
