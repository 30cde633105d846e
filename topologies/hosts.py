"""P4 host configuration: what a host in front of a P4 switch needs.

A host on a Checkmate network talks through a software switch that reads and
re-sends raw frames, and through switches that route without ARP. So every
host gets, inside its own namespaces:

* TX checksum offload off (or frames re-sent through AF_PACKET carry bad
  UDP/TCP checksums), TSO and GSO off (the switch sees real frames, not 64 KB
  super-packets);
* MTU 9000 (Checkmate datagrams fill one jumbo frame);
* IPv6 off (no router solicitations or MLD reports in the switch's counters);
* for every other host a static ARP entry with the MAC of the switch port the
  host is linked to (that port routes, :meth:`checkmate.network.Network.arp_entries`),
  plus an on-link /32 route when the other host lies outside this host's
  subnet. No gateway address is needed and no ARP request ever leaves a host.

The switch ends of links get MTU 9000, offloads off and IPv6 off as well.
Every command runs with a timeout; none goes through Mininet's shell.
"""

from __future__ import annotations

import ipaddress
import logging
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from checkmate.network import Network

logger = logging.getLogger(__name__)

HOST_INTERFACE = "eth0"
"""Every host's one interface has this name (inside its own namespace)."""
JUMBO_MTU = 9000
COMMAND_TIMEOUT_S = 10.0
OFFLOADS_OFF = ("tx", "off", "tso", "off", "gso", "off")


class HostConfigError(RuntimeError):
    """A host or interface could not be configured; the message has the command and its output."""


@dataclass(frozen=True)
class HostConfig:
    """The P4-host settings of one host."""

    name: str
    address: ipaddress.IPv4Interface
    interface: str = HOST_INTERFACE
    mtu: int = JUMBO_MTU
    neighbours: dict[str, str] = field(default_factory=dict)
    """IPv4 address -> MAC of every other host (static ARP entries)."""

    @classmethod
    def from_network(cls, network: Network, host: str) -> HostConfig:
        return cls(name=host, address=network.host(host).ip, neighbours=network.arp_entries(host))

    def ip_batch(self) -> str:
        """``ip -batch`` input: on-link routes for off-subnet hosts, then static neighbours."""
        lines = []
        for address, mac in sorted(self.neighbours.items(), key=lambda item: ipaddress.IPv4Address(item[0])):
            if ipaddress.IPv4Address(address) not in self.address.network:
                lines.append(f"route replace {address}/32 dev {self.interface} scope link")
            lines.append(f"neigh replace {address} lladdr {mac} dev {self.interface} nud permanent")
        return "\n".join(lines) + "\n"

    def commands(self) -> list[tuple[list[str], str | None]]:
        """(argv, stdin) to run inside the host's namespaces, in order."""
        sysctls = [
            f"net.ipv6.conf.{name}.disable_ipv6=1" for name in ("all", "default", "lo", self.interface)
        ]
        return [
            (["ip", "link", "set", "dev", self.interface, "mtu", str(self.mtu)], None),
            (["ethtool", "-K", self.interface, *OFFLOADS_OFF], None),
            (["sysctl", "-q", "-w", *sysctls], None),
            (["ip", "-batch", "-"], self.ip_batch()),
        ]


def in_namespaces(pid: int, argv: list[str]) -> list[str]:
    """``argv`` run inside the network and mount namespaces of process ``pid``."""
    return ["nsenter", f"--target={pid}", "--net", "--mount", "--", *argv]


def run_checked(argv: list[str], stdin: str | None = None, timeout: float = COMMAND_TIMEOUT_S) -> str:
    """Run a command with a timeout; HostConfigError with its output when it fails."""
    try:
        result = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise HostConfigError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from None
    except OSError as exc:
        raise HostConfigError(f"`{argv[0]}` cannot run: {exc.strerror}") from None
    if result.returncode != 0:
        raise HostConfigError(
            f"`{' '.join(argv)}` failed ({result.returncode}): {(result.stderr or result.stdout).strip()}"
        )
    return result.stdout


def configure_host(pid: int, config: HostConfig, timeout: float = COMMAND_TIMEOUT_S) -> None:
    """Apply ``config`` inside the namespaces of the host whose shell is ``pid``."""
    for argv, stdin in config.commands():
        run_checked(in_namespaces(pid, argv), stdin=stdin, timeout=timeout)
    logger.debug(
        "host %s: mtu %d, offloads off, IPv6 off, %d static neighbours",
        config.name,
        config.mtu,
        len(config.neighbours),
    )


def configure_switch_interface(
    interface: str, mtu: int = JUMBO_MTU, timeout: float = COMMAND_TIMEOUT_S
) -> None:
    """MTU, offloads and IPv6 for a switch-side interface in this (the root) namespace."""
    run_checked(["ip", "link", "set", "dev", interface, "mtu", str(mtu)], timeout=timeout)
    run_checked(["ethtool", "-K", interface, *OFFLOADS_OFF], timeout=timeout)
    ipv6 = Path("/proc/sys/net/ipv6/conf") / interface / "disable_ipv6"
    if ipv6.exists():
        ipv6.write_text("1\n")
