"""Prometheus endpoints for Checkmate's processes (shadow, embedded switch, rank 0's agent).

Each component has a *collector* (``shadow/metrics.py``, ``embedded_switch/metrics.py``,
``hosts/metrics.py``) that reads the component's own status and counters when Prometheus
scrapes, so nothing on a hot path increments anything for metrics' sake. This module
holds what they share: :class:`MetricsServer` (``prometheus_client``'s HTTP exporter on a
private registry, so two components in one process never collide) and small builders
for metric families. docs/metrics.md lists every metric.

Names follow Prometheus conventions: ``checkmate_<component>_..._total`` for counters,
``_seconds`` and ``_bytes`` in base units, gauges without a suffix.

A port already in use raises :class:`MetricsPortError` (an ``OSError``) with a message
naming the port; what the process does then is the component's call (docs/metrics.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector, CollectorRegistry

logger = logging.getLogger(__name__)

DEFAULT_BIND = "127.0.0.1"


class MetricsPortError(OSError):
    """The metrics port cannot be bound (in use, no permission, bad address)."""


class MetricsServer:
    """An HTTP endpoint serving one collector's metrics at ``/metrics`` on its own thread."""

    def __init__(self, collector: Collector, port: int, address: str = DEFAULT_BIND) -> None:
        if not 0 <= port <= 65535:
            raise MetricsPortError(f"metrics port {port} is outside 0..65535")
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        try:
            self._server, self._thread = start_http_server(port, address, self.registry)
        except OSError as exc:
            raise MetricsPortError(
                f"cannot serve metrics on {address}:{port}: {exc.strerror or exc}"
                + (" (the port is in use)" if exc.errno == 98 else "")
            ) from None
        self.address = address
        self.port: int = self._server.server_address[1]
        self._closed = threading.Event()
        logger.info("Prometheus metrics on http://%s:%d/metrics", address, self.port)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2.0)


def start_or_log(collector: Collector, port: int, address: str = DEFAULT_BIND) -> MetricsServer | None:
    """Start an endpoint; on a port that cannot be bound log one error and return None."""
    try:
        return MetricsServer(collector, port, address)
    except MetricsPortError as exc:
        logger.error("%s; running without metrics", exc)
        return None


class CallbackCollector(Collector):
    """A collector that yields whatever ``produce()`` returns; an error there is logged, not raised.

    A scrape must never take the component down: if reading the status fails the scrape
    answers with no metrics from this collector (and ``checkmate_metrics_errors_total``).
    """

    def __init__(self, prefix: str, produce: Callable[[], Iterable[Metric]]) -> None:
        self._prefix = prefix
        self._produce = produce
        self._errors = 0

    def collect(self) -> Iterator[Metric]:
        try:
            metrics = list(self._produce())
        except Exception:  # noqa: BLE001 - any failure of a status read stays in the scrape
            logger.exception("metrics: reading %s status failed", self._prefix)
            self._errors += 1
            metrics = []
        yield from metrics
        errors = CounterMetricFamily(
            f"{self._prefix}_metrics_errors", "Scrapes whose status read failed", labels=[]
        )
        errors.add_metric([], self._errors)
        yield errors


class Families:
    """Builds metric families with a fixed set of base labels (e.g. shadow, job)."""

    def __init__(self, prefix: str, base: Mapping[str, str]) -> None:
        self.prefix = prefix
        self.base_names = list(base)
        self.base_values = [str(v) for v in base.values()]
        self.out: list[Metric] = []

    def gauge(self, name: str, doc: str, value: float | None, **labels: Any) -> None:
        if value is None:
            return
        family = GaugeMetricFamily(f"{self.prefix}_{name}", doc, labels=self.base_names + list(labels))
        family.add_metric(self.base_values + [str(v) for v in labels.values()], float(value))
        self.out.append(family)

    def counter(self, name: str, doc: str, value: float | None) -> None:
        if value is None:
            return
        family = CounterMetricFamily(f"{self.prefix}_{name}", doc, labels=self.base_names)
        family.add_metric(self.base_values, float(value))
        self.out.append(family)

    def labelled_counter(self, name: str, doc: str, label: str, values: Mapping[Any, float]) -> None:
        """One counter family with one sample per ``values`` key (also when empty: the family shows)."""
        family = CounterMetricFamily(f"{self.prefix}_{name}", doc, labels=[*self.base_names, label])
        for key, value in sorted(values.items(), key=lambda kv: str(kv[0])):
            family.add_metric([*self.base_values, str(key)], float(value))
        self.out.append(family)

    def labelled_gauge(self, name: str, doc: str, label: str, values: Mapping[Any, float]) -> None:
        family = GaugeMetricFamily(f"{self.prefix}_{name}", doc, labels=[*self.base_names, label])
        for key, value in sorted(values.items(), key=lambda kv: str(kv[0])):
            family.add_metric([*self.base_values, str(key)], float(value))
        self.out.append(family)


def parse_metrics_port(text: str | None, what: str) -> int | None:
    """A port from an option or environment variable (None/empty: no endpoint); ValueError names ``what``."""
    if text is None or text.strip() == "":
        return None
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{what}={text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{what}={port} is outside 0..65535")
    return port
