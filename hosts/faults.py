"""Seeded fault injection for the host transport: drop, duplicate and reorder datagrams.

The machine has no netem, so tests inject loss where the datagrams are made:
:class:`FaultInjector` decides, with its own seeded random generator, whether
each datagram the transport sends (or receives) is dropped, sent twice, or held
back and sent after the next one. Every decision is counted, so a test can say
how many faults it actually exercised.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class FaultConfig:
    """Probabilities (0..1) of each fault, applied independently per datagram."""

    seed: int = 0
    send_drop: float = 0.0
    """Drop a datagram instead of sending it (data, ACK and NACK alike)."""
    recv_drop: float = 0.0
    """Discard a received datagram before it is parsed."""
    duplicate: float = 0.0
    """Send a datagram twice."""
    reorder: float = 0.0
    """Hold a datagram back and send it after the next one."""

    def __post_init__(self) -> None:
        for name in ("send_drop", "recv_drop", "duplicate", "reorder"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value} must be in [0, 1)")

    @property
    def active(self) -> bool:
        return any((self.send_drop, self.recv_drop, self.duplicate, self.reorder))


class SendAction:
    DROP = 0
    SEND = 1
    DUPLICATE = 2
    HOLD = 3


class FaultInjector:
    """Thread-safe per-datagram fault decisions from one seeded generator."""

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._lock = threading.Lock()
        self.counts = {"send_drop": 0, "recv_drop": 0, "duplicate": 0, "reorder": 0}

    def on_send(self) -> int:
        """One of :class:`SendAction`'s values for the next outgoing datagram."""
        c = self.config
        with self._lock:
            r = self._rng.random()
            if r < c.send_drop:
                self.counts["send_drop"] += 1
                return SendAction.DROP
            r -= c.send_drop
            if r < c.duplicate:
                self.counts["duplicate"] += 1
                return SendAction.DUPLICATE
            r -= c.duplicate
            if r < c.reorder:
                self.counts["reorder"] += 1
                return SendAction.HOLD
            return SendAction.SEND

    def drop_received(self) -> bool:
        if not self.config.recv_drop:
            return False
        with self._lock:
            if self._rng.random() < self.config.recv_drop:
                self.counts["recv_drop"] += 1
                return True
            return False
