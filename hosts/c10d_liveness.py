"""The ``checkmate`` backend's liveness watch: a dead rank fails the group within ``peer_timeout``.

The transport has no connection to lose (gloo's TCP has one), so it sees a dead peer only through
data that stays unacknowledged. A rank with nothing outstanding toward the dead one (in a ring of
three or more, its successor, waiting to receive) would otherwise wait for the collective's
timeout, 30 minutes unless given. :class:`StoreLiveness` closes that gap through the store torch
hands the backend (its keys are the group's own, torch prefixes them):

* every rank adds 1 to ``checkmate/alive/<rank>`` every ``interval`` (a quarter of
  ``silent_after``, between 0.1 and 5 s): three small store calls per interval and rank, from a
  thread of its own (``cm-live-<rank>``), none on the training path;
* it reads its ring predecessor's counter (``add(key, 0)``) and whether any rank declared another
  dead (``checkmate/dead``);
* it declares the predecessor dead only while one of the group's collectives has waited longer
  than ``silent_after`` **and** the predecessor's counter has not moved for ``silent_after`` (or
  the store itself has not answered for that long). A slow rank keeps beating; a group with
  nothing running never fails (so ranks leaving at different times, or the store's host leaving
  first, are not deaths). A rank that closes its group says so (``checkmate/closed/<rank>``) and
  is not watched after that.
* The first rank to declare a death writes it to ``checkmate/dead``; every other rank fails its
  group with the same words at its next look, so one death reaches every rank within about
  ``silent_after`` plus an interval.

A death is a :class:`~hosts.transport.PeerTimeoutError` naming the rank: the group's flow
collectives and its ring fail their pending collectives and every later one with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from hosts.c10d_flows import FlowCollectives
from hosts.ring_allreduce import RingAllReduce
from hosts.transport import Addr, PeerTimeoutError

__all__ = ["StoreLiveness"]

logger = logging.getLogger(__name__)

ALIVE = "checkmate/alive/"
CLOSED = "checkmate/closed/"
DEAD = "checkmate/dead"


class StoreLiveness:
    """One rank's heartbeat in the group's store and its watch on its ring predecessor."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        peers: tuple[Addr, ...],
        job_id: int,
        silent_after: float,
        flows: FlowCollectives,
        ring: Callable[[], RingAllReduce | None],
        interval: float | None = None,
    ) -> None:
        if silent_after <= 0:
            raise ValueError(f"silent_after must be positive, got {silent_after}")
        self._store = store
        self._rank = rank
        self._peers = peers
        self._job_id = job_id
        self._silent_after = silent_after
        self._flows = flows
        self._ring = ring
        self.interval = interval if interval is not None else min(5.0, max(0.1, silent_after / 4))
        self.watched = (rank - 1) % len(peers)
        """The ring predecessor: the rank this one receives from."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.declared: PeerTimeoutError | None = None
        """What this rank's watch declared (None while every watched rank is alive)."""

    def start(self) -> None:
        """Beat once (so a peer's first look finds the key), then watch in ``cm-live-<rank>``."""
        self._store.add(f"{ALIVE}{self._rank}", 1)
        self._thread = threading.Thread(target=self._run, name=f"cm-live-{self._rank}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 1.0) -> None:
        """Stop watching and say this rank left on purpose (best effort: the store may be gone)."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._store.set(f"{CLOSED}{self._rank}", "1")
        except (RuntimeError, OSError) as exc:  # the store's host may have left first
            logger.debug("rank %d: could not record its close in the store: %s", self._rank, exc)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _published(self, value: bytes) -> tuple[int, str]:
        """The rank and words another rank wrote to ``checkmate/dead`` (``<rank>|<detail>``)."""
        rank_text, _, detail = value.decode(errors="replace").partition("|")
        try:
            rank = int(rank_text)
        except ValueError:
            rank = -1
        if not 0 <= rank < len(self._peers):
            return self.watched, f"another rank declared a rank dead: {value!r}"
        return rank, detail

    def _run(self) -> None:
        last_value: int | None = None
        value: int | None
        last_change = store_answered = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                self._store.add(f"{ALIVE}{self._rank}", 1)
                if self._store.check([DEAD]):
                    self._declare(*self._published(self._store.get(DEAD)), publish=False)
                    return
                if self._store.check([f"{CLOSED}{self.watched}"]):
                    logger.debug("rank %d: rank %d closed its group", self._rank, self.watched)
                    return
                value = self._store.add(f"{ALIVE}{self.watched}", 0)
                store_answered = now
            except (RuntimeError, OSError) as exc:
                value = last_value
                if now - store_answered > self._silent_after and self._waited_too_long(now):
                    self._declare(
                        self.watched,
                        f"the group's store has not answered for {now - store_answered:.1f}s "
                        f"({exc}) while a collective waited for more than {self._silent_after:.1f}s",
                        publish=False,
                    )
                    return
                continue
            if value != last_value:
                last_value, last_change = value, now
            elif now - last_change > self._silent_after and self._waited_too_long(now):
                self._declare(
                    self.watched,
                    f"no heartbeat in the group's store for {now - last_change:.1f}s "
                    f"(peer_timeout {self._silent_after:.1f}s; seen by rank {self._rank})",
                    publish=True,
                )
                return

    def _waited_too_long(self, now: float) -> bool:
        """Whether a collective (flows or ring) has run for longer than ``silent_after``."""
        ring = self._ring()
        starts = [self._flows.waiting_since(), ring.waiting_since() if ring is not None else None]
        since = min((s for s in starts if s is not None), default=None)
        return since is not None and now - since > self._silent_after

    def _declare(self, rank: int, detail: str, publish: bool) -> None:
        error = PeerTimeoutError(self._peers[rank], self._job_id, rank, detail)
        self.declared = error
        logger.error("checkmate backend rank %d: %s", self._rank, error)
        if publish:
            try:
                self._store.set(DEAD, f"{rank}|{detail}")
            except (RuntimeError, OSError) as exc:
                logger.warning("rank %d: could not tell the others through the store: %s", self._rank, exc)
        self._flows.on_peer_failure(error)  # this collective and every later one fail with it
        ring = self._ring()
        if ring is not None:
            ring.fail(error)
