"""Seeded mutation of Checkmate frames and datagrams, and a reference model of the switch.

Mutations (each returns new bytes, never the input object):

* ``random``     random bytes of a random length;
* ``bitflip``    1..8 random bits flipped anywhere;
* ``truncate``   cut at a random length;
* ``extend``     random bytes appended;
* ``field``      one Checkmate header field (version, msg_type, flags, dtype, job id,
  shard key, reserved, offset, count, sequence) set to a boundary or random value;
* ``udp``        the UDP destination port or length set to a boundary or random value;
* ``ipv4``       IPv4 options inserted, fragment bits or offset set, another protocol,
  a wrong total length or TTL;
* ``ether``      another EtherType.

Frame-level mutations (``udp``, ``ipv4``, ``field`` on a frame) recompute the IPv4
header checksum half of the time, so mutated frames get past the checksum check and
reach the Checkmate logic behind it.

:class:`SwitchModel` is an independent, straightforward statement of what
p4src/v1model/checkmate.p4 does with one frame (docs/protocol.md, "What the switch
does to a tagged packet"), built from the entities the controller's planning code
(controller/jobs.py) would install. The fuzz tests compare the embedded pipeline
against it frame by frame.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from checkmate import wire
from controller.entities import Entity, MulticastGroup, TableEntry

ETH_END, IPV4_END, UDP_END, CM_END = 14, 34, 42, 74

# Checkmate header fields: (offset within the header, size in bytes)
CM_FIELDS: dict[str, tuple[int, int]] = {
    "version": (0, 1),
    "msg_type": (1, 1),
    "flags": (2, 1),
    "dtype": (3, 1),
    "job_id": (4, 4),
    "iteration": (8, 4),
    "bucket_id": (12, 2),
    "sender_rank": (14, 2),
    "shard_key": (16, 2),
    "reserved": (18, 2),
    "element_offset": (20, 4),
    "element_count": (24, 4),
    "sequence": (28, 4),
}


def ipv4_checksum(header: bytes | bytearray) -> int:
    """RFC 791 checksum of the 20 fixed bytes of ``header``, its checksum field taken as 0."""
    words = struct.unpack("!10H", bytes(header[:10]) + b"\x00\x00" + bytes(header[12:20]))
    total = sum(words)
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def fix_ipv4_checksum(frame: bytearray) -> None:
    if len(frame) >= IPV4_END:
        struct.pack_into("!H", frame, ETH_END + 10, ipv4_checksum(frame[ETH_END:IPV4_END]))


def boundary(rng: random.Random, size: int) -> int:
    """A value of ``size`` bytes: 0, 1, max, max-1, a power of two, or random."""
    top = (1 << (8 * size)) - 1
    return rng.choice([0, 1, 2, top, top - 1, 1 << rng.randrange(8 * size), rng.randrange(top + 1)])


# ---- mutations ---------------------------------------------------------------------------------------
def mut_random(data: bytes, rng: random.Random, offset: int) -> bytes:
    n = rng.choice([0, 1, rng.randrange(offset + 40), rng.randrange(2000), rng.randrange(9100)])
    return rng.randbytes(n)


def mut_bitflip(data: bytes, rng: random.Random, offset: int) -> bytes:
    out = bytearray(data)
    if not out:
        return b"\x01"
    for _ in range(rng.randint(1, 8)):
        i = rng.randrange(len(out))
        out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


def mut_truncate(data: bytes, rng: random.Random, offset: int) -> bytes:
    # favour cuts inside the headers
    cut = rng.choice([rng.randrange(len(data) + 1), rng.randrange(min(len(data), offset + 40) + 1)])
    return data[:cut]


def mut_extend(data: bytes, rng: random.Random, offset: int) -> bytes:
    return data + rng.randbytes(rng.choice([1, 2, 4, rng.randrange(1, 64), rng.randrange(1, 9000)]))


def mut_field(data: bytes, rng: random.Random, offset: int) -> bytes:
    """One Checkmate header field (at ``offset``) set to a boundary or random value."""
    out = bytearray(data)
    name = rng.choice(sorted(CM_FIELDS))
    where, size = CM_FIELDS[name]
    if offset + where + size > len(out):
        return bytes(out)
    if name in ("version", "msg_type", "dtype") and rng.random() < 0.5:
        value = rng.randrange(8)  # near the valid range
    elif name == "flags" and rng.random() < 0.5:
        value = rng.choice([0, 1, 2, 4, 5, 7, 8, 0x81, 0xFF])
    else:
        value = boundary(rng, size)
    out[offset + where : offset + where + size] = value.to_bytes(size, "big")
    return bytes(out)


def mut_udp(data: bytes, rng: random.Random, offset: int) -> bytes:
    out = bytearray(data)
    if len(out) < UDP_END:
        return bytes(out)
    if rng.random() < 0.5:
        port = rng.choice([wire.CHECKMATE_UDP_PORT, wire.CHECKMATE_UDP_PORT + 1, 0, boundary(rng, 2)])
        struct.pack_into("!H", out, IPV4_END + rng.choice([0, 2]), port)
    else:
        length = rng.choice(
            [0, 7, 8, 39, 40, 41, len(out) - IPV4_END, len(out) - IPV4_END + 4, boundary(rng, 2)]
        )
        struct.pack_into("!H", out, IPV4_END + 4, length & 0xFFFF)
    return bytes(out)


def mut_ipv4(data: bytes, rng: random.Random, offset: int) -> bytes:
    out = bytearray(data)
    if len(out) < IPV4_END:
        return bytes(out)
    choice = rng.randrange(6)
    if choice == 0:  # options: IHL > 5 and option bytes inserted after the fixed header
        words = rng.randint(1, 10)
        out[ETH_END] = 0x40 | (5 + words)
        out[IPV4_END:IPV4_END] = rng.choice([b"\x94\x04\x00\x00", b"\x01\x01\x01\x01"]) * words
    elif choice == 1:  # more fragments / a fragment offset / DF
        struct.pack_into("!H", out, ETH_END + 6, rng.choice([0x2000, 0x0001, 0x1FFF, 0x2001, 0x4000, 0x8000]))
    elif choice == 2:
        out[ETH_END + 9] = rng.choice([1, 6, 16, 18, boundary(rng, 1)])
    elif choice == 3:
        struct.pack_into("!H", out, ETH_END + 2, boundary(rng, 2))
    elif choice == 4:
        out[ETH_END + 8] = rng.choice([0, 1, 2, 255])
    else:
        out[ETH_END] = rng.choice([0x45, 0x44, 0x46, 0x65, 0x4F, 0x00, boundary(rng, 1)])
    return bytes(out)


def mut_ether(data: bytes, rng: random.Random, offset: int) -> bytes:
    out = bytearray(data)
    if len(out) >= ETH_END:
        struct.pack_into("!H", out, 12, rng.choice([0x86DD, 0x0806, 0x8100, 0x0801, boundary(rng, 2)]))
    return bytes(out)


Mutation = Callable[[bytes, random.Random, int], bytes]
FRAME_MUTATIONS: dict[str, Mutation] = {
    "random": mut_random,
    "bitflip": mut_bitflip,
    "truncate": mut_truncate,
    "extend": mut_extend,
    "field": mut_field,
    "udp": mut_udp,
    "ipv4": mut_ipv4,
    "ether": mut_ether,
}
DATAGRAM_MUTATIONS: dict[str, Mutation] = {
    "random": mut_random,
    "bitflip": mut_bitflip,
    "truncate": mut_truncate,
    "extend": mut_extend,
    "field": mut_field,
}


def mutate_frame(frame: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One or two mutations of an Ethernet frame; IPv4 checksum fixed up half of the time."""
    names = [rng.choice(sorted(FRAME_MUTATIONS))]
    if rng.random() < 0.25:
        names.append(rng.choice(sorted(FRAME_MUTATIONS)))
    out = frame
    for name in names:
        out = FRAME_MUTATIONS[name](out, rng, UDP_END)
    if names[-1] in ("field", "udp", "ipv4", "ether", "extend") and rng.random() < 0.5:
        fixed = bytearray(out)
        fix_ipv4_checksum(fixed)
        out = bytes(fixed)
    return "+".join(names), out


