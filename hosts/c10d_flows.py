"""The ``checkmate`` backend's flow collectives: messages on the transport's reliable flows.

Every collective but the ring's all-reduce sends each rank's bytes straight to the ranks that need
them as DATA datagrams of a second job on the same socket (the ring's job id + 2**31): header
``iteration`` = the group's flow counter, ``sender_rank``, ``element_offset``/``element_count`` in
2-byte units of the raw bytes. The receiver copies them into per-sender buffers and completes the
collective once every expected byte arrived (docs/backend.md). :class:`FlowCollectives` is the
component of :class:`hosts.c10d_backend.CheckmateProcessGroup` that does this: it owns the table of
operations in flight, the datagrams that came before their operation, the flow counter, the
group's failure and closed state, all under its one lock, and its deadline watch thread
(``cm-pg-<rank>``); the group passes it the transport and the peers, and calls its methods.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from checkmate.wire import MAX_PAYLOAD_BYTES, DType, pack_data_header
from hosts.c10d_work import CheckmateBackendError, FutureWork, as_bytes, from_bytes
from hosts.ring_allreduce import MAX_ITERATION
from hosts.ring_config import CollectiveError
from hosts.transport import Addr, PeerTimeoutError, Transport

__all__ = ["FlowCollectives", "FlowOp"]

logger = logging.getLogger(__name__)

_PIECE = MAX_PAYLOAD_BYTES - MAX_PAYLOAD_BYTES % 2
"""Bytes per datagram of a flow message (even: payloads travel as 2-byte elements)."""
_WIRE_UNIT = DType.FP16
"""Flow payloads are raw bytes; the header counts them in 2-byte units (odd tails padded)."""


@dataclass
class FlowOp:
    """One flow collective on this rank: the bytes it waits for from each peer."""

    name: str
    expected: dict[int, int]
    """Sender rank -> bytes it sends this rank."""
    buffers: dict[int, torch.Tensor]
    """Sender rank -> a uint8 tensor of ``expected[sender]`` bytes, filled as datagrams arrive."""
    finish: Callable[[dict[int, torch.Tensor]], Any]
    """Runs once everything arrived (receive thread); its value is the future's."""
    deadline: float
    received: dict[int, int] = field(default_factory=dict)
    future: torch.futures.Future[Any] = field(default_factory=torch.futures.Future)
    done: bool = False


