"""The shadow node's maintenance thread: repair requests for gaps, and the status document and file.

Every 5 ms it plans repairs under ``_lock`` (REPAIR_REQUEST for exactly the missing
ranges of an iteration whose commit is here, see :mod:`shadow.repair`) and sends them
without it; an unrepairable iteration makes the shadow ask rank 0 for fresh state. Once
a second it rewrites the status file from :meth:`Maintenance.status` (taken under ``_lock``).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from checkmate.sockets import receive_queued
from checkmate.wire import CheckmateHeader
from shadow.node_state import Addr, NodeState
from shadow.repair import request_datagram
from shadow.snapshots import disk_status

logger = logging.getLogger(__name__)

REPAIR_DEFER_LIMIT_S = 1.0
MAINTENANCE_BUSY_S = 0.005
"""The maintenance thread's period while a committed iteration lacks copies."""
MAINTENANCE_IDLE_S = 0.05
"""Its period otherwise (a commit wakes it at once)."""
"""Longest a shadow defers planning repairs while copies still wait unread in its socket."""


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # the shadow's status: its owner's only
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class Maintenance(NodeState):
    """Repairs and status of a shadow node (``_lock`` to plan and to read status)."""

    _repair_wanted: bool = False
    """A committed iteration in the window lacks copies (the loop then runs every 5 ms)."""

    def status(self) -> dict[str, Any]:
        with self._lock:
            job, epoch = self._job, self._epoch
            repairs = self._repairs.stats if self._repairs is not None else None
            stats = self.stats
            if job is None:
                state = "waiting_for_job"
            elif epoch is None:
                state = "waiting_for_layout"
            elif self._diverged is not None:
                state = "diverged"
            elif self._blocked:
                state = "stalled"
            else:
                state = "running"
            apply_rate = stats.applied_elements / stats.apply_seconds if stats.apply_seconds else 0.0
            drops = collections.Counter(stats.drops)
            document: dict[str, Any] = {
                "shadow": self.name,
                "time": time.time(),
                "uptime_seconds": round(time.time() - self._started, 3),
                "job_id": job.job_id if job else None,
                "data_address": list(self.data_address),
                "state": state,
                "blocked": self._blocked,
                "applied_iteration": self._applied,
                "certified_iteration": self._certified,
                "verified_iteration": self._last_verified,
                "divergence": self._diverged,
                "last_divergence": self._last_divergence,
                "divergences": stats.divergences,
                "fingerprints_checked": stats.fingerprints_checked,
                "next_iteration": epoch.window.next_iteration if epoch else None,
                "latest_commit": self._latest_commit,
                "latest_seen_iteration": max(self._latest_seen, self._latest_commit),
                "lag_iterations": max(0, self._latest_commit - self._applied) if job else None,
                "optimizer_step": self._optimizer_step,
                "restored_from_snapshot": self._restored_from,
                "shard": {
                    "keys": sorted(job.shard_keys) if job else [],
                    "index": job.shard_index if job else None,
                    "count": job.num_shards if job else None,
                    "buckets": sorted(epoch.owned_buckets) if epoch else [],
                    "parameters": len(epoch.optimizer.parameters) + len(epoch.static) if epoch else 0,
                    "elements": sum(p.numel() for p in epoch.optimizer.parameters.values()) if epoch else 0,
                },
                "packets_received": stats.packets_received,
                "bytes_received": stats.bytes_received,
                "packets_placed": stats.packets_placed,
                "elements_placed": stats.elements_placed,
                "stash": {
                    "datagrams": sum(len(v) for v in self._stash.values()),
                    "bytes": self._stash_bytes,
                    # copies placed before their commit (undone if rank 0 changes the layout first)
                    "placed_ahead": sum(len(v) for v in epoch.unconfirmed.values()) if epoch else 0,
                },
                "drops": dict(sorted(drops.items())),
                "repairs": {**vars(repairs), "grace_s": round(self._repairs.grace, 6)}
                if repairs is not None and self._repairs is not None
                else {},
                "apply": {
                    "iterations": stats.applied_iterations,
                    "seconds": round(stats.apply_seconds, 6),
                    "last_seconds": round(stats.last_apply_seconds, 6),
                    "elements_per_second": round(apply_rate),
                    "last_commit_to_apply_seconds": round(stats.last_commit_to_apply_seconds, 6),
                },
                "reseeds": stats.reseeds,
                "resync_requests": stats.resync_requests,
                "control_connected": self._control_conn is not None,
                "snapshots": dict(vars(self.snapshotter.stats)) if self.snapshotter else None,
                "disk": disk_status(self.snapshotter.policy.directory, self._applied)
                if self.snapshotter
                else None,
            }
        return document

    def _maintenance_loop(self) -> None:
        next_status = time.monotonic()
        deferred_since: float | None = None
        self._repair_wanted = False
        while not self._stop.is_set():
            # Every 5 ms while a committed iteration lacks copies (repairs are due or in flight),
            # else every 50 ms or when a commit arrives: an idle shadow does not spin.
            self._wake.wait(MAINTENANCE_BUSY_S if self._repair_wanted else MAINTENANCE_IDLE_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            sends: list[tuple[Addr, CheckmateHeader, bytes]] = []
            resync: str | None = None
            # Nothing is missing that still waits unread in the socket (a loaded shadow): plan
            # repairs once the socket is drained, or after REPAIR_DEFER_LIMIT_S at the latest,
            # so that steady traffic that never lets the queue empty cannot starve repairs.
            if receive_queued(self._udp):
                deferred_since = now if deferred_since is None else deferred_since
            else:
                deferred_since = None
            if deferred_since is None or now - deferred_since >= REPAIR_DEFER_LIMIT_S:
                deferred_since = None
                with self._lock:
                    resync = self._plan_repairs(now, sends)
            for addr, header, payload in sends:
                try:
                    datagram = header.pack() + payload
                    tag = self._datagram_keys.for_job(header.job_id).tag((datagram,))
                    self._udp.sendto(datagram + tag, addr)
                except OSError as exc:
                    logger.debug("repair request to %s failed: %s", addr, exc)
            if resync is not None and self.config.resync_on_unrepairable:
                conn = self._control_conn
                if conn is not None:
                    self._request_state(conn, resync)
            if now >= next_status:
                next_status = now + 1.0
                self._write_status()

    def _plan_repairs(self, now: float, sends: list[tuple[Addr, CheckmateHeader, bytes]]) -> str | None:
        self._repair_wanted = False
        epoch, job, repairs = self._epoch, self._job, self._repairs
        if epoch is None or job is None or repairs is None or not job.workers or self._diverged is not None:
            return None  # diverged: nothing is applied until rank 0 re-seeds, so nothing to repair
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
        self._repair_wanted = wanted
        failure = repairs.failure(nxt)
        if failure is not None:
            blocked = f"not certified: {failure}"
            if self._blocked != blocked:
                self._blocked = blocked
                return failure
            return None
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

    def _write_status(self) -> None:
        path = self.config.status_file
        if path is None and self.config.snapshots is not None:
            path = self.config.snapshots.directory / f"status-{self.name}.json"
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write_text(path, json.dumps(self.status(), indent=1, sort_keys=True) + "\n")
        except OSError as exc:
            logger.warning("shadow %s: cannot write status file %s: %s", self.name, path, exc)
