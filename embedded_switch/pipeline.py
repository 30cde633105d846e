"""The data path of p4src/v1model/checkmate.p4 with v1model semantics, on bytes.

``Pipeline(state).process(frame, ingress_port)`` runs one frame through

    parser -> verify IPv4 checksum -> CheckmateIngress -> replication engine
    -> CheckmateEgress (once per replica, with its egress_rid) -> deparser

and returns the frames that leave, as ``(egress_port, frame)`` pairs. It reads
the tables, multicast groups and counters of a :class:`SwitchState` (written by
the P4Runtime server) and bumps the P4 counters exactly where the P4 source
does. Every packet that does not leave is counted in :attr:`Pipeline.drops` by
reason and port; the reasons below 16 are the P4 ``DROP_*`` constants of
p4src/shared/defines.p4, the others are the target's own (a multicast group
that does not exist, the v1model drop port, and the I/O layer's reasons).

v1model details this mirrors:

* a parser error does not drop by itself: ingress sees ``parser_error`` with
  the headers extracted so far still valid (a truncated or ``verify``-failed
  Checkmate header after a valid UDP header is ``DROP_MALFORMED_CHECKMATE``);
* ``egress_spec`` starts at 0, ``mark_to_drop`` sets it to 511 (the drop port)
  and clears ``mcast_grp``; a non-zero ``mcast_grp`` wins over ``egress_spec``;
* the replication engine makes one copy per (port, instance) of the group,
  with ``egress_rid = instance``; a group that does not exist copies nothing;
* the deparser emits the valid headers, then the unparsed rest of the frame
  untouched, and ``update_checksum`` recomputes the IPv4 checksum.

Speed: the decision for a packet depends only on a few header fields, the
ingress port and the tables. The pipeline interprets the program once per
distinct (port, fields) key and caches the resulting decision; later packets
with the same key only verify their IPv4 checksum and get their bytes patched.
The key includes the IPv4 source (``check_source`` reads it). The cache is
dropped whenever a table's entries or default action change
(``Table.generation``, every table the program applies), and a cached
multicast decision is used only while the group still holds the very same
replica tuple.
"""

from __future__ import annotations

import enum
import logging
import struct
import threading
from collections.abc import Iterable

from checkmate import wire
from checkmate.p4 import names
from embedded_switch.state import CounterArray, Replica, SwitchState, Table

Buffer = bytes | bytearray | memoryview

logger = logging.getLogger(__name__)

# ---- constants of p4src/shared/defines.p4 -----------------------------------------------------------
ETHERTYPE_IPV4 = 0x0800
IP_PROTOCOL_UDP = 17
# The Checkmate header constants come from the one wire-format implementation.
CHECKMATE_UDP_PORT = wire.CHECKMATE_UDP_PORT
CHECKMATE_VERSION = wire.WIRE_VERSION
UDP_HEADER_BYTES = wire.UDP_HEADER_BYTES
CHECKMATE_HEADER_BYTES = wire.HEADER_BYTES
CHECKMATE_MSG_DATA = int(wire.MessageType.DATA)
CHECKMATE_FLAG_REPLICATE = int(wire.Flags.REPLICATE)
CHECKMATE_DTYPE_FP32 = int(wire.DType.FP32)
CHECKMATE_DTYPE_BF16 = int(wire.DType.BF16)
CHECKMATE_DTYPE_FP16 = int(wire.DType.FP16)
UNKNOWN_JOB_SLOT = 0

V1MODEL_DROP_PORT = 511
"""``egress_spec`` value v1model (BMv2) treats as "drop"; ``mark_to_drop`` sets it."""


