"""The shadow node's receiver: the data socket, the receive thread, and the iteration window it fills.

It decodes each datagram on the data port (copies, REPAIR_DATA, NACK) and places it into
the epoch's :class:`~shadow.iteration_window.IterationWindow` under its own ``_lock``
(one copy into the bucket buffer). Only an iteration's commit confirms the bucket layout
its copies used, and copies arrive before it; since layouts change rarely (at job start,
when DDP rebuilds its buckets), a copy that fits the layout in force is placed at once
and remembered until the commit comes; should rank 0 change the layout first, those copies
go back to the stash and are placed again under the new one. Copies that do not fit (no
epoch yet, another layout's bucket) are stashed raw (bounded in bytes) until the commit.

The :class:`Receiver` owns everything between a copy's arrival and its iteration's apply:
the job it takes copies for, the epoch whose window it fills, the stash, the commit records
until their iteration is applied, the repair tracker and why the shadow is blocked. The
control server hands it jobs, epochs and commits; the apply thread takes ready iterations
from it (:meth:`Receiver.next_ready`, :meth:`Receiver.finish`); the maintenance thread has
it plan repairs (:meth:`Receiver.plan_repairs`). It never touches the disk or the optimizer.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, NamedTuple

import torch

from checkmate.auth import DatagramKeys
from checkmate.sockets import bind, grow_buffer, receive_queued
from checkmate.tensors import torch_dtype
from checkmate.wire import (
    HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    CheckmateHeader,
    DType,
    MessageType,
    WireFormatError,
    decode,
    decode_data,
)
from shadow.iteration_window import DropReason, PendingIteration
from shadow.node_state import Addr, CommitEntry, ComponentThread, Drops, Epoch, Job, ShadowConfig, Unconfirmed
from shadow.reassembly import PlaceResult
from shadow.repair import RepairTracker, request_datagram

logger = logging.getLogger(__name__)

_DATA = int(MessageType.DATA)
_TORCH_DTYPES = {int(d): torch_dtype(d) for d in DType if d is not DType.NONE}


def _from_worker(job: Job, addr: Addr) -> bool:
    """A copy or repair answer may only come from one of the job's worker hosts (docs/security.md)."""
    return not job.workers or addr[0] in job.worker_hosts


class Ready(NamedTuple):
    """An iteration the apply thread may step: its commit is here and every owned bucket is complete."""

    epoch: Epoch
    pending: PendingIteration
    entry: CommitEntry
    gradients: dict[str, torch.Tensor]


class RepairPlan(NamedTuple):
    """What the maintenance thread sends and reports after one planning pass."""

    sends: list[tuple[Addr, CheckmateHeader, bytes]]
    """REPAIR_REQUESTs due now: (worker, header, payload), MAC not yet added."""
    failure: str | None
    """Why the next iteration cannot be repaired (reported once), or None."""
    wanted: bool
    """A committed iteration in the window lacks copies (plan again soon)."""


