"""A network description's JSON read and checked: :func:`parse_description`.

Strict: anything the description cannot mean raises
:class:`~checkmate.network_elements.NetworkError` naming the offending entry (the shape
is in :mod:`checkmate.network`'s docstring).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from typing import Any

from checkmate.address import AddressError, parse_host_port
from checkmate.network_elements import (
    BMV2_MAX_MULTICAST_GROUPS,
    MAX_DEVICE_ID,
    MAX_MULTICAST_GROUP_ID,
    MAX_PORT,
    ROLES,
    Endpoint,
    Host,
    Link,
    LinkOptions,
    NetworkError,
    Switch,
    mac_to_int,
)

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,9}$")
_MAC = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")
_SWITCH_PORT = re.compile(r"^(?P<node>[A-Za-z][A-Za-z0-9_]*)-p(?P<port>[0-9]+)$")
_DELAY = re.compile(r"^[0-9]+(\.[0-9]+)?(us|ms|s)$")

_TOP_FIELDS = {"hosts", "switches", "links", "description"}
_HOST_FIELDS = {"ip", "mac", "role", "commands"}
_SWITCH_FIELDS = {"grpc", "device_id", "cpu_port", "thrift_port", "max_multicast_groups"}
_LINK_OPTIONS = {"bw", "delay", "loss", "max_queue_size"}


def parse_description(data: Any) -> tuple[dict[str, Host], dict[str, Switch], list[Link], str]:
    """A parsed description's hosts, switches, links and text; NetworkError naming the first problem."""
    if not isinstance(data, Mapping):
        raise NetworkError(f"a network description is a JSON object, got {type(data).__name__}")
    _no_unknown(data, _TOP_FIELDS, "the description")
    for required in ("hosts", "switches", "links"):
        if required not in data:
            raise NetworkError(f"the description lacks {required!r}")
    description = data.get("description", "")
    if not isinstance(description, str):
        raise NetworkError("description must be a string")
    hosts = _parse_hosts(data["hosts"])
    switches = _parse_switches(data["switches"])
    both = sorted(set(hosts) & set(switches))
    if both:
        raise NetworkError(f"name(s) {both} are used for both a host and a switch")
    links = _parse_links(data["links"], hosts, switches)
    return hosts, switches, links, description


