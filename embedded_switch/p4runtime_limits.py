"""Bounds on the embedded switch's StreamChannels, so idle streams cannot starve real calls.

gRPC's synchronous server runs each RPC on a thread of one pool, and a
StreamChannel holds its thread for as long as it is open. Without bounds, a few
dozen streams that never send anything (issue 29: 60 of them) take every thread
and a Capabilities or Write call waits for ever. :class:`StreamGate` wraps the
StreamChannel handler:

* at most ``max_streams`` StreamChannels at once, at most ``max_streams_per_host``
  from one peer address; the pool has ``max_streams + unary_workers`` threads, so
  ``unary_workers`` are always left for Write, Read, Capabilities and the pipeline calls;
* a stream that sends nothing within ``first_message_timeout`` is cancelled.

Each refusal ends the RPC with RESOURCE_EXHAUSTED (or cancels it), is counted in
:attr:`StreamGate.refused` (status and metrics) and logged once per cause and
interval (:class:`checkmate.admission.RefusalLog`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
from google.rpc import code_pb2
from p4.v1 import p4runtime_pb2

from checkmate.admission import RefusalLog
from embedded_switch.p4runtime.errors import Failure, set_failure

Serve = Callable[[Iterator[bytes], grpc.ServicerContext], Iterator[p4runtime_pb2.StreamMessageResponse]]


@dataclass(frozen=True)
class StreamLimits:
    max_streams: int = 32
    max_streams_per_host: int = 8
    first_message_timeout: float = 10.0
    """Seconds a new StreamChannel has to send its first message (normally its arbitration)."""
    unary_workers: int = 16
    """Threads kept for the unary and Read calls, beyond the streams'."""

    @property
    def pool_size(self) -> int:
        return self.max_streams + self.unary_workers


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string (``ipv4:10.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:...``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1 : rest.find("]")]
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return peer


class StreamGate:
    """Admits StreamChannel RPCs within :class:`StreamLimits` and cancels idle ones."""

    def __init__(self, serve: Serve, limits: StreamLimits, who: str) -> None:
        self._serve = serve
        self.limits = limits
        self.refused: collections.Counter[str] = collections.Counter()
        self._open: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._log = RefusalLog(who)

    def _refuse(self, cause: str, detail: str) -> None:
        with self._lock:
            self.refused[cause] += 1
        self._log.refused(cause, detail)

    def open_streams(self) -> int:
        with self._lock:
            return sum(self._open.values())

    def serve(
        self, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[p4runtime_pb2.StreamMessageResponse]:
        peer = context.peer()
        host = peer_host(peer)
        with self._lock:
            total, here = sum(self._open.values()), self._open[host]
            cause = (
                "p4runtime_streams_per_host"
                if here >= self.limits.max_streams_per_host
                else "p4runtime_streams"
                if total >= self.limits.max_streams
                else None
            )
            if cause is None:
                self._open[host] += 1
        if cause is not None:
            limit = (
                f"{here} StreamChannels open from {host} (at most {self.limits.max_streams_per_host})"
                if cause == "p4runtime_streams_per_host"
                else f"{total} StreamChannels open (at most {self.limits.max_streams})"
            )
            self._refuse(cause, f"StreamChannel from {peer}: {limit}")
            set_failure(context, Failure(code_pb2.RESOURCE_EXHAUSTED, f"Too many streams: {limit}"))
            return
        heard = threading.Event()

        def watched() -> Iterator[bytes]:
            for raw in requests:
                heard.set()
                yield raw

        def idle_check() -> None:
            if not heard.is_set() and context.is_active():
                self._refuse(
                    "p4runtime_idle_stream",
                    f"StreamChannel from {peer} sent nothing within {self.limits.first_message_timeout:g} s",
                )
                context.cancel()

        timer = threading.Timer(self.limits.first_message_timeout, idle_check)
        timer.daemon = True
        timer.start()
        try:
            yield from self._serve(watched(), context)
        finally:
            timer.cancel()
            with self._lock:
                self._open[host] -= 1
                if self._open[host] <= 0:
                    del self._open[host]