class Receiver:
    """Copies in: the data socket, its thread and the iteration window (``_lock`` per datagram, briefly)."""

    def __init__(self, config: ShadowConfig, drops: Drops, keys: DatagramKeys, stop: threading.Event) -> None:
        self._config = config
        self._name = config.name
        self._drops = drops
        self._keys = keys
        self._stop = stop
        self._lock = threading.Condition(threading.RLock())
        """Guards everything below; notified on progress the apply thread waits for."""
        self._job: Job | None = None
        self._epoch: Epoch | None = None
        self._stash: dict[int, list[tuple[bytearray, float, Addr]]] = {}
        self._stash_bytes = 0
        self._commits: dict[int, CommitEntry] = {}
        self._latest_commit = -1
        self._latest_seen = -1
        self._repairs: RepairTracker | None = None
        self._blocked: str | None = None
        self._packets_received = 0
        self._bytes_received = 0
        self._packets_placed = 0
        self._elements_placed = 0
        self._udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        grow_buffer(self._udp, socket.SO_RCVBUF, config.recv_buffer_bytes)  # past rmem_max as root
        bind(self._udp, config.data_bind, f"shadow {self._name}'s data socket")
        self._udp.settimeout(0.1)
        self.address: Addr = self._udp.getsockname()
        self._thread = ComponentThread(self._name, "rx", self._receive_loop)

    # -- the receive thread ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        with self._lock:
            self._lock.notify_all()
        self._thread.join(timeout)

    def close(self) -> None:
        self._udp.close()

    def _receive_loop(self) -> None:
        buffer = bytearray(HEADER_BYTES + MAX_PAYLOAD_BYTES + 1024)
        view = memoryview(buffer)
        while not self._stop.is_set():
            try:
                n, addr = self._udp.recvfrom_into(buffer)
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                logger.warning("shadow %s: receive failed: %s", self._name, exc)
                continue
            self.on_datagram(view[:n], addr)

    def send(self, datagram: bytes, addr: Addr) -> None:
        """Send one datagram from the data port (a repair request); OSError as the socket raises it."""
        self._udp.sendto(datagram, addr)

    def queued(self) -> bool:
        """Whether datagrams still wait unread in the data socket."""
        return receive_queued(self._udp)

    def _drop(self, reason: str) -> str:
        return self._drops.add(reason)

    def on_datagram(self, data: memoryview, addr: Addr) -> DropReason | str | None:
        """Handle one datagram (the receive thread's body; callable directly in tests)."""
        now = time.monotonic()
        with self._lock:
            self._packets_received += 1
            self._bytes_received += len(data)
            if len(data) > 1 and data[1] == _DATA:
                handled, why = self._place_copy(data, addr, now)
                if handled:
                    return why
            opened = self._keys.open(data)  # NACK, REPAIR_DATA: MAC checked (checkmate.auth)
            if opened is None:
                return self._drop("unauthenticated")
            data = opened
            try:
                header, payload = decode(data)
            except WireFormatError:
                return self._drop("malformed")
            if header.msg_type is MessageType.NACK:
                if self._repairs is not None and self._job is not None and header.job_id == self._job.job_id:
                    self._repairs.on_nack(header)
                    self._lock.notify_all()
                    return None
                return self._drop("unexpected_nack")
            if header.msg_type not in (MessageType.DATA, MessageType.REPAIR_DATA):
                return self._drop(DropReason.NOT_DATA.value)
            job = self._job
            if job is None:
                if self._config.job_id is not None and header.job_id != self._config.job_id:
                    return self._drop(DropReason.OTHER_JOB.value)
                return self._stash_datagram(header.iteration, data, now, addr)
            if header.job_id != job.job_id:
                return self._drop(DropReason.OTHER_JOB.value)
            if not _from_worker(job, addr):
                return self._drop("not_from_a_worker")
            if header.msg_type is MessageType.REPAIR_DATA and self._repairs is not None:
                self._repairs.on_answer(header)
            self._latest_seen = max(self._latest_seen, header.iteration)
            epoch = self._epoch
            ahead = epoch is not None and header.iteration > epoch.confirmed_through
            if epoch is None or (ahead and not self._fits(epoch, header)):
                if epoch is not None:
                    refused = epoch.window.admits(header.iteration)
                    if refused is DropReason.STALE:
                        return self._drop(refused.value)
                    if header.iteration >= epoch.window.next_iteration + 2 * self._config.horizon:
                        return self._drop(DropReason.TOO_FAR_AHEAD.value)
                return self._stash_datagram(header.iteration, data, now, addr)
            reason = self._place(epoch, header, payload)
            if ahead and reason is None:
                # Placed before its commit confirmed the layout (one pass, the common case):
                # remembered, so that a layout change can put it back into the stash.
                copy = Unconfirmed(
                    bytes(data[:HEADER_BYTES]),
                    header.bucket_id,
                    header.element_offset,
                    header.element_count,
                    now,
                    addr,
                )
                epoch.unconfirmed.setdefault(header.iteration, []).append(copy)
            return reason

    def _place_copy(self, data: memoryview, addr: Addr, now: float) -> tuple[bool, str | None]:
        """A DATA copy that fits the epoch in force, placed straight from the datagram (lock held).

        The common case, without building a header object: the same checks as the general
        path below, which takes anything else (``(False, None)``: not placed, nothing counted);
        ``(True, why it was dropped or None)`` for a copy it handled.
        """
        try:
            fields, payload = decode_data(data)
        except WireFormatError:
            return False, None
        job, epoch = self._job, self._epoch
        if job is None or epoch is None or fields[4] != job.job_id or not _from_worker(job, addr):
            return False, None
        iteration, bucket_id, offset, count = fields[5], fields[6], fields[10], fields[11]
        window = epoch.window
        layout = window.layouts.get(bucket_id)
        spec = epoch.layout.get(bucket_id)
        if (
            not window.next_iteration <= iteration < window.next_iteration + window.horizon
            or layout is None
            or spec is None
            or bucket_id not in window.owned
            or fields[8] != spec.shard_key
            or _TORCH_DTYPES.get(fields[3]) != layout.dtype
            or offset + count > layout.numel
            or (window.repair_only and (iteration, bucket_id) in window.repair_only)
        ):
            return False, None
        self._latest_seen = max(self._latest_seen, iteration)
        assembly = window.assembly(iteration, bucket_id)
        if assembly.place_bytes(offset, count, payload) is PlaceResult.DUPLICATE:
            window.stats.drops[DropReason.DUPLICATE.value] += 1
            if self._repairs is not None:
                self._repairs.note_late_copy(iteration, now)  # filled by a repair before it came?
            return True, self._drop(DropReason.DUPLICATE.value)
        window.stats.placed_packets += 1
        window.stats.placed_elements += count
        self._packets_placed += 1
        self._elements_placed += count
        if iteration > epoch.confirmed_through:  # ahead of its commit: see _restash_unconfirmed
            copy = Unconfirmed(bytes(data[:HEADER_BYTES]), bucket_id, offset, count, now, addr)
            epoch.unconfirmed.setdefault(iteration, []).append(copy)
        if assembly.complete:
            self._lock.notify_all()  # the apply thread waits for whole buckets, not for each copy
        return True, None

    @staticmethod
    def _fits(epoch: Epoch, header: CheckmateHeader) -> bool:
        """Whether a copy ahead of its commit can be placed now under ``epoch``'s layout.

        Yes for a DATA copy of an owned bucket (shard key, dtype and range as the layout
        says) of an iteration inside the window: the layout holds unless rank 0 changes it,
        and then :meth:`_restash_unconfirmed` undoes the placement. Anything else waits in
        the stash for the commit, as every copy did before.
        """
        window = epoch.window
        if (
            header.msg_type is not MessageType.DATA
            or header.iteration >= window.next_iteration + window.horizon
        ):
            return False
        layout = window.layouts.get(header.bucket_id)
        return (
            layout is not None
            and header.bucket_id in window.owned
            and header.bucket_id in epoch.layout
            and header.shard_key == epoch.layout[header.bucket_id].shard_key
            and header.dtype is not DType.NONE
            and torch_dtype(header.dtype) == layout.dtype
            and header.element_offset + header.element_count <= layout.numel
        )

    def _restash_unconfirmed(self) -> None:  # lock held
        """Copies placed ahead of their commit go back to the stash as datagrams (lock held).

        Called when the epoch ends (a job_start: a new layout or a new run), before the stash
        is sorted out: they then meet exactly the fate a stashed copy meets (kept for the new
        layout within the same run, dropped as stale otherwise). A bucket's elements hold each
        copy's values, first copy first, as the stash replay would have placed them.
        """
        epoch = self._epoch
        if epoch is None:
            return
        for iteration in sorted(epoch.unconfirmed):
            pending = epoch.window.pending.get(iteration)
            for copy in epoch.unconfirmed[iteration]:
                if pending is None:  # applied meanwhile: nothing to undo
                    continue
                self._packets_placed -= 1
                self._elements_placed -= copy.element_count
                data = bytearray(copy.head)
                data += pending.buckets[copy.bucket_id].payload(copy.element_offset, copy.element_count)
                self._stash_datagram(iteration, memoryview(data), copy.arrival, copy.source)
        epoch.unconfirmed.clear()

    def _forget_unconfirmed(self, epoch: Epoch) -> None:
        """Copies of iterations whose commit arrived are confirmed: nothing to undo (lock held)."""
        for iteration in [i for i in epoch.unconfirmed if i <= epoch.confirmed_through]:
            del epoch.unconfirmed[iteration]

    def _stash_datagram(self, iteration: int, data: memoryview, now: float, addr: Addr) -> str | None:
        if self._stash_bytes + len(data) > self._config.stash_bytes:
            return self._drop("stash_full")
        self._stash.setdefault(iteration, []).append((bytearray(data), now, addr))
        self._stash_bytes += len(data)
        return None

    def _place(self, epoch: Epoch, header: CheckmateHeader, payload: memoryview) -> DropReason | None:
        if header.bucket_id in epoch.layout and header.bucket_id in epoch.owned_buckets:
            if header.shard_key != epoch.layout[header.bucket_id].shard_key:
                self._drop("wrong_shard_key")
                return DropReason.NOT_OWNED
        reason = epoch.window.place(header, payload)
        if reason is not None:
            self._drop(reason.value)
            if (
                reason in (DropReason.STALE, DropReason.DUPLICATE)
                and header.msg_type is MessageType.DATA
                and self._repairs is not None
            ):
                self._repairs.note_late_copy(header.iteration, time.monotonic())  # applied through a repair?
            return reason
        self._packets_placed += 1
        self._elements_placed += header.element_count
        if header.msg_type is MessageType.REPAIR_DATA:
            if self._repairs is not None:
                self._repairs.stats.elements_repaired += header.element_count
            self._lock.notify_all()
        elif epoch.window.bucket_complete(header.iteration, header.bucket_id):
            self._lock.notify_all()  # the apply thread waits for whole buckets, not for each copy
        return None

    def _drain_stash(self) -> None:
        """Place stashed copies of confirmed iterations inside the window (lock held)."""
        epoch = self._epoch
        if epoch is None:
            return
        limit = min(epoch.confirmed_through, epoch.window.next_iteration + epoch.window.horizon - 1)
        for iteration in sorted(self._stash):
            if iteration > limit:
                break
            for data, _, source in self._stash.pop(iteration):
                self._stash_bytes -= len(data)
                header, payload = decode(data)
                if self._job is not None and not _from_worker(self._job, source):
                    self._drop("not_from_a_worker")
                    continue
                if header.job_id != epoch.window.job_id:
                    self._drop(DropReason.OTHER_JOB.value)
                    continue
                if header.iteration < epoch.window.next_iteration:
                    self._drop(DropReason.STALE.value)
                    continue
                self._place(epoch, header, payload)

    # -- what the control server hands over ----------------------------------------------------

    def begin_job(self, job: Job, start_iteration: int, new_run: bool, connected_at: float) -> None:
        """A job_start: no epoch until its layout comes; held copies and commits sorted out.

        ``connected_at`` (``time.monotonic()``): when the job_start's control connection was accepted.
        """
        with self._lock:
            self._restash_unconfirmed()  # placed under the old layout: sorted out with the stash below
            self._job = job
            self._epoch = None
            self._blocked = None
            self._repairs = RepairTracker(self._config.repair, len(job.workers))
            # Copies of earlier iterations are stale. A job_start on a new control connection
            # (the job restarted, maybe with another worker count) makes every copy held from
            # before that connection stale: the failed run's iterations >= start are redone,
            # possibly with other chunks and sums. Copies that arrived after it are this run's:
            # rank 0 connects and then sends the whole state, and for a large model the first
            # iteration's copies arrive while it is on its way (dropping them cost a repair of
            # the shadow's whole share, the large-state benchmark's start-up repair). A layout
            # change within a run keeps copies of later iterations (same run).
            for iteration in list(self._stash):
                kept = []
                for entry in self._stash.pop(iteration):
                    if iteration >= start_iteration and (not new_run or entry[1] >= connected_at):
                        kept.append(entry)
                    else:
                        self._stash_bytes -= len(entry[0])
                        self._drop(DropReason.STALE.value)
                if kept:
                    self._stash[iteration] = kept
            # Commit records arrive on the control connection after their job_start, so any
            # held for iterations >= start belong to a previous run or layout: drop them all.
            self._commits.clear()
            if new_run:
                self._latest_commit = min(self._latest_commit, start_iteration - 1)
                self._latest_seen = min(self._latest_seen, start_iteration - 1)
            self._lock.notify_all()

    def install_epoch(self, epoch: Epoch) -> None:
        """A new layout with rank 0's state before its first iteration: copies are placed under it."""
        with self._lock:
            self._epoch = epoch
            if self._repairs is not None:
                self._repairs.forget_before(epoch.first_iteration)
            self._drain_stash()
            self._lock.notify_all()

    def install_resumed(self, job: Job, epoch: Epoch, blocked: str) -> None:
        """The state of a snapshot, served until rank 0 re-seeds (nothing to place: no layout)."""
        with self._lock:
            self._job = job
            self._epoch = epoch
            self._blocked = blocked

    def block(self, why: str) -> None:
        """Say why the shadow makes no progress (the status' ``blocked``; cleared by the next apply)."""
        with self._lock:
            self._blocked = why

    def add_commit(self, entry: CommitEntry) -> None:
        """A commit record: its iteration's layout is confirmed, its stashed copies placed."""
        iteration = entry.record.iteration
        with self._lock:
            self._commits[iteration] = entry
            self._latest_commit = max(self._latest_commit, iteration)
            epoch = self._epoch
            if epoch is not None:
                epoch.confirmed_through = max(epoch.confirmed_through, iteration)
                self._forget_unconfirmed(epoch)
                self._drain_stash()
            self._lock.notify_all()

    # -- what the apply thread takes -----------------------------------------------------------

    def next_ready(self, timeout: float) -> Ready | None:
        """The next iteration ready to apply, or None after waiting up to ``timeout`` for progress."""
        with self._lock:
            epoch = self._epoch
            pending = None
            if epoch is not None:
                nxt = epoch.window.next_iteration
                if nxt in self._commits:
                    waiting = epoch.window.pending.get(nxt)
                    if waiting is None or waiting.step is None:
                        epoch.window.commit(self._commits[nxt].record)
                pending = epoch.window.ready()
            if pending is None:
                self._lock.wait(timeout)
                return None
            assert epoch is not None
            return Ready(epoch, pending, self._commits[pending.iteration], epoch.window.gradients(pending))

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` for any progress (a copy completing a bucket, a commit, a job)."""
        with self._lock:
            self._lock.wait(timeout)

    def finish(self, epoch: Epoch, iteration: int) -> bool:
        """``iteration`` was applied to ``epoch``: the window moves on (False: ``epoch`` was replaced)."""
        with self._lock:
            current = self._epoch is epoch
            if current:
                epoch.window.advance()
                self._commits.pop(iteration, None)
                if self._repairs is not None:
                    self._repairs.forget_before(iteration + 1)
                self._drain_stash()
            self._blocked = None
            self._lock.notify_all()
            return current

    def refuse_forged(self, epoch: Epoch, iteration: int, forged: list[tuple[int, str]]) -> tuple[int, bool]:
        """Buckets whose copies fail rank 0's gradient tags: refilled from repairs, or the iteration dropped.

        Returns how many buckets are repaired, and whether the iteration was dropped instead
        (a bucket that cannot be refused again: rank 0 must re-seed this shadow).
        """
        with self._lock:
            current = self._epoch is epoch
            repairing = [b for b, _ in forged if current and epoch.window.refuse_copies(iteration, b)]
            reseed = current and len(repairing) < len(forged)
            if reseed:  # halted here until rank 0's fresh state replaces this epoch
                epoch.window.pending.pop(iteration, None)
                self._commits.pop(iteration, None)
            elif self._repairs is not None:
                for bucket_id in repairing:
                    self._repairs.restart(iteration, bucket_id)
            self._drop("forged_gradient")
            return len(repairing), reseed

    # -- what the maintenance thread asks ------------------------------------------------------

    def plan_repairs(self, now: float) -> RepairPlan:
        """REPAIR_REQUESTs for exactly the missing ranges of committed iterations whose grace is over."""
        with self._lock:
            sends: list[tuple[Addr, CheckmateHeader, bytes]] = []
            epoch, job, repairs = self._epoch, self._job, self._repairs
            if epoch is None or job is None or repairs is None or not job.workers:
                return RepairPlan(sends, None, False)
            window = epoch.window
            nxt = window.next_iteration
            wanted = False
            for iteration in range(nxt, min(epoch.confirmed_through, nxt + window.horizon - 1) + 1):
                entry = self._commits.get(iteration)
                if entry is None:
                    continue
                pending = window.pending.get(iteration)
                if pending is not None and pending.complete:
                    continue
                wanted = True
                refused = window.repair_only and any(key[0] == iteration for key in window.repair_only)
                if now - entry.arrival < repairs.current_grace(now) and not refused:
                    continue  # copies may still be on the way (a refused bucket takes none: no grace)
                if pending is None:
                    window.commit(entry.record)
                    pending = window.pending[iteration]
                for bucket_id, gaps in pending.missing().items():
                    plan = repairs.due(iteration, bucket_id, gaps, now)
                    if plan is None:
                        continue
                    worker, request_id, ranges = plan
                    header, payload = request_datagram(
                        job.job_id,
                        iteration,
                        bucket_id,
                        ranges,
                        request_id,
                        sender_rank=min(job.shard_index, 0xFFFF),
                        shard_key=epoch.layout[bucket_id].shard_key,
                    )
                    sends.append((job.workers[worker], header, payload))
            return RepairPlan(sends, self._blocked_by(repairs, epoch, nxt, now), wanted)

    def _blocked_by(self, repairs: RepairTracker, epoch: Epoch, nxt: int, now: float) -> str | None:
        """Note why iteration ``nxt`` waits; an unrepairable one is returned, once (lock held)."""
        failure = repairs.failure(nxt)
        if failure is not None:
            blocked = f"not certified: {failure}"
            if self._blocked != blocked:
                self._blocked = blocked
                return failure
            return None
        window = epoch.window
        if nxt in self._commits:
            waited = now - self._commits[nxt].arrival
            if waited > 1.0 and window.pending.get(nxt) is not None and not window.pending[nxt].complete:
                self._blocked = f"iteration {nxt}: owned buckets incomplete {waited:.1f}s after its commit"
        elif self._stash.get(nxt) or epoch.unconfirmed.get(nxt):
            arrivals = [entry[1] for entry in self._stash.get(nxt, [])[:1]]
            arrivals += [copy.arrival for copy in epoch.unconfirmed.get(nxt, [])[:1]]
            waited = now - min(arrivals)
            if waited > 1.0:
                self._blocked = f"iteration {nxt}: no commit record {waited:.1f}s after its first copy"
        return None

    def status(self) -> dict[str, Any]:
        """The status document's fields about copies, the window, the stash and repairs."""
        with self._lock:
            epoch, repairs = self._epoch, self._repairs
            return {
                "has_epoch": epoch is not None,
                "blocked": self._blocked,
                "next_iteration": epoch.window.next_iteration if epoch else None,
                "latest_commit": self._latest_commit,
                "latest_seen_iteration": max(self._latest_seen, self._latest_commit),
                "buckets": sorted(epoch.owned_buckets) if epoch else [],
                "packets_received": self._packets_received,
                "bytes_received": self._bytes_received,
                "packets_placed": self._packets_placed,
                "elements_placed": self._elements_placed,
                "stash": {
                    "datagrams": sum(len(v) for v in self._stash.values()),
                    "bytes": self._stash_bytes,
                    # copies placed before their commit (undone if rank 0 changes the layout first)
                    "placed_ahead": sum(len(v) for v in epoch.unconfirmed.values()) if epoch else 0,
                },
                "repairs": {**vars(repairs.stats), "grace_s": round(repairs.grace, 6)} if repairs else {},
            }