def _no_unknown(data: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        raise NetworkError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")


def _check_name(name: Any, kind: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise NetworkError(
            f"{kind} name {name!r} must be a letter then up to 9 letters, digits or '_' "
            f"(it becomes part of interface names)"
        )
    return name


def _int_field(data: Mapping[str, Any], key: str, where: str, low: int, high: int) -> int | None:
    if key not in data:
        return None
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise NetworkError(f"{where}.{key}: {value!r} is not an integer in {low}..{high}")
    return value


def _parse_hosts(raw: Any) -> dict[str, Host]:
    if not isinstance(raw, Mapping):
        raise NetworkError("hosts must be an object {name: {ip, mac, role}}")
    if not raw:
        raise NetworkError("hosts is empty")
    hosts: dict[str, Host] = {}
    by_ip: dict[ipaddress.IPv4Address, str] = {}
    by_mac: dict[str, str] = {}
    for name, spec in raw.items():
        _check_name(name, "host")
        where = f"hosts.{name}"
        if not isinstance(spec, Mapping):
            raise NetworkError(f"{where} must be an object with ip and mac")
        _no_unknown(spec, _HOST_FIELDS, where)
        for required in ("ip", "mac"):
            if required not in spec:
                raise NetworkError(f"{where} lacks {required!r}")
        ip = _parse_interface(spec["ip"], f"{where}.ip")
        mac = _parse_mac(spec["mac"], f"{where}.mac")
        role = spec.get("role", "host")
        if role not in ROLES:
            raise NetworkError(f"{where}.role: {role!r} is not one of {list(ROLES)}")
        commands = spec.get("commands", [])
        if not isinstance(commands, list) or not all(isinstance(c, str) for c in commands):
            raise NetworkError(f"{where}.commands must be a list of strings")
        if ip.ip in by_ip:
            raise NetworkError(f"{where}.ip: address {ip.ip} is also used by host {by_ip[ip.ip]}")
        if mac in by_mac:
            raise NetworkError(f"{where}.mac: {mac} is also used by host {by_mac[mac]}")
        by_ip[ip.ip] = name
        by_mac[mac] = name
        hosts[name] = Host(name=name, ip=ip, mac=mac, role=role, commands=tuple(commands))
    return hosts


def _parse_interface(value: Any, where: str) -> ipaddress.IPv4Interface:
    if not isinstance(value, str) or "/" not in value:
        raise NetworkError(f"{where}: {value!r} must be ADDRESS/PREFIX, e.g. '10.0.1.1/8'")
    try:
        iface = ipaddress.IPv4Interface(value)
    except ValueError as exc:
        raise NetworkError(f"{where}: {value!r} is not an IPv4 address/prefix ({exc})") from None
    address = iface.ip
    if address.is_multicast or address.is_loopback or address.is_unspecified or address.is_reserved:
        raise NetworkError(f"{where}: {address} is not a unicast host address")
    if iface.network.prefixlen <= 30 and address in (
        iface.network.network_address,
        iface.network.broadcast_address,
    ):
        raise NetworkError(f"{where}: {address} is the network or broadcast address of {iface.network}")
    return iface


def _parse_mac(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _MAC.match(value):
        raise NetworkError(f"{where}: {value!r} is not a MAC address like '08:00:00:00:01:11'")
    mac = value.lower()
    as_int = mac_to_int(mac)
    if as_int == 0 or (as_int >> 40) & 1:
        raise NetworkError(f"{where}: {mac} is not a unicast MAC address")
    return mac


def _parse_switches(raw: Any) -> dict[str, Switch]:
    if not isinstance(raw, Mapping):
        raise NetworkError("switches must be an object {name: {grpc, device_id}}")
    if not raw:
        raise NetworkError("switches is empty")
    switches: dict[str, Switch] = {}
    by_grpc: dict[str, str] = {}
    by_device: dict[int, str] = {}
    for position, (name, spec) in enumerate(raw.items()):
        _check_name(name, "switch")
        where = f"switches.{name}"
        if not isinstance(spec, Mapping):
            raise NetworkError(f"{where} must be an object with grpc and device_id")
        _no_unknown(spec, _SWITCH_FIELDS, where)
        grpc_addr = spec.get("grpc")
        if not isinstance(grpc_addr, str):
            raise NetworkError(f"{where}.grpc: {grpc_addr!r} must be 'HOST:PORT', e.g. '127.0.0.1:50001'")
        try:
            parse_host_port(grpc_addr)
        except AddressError as exc:
            example = "e.g. '127.0.0.1:50001'"
            raise NetworkError(f"{where}.grpc: {exc}; it must be 'HOST:PORT', {example}") from None
        device_id = _int_field(spec, "device_id", where, 0, MAX_DEVICE_ID)
        device_id = position if device_id is None else device_id
        cpu_port = _int_field(spec, "cpu_port", where, 1, MAX_PORT)
        thrift_port = _int_field(spec, "thrift_port", where, 1, 65535)
        max_groups = _int_field(spec, "max_multicast_groups", where, 1, MAX_MULTICAST_GROUP_ID)
        if grpc_addr in by_grpc:
            raise NetworkError(f"{where}.grpc: {grpc_addr} is also used by switch {by_grpc[grpc_addr]}")
        if device_id in by_device:
            raise NetworkError(
                f"{where}.device_id: {device_id} is also used by switch {by_device[device_id]}"
            )
        by_grpc[grpc_addr] = name
        by_device[device_id] = name
        switches[name] = Switch(
            name=name,
            grpc=grpc_addr,
            device_id=device_id,
            cpu_port=cpu_port,
            thrift_port=thrift_port,
            max_multicast_groups=BMV2_MAX_MULTICAST_GROUPS if max_groups is None else max_groups,
        )
    return switches


def _parse_endpoint(
    value: Any, where: str, hosts: Mapping[str, Host], switches: Mapping[str, Switch]
) -> Endpoint:
    if not isinstance(value, str):
        raise NetworkError(f"{where}: endpoint {value!r} must be a string such as 'h1' or 's1-p1'")
    if value in hosts:
        return Endpoint(value)
    match = _SWITCH_PORT.match(value)
    if match is None:
        if value in switches:
            raise NetworkError(f"{where}: switch end {value!r} needs a port, e.g. '{value}-p1'")
        raise NetworkError(f"{where}: {value!r} names no host and no switch port (dangling link)")
    node, port = match["node"], int(match["port"])
    if node not in switches:
        if node in hosts:
            raise NetworkError(f"{where}: a host end is the bare host name {node!r}, not {value!r}")
        raise NetworkError(f"{where}: {value!r} names unknown switch {node!r} (dangling link)")
    if not 1 <= port <= MAX_PORT:
        raise NetworkError(f"{where}: port {port} of {node} is outside 1..{MAX_PORT}")
    return Endpoint(node, port)


def _parse_link_options(extra: Sequence[Any], where: str) -> LinkOptions:
    if not extra:
        return LinkOptions()
    if len(extra) == 1 and isinstance(extra[0], Mapping):
        options = dict(extra[0])
    elif len(extra) <= 2 and not isinstance(extra[0], Mapping):
        # p4lang/tutorials: [a, b, latency, bandwidth_mbps]
        options = {"delay": extra[0]}
        if len(extra) == 2:
            options["bw"] = extra[1]
    else:
        raise NetworkError(f"{where}: after the two ends comes one options object or 'latency', bandwidth")
    _no_unknown(options, _LINK_OPTIONS, f"{where} options")
    bw = options.get("bw")
    if bw is not None and (isinstance(bw, bool) or not isinstance(bw, (int, float)) or bw <= 0):
        raise NetworkError(f"{where}: bw {bw!r} must be a positive number of Mbit/s")
    delay = options.get("delay")
    if delay is not None and (not isinstance(delay, str) or not _DELAY.match(delay)):
        raise NetworkError(f"{where}: delay {delay!r} must look like '0ms', '150us' or '1s'")
    loss = options.get("loss")
    if loss is not None and (
        isinstance(loss, bool) or not isinstance(loss, (int, float)) or not 0 <= loss <= 100
    ):
        raise NetworkError(f"{where}: loss {loss!r} must be a percentage in 0..100")
    queue = options.get("max_queue_size")
    if queue is not None and (isinstance(queue, bool) or not isinstance(queue, int) or queue < 1):
        raise NetworkError(f"{where}: max_queue_size {queue!r} must be a positive integer")
    return LinkOptions(
        bw=None if bw is None else float(bw),
        delay=delay,
        loss=None if loss is None else float(loss),
        max_queue_size=queue,
    )


def _parse_links(raw: Any, hosts: Mapping[str, Host], switches: Mapping[str, Switch]) -> list[Link]:
    if not isinstance(raw, list):
        raise NetworkError("links must be a list such as [['h1', 's1-p1'], ['s1-p2', 's2-p1']]")
    links: list[Link] = []
    for index, item in enumerate(raw):
        where = f"links[{index}]"
        if not isinstance(item, list) or len(item) < 2:
            raise NetworkError(f"{where}: {item!r} must be a list [end, end, options?]")
        a = _parse_endpoint(item[0], where, hosts, switches)
        b = _parse_endpoint(item[1], where, hosts, switches)
        if a.port is None and b.port is None:
            raise NetworkError(f"{where}: links two hosts; hosts attach to switches")
        if a.node == b.node:
            raise NetworkError(f"{where}: links switch {a.node} to itself")
        links.append(Link(a, b, _parse_link_options(item[2:], where)))
    return links
