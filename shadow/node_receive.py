"""The shadow node's receive thread: copies and repair answers placed by (iteration, bucket, offset).

It decodes each datagram on the data port (copies, REPAIR_DATA, NACK) and places it into
the epoch's :class:`~shadow.iteration_window.IterationWindow` under the node's ``_lock``
(a copy into the bucket buffer), or stashes it raw (bounded in bytes) while its
iteration's commit, which alone fixes the bucket layout it used, has not arrived. It
never touches the disk or the optimizer.
"""

from __future__ import annotations

import logging
import time

from checkmate.wire import (
    HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    CheckmateHeader,
    MessageType,
    WireFormatError,
    decode,
)
from shadow.iteration_window import DropReason
from shadow.node_state import Addr, Epoch, Job, NodeState

logger = logging.getLogger(__name__)


def _from_worker(job: Job, addr: Addr) -> bool:
    """A copy or repair answer may only come from one of the job's worker hosts (docs/security.md)."""
    return not job.workers or any(addr[0] == host for host, _ in job.workers)


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
                return self._stash_datagram(header, data, now, addr)
            if header.job_id != job.job_id:
                return self._drop(DropReason.OTHER_JOB.value)
            if not _from_worker(job, addr):
                return self._drop("not_from_a_worker")
            if header.msg_type is MessageType.REPAIR_DATA and self._repairs is not None:
                self._repairs.on_answer(header)
            self._latest_seen = max(self._latest_seen, header.iteration)
            epoch = self._epoch
            if (
                epoch is None
                or header.iteration > epoch.confirmed_through
                or header.iteration >= epoch.window.next_iteration + epoch.window.horizon
            ):
                if epoch is not None:
                    refused = epoch.window.admits(header.iteration)
                    if refused is DropReason.STALE:
                        return self._drop(refused.value)
                    if header.iteration >= epoch.window.next_iteration + 2 * self.config.horizon:
                        return self._drop(DropReason.TOO_FAR_AHEAD.value)
                return self._stash_datagram(header, data, now, addr)
            return self._place(epoch, header, payload)

    def _stash_datagram(
        self, header: CheckmateHeader, data: memoryview, now: float, addr: Addr
    ) -> str | None:
        if self._stash_bytes + len(data) > self.config.stash_bytes:
            return self._drop("stash_full")
        self._stash.setdefault(header.iteration, []).append((bytearray(data), now, addr))
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
            return reason
        self.stats.packets_placed += 1
        self.stats.elements_placed += header.element_count
        if header.msg_type is MessageType.REPAIR_DATA and self._repairs is not None:
            self._repairs.stats.elements_repaired += header.element_count
        self._lock.notify_all()
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
