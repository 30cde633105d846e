"""One switch scenario, stated once: entries by P4Info name, input packets, expected packets.

The pipeline unit tests install these entries straight into a SwitchState; the
packet tests install the same entries over P4Runtime into a running switch. The
topology is two workers of one ring and two shadows::

    port 1  worker 0   10.0.1.1   (enrolled for job 7: its tagged packets are copied)
    port 2  worker 1   10.0.2.1   (the next hop of worker 0)
    port 3  shadow 1   10.0.3.1   (shard key 0; egress_rid 1)
    port 4  shadow 2   10.0.4.1   (shard key 1; egress_rid 2)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scapy.layers.inet import ICMP, IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw

from checkmate.p4 import names
from checkmate.scapy_layer import Checkmate
from checkmate.wire import CHECKMATE_UDP_PORT
from embedded_switch.state import ActionCall, FieldMatch, MatchKind, Replica, SwitchState, TableEntry

SWITCH_MAC = "02:00:00:00:00:fe"
W0_PORT, W1_PORT, SH1_PORT, SH2_PORT = 1, 2, 3, 4
PORTS = (W0_PORT, W1_PORT, SH1_PORT, SH2_PORT)
W0_MAC, W1_MAC, SH1_MAC, SH2_MAC = (f"02:00:00:00:00:0{i}" for i in PORTS)
W0_IP, W1_IP, SH1_IP, SH2_IP = (f"10.0.{i}.1" for i in PORTS)
SH1_UDP_PORT, SH2_UDP_PORT = 50001, 50002

JOB_ID = 7
JOB_SLOT = 3
UNKNOWN_JOB_ID = 99
GROUP_SHADOW1, GROUP_SHADOW2, GROUP_BOTH = 100, 101, 102
SHARD_SHADOW1, SHARD_SHADOW2, SHARD_BOTH, SHARD_NO_REWRITE, SHARD_NO_GROUP = 0, 1, 2, 3, 4
RID_SHADOW1, RID_SHADOW2, RID_NO_REWRITE = 1, 2, 9
GROUP_NO_REWRITE, GROUP_MISSING = 103, 104


def mac(text: str) -> int:
    return int(text.replace(":", ""), 16)


def ip(text: str) -> int:
    a, b, c, d = (int(x) for x in text.split("."))
    return (a << 24) | (b << 16) | (c << 8) | d


@dataclass(frozen=True)
class Entry:
    """A table entry by P4Info names. Match values: int (exact) or (value, prefix_len) (lpm)."""

    table: str
    match: dict[str, int | tuple[int, int]]
    action: str
    params: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Group:
    group_id: int
    replicas: tuple[tuple[int, int], ...]
    """(egress port, instance) pairs."""


def route(prefix: str, plen: int, port: int, dst_mac: str) -> Entry:
    return Entry(
        names.RouteIpv4.NAME,
        {names.RouteIpv4.DST_ADDR: (ip(prefix), plen)},
        names.Forward.NAME,
        {
            names.Forward.PORT: port,
            names.Forward.SRC_MAC: mac(SWITCH_MAC),
            names.Forward.DST_MAC: mac(dst_mac),
        },
    )


def replicate(shard_key: int, group: int, ingress_port: int = W0_PORT, job_id: int = JOB_ID) -> Entry:
    table = names.ReplicateToShadow
    return Entry(
        table.NAME,
        {
            table.JOB_ID: job_id,
            table.INGRESS_PORT: ingress_port,
            table.SHARD_KEY: shard_key,
            table.NEXT_HOP_PORT: W1_PORT,
        },
        names.SetMulticastGroup.NAME,
        {names.SetMulticastGroup.GROUP: group},
    )


def shadow_rewrite(rid: int, dst_mac: str, dst_ip: str, dst_port: int) -> Entry:
    action = names.SetShadowDestination
    return Entry(
        names.RewriteShadowCopy.NAME,
        {names.RewriteShadowCopy.EGRESS_RID: rid},
        action.NAME,
        {
            action.SRC_MAC: mac(SWITCH_MAC),
            action.DST_MAC: mac(dst_mac),
            action.DST_ADDR: ip(dst_ip),
            action.DST_PORT: dst_port,
        },
    )


ENTRIES: tuple[Entry, ...] = (
    route("10.0.1.0", 24, W0_PORT, W0_MAC),
    route("10.0.2.0", 24, W1_PORT, W1_MAC),
    route("10.0.3.1", 32, SH1_PORT, SH1_MAC),
    route("10.0.4.1", 32, SH2_PORT, SH2_MAC),
    Entry(
        names.LookupJob.NAME,
        {names.LookupJob.JOB_ID: JOB_ID},
        names.SetJobSlot.NAME,
        {names.SetJobSlot.SLOT: JOB_SLOT},
    ),
    replicate(SHARD_SHADOW1, GROUP_SHADOW1),
    replicate(SHARD_SHADOW2, GROUP_SHADOW2),
    replicate(SHARD_BOTH, GROUP_BOTH),
    replicate(SHARD_NO_REWRITE, GROUP_NO_REWRITE),
    replicate(SHARD_NO_GROUP, GROUP_MISSING),
    shadow_rewrite(RID_SHADOW1, SH1_MAC, SH1_IP, SH1_UDP_PORT),
    shadow_rewrite(RID_SHADOW2, SH2_MAC, SH2_IP, SH2_UDP_PORT),
)
"""Routes to all four hosts, job 7 in slot 3, worker 0 enrolled for five shard keys."""

GROUPS: tuple[Group, ...] = (
    Group(GROUP_SHADOW1, ((W1_PORT, 0), (SH1_PORT, RID_SHADOW1))),
    Group(GROUP_SHADOW2, ((W1_PORT, 0), (SH2_PORT, RID_SHADOW2))),
    Group(GROUP_BOTH, ((W1_PORT, 0), (SH1_PORT, RID_SHADOW1), (SH2_PORT, RID_SHADOW2))),
    Group(GROUP_NO_REWRITE, ((W1_PORT, 0), (SH1_PORT, RID_NO_REWRITE))),
)
"""GROUP_MISSING is deliberately never created."""


# ---- installing into a SwitchState (no P4Runtime) ------------------------------------------------------
def install(
    state: SwitchState, entries: tuple[Entry, ...] = ENTRIES, groups: tuple[Group, ...] = GROUPS
) -> None:
    """Write entries and groups straight into ``state`` (what the P4Runtime server would do)."""
    from checkmate.p4.p4info import load_p4info

    info = load_p4info()
    params = {a.preamble.alias: [p.name for p in a.params] for a in info.actions}
    with state.write_lock:
        for e in entries:
            table = state.table(e.table)
            key = []
            for spec in table.fields:
                value = e.match[spec.name]
                if spec.kind is MatchKind.LPM:
                    assert isinstance(value, tuple)
                    key.append(FieldMatch(MatchKind.LPM, value=value[0], prefix_len=value[1]))
                else:
                    assert isinstance(value, int)
                    key.append(FieldMatch(spec.kind, value=value))
            action = ActionCall(e.action, tuple(e.params[name] for name in params[e.action]))
            table.insert(TableEntry(tuple(key), action))
        for g in groups:
            state.multicast_groups[g.group_id] = tuple(Replica(p, i) for p, i in g.replicas)


# ---- packets ------------------------------------------------------------------------------------------
def payload_for(count: int, itemsize: int = 4) -> bytes:
    return bytes((i * 7 + 3) & 0xFF for i in range(count * itemsize))


def checkmate_packet(
    *,
    shard_key: int = SHARD_SHADOW1,
    job_id: int = JOB_ID,
    flags: int = 0x01,
    count: int = 8,
    dtype: int = 1,
    dst_ip: str = W1_IP,
    ttl: int = 64,
    payload: bytes | None = None,
    udp_len: int | None = None,
    **fields: int,
) -> Packet:
    """A tagged gradient packet from worker 0 to worker 1 (REPLICATE set unless ``flags`` says otherwise)."""
    itemsize = 4 if dtype == 1 else 2
    body = payload if payload is not None else payload_for(count, itemsize)
    return (
        Ether(src=W0_MAC, dst=SWITCH_MAC)
        / IP(src=W0_IP, dst=dst_ip, ttl=ttl, id=0x1234)
        / UDP(sport=CHECKMATE_UDP_PORT, dport=CHECKMATE_UDP_PORT, len=udp_len)
        / Checkmate(
            **{
                "flags": flags,
                "job_id": job_id,
                "shard_key": shard_key,
                "element_count": count,
                "dtype": dtype,
                "iteration": 5,
                "bucket_id": 2,
                "sender_rank": 0,
                "element_offset": 1024,
                "sequence": 11,
                **fields,
            }
        )
        / Raw(body)
    )


def sized_checkmate_packet(frame_bytes: int, **kwargs: int) -> Packet:
    """A tagged fp32 packet whose Ethernet frame is ``frame_bytes`` long (a multiple of 4 past 74)."""
    count = (frame_bytes - 74) // 4
    return checkmate_packet(count=count, **kwargs)


def udp_packet(dport: int = 5000, dst_ip: str = W1_IP, size: int = 64) -> Packet:
    return (
        Ether(src=W0_MAC, dst=SWITCH_MAC)
        / IP(src=W0_IP, dst=dst_ip, ttl=64, id=7)
        / UDP(sport=4000, dport=dport)
        / Raw(bytes(range(256)) * (size // 256) + bytes(size % 256))
    )


def icmp_packet(dst_ip: str = W1_IP) -> Packet:
    return (
        Ether(src=W0_MAC, dst=SWITCH_MAC)
        / IP(src=W0_IP, dst=dst_ip, ttl=9)
        / ICMP(id=3, seq=4)
        / Raw(b"ping" * 10)
    )


def routed(pkt: Packet | bytes, dst_mac: str) -> bytes:
    """``pkt`` as the switch forwards it unicast: MACs rewritten, TTL - 1, IPv4 checksum recomputed."""
    p = Ether(bytes(pkt))
    p[Ether].src, p[Ether].dst = SWITCH_MAC, dst_mac
    p[IP].ttl -= 1
    del p[IP].chksum
    return bytes(p)


def replica(pkt: Packet | bytes, dst_mac: str, dst_ip: str | None = None, dport: int | None = None) -> bytes:
    """A replica of a replicated packet: routed, REPLICATE cleared, UDP checksum 0, maybe re-addressed."""
    p = Ether(routed(pkt, dst_mac))
    p[Checkmate].flags = int(p[Checkmate].flags) & ~0x01
    p[UDP].chksum = 0
    if dst_ip is not None:
        p[IP].dst = dst_ip
        del p[IP].chksum
    if dport is not None:
        p[UDP].dport = dport
    return bytes(p)


def primary_copy(pkt: Packet | bytes) -> bytes:
    return replica(pkt, W1_MAC)


def shadow1_copy(pkt: Packet | bytes) -> bytes:
    return replica(pkt, SH1_MAC, SH1_IP, SH1_UDP_PORT)


def shadow2_copy(pkt: Packet | bytes) -> bytes:
    return replica(pkt, SH2_MAC, SH2_IP, SH2_UDP_PORT)


# ---- spoofed tagged packets (job 7's id, REPLICATE set, well formed) -----------------------------------
@dataclass(frozen=True)
class Spoofed:
    """A tagged packet from where job 7 did not enroll it: forwarded uncopied, counted as rejected."""

    name: str
    ingress_port: int
    packet: Packet
    out_port: int
    out_mac: str


def _spoofed(src_mac: str, src_ip: str, dst_ip: str, shard_key: int = SHARD_SHADOW1) -> Packet:
    pkt = checkmate_packet(dst_ip=dst_ip, shard_key=shard_key)
    pkt[Ether].src = src_mac
    pkt[IP].src = src_ip
    return pkt


SPOOFED: tuple[Spoofed, ...] = (
    Spoofed("from a worker port not enrolled", W1_PORT, _spoofed(W1_MAC, W1_IP, W0_IP), W0_PORT, W0_MAC),
    Spoofed("from a shadow port", SH1_PORT, _spoofed(SH1_MAC, SH1_IP, W1_IP), W1_PORT, W1_MAC),
    Spoofed(
        "from a shadow port claiming worker 0's addresses",
        SH2_PORT,
        _spoofed(W0_MAC, W0_IP, W1_IP, shard_key=SHARD_SHADOW2),
        W1_PORT,
        W1_MAC,
    ),
    Spoofed(
        "enrolled port, unknown shard key",
        W0_PORT,
        _spoofed(W0_MAC, W0_IP, W1_IP, shard_key=77),
        W1_PORT,
        W1_MAC,
    ),
    Spoofed(
        "enrolled port and shard key, wrong next hop",
        W0_PORT,
        _spoofed(W0_MAC, W0_IP, "10.0.1.9"),
        W0_PORT,
        W0_MAC,
    ),
)
"""Each is forwarded by its route only: nothing reaches a shadow port, ``rejected_replications``
counts it at job 7's slot."""