def mutate_datagram(datagram: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One or two mutations of a UDP payload (a Checkmate header and its payload)."""
    names = [rng.choice(sorted(DATAGRAM_MUTATIONS))]
    if rng.random() < 0.25:
        names.append(rng.choice(sorted(DATAGRAM_MUTATIONS)))
    out = datagram
    for name in names:
        out = DATAGRAM_MUTATIONS[name](out, rng, 0)
    return "+".join(names), out


def decodes(datagram: bytes) -> wire.CheckmateHeader | None:
    """The header if ``checkmate.wire.decode`` accepts the datagram, else None."""
    try:
        return wire.decode(datagram)[0]
    except wire.WireFormatError:
        return None


# ---- building valid frames ----------------------------------------------------------------------------
def frame(
    src_mac: int,
    dst_mac: int,
    src_ip: int,
    dst_ip: int,
    datagram: bytes,
    *,
    sport: int = wire.CHECKMATE_UDP_PORT,
    dport: int = wire.CHECKMATE_UDP_PORT,
    ttl: int = 64,
    ident: int = 0,
) -> bytes:
    udp = struct.pack("!HHHH", sport, dport, 8 + len(datagram), 0) + datagram
    ip = bytearray(
        struct.pack("!BBHHHBBHII", 0x45, 0, 20 + len(udp), ident, 0x4000, ttl, 17, 0, src_ip, dst_ip)
    )
    struct.pack_into("!H", ip, 10, ipv4_checksum(ip))
    return dst_mac.to_bytes(6, "big") + src_mac.to_bytes(6, "big") + b"\x08\x00" + bytes(ip) + udp


def checkmate_datagram(
    rng: random.Random,
    job_id: int,
    shard_key: int,
    *,
    flags: wire.Flags = wire.Flags.REPLICATE,
    msg_type: wire.MessageType = wire.MessageType.DATA,
) -> bytes:
    dtype = rng.choice([wire.DType.FP32, wire.DType.BF16, wire.DType.FP16])
    count = rng.choice([0, 1, 3, 16, rng.randrange(1, 200)])
    header = wire.CheckmateHeader(
        msg_type=msg_type,
        job_id=job_id,
        iteration=rng.randrange(1000),
        bucket_id=rng.randrange(16),
        sender_rank=rng.randrange(8),
        element_offset=rng.randrange(1 << 20),
        element_count=count,
        sequence=rng.randrange(1 << 20),
        dtype=dtype,
        flags=flags,
        shard_key=shard_key,
    )
    return bytes(wire.encode(header, rng.randbytes(count * dtype.itemsize)))


# ---- the reference model of the switch ----------------------------------------------------------------
@dataclass
class SwitchModel:
    """What the Checkmate P4 program does, from the entities the controller plans for one switch."""

    sources: dict[int, int] = field(default_factory=dict)
    """/32 source -> the ingress port its Checkmate packets must come in on (check_source)."""
    routes: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """/32 destination -> (port, src MAC, dst MAC)."""
    jobs: dict[int, int] = field(default_factory=dict)
    """job id -> counter slot."""
    replicate: dict[tuple[int, int, int, int], int] = field(default_factory=dict)
    """(job id, ingress port, shard key, next-hop port) -> multicast group."""
    groups: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    rewrites: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)
    """rid -> (src MAC, dst MAC, dst IPv4, dst UDP port)."""

    @classmethod
    def from_entities(cls, entities: Iterable[Entity]) -> SwitchModel:
        model = cls()
        for e in entities:
            if isinstance(e, MulticastGroup):
                model.groups[e.group_id] = e.replicas
                continue
            assert isinstance(e, TableEntry)
            if e.table == "check_source":
                (m,) = e.match
                assert m.prefix_len == 32, "the model knows /32 sources only"
                model.sources[m.value] = e.param("port")
            elif e.table == "route_ipv4":
                (m,) = e.match
                assert m.prefix_len == 32, "the model knows /32 routes only"
                model.routes[m.value] = (e.param("port"), e.param("src_mac"), e.param("dst_mac"))
            elif e.table == "lookup_job":
                model.jobs[e.match_value("job_id")] = e.param("slot")
            elif e.table == "replicate_to_shadow":
                key = tuple(
                    e.match_value(n) for n in ("job_id", "ingress_port", "shard_key", "next_hop_port")
                )
                model.replicate[key] = e.param("group")  # type: ignore[index]
            elif e.table == "rewrite_shadow_copy":
                model.rewrites[e.match_value("egress_rid")] = (
                    e.param("src_mac"),
                    e.param("dst_mac"),
                    e.param("dst_addr"),
                    e.param("dst_port"),
                )
        return model

    def shadow_ports(self) -> set[int]:
        return {port for replicas in self.groups.values() for port, rid in replicas if rid != 0}

    def run(self, data: bytes, port: int) -> Verdict:
        """The verdict for ``data`` received on ``port``."""
        n = len(data)
        if n < ETH_END:
            return Verdict("drop", "MALFORMED_PACKET")
        if struct.unpack_from("!H", data, 12)[0] != 0x0800:
            return Verdict("drop", "NOT_IPV4")
        if n < IPV4_END:
            return Verdict("drop", "MALFORMED_PACKET")
        ver_ihl, flags_frag, ttl, proto, csum, src, dst = (
            data[ETH_END],
            struct.unpack_from("!H", data, ETH_END + 6)[0],
            data[ETH_END + 8],
            data[ETH_END + 9],
            struct.unpack_from("!H", data, ETH_END + 10)[0],
            struct.unpack_from("!I", data, ETH_END + 12)[0],
            struct.unpack_from("!I", data, ETH_END + 16)[0],
        )
        checkmate = False
        udp_len = 0
        if ver_ihl & 0x0F == 5 and flags_frag & 0x3FFF == 0 and proto == 17:
            if n < UDP_END:
                return Verdict("drop", "MALFORMED_PACKET")
            dport, udp_len = struct.unpack_from("!HH", data, IPV4_END + 2)
            if dport == wire.CHECKMATE_UDP_PORT:
                if n < CM_END or data[UDP_END] != wire.WIRE_VERSION or udp_len < 40:
                    return Verdict("drop", "MALFORMED_CHECKMATE")
                checkmate = True
        if ipv4_checksum(data[ETH_END:IPV4_END]) != csum:
            return Verdict("drop", "BAD_IPV4_CHECKSUM")
        if ttl <= 1:
            return Verdict("drop", "TTL_EXPIRED")
        if checkmate and self.sources.get(src, port) != port:
            return Verdict("drop", "SPOOFED_SOURCE")
        route = self.routes.get(dst)
        if route is None:
            return Verdict("drop", "NO_ROUTE")
        next_port, src_mac, dst_mac = route
        primary = _rewrite(data, dst_mac, src_mac, ttl - 1)
        if not (checkmate and data[UDP_END + 2] & wire.Flags.REPLICATE):
            return Verdict("forward", outputs=[(next_port, primary)])
        msg_type, dtype = data[UDP_END + 1], data[UDP_END + 3]
        job_id, shard_key, count = (
            struct.unpack_from("!I", data, UDP_END + 4)[0],
            struct.unpack_from("!H", data, UDP_END + 16)[0],
            struct.unpack_from("!I", data, UDP_END + 24)[0],
        )
        size = {1: 4, 2: 2, 3: 2}.get(dtype)
        if msg_type != wire.MessageType.DATA or size is None or udp_len - 40 != count * size:
            return Verdict("drop", "MALFORMED_CHECKMATE")
        slot = self.jobs.get(job_id, 0)
        group = self.replicate.get((job_id, port, shard_key, next_port))
        if group is None:
            return Verdict("forward", outputs=[(next_port, primary)], rejected_slot=slot)
        outputs = []
        copies = 0
        for out_port, rid in self.groups[group]:
            out = bytearray(primary)
            struct.pack_into("!H", out, IPV4_END + 6, 0)  # UDP checksum 0
            out[UDP_END + 2] &= 0xFF ^ int(wire.Flags.REPLICATE)
            if rid != 0:
                smac, dmac, daddr, dport = self.rewrites[rid]
                out[0:12] = dmac.to_bytes(6, "big") + smac.to_bytes(6, "big")
                struct.pack_into("!I", out, ETH_END + 16, daddr)
                struct.pack_into("!H", out, IPV4_END + 2, dport)
                fix_ipv4_checksum(out)
                copies += 1
            outputs.append((out_port, bytes(out)))
        return Verdict("replicate", outputs=outputs, copy_slot=slot, copies=copies)


@dataclass
class Verdict:
    kind: str
    """``drop``, ``forward`` or ``replicate``."""
    reason: str = ""
    outputs: list[tuple[int, bytes]] = field(default_factory=list)
    rejected_slot: int | None = None
    """Set when a tagged, well-formed packet was not copied (counted in rejected_replications)."""
    copy_slot: int | None = None
    copies: int = 0


def _rewrite(data: bytes, dst_mac: int, src_mac: int, ttl: int) -> bytes:
    out = bytearray(data)
    out[0:12] = dst_mac.to_bytes(6, "big") + src_mac.to_bytes(6, "big")
    out[ETH_END + 8] = ttl
    fix_ipv4_checksum(out)
    return bytes(out)


def tally(counts: Mapping[str, int]) -> str:
    """``a=3 b=2`` for a held-column summary, largest first."""
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
