"""Ring all-reduce over the host transport, with the all-gather's first transmissions tagged.

The ring's algorithm, its slot grid and its exact reduction order are :mod:`hosts.ring_config`'s
(where :func:`~hosts.ring_config.slot_grid` and :func:`~hosts.ring_config.reference_allreduce`
live); this module is the engine that runs it per datagram.

Tags
----
The owner's first transmission of each reduced slot carries REPLICATE, the
iteration, bucket, element offset and the bucket's shard key
(``JobSpec.shard_key_for_bucket``); forwarders never tag. So each reduced
element crosses to a shadow once per iteration, and no extra bytes are sent.
Every tag is also recorded (:attr:`RingAllReduce.tag_log`, ``on_tag``).

Repairs
-------
Reduced buckets of the last ``keep_iterations`` iterations are kept (zero
copy: the result tensor itself). A shadow's REPAIR_REQUEST for element ranges
is answered with untagged REPAIR_DATA; a range no longer held is answered
with a NACK (docs/protocol.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from checkmate.auth import DATAGRAM_TAG_BYTES
from checkmate.tensors import payload_tensor, tensor_payload, wire_dtype
from checkmate.wire import MAX_PAYLOAD_BYTES, CheckmateHeader, DType, Flags, MessageType, pack_data_header
from hosts.ring_config import (
    CollectiveError,
    CollectiveTimeoutError,
    ReduceOp,
    RingConfig,
    SlotGrid,
    slot_grid,
)
from hosts.ring_repair import answerable, nack_for, pieces, requested_ranges
from hosts.tag_log import TagLog, TagRecord
from hosts.transport import Addr, PeerTimeoutError, Transport

logger = logging.getLogger(__name__)

MAX_BUCKET_ID = (1 << 16) - 1
MAX_ITERATION = (1 << 32) - 1
_NONE, _REPLICATE, _LAST = int(Flags.NONE), int(Flags.REPLICATE), int(Flags.LAST)
"""Flags as ints on the per-datagram path (an IntFlag operation costs about a microsecond)."""


_RS_DONE = 1
_FINAL = 2
_SPARE_BUFFERS = 32
"""Most released result buffers a ring keeps for reuse."""
_storage_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)
"""References to a tensor storage (torch internals; without it nothing is reused)."""


@dataclass
class _Op:
    iteration: int
    bucket_id: int
    work: torch.Tensor
    array: np.ndarray | None
    """float32 numpy view of ``work`` (fast adds); None for 2-byte dtypes."""
    source: np.ndarray | None
    """The caller's input (fp32 SUM on CPU): reduce-scatter adds read it and write ``work``; None:
    ``work`` started as a copy of the input."""
    source_view: memoryview
    """What this rank's own chunk is first sent from: the input's bytes, or ``work``'s."""
    view: memoryview
    dtype: DType
    dtype_value: int
    """``int(dtype)``, compared per datagram."""
    grid: SlotGrid
    state: bytearray
    remaining: int
    shard_key: int
    deadline: float
    result: torch.Tensor | None = None
    """What the caller gets: ``work``, or on the native path a view of it (the view's life tells
    when the buffer may be reused, :meth:`RingAllReduce._buffer`)."""
    future: torch.futures.Future[torch.Tensor] = field(default_factory=torch.futures.Future)
    done: bool = False
    failed: bool = False