class FlowCollectives:
    """Flow collectives of one process group: the operations in flight, their deadlines, the failure.

    ``transport`` is None for a group of one rank (nothing is ever sent: the group completes every
    collective itself); then only :meth:`check_usable` and :meth:`close` are called.
    """

    def __init__(
        self,
        rank: int,
        world: int,
        timeout: float,
        transport: Transport | None = None,
        peers: tuple[Addr, ...] = (),
        flow_job_id: int = 0,
    ) -> None:
        self._rank = rank
        self._world = world
        self._timeout = timeout
        self._transport = transport
        self._peers = peers
        self._flow_job_id = flow_job_id
        self._lock = threading.Lock()
        self._ops: dict[int, FlowOp] = {}
        self._early: dict[int, list[tuple[int, int, int, bytes]]] = {}
        """Flow op -> (sender, byte offset, bytes announced, payload) that came before the op started here."""
        self._flow_seq = 0
        self._failed: BaseException | None = None
        self._closed = False
        self._watch_event = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (every later collective raises)."""
        return self._closed

    def start_watch(self) -> None:
        """Start the deadline watch thread (``cm-pg-<rank>``; it ends at :meth:`close`)."""
        self._watchdog = threading.Thread(target=self._watch, name=f"cm-pg-{self._rank}", daemon=True)
        self._watchdog.start()

    def close(self, error: BaseException) -> bool:
        """Fail every pending collective with ``error`` and stop the watch; False if already closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        self._fail_all(error)
        self._watch_event.set()
        return True

    def barrier(self) -> dist.Work:
        """A one-byte token from every rank to every rank: completes once every rank has entered it."""
        token = torch.zeros(1, dtype=torch.uint8)
        return self.exchange("barrier", {r: token for r in range(self._world)}, token, lambda parts: [])

    def sum_in_rank_order(self, parts: dict[int, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """``parts[0] + parts[1] + ... + parts[N-1]`` in ``like``'s dtype; this rank's part is ``like``."""
        values = [
            like.reshape(-1) if r == self._rank else from_bytes(parts[r], like).reshape(-1)
            for r in range(self._world)
        ]
        total = values[0].clone()
        for value in values[1:]:
            total += value
        return total.view(like.shape)

    def exchange(
        self,
        name: str,
        sends: dict[int, torch.Tensor],
        like: torch.Tensor,
        finish: Callable[[dict[int, torch.Tensor]], Any],
    ) -> dist.Work:
        """Send ``sends[r]`` to each other rank r and wait for every other rank's ``like``-sized part."""
        others = [r for r in range(self._world) if r != self._rank]
        return self.flow_op(
            name,
            {r: t for r, t in sends.items() if r != self._rank},
            others,
            like.numel() * like.element_size(),
            finish,
        )

    def flow_op(
        self,
        name: str,
        sends: dict[int, torch.Tensor],
        expect_from: Sequence[int],
        nbytes: int,
        finish: Callable[[dict[int, torch.Tensor]], Any],
    ) -> dist.Work:
        """Start one flow collective: its sends and the receipt of ``nbytes`` from each of ``expect_from``."""
        assert self._transport is not None
        if (nbytes + 1) // 2 > 0xFFFFFFFF:
            raise ValueError(f"{name}: a {nbytes}-byte message exceeds the wire's 32-bit offsets")
        record = FlowOp(
            name=name,
            expected={r: nbytes for r in expect_from},
            buffers={r: torch.empty(nbytes, dtype=torch.uint8) for r in expect_from},
            finish=finish,
            deadline=time.monotonic() + self._timeout,
        )
        payloads = {r: as_bytes(t) for r, t in sends.items()}
        with self._lock:
            self.check_usable()
            seq = self._flow_seq
            self._flow_seq = (seq + 1) % (MAX_ITERATION + 1)
            self._ops[seq] = record
            early = self._early.pop(seq, [])
            self._watch_event.set()
        try:
            for dst, payload in payloads.items():
                self._send_message(seq, dst, payload)
        except (PeerTimeoutError, CollectiveError) as exc:
            self._fail_op(seq, exc)
        for sender, offset, announced, data in early:
            self._accept(seq, sender, offset, announced, memoryview(data))
        self._complete_ifdone_work(seq)
        return FutureWork(record.future)

    def _send_message(self, seq: int, dst: int, payload: torch.Tensor) -> None:
        assert self._transport is not None
        view = payload.numpy().data.cast("B") if payload.numel() else memoryview(b"")
        total = len(view)
        for start in range(0, total, _PIECE):
            piece = view[start : start + _PIECE]
            if len(piece) % 2:
                piece = memoryview(bytes(piece) + b"\0")
            header = bytearray(32)
            pack_data_header(
                header,
                0,
                int(_WIRE_UNIT),
                self._flow_job_id,
                seq,
                0,
                self._rank,
                0,
                start // 2,
                len(piece) // 2,
            )
            self._transport.send_packed(self._peers[dst], self._flow_job_id, header, piece)

    # ---- receive side (the transport's thread) -----------------------------------------------
    def on_fields(self, fields: tuple[int, ...], payload: memoryview, addr: Addr) -> None:
        seq, sender = fields[5], fields[7]
        offset = fields[10] * 2
        with self._lock:
            if seq not in self._ops:
                if not self._closed:
                    self._early.setdefault(seq, []).append((sender, offset, len(payload), bytes(payload)))
                return
        self._accept(seq, sender, offset, len(payload), payload)
        self._complete_ifdone_work(seq)

    def _accept(self, seq: int, sender: int, offset: int, announced: int, payload: memoryview) -> None:
        with self._lock:
            record = self._ops.get(seq)
            if record is None or record.done or sender not in record.expected:
                self._drop(f"{record.name if record else 'stale'} from unexpected rank {sender}")
                return
            expected = record.expected[sender]
            count = min(announced, expected - offset)
            if count < 0 or offset < 0:
                self._drop(f"{record.name}: bytes {offset}.. from rank {sender} beyond its {expected}")
                return
            record.buffers[sender][offset : offset + count].copy_(
                torch.frombuffer(payload[:count], dtype=torch.uint8)
                if count
                else torch.empty(0, dtype=torch.uint8)
            )
            record.received[sender] = record.received.get(sender, 0) + count

    def _complete_ifdone_work(self, seq: int) -> None:
        with self._lock:
            record = self._ops.get(seq)
            if record is None or record.done:
                return
            if any(record.received.get(r, 0) < n for r, n in record.expected.items()):
                return
            record.done = True
            del self._ops[seq]
        try:
            value = record.finish(record.buffers)
        except Exception as exc:  # noqa: BLE001 - a failed finish fails the caller's Work, not this thread
            record.future.set_exception(exc)
            return
        record.future.set_result(value)

    def _drop(self, why: str) -> None:
        logger.warning("checkmate backend rank %d: dropped a datagram (%s)", self._rank, why)

    # ---- failures -----------------------------------------------------------------------------
    def check_usable(self) -> None:
        """Raise :class:`CheckmateBackendError` if the group was shut down or failed earlier."""
        if self._closed:
            raise CheckmateBackendError("the checkmate process group was shut down")
        if self._failed is not None:
            raise CheckmateBackendError(f"the checkmate process group failed earlier: {self._failed}")

    def _fail_op(self, seq: int, error: BaseException) -> None:
        with self._lock:
            record = self._ops.pop(seq, None)
            if record is None or record.done:
                return
            record.done = True
        record.future.set_exception(error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            records = [r for r in self._ops.values() if not r.done]
            for record in records:
                record.done = True
            self._ops.clear()
        for record in records:
            record.future.set_exception(error)

    def waiting_since(self) -> float | None:
        """When the oldest flow collective still running started (monotonic); None when none runs."""
        with self._lock:
            return min((r.deadline - self._timeout for r in self._ops.values() if not r.done), default=None)

    def on_peer_failure(self, error: PeerTimeoutError) -> None:
        with self._lock:
            if self._failed is None:
                self._failed = error
        self._fail_all(error)

    def _watch(self) -> None:
        """Fail flow collectives past their deadline (naming the ranks still silent)."""
        while not self._closed:
            now = time.monotonic()
            with self._lock:
                late = [(s, r) for s, r in self._ops.items() if not r.done and r.deadline < now]
                deadline = min((r.deadline for r in self._ops.values() if not r.done), default=None)
                self._watch_event.clear()
            for seq, record in late:
                missing = sorted(r for r, n in record.expected.items() if record.received.get(r, 0) < n)
                self._fail_op(
                    seq,
                    TimeoutError(
                        f"checkmate backend rank {self._rank}: {record.name} (collective {seq}) "
                        f"incomplete after {self._timeout:.1f}s; still waiting for ranks {missing}"
                    ),
                )
            if late:
                continue
            self._watch_event.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0) + 0.01)
