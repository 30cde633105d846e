"""Everything ``checkmate-net up`` checks before it creates anything.

The checks run in an order that lets the cheap, user-facing ones speak first:
the description (unknown fields, duplicate addresses, dangling links: all in
:mod:`checkmate.network`), link options this kernel cannot honour, the switch
binary and pipeline files of the chosen target, the tools, then the machine
(root, Mininet, interfaces and TCP ports not taken, the run directory free).
Each failure raises :class:`PreflightError` with one clear sentence. The
result is a :class:`Plan`: the network, the switch command lines and the
name of every interface the bring-up will create.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shlex
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from checkmate.address import AddressError, parse_host_port
from checkmate.network import Network, NetworkError
from checkmate.p4.program import Target
from checkmate.tls import PkiFiles, TlsConfigError, pki_in, server_args
from topologies.mininet_import import MininetMissing, import_mininet
from topologies.runstate import RunState, RunStateError, is_same_process
from topologies.targets import SwitchProcessConfig, TargetError, find_binary, find_tool, pipeline_files

logger = logging.getLogger(__name__)

IFNAMSIZ = 15
"""Longest Linux interface name."""
REQUIRED_TOOLS = ("ip", "ethtool", "nsenter", "sysctl", "mnexec", "ifconfig")
CONTROLLER_TOOL = "checkmate-ctl"
BMV2_THRIFT_BASE = 9090
"""Thrift port of the first switch when the description names none (as in p4lang/tutorials)."""


class PreflightError(RuntimeError):
    """The network cannot be brought up; nothing has been created."""


def switch_interface(switch: str, port: int) -> str:
    """The root-namespace interface of a switch port: the link end's own name, ``s1-p1``."""
    return f"{switch}-p{port}"


@dataclass(frozen=True)
class Plan:
    """A checked bring-up: what will run and what will be created."""

    network: Network
    network_file: Path
    target: Target
    switch_binary: str
    controller_binary: str
    p4info: Path
    bmv2_json: Path | None
    run_dir: Path
    pcap: bool
    switches: dict[str, SwitchProcessConfig] = field(default_factory=dict)
    interfaces: tuple[str, ...] = ()
    tls: PkiFiles | None = None
    """P4Runtime over mutual TLS (``checkmate-net up --tls``/``--tls-dir``): every switch serves
    with ``tls.switch`` and requires a client certificate; the controller uses ``tls.controller``.
    None: plaintext on the switches' loopback gRPC addresses."""

    def controller_env(self) -> dict[str, str]:
        """What ``checkmate-ctl`` needs in its environment to reach these switches."""
        if self.tls is None:
            return {}
        return {
            "CHECKMATE_P4RT_CA": str(self.tls.ca),
            "CHECKMATE_P4RT_CERT": str(self.tls.client_cert),
            "CHECKMATE_P4RT_KEY": str(self.tls.client_key),
        }

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def pcap_dir(self) -> Path | None:
        return self.run_dir / "pcap" if self.pcap else None

    @property
    def controller_state_dir(self) -> Path:
        return self.run_dir / "controller"


_SWITCH_PREFIX = re.compile(r"^([A-Za-z][A-Za-z0-9_]*)=(.*)$", re.DOTALL)


