"""Prometheus metrics of rank 0's Checkmate agent, read from the agent at scrape time.

Rank 0 serves them when ``CHECKMATE_METRICS_PORT`` is set (``CheckmateConfig.metrics_port``);
other ranks never do. A port that cannot be bound is logged as an error and training
goes on without metrics: a dashboard is not worth a failed job (docs/metrics.md).
Every sample carries the labels ``job`` and ``rank``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

from prometheus_client.core import Metric

from checkmate.metrics import CallbackCollector, Families, MetricsServer, start_or_log

logger = logging.getLogger(__name__)

PREFIX = "checkmate_agent"


class _Agent(Protocol):
    """What the metrics read of an agent (read-only: the agent's properties)."""

    @property
    def iteration(self) -> int: ...

    @property
    def channel(self) -> Any: ...

    def stats(self) -> dict[str, Any]: ...


def agent_metrics(agent: _Agent, job_id: int, rank: int) -> list[Metric]:
    f = Families(PREFIX, {"job": str(job_id), "rank": str(rank)})
    f.gauge("iteration", "The iteration the agent is in (the next all-reduce's number)", agent.iteration)
    channel = agent.channel
    certified = channel.certified_through() if channel is not None else None
    f.gauge("certified_iteration", "Last iteration every shadow has certified", certified)
    if certified is not None:
        f.gauge(
            "lag_iterations", "Current iteration minus the last certified one", agent.iteration - certified
        )
    stats = agent.stats()
    protection = stats.get("protection")
    if isinstance(protection, dict):  # hosts.protection: bounded lag and the unprotected verdict
        f.gauge(
            "protected",
            "1 while the shadows hold a certified state within max_lag",
            int(protection["protected"]),
        )
        f.gauge(
            "max_lag_iterations",
            "The lag bound (CHECKMATE_MAX_LAG, or the fingerprint interval)",
            protection["max_lag"],
        )
        f.counter(
            "unprotected_episodes",
            "Episodes in which the job was unprotected",
            protection["unprotected_episodes"],
        )
        f.counter(
            "backpressure_waits",
            "Forward passes rank 0 waited at for the shadows",
            protection["backpressure_waits"],
        )
        f.counter(
            "backpressure_seconds",
            "Seconds rank 0 waited for the shadows (backpressure)",
            protection["backpressure_seconds"],
        )
    transport = {k: v for k, v in stats.get("transport", {}).items() if isinstance(v, (int, float))}
    f.labelled_counter(
        "transport_drops",
        "Datagrams the transport dropped, by reason",
        "reason",
        {k[5:]: v for k, v in transport.items() if k.startswith("drop.")},
    )
    f.labelled_counter(
        "transport_events",
        "Transport counters (data_sent, data_received, retransmissions, acks_sent, ...)",
        "event",
        {
            k: v
            for k, v in transport.items()
            if not k.startswith("drop.") and not k.startswith("flows.") and k != "unacked"
        },
    )
    f.gauge(
        "transport_unacked_datagrams", "Datagrams sent and not yet acknowledged", transport.get("unacked")
    )
    ring = {k: v for k, v in stats.get("ring", {}).items() if isinstance(v, (int, float))}
    f.labelled_counter(
        "ring_events",
        "All-reduce counters (ops_completed, tagged_datagrams, repair_requests, ...)",
        "event",
        {k: v for k, v in ring.items() if k not in ("ops_kept", "stash_bytes")},
    )
    f.gauge("ring_stash_bytes", "Bytes the all-reduce holds for early datagrams", ring.get("stash_bytes"))
    control = stats.get("control", {})
    f.labelled_gauge(
        "shadow_connected",
        "1 while the control link to the shadow is up",
        "shadow",
        {name: counters.get("connected", 0) for name, counters in control.items()},
    )
    certified_counts = {name: counters.get("certified", 0) for name, counters in control.items()}
    f.labelled_counter(
        "shadow_certified_messages", "Certified messages received per shadow", "shadow", certified_counts
    )
    return f.out


def start_agent_metrics(agent: _Agent, job_id: int, rank: int, port: int) -> MetricsServer | None:
    """Serve ``agent``'s metrics on ``port``; None (and one logged error) when it cannot be bound."""

    def produce() -> Iterable[Metric]:
        return agent_metrics(agent, job_id, rank)

    return start_or_log(CallbackCollector(PREFIX, produce), port)