class DropReason(enum.IntEnum):
    """Why a packet did not leave. Values 0-7 are the P4 ``DROP_*`` constants (counter indices)."""

    NOT_IPV4 = 0
    NO_ROUTE = 1
    TTL_EXPIRED = 2
    MALFORMED_PACKET = 3
    MALFORMED_CHECKMATE = 4
    BAD_IPV4_CHECKSUM = 5
    NO_SHADOW_DESTINATION = 6
    SPOOFED_SOURCE = 7
    """A Checkmate packet from a known host's address (a ``check_source`` entry) on another port."""
    # ---- the target's own reasons (no P4 counter) ----
    UNKNOWN_MULTICAST_GROUP = 16
    """The packet chose a multicast group nobody created (BMv2 drops it silently)."""
    DROP_PORT = 17
    """Unicast to the v1model drop port 511."""
    NO_SUCH_PORT = 18
    """Sent to a port no interface is bound to (I/O layer)."""
    FAULT_INJECTION = 19
    """Dropped on purpose by ``--drop-egress`` (I/O layer)."""
    TX_ERROR = 20
    """The interface refused the frame (I/O layer)."""
    RX_TRUNCATED = 21
    """Larger than the receive buffer (I/O layer)."""
    NO_PIPELINE = 22
    """Arrived before a controller pushed a pipeline config (I/O layer)."""
    KERNEL_RX_OVERFLOW = 23
    """The kernel dropped a frame for the port because the switch's receive queue was full."""
    KERNEL_TX_DROPPED = 24
    """The interface dropped a frame the switch sent (e.g. a veth peer's backlog was full)."""


# Byte offsets (Ethernet at 0; IPv4 without options at 14; UDP at 34; Checkmate at 42).
_ETH_END = 14
_IPV4_END = 34
_UDP_END = 42
_CHECKMATE_END = 74

_ETHERTYPE = struct.Struct("!H")
_IPV4 = struct.Struct("!BBHHHBBHII")  # ver_ihl tos total_len id flags_frag ttl proto csum src dst
_UDP = struct.Struct("!HHHH")
_CHECKMATE = struct.Struct("!BBBBIIHHHHIII")
_TTL_PROTO_CSUM = struct.Struct("!BBH")
_PACK_TTL_PROTO_CSUM = _TTL_PROTO_CSUM.pack_into
_DST = struct.Struct("!I")
_UDP_TAIL = struct.Struct("!HHHBBBB")  # dst_port length checksum | version msg_type flags dtype

# Fields the decision depends on, read in one call from offset 12 (frames >= 74 bytes only):
# ethertype | ver_ihl (tos len id) flags_frag ttl proto (csum) src dst | (sport) dport ulen (ucsum)
# | version msg_type flags dtype job_id (iteration bucket rank) shard_key (reserved offset) count
# The source address is in the key because check_source decides on it (with the ingress port,
# the cache's other key); native/_datapath.c keeps the same bytes (its key_mask).
_KEY = struct.Struct("!HB5xHBB2xII2xHH2xBBBBI8xH6xI")
assert _KEY.size + 12 == 70

_TTL_SHIFT = 88  # the TTL byte's place in the 20-byte IPv4 header read as one big-endian integer
_CSUM_SHIFT = 64
_CACHE_LIMIT = 4096


def _csum16(total: int) -> int:
    """BMv2's csum16 of words whose plain sum is congruent to ``total`` (a big-endian integer).

    Summing 16-bit words with end-around carry is arithmetic modulo 0xFFFF, and a
    big-endian integer is congruent to the sum of its 16-bit words. The carry fold
    yields 0 only when every word is 0, else a value in [1, 0xFFFF].
    """
    if total == 0:
        return 0xFFFF
    return ((total - 1) % 0xFFFF + 1) ^ 0xFFFF


def ipv4_checksum(header: bytes | bytearray | memoryview) -> int:
    """The IPv4 header checksum of the first 20 bytes of ``header`` (checksum field ignored)."""
    value = int.from_bytes(header[:20], "big")
    return _csum16(value - (((value >> _CSUM_SHIFT) & 0xFFFF) << _CSUM_SHIFT))


