"""The network description: parsing, every class of bad input, port MACs, paths and routes."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from checkmate.network import Hop, Network, NetworkError
from tests.controller.conftest import TOPOLOGIES, topology_json


def test_both_topologies_load_and_round_trip() -> None:
    for name in ("single", "leafspine"):
        network = Network.load(TOPOLOGIES / f"{name}.json")
        assert Network.from_json(network.to_json()) == network
    single = Network.load(TOPOLOGIES / "single.json")
    assert single.hosts_with_role("worker") == ["h1", "h2", "h3", "h4"]
    assert single.hosts_with_role("shadow") == ["sh1", "sh2"]
    assert list(single.switches) == ["s1"]
    leafspine = Network.load(TOPOLOGIES / "leafspine.json")
    workers_on = {leafspine.attachment(h)[0] for h in leafspine.hosts_with_role("worker")}
    shadows_on = {leafspine.attachment(h)[0] for h in leafspine.hosts_with_role("shadow")}
    assert workers_on == {"s1", "s2"} and shadows_on == {"s3"}


def test_tutorials_shape_is_accepted() -> None:
    """A p4lang/tutorials file: no roles, tutorials' link latency/bandwidth, host commands."""
    network = Network.from_json(
        {
            "hosts": {
                "h1": {"ip": "10.0.1.1/24", "mac": "08:00:00:00:01:11", "commands": ["route add default"]},
                "h2": {"ip": "10.0.2.2/24", "mac": "08:00:00:00:02:22"},
            },
            "switches": {"s1": {"grpc": "127.0.0.1:50051"}, "s2": {"grpc": "127.0.0.1:50052"}},
            "links": [["h1", "s1-p1"], ["h2", "s2-p1"], ["s1-p2", "s2-p2", "0ms", 10]],
        }
    )
    assert network.hosts["h1"].role == "host" and network.hosts["h1"].commands == ("route add default",)
    assert [s.device_id for s in network.switches.values()] == [0, 1]
    assert network.links[2].options.delay == "0ms" and network.links[2].options.bw == 10.0


def test_single_routes() -> None:
    network = Network.load(TOPOLOGIES / "single.json")
    routes = {r.host: r for r in network.routes_for("s1")}
    assert sorted(routes) == ["h1", "h2", "h3", "h4", "sh1", "sh2"]
    for host, route in routes.items():
        switch, port = network.attachment(host)
        assert (switch, route.port) == ("s1", port)
        assert route.dst_mac == network.hosts[host].mac
        assert route.src_mac == network.port_mac("s1", port) == f"02:00:00:01:00:{port:02x}"
        assert route.dst_addr == network.hosts[host].address and route.prefix_len == 32


def test_leafspine_routes_and_paths() -> None:
    network = Network.load(TOPOLOGIES / "leafspine.json")
    # Leaf s1: local hosts on their ports, everything else up to the spine.
    s1 = {r.host: (r.port, r.dst_mac) for r in network.routes_for("s1")}
    spine_port_mac = network.port_mac("s4", 1)
    assert s1 == {
        "h1": (1, "08:00:00:00:01:01"),
        "h2": (2, "08:00:00:00:01:02"),
        "h3": (3, spine_port_mac),
        "h4": (3, spine_port_mac),
        "sh1": (3, spine_port_mac),
        "sh2": (3, spine_port_mac),
    }
    # The spine sends each host toward its leaf, to that leaf's uplink MAC.
    s4 = {r.host: (r.port, r.dst_mac) for r in network.routes_for("s4")}
    assert s4["h3"] == (2, network.port_mac("s2", 3))
    assert s4["sh2"] == (3, network.port_mac("s3", 3))
    assert network.path("h2", "h3") == [Hop("s1", 2, 3), Hop("s4", 1, 2), Hop("s2", 3, 1)]
    assert network.path("h1", "h2") == [Hop("s1", 1, 2)]
    assert network.path("h4", "sh1") == [Hop("s2", 2, 3), Hop("s4", 2, 3), Hop("s3", 3, 1)]
    # Every route's source MAC is its own port's; every port MAC is unique.
    macs = [network.port_mac(s, p) for s in network.switches for p in network.ports(s)]
    assert len(set(macs)) == len(macs)
    assert network.arp_entries("h1")["10.0.9.1"] == network.port_mac("s1", 1)


def test_tie_break_takes_the_lowest_port() -> None:
    """Two equal-cost paths (two spines): the lowest-numbered uplink wins, the same every time."""
    data: dict[str, Any] = {
        "hosts": {
            "a": {"ip": "10.0.0.1/8", "mac": "08:00:00:00:00:01"},
            "b": {"ip": "10.0.0.2/8", "mac": "08:00:00:00:00:02"},
        },
        "switches": {f"s{i}": {"grpc": f"127.0.0.1:{50000 + i}", "device_id": i} for i in range(1, 5)},
        "links": [
            ["a", "s1-p1"],
            ["b", "s2-p1"],
            ["s1-p7", "s4-p1"],
            ["s1-p3", "s3-p1"],
            ["s2-p9", "s3-p2"],
            ["s2-p4", "s4-p2"],
        ],
    }
    network = Network.from_json(data)
    assert [h.switch for h in network.path("a", "b")] == ["s1", "s3", "s2"]
    assert [h.switch for h in network.path("b", "a")] == ["s2", "s4", "s1"]


def _single() -> dict[str, Any]:
    return copy.deepcopy(topology_json("single"))


def _mutate(change: Any) -> dict[str, Any]:
    data = _single()
    change(data)
    return data


