"""The switch's shadow copy, emulated on loopback: tap a worker's sends and copy tagged datagrams.

Loopback has no switch, so a worker's transport is tapped right where it
hands frames to the socket: every DATA datagram carrying REPLICATE is copied,
with REPLICATE cleared (as the switch's egress does), to the UDP address of
the shadow owning its shard key. Seeded loss, duplication and reordering are
injected on the copies only, so the shadows must repair.
"""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checkmate.network import Addr
from checkmate.wire import Flags, MessageType


@dataclass(frozen=True)
class CopyFaults:
    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    """Fraction of copies held back and sent after the next one."""
    seed: int = 0


class CopyTap:
    def __init__(self, transport: Any, shadows: Mapping[int, Addr], faults: CopyFaults, rank: int) -> None:
        self.shadows = dict(shadows)
        self.faults = faults
        self.rng = random.Random(faults.seed * 1000 + rank)
        self.counters = {"copied": 0, "lost": 0, "duplicated": 0, "reordered": 0}
        self._lock = threading.Lock()
        self._held: tuple[bytes, Addr] | None = None
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((transport.address[0], 0))
        if getattr(transport, "native", None) is not None:  # the compiled data path: its copy hook
            transport.copy_hook = lambda data, addr: self._copy([data])
            return
        original = transport._sendmsg

        def tapped(parts: Sequence[Any], addr: Addr) -> None:
            original(parts, addr)
            self._copy(parts)

        transport._sendmsg = tapped

    def _copy(self, parts: Sequence[Any]) -> None:
        head = bytes(parts[0][:4]) if len(parts[0]) >= 4 else b""
        if len(head) < 4 or head[1] != MessageType.DATA or not head[2] & Flags.REPLICATE:
            return
        data = bytearray(b"".join(bytes(p) for p in parts))
        data[2] &= ~int(Flags.REPLICATE) & 0xFF
        target = self.shadows[int.from_bytes(data[16:18], "big")]
        with self._lock:
            self.counters["copied"] += 1
            roll = self.rng.random()
            f = self.faults
            if roll < f.loss:
                self.counters["lost"] += 1
                return
            if roll < f.loss + f.reorder and self._held is None:
                self.counters["reordered"] += 1
                self._held = (bytes(data), target)
                return
            self._sock.sendto(data, target)
            if roll < f.loss + f.reorder + f.duplicate:
                self.counters["duplicated"] += 1
                self._sock.sendto(data, target)
            if self._held is not None:
                held, self._held = self._held, None
                self._sock.sendto(held[0], held[1])

    def flush(self) -> None:
        with self._lock:
            if self._held is not None:
                self._sock.sendto(self._held[0], self._held[1])
                self._held = None