class DropStats:
    """Dropped packets by (reason, port): the ingress port for ingress drops, else the egress port."""

    def __init__(self) -> None:
        self._counts: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    def count(self, reason: int, port: int, packets: int = 1) -> None:
        key = (reason, port)
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + packets

    def snapshot(self) -> dict[tuple[int, int], int]:
        with self._lock:
            return dict(self._counts)

    def by_reason(self) -> dict[DropReason, int]:
        out: dict[DropReason, int] = {}
        for (reason, _port), n in self.snapshot().items():
            out[DropReason(reason)] = out.get(DropReason(reason), 0) + n
        return out

    def by_port(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for (_reason, port), n in self.snapshot().items():
            out[port] = out.get(port, 0) + n
        return out

    def total(self) -> int:
        return sum(self.snapshot().values())

    def describe(self) -> str:
        """One line for logs, e.g. ``NO_ROUTE@1=3 FAULT_INJECTION@2=10``."""
        items = sorted(self.snapshot().items())
        return " ".join(f"{DropReason(r).name}@{p}={n}" for (r, p), n in items) or "none"


Cell = tuple[CounterArray, int]
"""A counter cell to bump: (counter, index), the index checked when the decision was made."""

_Output = tuple[int, bytes, int, int, int, "bytes | None", "bytes | None", tuple[Cell, ...]]
"""One frame that leaves, as how it differs from the input frame:
(egress port, new dst+src MACs (12 bytes), TTL, protocol, IPv4 header delta (the change of
the 20-byte header read as one integer, checksum zeroed), new IPv4 dst (4 bytes) or None,
new bytes 36..45 (UDP dst port, length, checksum 0, Checkmate version..dtype) or None,
egress counter cells)."""

_Decision = tuple[
    bool,
    int,
    "tuple[Replica, ...] | None",
    tuple[Cell, ...],
    tuple[tuple[int, int], ...],
    tuple[_Output, ...],
]
"""What the program does with every packet of one key (fields, port, table contents):
(holds only if the IPv4 checksum verifies, multicast group (0: none), the group's replica
tuple it was made with (identity-checked on reuse), ingress counter cells, pipeline drops
(reason, port), outputs). Plain tuples: the cached path unpacks them without attribute look-ups."""


class Pipeline:
    """The Checkmate program's data path over a :class:`SwitchState`.

    Not thread-safe: one I/O thread calls :meth:`process`. Table writes from other
    threads are seen at the next call.
    """

    def __init__(self, state: SwitchState, drops: DropStats | None = None, cache: bool = True) -> None:
        self.drops = drops if drops is not None else DropStats()
        self._use_cache = cache
        self._state = state
        self._bind(state)

    # ---- state ------------------------------------------------------------------------------------
    @property
    def state(self) -> SwitchState:
        return self._state

    @state.setter
    def state(self, state: SwitchState) -> None:
        """Swap in a new program state (a new pipeline config was pushed)."""
        self._bind(state)
        self._state = state

    def _bind(self, state: SwitchState) -> None:
        # Keys and action parameters are positional: embedded_switch.program.PIPELINE says in
        # which order, and build_state refuses a P4Info whose order differs.
        self._source: Table = state.table(names.CheckSource.NAME)
        self._route: Table = state.table(names.RouteIpv4.NAME)
        self._job: Table = state.table(names.LookupJob.NAME)
        self._replicate: Table = state.table(names.ReplicateToShadow.NAME)
        self._rewrite: Table = state.table(names.RewriteShadowCopy.NAME)
        self._tables = (self._source, self._route, self._job, self._replicate, self._rewrite)
        self._ingress_drops: CounterArray = state.counter(names.IngressDrops.NAME)
        self._rejected: CounterArray = state.counter(names.RejectedReplications.NAME)
        self._shadow_copies: CounterArray = state.counter(names.ShadowCopies.NAME)
        self._egress_drops: CounterArray = state.counter(names.EgressDrops.NAME)
        self._cache: dict[int, dict[tuple[int, ...], _Decision]] = {}
        self._token: tuple[object, ...] = ()

    def _refresh(self) -> None:
        """Drop cached decisions if any table changed since they were made."""
        token = self._cache_token()
        if token != self._token:
            self._cache = {}
            self._token = token

    def _cache_token(self) -> tuple[object, ...]:
        """Equal for as long as cached decisions stay valid (every table's entries and default action)."""
        return tuple((t.generation, t.default_action) for t in self._tables)

    # ---- what a compiled flow cache (embedded_switch.native) calls -------------------------------
    def cache_view(self) -> tuple[tuple[object, ...], dict[int, tuple[Replica, ...]]]:
        """Once per batch: the token cached decisions are valid for, and the multicast groups.

        A decision that chose a multicast group holds only while the group maps to the very
        replica tuple the decision names (identity, as on the Python cached path).
        """
        return self._cache_token(), self._state.multicast_groups

    def native_miss(self, frame: bytes, port: int) -> tuple[list[tuple[int, bytearray]], _Decision | None]:
        """One frame the compiled cache could not handle, run exactly as :meth:`process` would.

        Counts what the frame counts and returns its outputs, with the decision a cache may
        keep under the frame's key (None: nothing to keep — a frame shorter than the key, a
        per-packet drop such as a bad checksum, or a pipeline built with ``cache=False``).
        """
        n = len(frame)
        result: list[tuple[int, bytearray]] = []
        decision = self._decide(frame, n, port)
        if decision is None:
            return result, None
        self._execute(decision, frame, n, result)
        return result, decision if n >= _CHECKMATE_END and self._use_cache else None

    # ---- the packet path --------------------------------------------------------------------------
    def process(self, frame: Buffer, ingress_port: int) -> list[tuple[int, bytearray]]:
        """Run one frame received on ``ingress_port``; return the (egress port, frame) pairs that leave."""
        self._refresh()
        result: list[tuple[int, bytearray]] = []
        self._process(frame, ingress_port, result)
        return result

    def process_batch(self, frames: Iterable[Buffer], ingress_port: int) -> list[tuple[int, bytearray]]:
        """Run frames received back to back on one port; their outputs in order."""
        self._refresh()
        result: list[tuple[int, bytearray]] = []
        process = self._process
        for frame in frames:
            process(frame, ingress_port, result)
        return result

    def _process(self, frame: Buffer, port: int, result: list[tuple[int, bytearray]]) -> None:
        n = len(frame)
        if n < _CHECKMATE_END or not self._use_cache:
            decision = self._decide(frame, n, port)
            if decision is not None:
                self._execute(decision, frame, n, result)
            return
        key = _KEY.unpack_from(frame, 12)
        per_port = self._cache.get(port)
        if per_port is None:
            per_port = self._cache[port] = {}
        decision = per_port.get(key)
        if decision is not None:
            if decision[1] and self._state.multicast_groups.get(decision[1]) is not decision[2]:
                decision = None  # the group changed since
            elif decision[0]:
                header = int.from_bytes(frame[_ETH_END:_IPV4_END], "big")
                stored = (header >> _CSUM_SHIFT) & 0xFFFF
                base = header - (stored << _CSUM_SHIFT)
                if base and ((base - 1) % 0xFFFF + 1) ^ 0xFFFF == stored:
                    # _execute, inlined: this is the path nearly every packet takes.
                    _needs_checksum, _group, _replicas, counts, drops, outputs = decision
                    for counter, index in counts:
                        counter.packets[index] += 1
                        counter.bytes[index] += n
                    if drops:
                        for reason, drop_port in drops:
                            self.drops.count(reason, drop_port)
                    for out_port, macs, ttl, proto, delta, dst, udp_tail, cells in outputs:
                        out = bytearray(frame)
                        out[0:12] = macs
                        _PACK_TTL_PROTO_CSUM(out, 22, ttl, proto, ((base + delta - 1) % 0xFFFF + 1) ^ 0xFFFF)
                        if dst is not None:
                            out[30:34] = dst
                        if udp_tail is not None:
                            out[36:46] = udp_tail
                        for counter, index in cells:
                            counter.packets[index] += 1
                            counter.bytes[index] += n
                        result.append((out_port, out))
                    return
                decision = None  # a bad checksum: interpret, which counts the drop
        if decision is None:
            decision = self._decide(frame, n, port)
            if decision is None:
                return
            if len(per_port) >= _CACHE_LIMIT:
                per_port.clear()
            per_port[key] = decision
        self._execute(decision, frame, n, result)

    def _execute(
        self, decision: _Decision, frame: Buffer, n: int, result: list[tuple[int, bytearray]], base: int = -1
    ) -> None:
        """Count, and build the outputs from ``frame`` (``base``: its IPv4 header as an int, checksum 0)."""
        _needs_checksum, _group, _replicas, counts, drops, outputs = decision
        for counter, index in counts:
            counter.packets[index] += 1
            counter.bytes[index] += n
        for reason, port in drops:
            self.drops.count(reason, port)
        if not outputs:
            return
        if base < 0:
            header = int.from_bytes(frame[_ETH_END:_IPV4_END], "big")
            base = header - (((header >> _CSUM_SHIFT) & 0xFFFF) << _CSUM_SHIFT)
        append = result.append
        pack_into = _TTL_PROTO_CSUM.pack_into
        for port, macs, ttl, proto, delta, dst, udp_tail, cells in outputs:
            out = bytearray(frame)
            out[0:12] = macs
            # base + delta > 0: the TTL/protocol word is never 0 for a packet that leaves
            pack_into(out, 22, ttl, proto, ((base + delta - 1) % 0xFFFF + 1) ^ 0xFFFF)
            if dst is not None:
                out[30:34] = dst
            if udp_tail is not None:
                out[36:46] = udp_tail
            for counter, index in cells:
                counter.packets[index] += 1
                counter.bytes[index] += n
            append((port, out))

    # ---- the program, interpreted -----------------------------------------------------------------
    def _decide(self, frame: Buffer, n: int, port: int) -> _Decision | None:
        """Interpret the P4 program for this frame.

        Returns the decision to execute, or None when the packet was dropped for a
        per-packet reason (bad checksum) and has already been counted.
        """
        # -- parser (CheckmateHeaderParser) --
        if n < _ETH_END:
            return self._ingress_drop(DropReason.MALFORMED_PACKET, port, needs_checksum=False)
        (ether_type,) = _ETHERTYPE.unpack_from(frame, 12)
        if ether_type != ETHERTYPE_IPV4:
            return self._ingress_drop(DropReason.NOT_IPV4, port, needs_checksum=False)
        if n < _IPV4_END:
            return self._ingress_drop(DropReason.MALFORMED_PACKET, port, needs_checksum=False)
        ver_ihl, _tos, _len, _id, flags_frag, ttl, proto, stored_csum, src, dst = _IPV4.unpack_from(
            frame, _ETH_END
        )
        udp_valid = checkmate_valid = parser_error = False
        udp_dport = udp_len = 0
        cm: tuple[int, ...] = ()
        if ver_ihl & 0x0F == 5 and flags_frag & 0x3FFF == 0 and proto == IP_PROTOCOL_UDP:
            if n < _UDP_END:
                parser_error = True
            else:
                udp_valid = True
                _sport, udp_dport, udp_len, _ucsum = _UDP.unpack_from(frame, _IPV4_END)
                if udp_dport == CHECKMATE_UDP_PORT:
                    if n < _CHECKMATE_END:
                        parser_error = True
                    else:
                        checkmate_valid = True
                        cm = _CHECKMATE.unpack_from(frame, _UDP_END)
                        if cm[0] != CHECKMATE_VERSION:
                            parser_error = True  # error.CheckmateBadVersion
                        elif udp_len < UDP_HEADER_BYTES + CHECKMATE_HEADER_BYTES:
                            parser_error = True  # error.CheckmateBadLength
        # -- CheckmateIngress --
        if parser_error:
            if udp_valid and udp_dport == CHECKMATE_UDP_PORT:
                return self._ingress_drop(DropReason.MALFORMED_CHECKMATE, port, needs_checksum=False)
            return self._ingress_drop(DropReason.MALFORMED_PACKET, port, needs_checksum=False)
        if ipv4_checksum(frame[_ETH_END:_IPV4_END]) != stored_csum:
            self._ingress_drops.count(DropReason.BAD_IPV4_CHECKSUM, n)
            self.drops.count(DropReason.BAD_IPV4_CHECKSUM, port)
            return None
        if ttl <= 1:
            return self._ingress_drop(DropReason.TTL_EXPIRED, port, needs_checksum=True)
        if checkmate_valid:
            # check_source: a known host's address must come in on that host's port.
            action = self._source.lookup((src,)).action
            if action.name == names.ExpectPort.NAME and action.params[0] != port:
                return self._ingress_drop(DropReason.SPOOFED_SOURCE, port, needs_checksum=True)

        counts: list[Cell] = []
        routed = replicated = False
        next_hop_port = 0
        macs = b""
        egress_spec = 0
        mcast_grp = 0
        job_slot = UNKNOWN_JOB_SLOT
        action = self._route.lookup((dst,)).action
        if action.name == names.Forward.NAME:
            next_hop_port, src_mac, dst_mac = action.params
            routed = True
            macs = dst_mac.to_bytes(6, "big") + src_mac.to_bytes(6, "big")
            ttl -= 1
        else:
            return self._ingress_drop(DropReason.NO_ROUTE, port, needs_checksum=True)

        if checkmate_valid and cm[2] & CHECKMATE_FLAG_REPLICATE:
            msg_type, dtype, job_id, shard_key, count = cm[1], cm[3], cm[4], cm[8], cm[11]
            action = self._job.lookup((job_id,)).action
            job_slot = action.params[0] if action.name == names.SetJobSlot.NAME else UNKNOWN_JOB_SLOT
            payload_bytes = udp_len - UDP_HEADER_BYTES - CHECKMATE_HEADER_BYTES
            expected_bytes = 0xFFFFFFFF
            if count >> 16 == 0:
                if dtype == CHECKMATE_DTYPE_FP32:
                    expected_bytes = count << 2
                elif dtype in (CHECKMATE_DTYPE_BF16, CHECKMATE_DTYPE_FP16):
                    expected_bytes = count << 1
            if msg_type != CHECKMATE_MSG_DATA or payload_bytes != expected_bytes:
                return self._ingress_drop(DropReason.MALFORMED_CHECKMATE, port, needs_checksum=True)
            action = self._replicate.lookup((job_id, port, shard_key, next_hop_port)).action
            if action.name == names.SetMulticastGroup.NAME:
                mcast_grp = action.params[0]
                replicated = True
            else:
                counts += _cell(self._rejected, job_slot)
        if routed and not replicated:
            egress_spec = next_hop_port

        # -- replication engine --
        drops: list[tuple[int, int]] = []
        replicas: tuple[Replica, ...] | None = None
        if mcast_grp != 0:
            replicas = self._state.multicast_groups.get(mcast_grp)
            if replicas is None:
                drops.append((DropReason.UNKNOWN_MULTICAST_GROUP, port))
            copies = [(r.egress_port, r.instance) for r in replicas or ()]
        elif egress_spec == V1MODEL_DROP_PORT:
            drops.append((DropReason.DROP_PORT, port))
            copies = []
        else:
            copies = [(egress_spec, 0)]

        # -- CheckmateEgress + deparser, per replica --
        outputs = []
        ttl_delta = -(1 << _TTL_SHIFT)  # forward() decremented the TTL
        for egress_port, egress_rid in copies:
            out_macs, out_dst, out_dport = macs, dst, udp_dport
            egress_counts: tuple[Cell, ...] = ()
            udp_tail = None
            if replicated and checkmate_valid:
                if egress_rid != 0:
                    action = self._rewrite.lookup((egress_rid,)).action
                    if action.name != names.SetShadowDestination.NAME:
                        drops.append((DropReason.NO_SHADOW_DESTINATION, egress_port))
                        counts += _cell(self._egress_drops, DropReason.NO_SHADOW_DESTINATION)
                        continue
                    src_mac, dst_mac, out_dst, out_dport = action.params
                    out_macs = dst_mac.to_bytes(6, "big") + src_mac.to_bytes(6, "big")
                    egress_counts = _cell(self._shadow_copies, job_slot)
                udp_tail = _UDP_TAIL.pack(
                    out_dport, udp_len, 0, cm[0], cm[1], cm[2] & ~CHECKMATE_FLAG_REPLICATE & 0xFF, cm[3]
                )
            output: _Output = (
                egress_port,
                out_macs,
                ttl,
                proto,
                ttl_delta + out_dst - dst,
                _DST.pack(out_dst) if out_dst != dst else None,
                udp_tail,
                egress_counts,
            )
            outputs.append(output)
        return (True, mcast_grp, replicas, tuple(counts), tuple(drops), tuple(outputs))

    def _ingress_drop(self, reason: DropReason, port: int, *, needs_checksum: bool) -> _Decision:
        """CheckmateIngress.drop(reason): count in ingress_drops, mark_to_drop."""
        return (needs_checksum, 0, None, _cell(self._ingress_drops, reason), ((int(reason), port),), ())


def _cell(counter: CounterArray, index: int) -> tuple[Cell, ...]:
    """The cell ``counter[index]`` to bump, or none (logged) if the index is out of range."""
    if 0 <= index < counter.size:
        return ((counter, int(index)),)
    logger.warning("counter %s: index %d out of range %d", counter.alias, index, counter.size)
    return ()
