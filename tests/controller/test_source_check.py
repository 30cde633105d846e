"""check_source: the controller derives source-validation entries from the routes (issue 29).

For every route "dst S/32 out port P" at a switch, ``check_source(S/32) -> expect_port(P)``;
installed and reconciled with ``route_ipv4`` by ``install_forwarding``, so a Checkmate
packet with a known host's source address that comes in on another port is dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scapy.layers.inet import IP

from checkmate.network import Network
from checkmate.wire import Flags
from controller.entities import TableEntry, Update, UpdateKind
from controller.route_ipv4 import arrival_ports, route_entries, source_entries
from embedded_switch.pipeline import DropReason
from tests.controller.conftest import Fabric, gradient, topology_json
from tests.controller.test_controller import behind_the_back, ready


def test_one_source_entry_per_route_with_the_route_port() -> None:
    network = Network.from_json(topology_json("leafspine"))
    for switch in sorted(network.switches):
        routes = {e.match[0].value: e.param("port") for e in route_entries(network, switch)}
        sources = source_entries(network, switch)
        assert len(sources) == len(routes) == len(network.hosts)
        for entry in sources:
            assert entry.table == "check_source" and entry.action == "expect_port"
            (match,) = entry.match
            assert match.prefix_len == 32
            assert entry.param("port") == routes[match.value]
    # at a leaf, a local host is expected on its own port, every remote one on the uplink
    expected = {
        "h1": 1,
        "h2": 2,
        "h3": 3,
        "h4": 3,
        "sh1": 3,
        "sh2": 3,
    }
    by_ip = {int(network.hosts[h].address): h for h in network.hosts}
    got = {by_ip[e.match[0].value]: e.param("port") for e in source_entries(network, "s1")}
    assert got == expected


def _square() -> dict[str, Any]:
    """Four switches in a cycle (two equal-cost paths between opposite corners), a host on each."""
    return {
        "hosts": {f"h{i}": {"ip": f"10.0.{i}.1/8", "mac": f"08:00:00:00:0{i}:01"} for i in range(1, 5)},
        "switches": {f"s{i}": {"grpc": f"127.0.0.1:5000{i}", "device_id": i} for i in range(1, 5)},
        "links": [
            ["h1", "s1-p1"],
            ["h2", "s2-p1"],
            ["h3", "s3-p1"],
            ["h4", "s4-p1"],
            ["s1-p2", "s2-p2"],
            ["s2-p3", "s3-p2"],
            ["s3-p3", "s4-p2"],
            ["s4-p3", "s1-p3"],
        ],
    }


def test_asymmetric_paths_leave_the_source_unchecked_where_it_is_ambiguous() -> None:
    network = Network.from_json(_square())
    skipped = 0
    for switch in sorted(network.switches):
        arrivals = arrival_ports(network, switch)
        routes = {r.host: r.port for r in network.routes_for(switch)}
        kept = {e.match[0].value: e.param("port") for e in source_entries(network, switch)}
        for host, port in routes.items():
            address = int(network.hosts[host].address)
            if arrivals[host] <= {port}:
                assert kept[address] == port
            else:
                assert address not in kept
                skipped += 1
        # a host's own switch always checks it: its packets only ever come in on its port
        own = next(h for h in network.hosts if network.attachment(h)[0] == switch)
        assert kept[int(network.hosts[own].address)] == network.attachment(own)[1]
    assert skipped > 0  # the square does have paths that return on another port
    # every real packet still gets through: no path crosses a switch on a port its entry refuses
    for src in sorted(network.hosts):
        for dst in sorted(network.hosts):
            if src == dst:
                continue
            for hop in network.path(src, dst):
                kept = {e.match[0].value: e.param("port") for e in source_entries(network, hop.switch)}
                assert kept.get(int(network.hosts[src].address), hop.in_port) == hop.in_port


def test_install_forwarding_installs_reads_back_and_removes_source_checks(
    fabric: Callable[..., Fabric],
) -> None:
    f, ctl = ready(fabric, "leafspine")
    for switch in sorted(f.network.switches):
        installed = ctl.read_installed(switch, ("check_source",))
        assert {e.key for e in installed.values()} == {e.key for e in source_entries(f.network, switch)}
        state = f.servers[switch].state
        assert state is not None and len(state.table("check_source")) == len(f.network.hosts)
    assert ctl.install_forwarding().changes == 0
    # a stray entry (a hand edit) is removed, a missing one put back
    stray = TableEntry.make("check_source", {"src_addr": (0x0B000001, 32)}, "expect_port", {"port": 2})
    mine = source_entries(f.network, "s1")[0]
    behind_the_back(f, "s1", Update(UpdateKind.INSERT, stray), Update(UpdateKind.DELETE, mine))
    report = ctl.install_forwarding()
    assert (report.inserted, report.deleted) == ({"s1": 1}, {"s1": 1})
    assert ctl.install_forwarding().changes == 0


def test_spoofed_source_is_dropped_at_the_leaf_and_real_traffic_passes(
    fabric: Callable[..., Fabric],
) -> None:
    f, _ = ready(fabric, "leafspine")
    net = f.network
    for src, dst in (("h1", "h2"), ("h1", "h3"), ("h3", "h1"), ("sh1", "h4")):
        assert list(f.send(src, gradient(src, dst, net, flags=Flags.NONE))) == [dst]

    def spoofed() -> dict[str, int]:
        counts = {}
        for name, server in sorted(f.servers.items()):
            assert server.state is not None
            counts[name] = server.state.counter("ingress_drops").read(DropReason.SPOOFED_SOURCE)[0]
        return counts

    before = spoofed()
    # h2 (same leaf) and h3 (another leaf) send ring DATA to h2 / h1 claiming h1's address
    for liar, victim in (("h2", "h2"), ("h3", "h2"), ("h4", "h3")):
        forged = gradient("h1", victim, net, flags=Flags.NONE)
        assert f.send(liar, forged) == {}, liar
    after = spoofed()
    # each forgery is dropped at the liar's own leaf: h2's at s1, h3's and h4's at s2
    assert {s: after[s] - before[s] for s in after} == {"s1": 1, "s2": 2, "s3": 0, "s4": 0}
    # plain UDP is not checked: the table is applied to Checkmate packets only
    plain = gradient("h1", "h2", net, flags=Flags.NONE)
    plain[IP].payload.dport = 5000
    plain[IP].payload.sport = 5000
    assert list(f.send("h2", plain)) == ["h2"]
