"""Bringing a network description up in Mininet, and down again.

:class:`NetworkRunner` follows a checked :class:`~topologies.preflight.Plan`:

1. record every interface it will create (so a crash at any later point can
   be cleaned up from the record);
2. create the hosts (one network and mount namespace each, interface
   ``eth0``), the switches (root namespace, port interfaces named after the
   link ends, ``s1-p1``) and the links, with Mininet;
3. configure hosts as P4 hosts (:mod:`topologies.hosts`) and the switch ends
   of the links;
4. start the switch processes and wait until each P4Runtime port accepts;
5. run the controller: ``checkmate-ctl pipeline push`` (which also reinstalls
   every job already in the registry) and ``checkmate-ctl forwarding install``;
6. run the hosts' ``commands`` from the description.

Every step has a timeout. Any failure raises :class:`BringUpError`; the
caller then calls :meth:`NetworkRunner.stop`, which takes down whatever part
was created.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkmate.network import LinkOptions
from checkmate.p4.program import Target
from topologies.hosts import HOST_INTERFACE, HostConfig, HostConfigError, configure_host, in_namespaces
from topologies.mininet_import import import_mininet
from topologies.preflight import Plan
from topologies.runstate import RUN_ENV, HostRecord, RunState, SwitchRecord, netns_inode, process_start_time
from topologies.switches import P4Switch, SwitchStartError, log_tail

import_mininet()
from mininet.link import Link, TCLink  # noqa: E402  (needs import_mininet first)
from mininet.log import setLogLevel  # noqa: E402
from mininet.net import Mininet  # noqa: E402
from mininet.node import Host  # noqa: E402

logger = logging.getLogger(__name__)

CONTROLLER_TIMEOUT_S = 60.0
HOST_COMMAND_TIMEOUT_S = 30.0


class BringUpError(RuntimeError):
    """A step of the bring-up failed; the message names the step and the cause."""


@dataclass(frozen=True)
class Timeouts:
    switch_ready_s: float = 30.0
    controller_s: float = CONTROLLER_TIMEOUT_S
    host_command_s: float = HOST_COMMAND_TIMEOUT_S


def link_options(options: LinkOptions) -> dict[str, Any]:
    """Mininet TCLink parameters for a link's options (a zero delay or loss asks for nothing)."""
    params: dict[str, Any] = {}
    if options.bw is not None:
        params["bw"] = options.bw
    if options.delay is not None and float(options.delay.rstrip("usm") or 0) > 0:
        params["delay"] = options.delay
    if options.loss:
        params["loss"] = options.loss
    if options.max_queue_size is not None:
        params["max_queue_size"] = options.max_queue_size
    return params


