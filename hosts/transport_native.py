"""The native data path of :class:`hosts.transport.Transport`: the compiled engine and its events.

With ``TransportConfig.datapath == "native"`` (the default where :mod:`hosts.native` built), a
transport's socket is served by one :class:`NativeDatapath`: it owns the C engine
(``hosts.native._datapath.Engine``) whose thread ``cm-native`` reads, checks, acknowledges,
reduces and forwards every DATA datagram of a native ring, keeps every flow (windows, SACK/NACK,
RTO) and sleeps until its next deadline; its second thread ``cm-native-tx`` writes the DATA it
queues (UDP GSO runs), so the kernel's send path runs beside the receive and the reductions.
Python sees only what is not per datagram of a ring:

* ``EV_DONE``: a ring op completed (:meth:`hosts.ring_allreduce.RingAllReduce` sets its future);
* ``EV_FAIL``: a peer stopped acknowledging (the job's failure callback, as on the Python path);
* ``EV_RAW``: a datagram the engine leaves to the Python checks (repair requests, runts, unknown
  types): :meth:`hosts.transport_receive.Receiver._handle_datagram`;
* ``EV_DATA``: an accepted DATA datagram of a job without a native ring (a plain ``add_job``
  handler), delivered to its handler;
* ``EV_TAP``: a reliable transmission, while ``Transport.tap`` or ``Transport.copy_hook`` is set.

Events are dispatched on the engine's thread (with the GIL, the engine's mutex released) or on
the Python thread whose call produced them. The Python path's own counters (``count``) and the
engine's are summed in ``Transport.stats()``.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from checkmate.network import Addr
from checkmate.wire import HEADER_BYTES, CheckmateHeader, decode, decode_data
from hosts.transport_records import Job, PeerTimeoutError, TransportClosedError, TransportConfig


class _Host(Protocol):
    """What the engine and its events use of the transport that owns them (:class:`hosts.transport.Transport`;
    named here rather than imported, so that this layer does not import the one above it)."""

    @property
    def config(self) -> TransportConfig: ...
    @property
    def advertised_window(self) -> int: ...
    @property
    def tap(self) -> Callable[[CheckmateHeader, Addr, bool], None] | None: ...
    @property
    def copy_hook(self) -> Callable[[bytes, Addr], None] | None: ...
    @property
    def _sock(self) -> socket.socket: ...
    @property
    def _gro(self) -> bool: ...
    @property
    def _jobs(self) -> dict[int, Job]: ...
    def count(self, name: str, n: int = 1) -> None: ...
    def _handle_datagram(self, data: memoryview, addr: Addr) -> None: ...


logger = logging.getLogger(__name__)

EV_RAW, EV_DATA, EV_DONE, EV_FAIL, EV_TAP = range(5)
OpDoneHandler = Callable[[int, int], None]
"""Called with (iteration, bucket) when a native ring op of a job completes."""

_live: weakref.WeakSet[NativeDatapath] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Stop every engine thread before the interpreter goes away (they take the GIL for events)."""
    for datapath in list(_live):
        datapath.stop()


def _forget_all() -> None:
    """In a child after fork (a DataLoader worker): the parent's engines have no thread here."""
    for datapath in list(_live):
        datapath._stopped = True
        datapath.engine.forget()


os.register_at_fork(after_in_child=_forget_all)