BAD_INPUTS = [
    ("unknown top-level field", lambda d: d.update(extra=1), "unknown field(s) ['extra']"),
    ("unknown host field", lambda d: d["hosts"]["h1"].update(gw="x"), "hosts.h1: unknown field(s) ['gw']"),
    ("unknown switch field", lambda d: d["switches"]["s1"].update(json="x"), "switches.s1: unknown field"),
    ("missing links", lambda d: d.pop("links"), "lacks 'links'"),
    ("duplicate MAC", lambda d: d["hosts"]["h2"].update(mac="08:00:00:00:01:01"), "also used by host h1"),
    ("duplicate IP", lambda d: d["hosts"]["h2"].update(ip="10.0.1.1/8"), "also used by host h1"),
    ("bad MAC", lambda d: d["hosts"]["h1"].update(mac="08:00:00:00:01"), "not a MAC address"),
    ("multicast MAC", lambda d: d["hosts"]["h1"].update(mac="01:00:5e:00:00:01"), "not a unicast MAC"),
    ("IP without prefix", lambda d: d["hosts"]["h1"].update(ip="10.0.1.1"), "ADDRESS/PREFIX"),
    ("bad IP", lambda d: d["hosts"]["h1"].update(ip="10.0.1.300/8"), "not an IPv4 address"),
    ("network address", lambda d: d["hosts"]["h1"].update(ip="10.0.0.0/8"), "network or broadcast"),
    ("loopback", lambda d: d["hosts"]["h1"].update(ip="127.0.0.2/8"), "not a unicast host address"),
    ("bad role", lambda d: d["hosts"]["h1"].update(role="boss"), "is not one of"),
    ("bad name", lambda d: d["hosts"].update({"h 9": d["hosts"].pop("h1")}), "name 'h 9'"),
    ("host and switch share a name", lambda d: d["hosts"].update(s1=d["hosts"].pop("h1")), "both a host"),
    ("dangling link", lambda d: d["links"].append(["h9", "s1-p9"]), "names no host and no switch port"),
    ("dangling switch", lambda d: d["links"].append(["s9-p1", "s1-p9"]), "unknown switch 's9'"),
    ("switch end without port", lambda d: d["links"].append(["s1", "s1-p9"]), "needs a port"),
    ("host end with a port", lambda d: d["links"].__setitem__(0, ["h1-p1", "s1-p1"]), "bare host name"),
    ("port used twice", lambda d: d["links"].__setitem__(1, ["h2", "s1-p1"]), "s1-p1 is used by two links"),
    ("host linked twice", lambda d: d["links"].append(["h1", "s1-p9"]), "already linked"),
    ("host not attached", lambda d: d["links"].pop(0), "['h1'] are not linked"),
    ("host to host", lambda d: d["links"].append(["h1", "h2"]), "links two hosts"),
    ("port out of range", lambda d: d["links"].__setitem__(0, ["h1", "s1-p511"]), "outside 1..510"),
    ("bad grpc address", lambda d: d["switches"]["s1"].update(grpc="localhost"), "HOST:PORT"),
    ("bad device id", lambda d: d["switches"]["s1"].update(device_id=-1), "device_id"),
    ("cpu port on a link", lambda d: d["switches"]["s1"].update(cpu_port=1), "cpu_port 1 is also used"),
    ("bad link option", lambda d: d["links"][0].append({"jitter": 1}), "unknown field(s) ['jitter']"),
    ("bad bandwidth", lambda d: d["links"][0].append({"bw": -1}), "positive number"),
    ("bad delay", lambda d: d["links"][0].append({"delay": "soon"}), "delay 'soon'"),
    ("not an object", lambda d: d["hosts"].update(h1=["10.0.1.1/8"]), "must be an object"),
]


@pytest.mark.parametrize(("case", "change", "message"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_refused_with_a_clear_error(case: str, change: Any, message: str) -> None:
    with pytest.raises(NetworkError) as info:
        Network.from_json(_mutate(change))
    assert message in str(info.value), f"{case}: {info.value}"


def test_disconnected_switches_and_duplicate_switch_identity() -> None:
    data = _single()
    data["switches"]["s2"] = {"grpc": "127.0.0.1:50002", "device_id": 2}
    data["hosts"]["h9"] = {"ip": "10.0.1.9/8", "mac": "08:00:00:00:01:09"}
    data["links"].append(["h9", "s2-p1"])
    with pytest.raises(NetworkError, match=r"\['s2'\] are not connected to s1"):
        Network.from_json(data)
    data["links"].append(["s1-p9", "s2-p9"])
    Network.from_json(data)
    data["switches"]["s2"]["grpc"] = "127.0.0.1:50001"
    with pytest.raises(NetworkError, match="also used by switch s1"):
        Network.from_json(data)
    data["switches"]["s2"].update(grpc="127.0.0.1:50002", device_id=1)
    with pytest.raises(NetworkError, match="device_id: 1 is also used by switch s1"):
        Network.from_json(data)


def test_files_that_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(NetworkError, match="cannot read"):
        Network.load(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(NetworkError, match="not valid JSON"):
        Network.load(broken)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_mutate(lambda d: d["hosts"]["h1"].update(ip="x/8"))))
    with pytest.raises(NetworkError, match=r"bad\.json: hosts\.h1\.ip"):
        Network.load(bad)


def test_unknown_names_in_queries() -> None:
    network = Network.load(TOPOLOGIES / "single.json")
    with pytest.raises(NetworkError, match="unknown host 'h9'"):
        network.route("s1", "h9")
    with pytest.raises(NetworkError, match="unknown switch 's9'"):
        network.routes_for("s9")
