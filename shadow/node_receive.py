"""The shadow node's receive thread: copies and repair answers placed by (iteration, bucket, offset).

It decodes each datagram on the data port (copies, REPAIR_DATA, NACK) and places it into
the epoch's :class:`~shadow.iteration_window.IterationWindow` under the node's ``_lock``
(one copy into the bucket buffer). Only an iteration's commit confirms the bucket layout
its copies used, and copies arrive before it; since layouts change rarely (at job start,
when DDP rebuilds its buckets), a copy that fits the layout in force is placed at once
and remembered until the commit comes; should rank 0 change the layout first, those copies
go back to the stash and are placed again under the new one. Copies that do not fit (no
epoch yet, another layout's bucket) are stashed raw (bounded in bytes) until the commit.
It never touches the disk or the optimizer.
"""

from __future__ import annotations

import logging
import time

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
from shadow.iteration_window import DropReason
from shadow.node_state import Addr, Epoch, Job, NodeState, Unconfirmed
from shadow.reassembly import PlaceResult

logger = logging.getLogger(__name__)

_DATA = int(MessageType.DATA)
_TORCH_DTYPES = {int(d): torch_dtype(d) for d in DType if d is not DType.NONE}


def _from_worker(job: Job, addr: Addr) -> bool:
    """A copy or repair answer may only come from one of the job's worker hosts (docs/security.md)."""
    return not job.workers or addr[0] in job.worker_hosts


class Receiver(NodeState):
    """The receive thread's part of a shadow node (takes ``_lock`` per datagram)."""

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
                logger.warning("shadow %s: receive failed: %s", self.name, exc)
                continue
            self.on_datagram(view[:n], addr)

    def on_datagram(self, data: memoryview, addr: Addr) -> DropReason | str | None:
        """Handle one datagram (the receive thread's body; callable directly in tests)."""
        now = time.monotonic()
        with self._lock:
            self.stats.packets_received += 1
            self.stats.bytes_received += len(data)
            if len(data) > 1 and data[1] == _DATA:
                handled, why = self._place_copy(data, addr, now)
                if handled:
                    return why
            opened = self._datagram_keys.open(data)  # NACK, REPAIR_DATA: MAC checked (checkmate.auth)
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
                if self.config.job_id is not None and header.job_id != self.config.job_id:
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
                    if header.iteration >= epoch.window.next_iteration + 2 * self.config.horizon:
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
        self.stats.packets_placed += 1
        self.stats.elements_placed += count
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

    def _restash_unconfirmed(self) -> None:
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
                self.stats.packets_placed -= 1
                self.stats.elements_placed -= copy.element_count
                data = bytearray(copy.head)
                data += pending.buckets[copy.bucket_id].payload(copy.element_offset, copy.element_count)
                self._stash_datagram(iteration, memoryview(data), copy.arrival, copy.source)
        epoch.unconfirmed.clear()

    def _forget_unconfirmed(self, epoch: Epoch) -> None:
        """Copies of iterations whose commit arrived are confirmed: nothing to undo (lock held)."""
        for iteration in [i for i in epoch.unconfirmed if i <= epoch.confirmed_through]:
            del epoch.unconfirmed[iteration]

    def _stash_datagram(self, iteration: int, data: memoryview, now: float, addr: Addr) -> str | None:
        if self._stash_bytes + len(data) > self.config.stash_bytes:
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
        self.stats.packets_placed += 1
        self.stats.elements_placed += header.element_count
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