class NativeDatapath:
    """One transport socket's compiled engine, the events it raises, and the calls into it."""

    def __init__(self, module: Any, transport: _Host) -> None:
        config = transport.config
        faults = config.faults
        self._transport = weakref.ref(transport)
        self._done: dict[int, OpDoneHandler] = {}
        self._rings: dict[int, tuple[int, int, int, bool]] = {}
        """Rings announced by :meth:`expect_ring` for jobs not yet added (job -> ring_add's arguments)."""
        self._errors: dict[tuple[Addr, int], PeerTimeoutError] = {}
        self._stopped = False
        self.engine = module.Engine(
            fd=transport._sock.fileno(),
            dispatch=self._dispatch,
            window=config.window,
            advertised_window=transport.advertised_window,
            ack_every=config.ack_every,
            dupthresh=config.dupthresh,
            max_reorder=config.max_reorder,
            initial_rto=config.initial_rto,
            min_rto=config.min_rto,
            max_rto=config.max_rto,
            peer_timeout=config.peer_timeout,
            nack_delay=config.nack_delay,
            nack_interval=config.nack_interval,
            timer_tick=config.timer_tick,
            send_block_timeout=config.send_block_timeout,
            gso=config.gso,
            gro=transport._gro,
            seed=faults.seed,
            send_drop=faults.send_drop,
            recv_drop=faults.recv_drop,
            duplicate=faults.duplicate,
            reorder=faults.reorder,
        )
        _live.add(self)

    def start(self) -> None:
        self.engine.start()

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self.engine.stop()

    # ---- jobs and rings ---------------------------------------------------------------
    def add_job(self, job_id: int, rank: int, peers: Mapping[int, Addr], key: bytes) -> None:
        """Register ``job_id`` with the engine, with its ring if :meth:`expect_ring` announced one."""
        ring = self._rings.pop(job_id, None)
        self.engine.add_job(job_id, rank, [(r, a) for r, a in peers.items()], key, ring)

    def remove_job(self, job_id: int) -> None:
        self._done.pop(job_id, None)
        self._rings.pop(job_id, None)
        self.engine.remove_job(job_id)

    def expect_ring(
        self,
        job_id: int,
        world: int,
        future_iterations: int,
        max_stash_bytes: int,
        on_done: OpDoneHandler,
        host_mode: bool = False,
    ) -> None:
        """:meth:`add_ring` for a job that ``Transport.add_job`` will add next (call it first).

        The ring is set up in the same engine call that adds the job, so no DATA of the job is
        ever accepted without it: with :meth:`add_ring` after ``add_job``, a peer that started
        sending while this rank was still building its ring had its first datagrams acknowledged
        and handed to Python, lost to the ring (the op then timed out with those slots missing).
        :meth:`cancel_ring` forgets an announcement that was not used.
        """
        self._done[job_id] = on_done
        self._rings[job_id] = (world, future_iterations, max_stash_bytes, host_mode)

    def cancel_ring(self, job_id: int) -> None:
        """Forget :meth:`expect_ring`'s announcement (``Transport.add_job`` failed); no engine call."""
        self._rings.pop(job_id, None)

    def add_ring(
        self,
        job_id: int,
        world: int,
        future_iterations: int,
        max_stash_bytes: int,
        on_done: OpDoneHandler,
        host_mode: bool = False,
    ) -> None:
        """Reduce and forward ``job_id``'s DATA in the engine; ``on_done`` hears of completed ops.

        ``host_mode``: host replication (no switch): REPLICATE stays off the wire and the owner of
        each reduced slot sends it once more, outside any flow, to the address
        ``engine.ring_replica`` set for its shard key."""
        self._done[job_id] = on_done
        self.engine.ring_add(job_id, world, future_iterations, max_stash_bytes, host_mode)

    # ---- sending ----------------------------------------------------------------------
    def send(self, peer: Addr, job_id: int, header_bytes: bytes | bytearray, payload: Any) -> None:
        """A reliable DATA datagram (the engine copies ``payload``); raises as ``send_packed`` does."""
        if self._stopped:
            raise TransportClosedError("the transport is closed")
        rc = self.engine.send(peer, job_id, header_bytes, payload)
        if rc == 0:
            return
        if rc == -1:
            raise self.flow_error(peer, job_id)
        if rc == -3:
            raise OverflowError(f"flow to {peer} exhausted its 32-bit sequence space")
        if rc == -4:
            raise KeyError(f"job {job_id} is not registered with this transport")
        raise MemoryError("the native data path is out of memory")

    def flow_error(self, peer: Addr, job_id: int) -> PeerTimeoutError:
        error = self._errors.get((peer, job_id))
        if error is None:
            found = self.engine.flow_error(peer, job_id)
            rank, detail = found if found is not None else (-1, "the flow failed")
            error = PeerTimeoutError(peer, job_id, rank if rank >= 0 else None, detail)
        return error

    def emit(self, datagram: bytes, addr: Addr) -> None:
        self.engine.emit(datagram, addr)

    # ---- events -----------------------------------------------------------------------
    def _dispatch(self, kind: int, *args: Any) -> None:
        try:
            self._on_event(kind, args)
        except Exception:  # noqa: BLE001 - an event handler's bug must not reach the engine's thread
            transport = self._transport()
            if transport is not None:
                transport.count("handler_error")
            logger.exception("native data path: handling event %d failed", kind)

    def _on_event(self, kind: int, args: tuple[Any, ...]) -> None:
        if kind == EV_DONE:
            job_id, iteration, bucket = args
            handler = self._done.get(job_id)
            if handler is not None:
                handler(iteration, bucket)
            return
        transport = self._transport()
        if transport is None:
            return
        if kind == EV_RAW:
            data, addr = args
            transport._handle_datagram(memoryview(data), addr)
        elif kind == EV_DATA:
            data, addr = args
            view = memoryview(data)
            fields, payload = decode_data(view)
            job = transport._jobs.get(fields[4])
            if job is None:
                return
            if job.on_data_fields is not None:
                job.on_data_fields(fields, payload, addr)
            else:
                job.on_data(decode(view)[0], payload, addr)
        elif kind == EV_FAIL:
            job_id, addr, rank, detail = args
            error = PeerTimeoutError(addr, job_id, rank if rank >= 0 else None, detail)
            self._errors[(addr, job_id)] = error
            logger.error("%s", error)
            job = transport._jobs.get(job_id)
            if job is not None and job.on_failure is not None:
                job.on_failure(error)
        elif kind == EV_TAP:
            data, addr, retransmit = args
            tap, hook = transport.tap, transport.copy_hook
            if tap is not None and len(data) >= HEADER_BYTES:
                tap(decode(data)[0], addr, bool(retransmit))
            if hook is not None:
                hook(data, addr)