def parse_switch_args(values: Sequence[str], switches: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """``--switch-args`` values -> extra command-line arguments per switch.

    Each value is ``ARGS`` (for every switch) or ``SWITCH=ARGS`` (for that one);
    ``ARGS`` is split like a shell would (``"--drop-egress 1:0.01 --drop-seed 7"``).
    Values for the same switch add up, in order. An unknown switch name or an
    unbalanced quote raises :class:`PreflightError`.
    """
    extra: dict[str, list[str]] = {name: [] for name in switches}
    for value in values:
        match = _SWITCH_PREFIX.match(value)
        names = [match.group(1)] if match else list(switches)
        text = match.group(2) if match else value
        if match and match.group(1) not in extra:
            raise PreflightError(
                f"--switch-args {value!r}: no switch {match.group(1)!r}; switches: {sorted(switches)}"
            )
        try:
            words = shlex.split(text)
        except ValueError as exc:
            raise PreflightError(f"--switch-args {value!r}: {exc}") from None
        for name in names:
            extra[name] += words
    return {name: tuple(words) for name, words in extra.items()}


def load_network(path: str | Path) -> Network:
    try:
        return Network.load(path)
    except NetworkError as exc:
        raise PreflightError(str(exc)) from None


def _netem_available() -> bool:
    if Path("/sys/module/sch_netem").exists():
        return True
    release = os.uname().release
    for listing in ("modules.builtin", "modules.dep"):
        try:
            if "sch_netem" in (Path("/lib/modules") / release / listing).read_text():
                return True
        except OSError:
            continue
    return False


def check_description(network: Network) -> None:
    """What a valid description may still ask for that this emulation cannot give."""
    for link in network.links:
        options = link.options
        wants_delay = options.delay is not None and float(options.delay.rstrip("usm") or 0) > 0
        wants_loss = options.loss is not None and options.loss > 0
        wants_queue = options.max_queue_size is not None  # Mininet sets queue limits with netem too
        if (wants_delay or wants_loss or wants_queue) and not _netem_available():
            raise PreflightError(
                f"link [{link.a}, {link.b}] asks for delay, loss or max_queue_size, which need the netem "
                f"qdisc; this kernel has none. Inject loss in the switch instead "
                f"(checkmate-switch --drop-egress)"
            )
    for name in network.switches:
        for port in network.ports(name):
            interface = switch_interface(name, port)
            if len(interface) > IFNAMSIZ:
                raise PreflightError(f"interface name {interface!r} is longer than {IFNAMSIZ} characters")


def make_plan(
    network_file: str | Path,
    target: Target,
    run_dir: str | Path,
    pcap: bool = False,
    switch_args: Sequence[str] | Mapping[str, Sequence[str]] = (),
    tls_dir: str | Path | None = None,
) -> Plan:
    """Check the description, target and tools (no root needed) and return the plan.

    ``switch_args``: ``--switch-args`` values (see :func:`parse_switch_args`), or
    already split arguments per switch name. ``tls_dir``: a PKI in
    :func:`checkmate.tls.make_test_pki`'s layout (checked here): P4Runtime over mutual TLS.
    """
    network_file = Path(network_file).resolve()
    network = load_network(network_file)
    check_description(network)
    if isinstance(switch_args, Mapping):
        unknown = sorted(set(switch_args) - set(network.switches))
        if unknown:
            raise PreflightError(f"switch arguments for unknown switch(es) {unknown}")
        extra = {name: tuple(switch_args.get(name, ())) for name in network.switches}
    else:
        extra = parse_switch_args(switch_args, list(network.switches))
    try:
        binary = find_binary(target)
        p4info, bmv2_json = pipeline_files(target)
    except TargetError as exc:
        raise PreflightError(str(exc)) from None
    controller = find_tool(CONTROLLER_TOOL)
    if controller is None:
        raise PreflightError(f"{CONTROLLER_TOOL} is not installed: run `make setup`")
    tls: PkiFiles | None = None
    if tls_dir is not None:
        try:
            tls = pki_in(Path(tls_dir).resolve())
        except TlsConfigError as exc:
            raise PreflightError(f"--tls-dir {tls_dir}: {exc}") from None
    run_dir = Path(run_dir).resolve()
    pcap_dir = run_dir / "pcap" if pcap else None
    switches: dict[str, SwitchProcessConfig] = {}
    interfaces: list[str] = []
    for index, (name, switch) in enumerate(network.switches.items()):
        ports = {port: switch_interface(name, port) for port in network.ports(name)}
        interfaces += ports.values()
        switches[name] = SwitchProcessConfig(
            name=name,
            device_id=switch.device_id,
            grpc_address=switch.grpc,
            ports=ports,
            cpu_port=switch.cpu_port,
            thrift_port=switch.thrift_port if switch.thrift_port is not None else BMV2_THRIFT_BASE + index,
            log_file=run_dir / "logs" / f"{name}.log",
            pcap_dir=pcap_dir,
            extra_args=extra[name],
            grpc_args=tuple(server_args(tls.switch, client_auth=True)) if tls is not None else (),
        )
    return Plan(
        network=network,
        network_file=network_file,
        target=target,
        switch_binary=binary,
        controller_binary=controller,
        p4info=p4info,
        bmv2_json=bmv2_json,
        run_dir=run_dir,
        pcap=pcap,
        switches=switches,
        interfaces=tuple(interfaces),
        tls=tls,
    )


def _check_tcp_free(address: str, owner: str, what: str) -> None:
    try:
        host, port = parse_host_port(address, default_host="0.0.0.0")
    except AddressError as exc:
        raise PreflightError(f"{owner}'s {what} address: {exc}") from None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PreflightError(f"{owner}'s {what} address {address}: {exc.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PreflightError(
                    f"{owner}'s {what} address {address} is already in use (another network up? "
                    f"`checkmate-net status` / `checkmate-net down`)"
                ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise PreflightError(
                    f"{owner}'s {what} address {address} is not an address of this machine; "
                    f"the switches run here"
                ) from None
            raise PreflightError(f"{owner}'s {what} address {address}: {exc.strerror}") from None


def check_machine(plan: Plan) -> None:
    """Root, tools, Mininet, nothing in the way. Raises PreflightError; creates nothing."""
    missing = [tool for tool in REQUIRED_TOOLS if find_tool(tool) is None]
    if missing:
        raise PreflightError(f"missing tools {missing}: run `make setup` (as root)")
    if os.geteuid() != 0:
        raise PreflightError("checkmate-net up needs root (network namespaces, veth pairs, AF_PACKET)")
    try:
        import_mininet()
    except MininetMissing as exc:
        raise PreflightError(str(exc)) from None
    try:
        state = RunState.load(plan.run_dir)
    except RunStateError:
        state = None
    if state is not None and is_same_process(state.supervisor_pid, state.supervisor_start_time):
        raise PreflightError(
            f"a network ({state.network_file}) is already up in {plan.run_dir}: "
            f"`checkmate-net down --run-dir {plan.run_dir}` first, or use another --run-dir"
        )
    taken = [name for name in plan.interfaces if Path("/sys/class/net", name).exists()]
    if taken:
        raise PreflightError(
            f"interface(s) {taken} already exist in this namespace (a network left over from another run "
            f"directory? `checkmate-net down --run-dir DIR`)"
        )
    for name, switch in plan.network.switches.items():
        _check_tcp_free(switch.grpc, f"switch {name}", "P4Runtime")
    if plan.target is Target.BMV2:
        for name, config in plan.switches.items():
            if config.thrift_port is not None:
                _check_tcp_free(f"0.0.0.0:{config.thrift_port}", f"switch {name}", "Thrift")