class RingAllReduce:
    """Ring all-reduce of flat buckets for one job on one rank, over a shared :class:`Transport`."""

    def __init__(self, transport: Transport, config: RingConfig, tag_log_size: int = 1 << 20) -> None:
        self.transport = transport
        self.config = config
        self.rank = config.rank
        self.world = config.world_size
        self.next_addr = config.workers[(self.rank + 1) % self.world]
        self.prev_rank = (self.rank - 1) % self.world
        self.prev_addr = config.workers[self.prev_rank]
        self._lock = threading.RLock()
        self._ops: dict[tuple[int, int], _Op] = {}
        self._stash: dict[tuple[int, int], list[tuple[tuple[int, ...], bytes]]] = {}
        self._stash_bytes = 0
        self._latest_iteration = -1
        self._released_through = -1
        self._failed: CollectiveError | PeerTimeoutError | None = None
        self._counters: dict[str, int] = {}
        self.tag_log = TagLog(tag_log_size)
        """Every tag this ring sent, oldest first (the last ``tag_log_size``)."""
        self.on_tag: Callable[[TagRecord], None] | None = None
        self._stop = threading.Event()
        self._spare: list[torch.Tensor] = []
        """Result buffers of released ops, reusable once nothing else refers to them (native path)."""
        self._watch_event = threading.Event()
        self._watch_deadline = float("inf")
        """The earliest deadline the watchdog sleeps towards (``inf``: no op running, until woken)."""
        peers = {r: a for r, a in enumerate(config.workers) if r != self.rank}
        self._native = transport.native
        """The transport's compiled data path when this ring's datagrams run in it; None:
        :meth:`_on_fields` does. In host-replication mode the engine sends the copies too, to the
        addresses :meth:`_native_replica` tells it as shard keys first appear."""
        self._replicas_told: set[int] = set()
        if self._native is not None:  # before add_job: the job's first DATA must reach the ring
            self._native.expect_ring(
                config.job_id,
                self.world,
                config.future_iterations,
                config.max_stash_bytes,
                self._native_done,
                host_mode=config.host_replica is not None,
            )
        try:
            transport.add_job(
                config.job_id,
                self.rank,
                peers,
                on_data=self._on_data,
                on_request=self._on_repair_request,
                on_failure=self.fail,
                on_data_fields=self._on_fields,
            )
        except BaseException:
            if self._native is not None:
                self._native.cancel_ring(config.job_id)
            raise
        self._watchdog = threading.Thread(target=self._watch, name=f"cm-ring-{self.rank}", daemon=True)
        self._watchdog.start()

    # ---- public API -----------------------------------------------------------------
    def allreduce_async(
        self, iteration: int, bucket_id: int, tensor: torch.Tensor, op: ReduceOp = ReduceOp.AVG
    ) -> torch.futures.Future[torch.Tensor]:
        """Start reducing ``tensor`` (any device; flattened) as bucket ``bucket_id`` of ``iteration``.

        The input is not modified. The future's value is a new flat CPU tensor
        holding the result; it is kept (unchanged) for repairs until the
        iteration is released.
        """
        if not 0 <= bucket_id <= MAX_BUCKET_ID:
            raise ValueError(f"bucket id {bucket_id} is outside 0..{MAX_BUCKET_ID}")
        if not 0 <= iteration <= MAX_ITERATION:
            raise ValueError(f"iteration {iteration} is outside 0..{MAX_ITERATION}")
        dtype = wire_dtype(tensor.dtype)
        flat = tensor.detach().reshape(-1)
        source: torch.Tensor | None = None
        if flat.device.type != "cpu":
            flat = flat.to("cpu")  # through host memory; a fresh tensor
            work = flat.div_(self.world) if op is ReduceOp.AVG else flat
        elif op is ReduceOp.AVG:
            work = torch.div(flat, self.world, out=self._buffer(flat))
        elif dtype is DType.FP32:
            # SUM: no copy of the input. This rank's chunk is sent from it, and every other slot
            # of the result is written once from it (input + arriving partial sum) or stored.
            source = flat.contiguous()
            work = self._buffer(source)
        else:
            work = self._buffer(flat).copy_(flat)
        work = work.contiguous()
        per = MAX_PAYLOAD_BYTES // dtype.itemsize
        grid = slot_grid(work.numel(), self.world, per)
        view = tensor_payload(work)
        record = _Op(
            iteration=iteration,
            bucket_id=bucket_id,
            work=work,
            array=work.numpy() if dtype is DType.FP32 else None,
            source=source.numpy() if source is not None else None,
            source_view=tensor_payload(source) if source is not None else view,
            view=view,
            dtype=dtype,
            dtype_value=int(dtype),
            grid=grid,
            state=bytearray(len(grid.offsets)),
            remaining=len(grid.offsets),
            shard_key=self.config.shard_key_for_bucket(bucket_id),
            deadline=time.monotonic() + self.config.timeout,
            result=work.view(-1) if self._native is not None else work,
        )
        completed: list[_Op] = []
        key = (iteration, bucket_id)
        with self._lock:
            if self._failed is not None:
                record.future.set_exception(self._failed)  # type: ignore[arg-type]
                return record.future
            if key in self._ops:
                raise ValueError(f"bucket {bucket_id} of iteration {iteration} was already started")
            self._ops[key] = record
            if record.deadline < self._watch_deadline:
                self._watch_deadline = record.deadline
                self._watch_event.set()
            if iteration > self._latest_iteration:
                self._latest_iteration = iteration
                self._release_locked(iteration - self.config.keep_iterations)
            self._count("ops_started")
        if self._native is not None:
            if self.config.host_replica is not None and record.shard_key not in self._replicas_told:
                self._native_replica(record.shard_key)
            # the engine sends this rank's chunk, applies what arrived early, and from then on
            # reduces and forwards every datagram itself; _native_done completes the future
            self._native.engine.op_start(
                self.config.job_id,
                iteration,
                bucket_id,
                view,
                record.source_view if source is not None else None,
                record.dtype_value,
                record.shard_key,
            )
            return record.future
        with self.transport.batch():  # the first sends leave in GSO runs at the end
            # This rank's own chunk goes out without the lock, so the receive thread keeps
            # reducing and forwarding meanwhile: its slots change state only when their
            # all-gather comes back round the ring, which needs these sends first.
            try:
                for slot in grid.chunk_slots[self.rank]:
                    self._send(record, slot, _NONE, record.source_view)
                    self.transport.flush_if_full()
            except PeerTimeoutError as exc:
                with self._lock:
                    self._fail_all_locked(exc)
            with self._lock:
                try:
                    for fields, payload in self._stash.pop(key, []):
                        self._stash_bytes -= len(payload)
                        self._apply(record, fields, memoryview(payload), completed)
                except PeerTimeoutError as exc:
                    self._fail_all_locked(exc)
                if record.remaining == 0 and not record.done and not record.failed:
                    record.done = True
                    completed.append(record)
        self._complete(completed)
        return record.future

    def allreduce(
        self,
        iteration: int,
        bucket_id: int,
        tensor: torch.Tensor,
        op: ReduceOp = ReduceOp.AVG,
    ) -> torch.Tensor:
        """Blocking :meth:`allreduce_async`; raises CollectiveError / PeerTimeoutError on failure."""
        return self.allreduce_async(iteration, bucket_id, tensor, op).wait()

    def reduced(self, iteration: int, bucket_id: int) -> torch.Tensor | None:
        """The kept result of a completed bucket, or None."""
        with self._lock:
            record = self._ops.get((iteration, bucket_id))
            return record.result if record is not None and record.done else None

    def release_through(self, iteration: int) -> None:
        """Forget reduced buckets of iterations <= ``iteration`` (the shadows confirmed them)."""
        with self._lock:
            self._release_locked(iteration)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counters)
            out["ops_kept"] = len(self._ops)
            out["stash_bytes"] = self._stash_bytes
        if self._native is not None:
            for name, value in self._native.engine.ring_stats(self.config.job_id).items():
                out[name] = value if name == "stash_bytes" else out.get(name, 0) + value
        return out

    def close(self) -> None:
        self._stop.set()
        self._watch_event.set()
        self._watchdog.join(timeout=1.0)
        with self._lock:
            self._fail_all_locked(CollectiveError("the all-reduce engine was closed"))
        self.transport.remove_job(self.config.job_id)

    # ---- internals ------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _drop(self, reason: str) -> None:
        self._count(f"drop.{reason}")
        self.transport.count_drop(reason)

    def _release_locked(self, through: int) -> None:
        if through <= self._released_through:
            return
        self._released_through = through
        if self._native is not None:
            self._native.engine.release_through(self.config.job_id, through)
        for key in [k for k, v in self._ops.items() if k[0] <= through and (v.done or v.failed)]:
            record = self._ops.pop(key)
            if self._native is not None:  # its result buffer was made here (_buffer, or the copy to host)
                self._spare.append(record.work)  # reused once nothing else refers to it
        del self._spare[:-_SPARE_BUFFERS]
        for key in [k for k in self._stash if k[0] <= through]:
            self._stash_bytes -= sum(len(p) for _, p in self._stash.pop(key))

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A flat CPU tensor of ``like``'s dtype and size for a result (uninitialised).

        The native path reuses the buffer of a released op that nothing refers to any more (its
        result view, the engine's hold and every numpy view gone: one storage reference left), so
        a job whose buckets repeat does not fault in fresh pages every iteration (about 4,000
        page faults per 16 MiB). The Python path, the reference, always allocates.
        """
        if self._native is not None and _storage_use_count is not None:
            with self._lock:
                for i, spare in enumerate(self._spare):
                    if spare.dtype == like.dtype and spare.numel() == like.numel():
                        if _storage_use_count(spare.untyped_storage()._cdata) <= 2:  # spare + this call's
                            del self._spare[i]
                            self._count("buffers_reused")
                            return spare
        return torch.empty(like.numel(), dtype=like.dtype)

    def _send(self, record: _Op, slot: int, flags: int, view: memoryview | None = None) -> None:
        grid = record.grid
        size = record.dtype.itemsize
        offset, count = grid.offsets[slot], grid.counts[slot]
        payload = (record.view if view is None else view)[offset * size : (offset + count) * size]
        if grid.last[slot]:
            flags |= _LAST
        tagged = flags & _REPLICATE
        host_mode = tagged and self.config.host_replica is not None
        header = bytearray(32)
        pack_data_header(
            header,
            flags & ~_REPLICATE if host_mode else flags,  # host mode: never tagged
            record.dtype_value,
            self.config.job_id,
            record.iteration,
            record.bucket_id,
            self.rank,
            record.shard_key,
            offset,
            count,
        )
        copy = bytes(header) if host_mode else b""  # before the transport numbers its own
        self.transport.send_packed(self.next_addr, self.config.job_id, header, payload)
        if host_mode:  # sent once more, like the switch's copy (the shadow repairs losses)
            assert self.config.host_replica is not None
            replica = self.config.host_replica(record.shard_key)
            if replica is not None:
                self.transport.send_unreliable(replica, copy, payload)
                self._count("host_copies")
        if tagged:
            tag = TagRecord(record.iteration, record.bucket_id, offset, count, record.shard_key)
            self.tag_log.append(tag)
            self._count("tagged_datagrams")
            if self.on_tag is not None:
                self.on_tag(tag)

    def _on_data(self, header: CheckmateHeader, payload: memoryview, addr: Addr) -> None:
        """DATA with a header object (the transport uses :meth:`_on_fields`; kept for direct callers)."""
        self._on_fields(header.fields(), payload, addr)

    def _on_fields(self, fields: tuple[int, ...], payload: memoryview, addr: Addr) -> None:
        """One DATA datagram, header as :func:`checkmate.wire.decode_data`'s ints (receive thread)."""
        if fields[7] != self.prev_rank:
            self._drop("not_ring_predecessor")
            return
        iteration = fields[5]
        key = (iteration, fields[6])
        completed: list[_Op] = []
        with self._lock:
            record = self._ops.get(key)
            if record is None:
                if iteration <= self._released_through:
                    self._drop("stale_iteration")
                elif (
                    self._latest_iteration >= 0
                    and iteration > self._latest_iteration + self.config.future_iterations
                ):
                    self._drop("future_iteration")
                elif self._stash_bytes + len(payload) > self.config.max_stash_bytes:
                    self._drop("stash_full")
                else:
                    self._stash.setdefault(key, []).append((fields, bytes(payload)))
                    self._stash_bytes += len(payload)
                    self._count("stashed")
                return
            if record.done or record.failed:
                self._drop("stale_iteration")
                return
            try:
                self._apply(record, fields, payload, completed)
            except PeerTimeoutError as exc:
                self._fail_all_locked(exc)
        self._complete(completed)

    def _apply(self, record: _Op, fields: tuple[int, ...], payload: memoryview, completed: list[_Op]) -> None:
        """Reduce or store one datagram and forward it (lock held)."""
        grid = record.grid
        lo = fields[10]
        slot = grid.slot_of.get(lo)
        if slot is None or grid.counts[slot] != fields[11]:
            self._drop("out_of_range")
            return
        if fields[3] != record.dtype_value:
            self._drop("dtype_mismatch")
            return
        chunk = grid.chunk[slot]
        r, world = self.rank, self.world
        state = record.state[slot]
        hi = lo + fields[11]
        if chunk == (r + 1) % world:  # last reduce-scatter step: this rank owns the chunk
            if state != 0:
                self._drop("unexpected_slot")
                return
            self._add(record, lo, hi, payload)
            self._finalize(record, slot, completed)
            self._send(record, slot, _REPLICATE)
        elif chunk == r or state == _RS_DONE:  # all-gather
            if (chunk == r and state != 0) or state == _FINAL:
                self._drop("unexpected_slot")
                return
            self._store(record, lo, hi, payload)
            self._finalize(record, slot, completed)
            if chunk != (r + 2) % world:
                self._send(record, slot, _NONE)
        elif state == 0:  # reduce-scatter, not yet the owner
            self._add(record, lo, hi, payload)
            record.state[slot] = _RS_DONE
            self._send(record, slot, _NONE)
        else:
            self._drop("unexpected_slot")

    def _native_replica(self, shard_key: int) -> None:
        """Tell the engine where host replication sends ``shard_key``'s copies (once per key)."""
        assert self._native is not None and self.config.host_replica is not None
        replica = self.config.host_replica(shard_key)
        self._native.engine.ring_replica(self.config.job_id, shard_key, replica)
        self._replicas_told.add(shard_key)

    def _native_done(self, iteration: int, bucket_id: int) -> None:
        """The engine completed an op (its thread, or the one that started the op)."""
        with self._lock:
            record = self._ops.get((iteration, bucket_id))
            if record is None or record.done or record.failed:
                return
            record.done = True
            record.state[:] = bytes([_FINAL]) * len(record.state)
            grid = record.grid
            owned = grid.chunk_slots[(self.rank + 1) % self.world]  # the slots this rank owns (consecutive)
            lo, hi = (owned[0], owned[-1] + 1) if owned else (0, 0)
            # built by map, not a loop of calls: the tags are most of this callback's time
            # one block per op, no object per tag: the log's records are made when it is read
            offsets, counts = grid.offsets[lo:hi], grid.counts[lo:hi]
            tagged = self.tag_log.add_block(iteration, bucket_id, record.shard_key, offsets, counts)
            self._count("tagged_datagrams", tagged)
        if self.on_tag is not None:
            for offset, count in zip(offsets, counts, strict=True):
                self.on_tag(TagRecord(iteration, bucket_id, offset, count, record.shard_key))
        self._complete([record])

    def _slot_states(self, record: _Op) -> bytes | bytearray:
        """Per-slot progress (0, _RS_DONE, _FINAL): the engine's for a native op."""
        if self._native is not None and not record.done:
            state = self._native.engine.op_state(self.config.job_id, record.iteration, record.bucket_id)
            if state is not None:
                return bytes(state)
        return record.state

    def _finalize(self, record: _Op, slot: int, completed: list[_Op]) -> None:
        record.state[slot] = _FINAL
        record.remaining -= 1
        if record.remaining == 0:
            record.done = True
            completed.append(record)

    @staticmethod
    def _add(record: _Op, lo: int, hi: int, payload: memoryview) -> None:
        if record.array is not None:
            part = record.array[lo:hi]
            mine = part if record.source is None else record.source[lo:hi]
            with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN (GradScaler overflow) is data
                np.add(mine, np.frombuffer(payload, dtype="<f4"), out=part)
        else:
            record.work[lo:hi].add_(payload_tensor(payload, record.dtype))

    @staticmethod
    def _store(record: _Op, lo: int, hi: int, payload: memoryview) -> None:
        size = record.dtype.itemsize
        record.view[lo * size : hi * size] = payload  # the wire's bytes are the tensor's (little-endian)

    def _complete(self, completed: list[_Op]) -> None:
        for record in completed:
            self._count("ops_completed")
            record.future.set_result(record.result if record.result is not None else record.work)

    def _fail_all_locked(self, error: CollectiveError | PeerTimeoutError) -> None:
        if self._failed is None:
            self._failed = error
        if self._native is not None:
            self._native.engine.fail_ops(self.config.job_id)
        for record in self._ops.values():
            if not record.done and not record.failed:
                record.failed = True
                record.future.set_exception(error)  # type: ignore[arg-type]

    def fail(self, error: PeerTimeoutError) -> None:
        """Fail the running all-reduces and every later one (the transport's or the backend's dead peer)."""
        with self._lock:
            self._fail_all_locked(error)

    def waiting_since(self) -> float | None:
        """When the oldest all-reduce still running started (monotonic); None when none runs."""
        with self._lock:
            running = [v.deadline for v in self._ops.values() if not v.done and not v.failed]
        return min(running) - self.config.timeout if running else None

    def _watch(self) -> None:
        """Fail the ops past their deadline; sleeps until the earliest running op's deadline."""
        while not self._stop.is_set():
            now = time.monotonic()
            with self._lock:
                running = [v for v in self._ops.values() if not v.done and not v.failed]
                late = [v for v in running if now > v.deadline]
                if late:
                    record = late[0]
                    states = self._slot_states(record)
                    missing = states.count(0) + states.count(_RS_DONE)
                    self._fail_all_locked(
                        CollectiveTimeoutError(
                            f"job {self.config.job_id} rank {self.rank}: all-reduce of bucket "
                            f"{record.bucket_id} at iteration {record.iteration} incomplete after "
                            f"{self.config.timeout:.1f}s; {missing} of {len(record.state)} datagrams "
                            f"still expected from rank {self.prev_rank} at "
                            f"{self.prev_addr[0]}:{self.prev_addr[1]} (ring predecessor); "
                            f"slots missing: {[i for i, v in enumerate(states) if v != _FINAL][:8]}; "
                            f"transport: {self.transport.stats()}"
                        )
                    )
                    running = []
                deadline = min((v.deadline for v in running), default=float("inf"))
                self._watch_deadline = deadline
                self._watch_event.clear()
            if deadline == float("inf"):
                self._watch_event.wait()
            else:
                self._watch_event.wait(max(deadline - time.monotonic(), 0.0) + 0.001)

    # ---- repair service -------------------------------------------------------------
    def _on_repair_request(self, header: CheckmateHeader, payload: memoryview, addr: Addr) -> None:
        """REPAIR_REQUEST: header range plus (offset, count) pairs in the payload -> REPAIR_DATA."""
        ranges = requested_ranges(header, payload)
        if ranges is None:
            self._drop("malformed_repair")
            return
        with self._lock:
            record = self._ops.get((header.iteration, header.bucket_id))
            available = record is not None and record.done
        self._count("repair_requests")
        if record is None or not available or not answerable(ranges, record.work.numel()):
            self._count("repair_unavailable")
            self.transport.send_unreliable(addr, nack_for(header, self.config.job_id, self.rank))
            return
        size = record.dtype.itemsize
        per = (MAX_PAYLOAD_BYTES - DATAGRAM_TAG_BYTES) // size  # room for the MAC (checkmate.auth)
        parts = pieces(ranges, per)
        for i, (start, count) in enumerate(parts):
            reply = CheckmateHeader(
                msg_type=MessageType.REPAIR_DATA,
                job_id=self.config.job_id,
                iteration=record.iteration,
                bucket_id=record.bucket_id,
                sender_rank=self.rank,
                element_offset=start,
                element_count=count,
                sequence=header.sequence,
                dtype=record.dtype,
                flags=Flags.LAST if i == len(parts) - 1 else Flags.NONE,
                shard_key=record.shard_key,
            )
            self.transport.send_unreliable(addr, reply, record.view[start * size : (start + count) * size])
        self._count("repair_datagrams", len(parts))