class NetworkRunner:
    """Holds one Mininet network built from a plan; records what it creates in ``state``."""

    def __init__(
        self,
        plan: Plan,
        state: RunState,
        controller_state_dir: Path | None = None,
        timeouts: Timeouts | None = None,
        on_change: Callable[[RunState], None] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        """``environ``: the environment the switches and host commands run in, the entry point's
        (``python -m topologies.supervisor`` passes its own, marked with the run directory)."""
        if environ is None:
            raise ValueError(
                "NetworkRunner needs environ: the environment its switches and host commands run in"
            )
        self.plan = plan
        self.state = state
        self.controller_state_dir = controller_state_dir
        self.timeouts = timeouts or Timeouts()
        self._save = on_change or (lambda state: state.save())
        self.net: Any = None
        self.switches: dict[str, P4Switch] = {}
        self.env = {**environ, RUN_ENV: str(plan.run_dir), **plan.controller_env()}

    # ---- bring-up -----------------------------------------------------------------
    def start(self) -> None:
        plan = self.plan
        plan.log_dir.mkdir(parents=True, exist_ok=True)
        self.state.interfaces = list(plan.interfaces)
        self.state.pcap_dir = str(plan.pcap_dir or "")
        self._save(self.state)
        self._build()
        self._configure()
        self._start_switches()
        self._program()
        self._run_host_commands()

    def _build(self) -> None:
        network = self.plan.network
        setLogLevel("warning")
        logging.getLogger("mininet").propagate = False  # it has its own handler (stdout: supervisor.log)
        Mininet.inited = True  # skip Mininet's fixLimits(): it raises global sysctls we would not undo
        shaped = any(link_options(link.options) for link in network.links)
        self.net = Mininet(
            topo=None,
            build=False,
            controller=None,
            link=TCLink if shaped else Link,
            autoSetMacs=False,
            autoStaticArp=False,
            waitConnected=False,
        )
        for name, host in network.hosts.items():
            node = self.net.addHost(name, cls=Host, ip=str(host.ip), mac=host.mac)
            inode = netns_inode(node.pid)
            if inode is None:
                raise BringUpError(f"host {name}: its shell (pid {node.pid}) died at once")
            self.state.hosts[name] = HostRecord(
                pid=node.pid,
                netns=inode,
                interface=HOST_INTERFACE,
                ip=str(host.ip),
                mac=host.mac,
                role=host.role,
            )
            self._save(self.state)
        for name, config in self.plan.switches.items():
            self.switches[name] = self.net.addSwitch(
                name,
                cls=P4Switch,
                config=config,
                binary=self.plan.switch_binary,
                target=self.plan.target,
                env=self.env,
            )
        for link in network.links:
            ends = []
            for end in (link.a, link.b):
                if end.port is None:
                    ends.append((end.node, 0, HOST_INTERFACE))
                else:
                    ends.append((end.node, end.port, f"{end.node}-p{end.port}"))
            (n1, p1, i1), (n2, p2, i2) = ends
            options = link_options(link.options)
            self.net.addLink(n1, n2, port1=p1, port2=p2, intfName1=i1, intfName2=i2, **options)
        self.net.build()
        logger.info(
            "built %d hosts, %d switches, %d links",
            len(network.hosts),
            len(self.switches),
            len(network.links),
        )

    def _configure(self) -> None:
        for name in self.plan.network.hosts:
            try:
                configure_host(self.state.hosts[name].pid, HostConfig.from_network(self.plan.network, name))
            except HostConfigError as exc:
                raise BringUpError(f"configuring host {name}: {exc}") from None
        for name, switch in self.switches.items():
            try:
                switch.configure_interfaces()
            except HostConfigError as exc:
                raise BringUpError(f"configuring the ports of switch {name}: {exc}") from None

    def _start_switches(self) -> None:
        for name, switch in self.switches.items():
            process = switch.start_process()
            start_time = process_start_time(process.pid)
            config = switch.config
            self.state.switches[name] = SwitchRecord(
                pid=process.pid,
                start_time=start_time or 0,
                grpc=config.grpc_address,
                device_id=config.device_id,
                log_file=str(config.log_file),
                command=switch.command,
            )
            self._save(self.state)
        for switch in self.switches.values():
            try:
                switch.wait_ready(self.timeouts.switch_ready_s)
            except SwitchStartError as exc:
                raise BringUpError(str(exc)) from None

    def controller_command(self, *args: str) -> list[str]:
        argv = [self.plan.controller_binary, "--network", str(self.plan.network_file)]
        if self.controller_state_dir is not None:
            argv += ["--state-dir", str(self.controller_state_dir)]
        return [*argv, *args]

    def _program(self) -> None:
        push = ["pipeline", "push", "--p4info", str(self.plan.p4info)]
        if self.plan.target is Target.BMV2 and self.plan.bmv2_json is not None:
            push += ["--bmv2-json", str(self.plan.bmv2_json)]
        for args in (push, ["forwarding", "install"]):
            argv = self.controller_command(*args)
            logger.info("controller: %s", " ".join(argv))
            try:
                result = subprocess.run(
                    argv,
                    capture_output=True,
                    text=True,
                    timeout=self.timeouts.controller_s,
                    env=self.env,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                raise BringUpError(
                    f"`{' '.join(args)}` did not finish within {self.timeouts.controller_s:.0f} s"
                ) from None
            for line in (result.stdout + result.stderr).splitlines():
                logger.info("controller: %s", line)
            if result.returncode != 0:
                output = (result.stderr or result.stdout).strip()
                raise BringUpError(f"controller `checkmate-ctl {' '.join(args)}` failed: {output}")

    def _run_host_commands(self) -> None:
        for name, host in self.plan.network.hosts.items():
            for command in host.commands:
                argv = in_namespaces(self.state.hosts[name].pid, ["sh", "-c", command])
                try:
                    result = subprocess.run(
                        argv,
                        capture_output=True,
                        text=True,
                        timeout=self.timeouts.host_command_s,
                        env=self.env,
                        check=False,
                    )
                except subprocess.TimeoutExpired:
                    raise BringUpError(f"host {name}: command {command!r} did not finish in time") from None
                if result.returncode != 0:
                    raise BringUpError(f"host {name}: command {command!r} failed: {result.stderr.strip()}")

    # ---- watching and taking down ------------------------------------------------
    def dead_switches(self) -> dict[str, str]:
        """Switches whose process has exited: name -> the end of its log."""
        dead = {}
        for name, switch in self.switches.items():
            if switch.process is not None and switch.process.poll() is not None:
                dead[name] = f"exited with {switch.process.returncode}: {log_tail(switch.config.log_file, 5)}"
        return dead

    def restart_switch(self, name: str) -> None:
        """Start a switch whose process died again, on the same ports, and program it like at bring-up.

        The new process starts empty: the pipeline is pushed again, and the push
        reconciles the controller's registry, so routes and every registered job's
        replication come back (``pipeline push`` goes to every switch of the network;
        the others are wiped and reconciled too). BringUpError if it does not come back.
        """
        switch = self.switches[name]
        if switch.process is not None and switch.process.poll() is None:
            return
        process = switch.start_process()
        record = self.state.switches[name]
        record.pid = process.pid
        record.start_time = process_start_time(process.pid) or 0
        self._save(self.state)
        try:
            switch.wait_ready(self.timeouts.switch_ready_s)
        except SwitchStartError as exc:
            raise BringUpError(str(exc)) from None
        self._program()

    def stop(self) -> None:
        """Take down whatever was created: switch processes first, then Mininet's links and nodes."""
        for name, switch in self.switches.items():
            try:
                switch.stop_process()
            except (OSError, subprocess.SubprocessError) as exc:
                logger.warning("stopping switch %s: %s", name, exc)
        if self.net is not None:
            self.net.stop()
        logger.info("network stopped")
