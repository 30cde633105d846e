"""Prometheus metrics of a shadow node, read from :meth:`ShadowNode.status` at scrape time.

``checkmate-shadow run --metrics-port 9100`` serves them; docs/metrics.md lists them.
Every sample carries the labels ``shadow`` (its name) and ``job`` (the job id, empty
before a job starts).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import Metric

from checkmate.metrics import CallbackCollector, Families

logger = logging.getLogger(__name__)

PREFIX = "checkmate_shadow"


def shadow_metrics(status: dict[str, Any]) -> list[Metric]:
    """Metric families from one shadow status document (docs/shadow.md)."""
    job = status.get("job_id")
    f = Families(PREFIX, {"shadow": status.get("shadow", ""), "job": "" if job is None else job})
    f.gauge(
        "info", "Always 1; the state label says what the shadow is doing", 1, state=status.get("state", "")
    )
    f.gauge(
        "applied_iteration",
        "Last iteration whose optimizer step this shadow applied",
        status.get("applied_iteration"),
    )
    f.gauge(
        "certified_iteration",
        "Last iteration this shadow certified to rank 0 (held in memory, restorable)",
        status.get("certified_iteration"),
    )
    f.gauge(
        "latest_commit_iteration", "Newest iteration whose commit record arrived", status.get("latest_commit")
    )
    f.gauge("lag_iterations", "Newest commit minus last applied iteration", status.get("lag_iterations"))
    f.gauge("uptime_seconds", "Seconds since the shadow started", status.get("uptime_seconds"))
    f.counter("packets_received", "Datagrams received on the data socket", status.get("packets_received"))
    f.counter("received_bytes", "Bytes received on the data socket", status.get("bytes_received"))
    f.counter(
        "packets_placed", "Datagrams whose elements were placed in a bucket", status.get("packets_placed")
    )
    f.counter("elements_placed", "Gradient elements placed", status.get("elements_placed"))
    f.labelled_counter("drops", "Datagrams dropped, by reason", "reason", status.get("drops") or {})
    repairs = {k: v for k, v in (status.get("repairs") or {}).items() if isinstance(v, (int, float))}
    f.labelled_counter(
        "repair_events", "Repair activity (requests, datagrams_received, timeouts, ...)", "event", repairs
    )
    apply = status.get("apply") or {}
    f.counter("applied_iterations", "Optimizer steps applied", apply.get("iterations"))
    f.counter("apply_seconds", "Seconds spent applying optimizer steps", apply.get("seconds"))
    f.gauge("last_apply_seconds", "Duration of the last optimizer step", apply.get("last_seconds"))
    f.gauge(
        "commit_to_apply_seconds",
        "Seconds from the last commit's arrival to its step being applied",
        apply.get("last_commit_to_apply_seconds"),
    )
    stash = status.get("stash") or {}
    f.gauge("stash_bytes", "Bytes of copies held for iterations not yet placeable", stash.get("bytes"))
    f.counter("reseeds", "Times the shadow re-seeded its state from a job_start", status.get("reseeds"))
    f.counter("resync_requests", "Times the shadow asked rank 0 for its state", status.get("resync_requests"))
    f.counter(
        "divergences", "Fingerprint checks that found the shadow's state differs", status.get("divergences")
    )
    shard = status.get("shard") or {}
    f.gauge("owned_elements", "Parameter elements this shadow holds", shard.get("elements"))
    snapshots = status.get("snapshots") or {}
    f.counter("snapshots_written", "Snapshots written to disk", snapshots.get("written"))
    f.counter(
        "snapshots_superseded",
        "Captures replaced by a newer one while the writer was busy",
        snapshots.get("superseded"),
    )
    f.counter("snapshots_failed", "Snapshot writes that failed", snapshots.get("failed"))
    f.gauge("snapshot_last_iteration", "Iteration of the newest snapshot on disk", snapshots.get("last_step"))
    f.gauge("snapshot_last_seconds", "Duration of the last snapshot write", snapshots.get("last_seconds"))
    f.gauge(
        "control_connected",
        "1 while rank 0's control connection is up",
        int(bool(status.get("control_connected"))),
    )
    return f.out


def shadow_collector(status: Callable[[], dict[str, Any]]) -> CallbackCollector:
    """A collector calling ``status()`` (e.g. ``node.status``) at every scrape."""

    def produce() -> Iterable[Metric]:
        return shadow_metrics(status())

    return CallbackCollector(PREFIX, produce)
