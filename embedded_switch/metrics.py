"""Prometheus metrics of the embedded switch, read from its ports, drops and P4 state at scrape time.

``checkmate-switch ... --metrics-port 9101`` serves them; docs/metrics.md lists them.
Every sample carries the label ``device`` (the P4Runtime device id). The per-job
counters (``shadow_copies``, ``rejected_replications``) are the P4 program's counter
arrays, indexed by job slot; the ``job`` label comes from the ``lookup_job`` table
(``unknown`` for slot 0 and for slots no entry names).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, Metric

from checkmate.metrics import CallbackCollector, Families
from checkmate.p4 import names
from embedded_switch.pipeline import DropReason
from embedded_switch.ports import SwitchPorts
from embedded_switch.state import SwitchState

logger = logging.getLogger(__name__)

PREFIX = "checkmate_switch"
_JOB_COUNTERS = (
    (names.ShadowCopies.NAME, "Copies re-addressed to a shadow (egress), per job"),
    (names.RejectedReplications.NAME, "Tagged packets of the job that matched no replication entry, per job"),
)


def _slot_jobs(state: SwitchState) -> dict[int, str]:
    out: dict[int, str] = {}
    table = state.tables.get(names.LookupJob.NAME)
    if table is None:
        return out
    for entry in list(table.entries()):
        if entry.action.params and entry.key:
            out[entry.action.params[0]] = str(entry.key[0].value)
    return out


def switch_metrics(
    device: int,
    ports: SwitchPorts,
    state: SwitchState | None,
    p4runtime_refusals: Mapping[str, int] | None = None,
) -> list[Metric]:
    f = Families(PREFIX, {"device": str(device)})
    if p4runtime_refusals is not None:
        f.labelled_counter(
            "p4runtime_refusals",
            "P4Runtime StreamChannels refused or cancelled (too many, per host, idle)",
            "cause",
            p4runtime_refusals,
        )
    stats = ports.port_stats()
    f.labelled_counter(
        "port_received_packets",
        "Frames received per port",
        "port",
        {p: s.rx_packets for p, s in stats.items()},
    )
    f.labelled_counter(
        "port_received_bytes", "Bytes received per port", "port", {p: s.rx_bytes for p, s in stats.items()}
    )
    f.labelled_counter(
        "port_transmitted_packets",
        "Frames sent per port",
        "port",
        {p: s.tx_packets for p, s in stats.items()},
    )
    f.labelled_counter(
        "port_transmitted_bytes", "Bytes sent per port", "port", {p: s.tx_bytes for p, s in stats.items()}
    )
    drops = CounterMetricFamily(
        f"{PREFIX}_drops", "Frames dropped, by reason and port", labels=["device", "reason", "port"]
    )
    for (reason, port), n in sorted(ports.drops.snapshot().items()):
        try:
            name = DropReason(reason).name
        except ValueError:
            name = str(reason)
        drops.add_metric([str(device), name, str(port)], n)
    f.out.append(drops)
    f.gauge("pipeline_loaded", "1 when a P4 pipeline is loaded", int(state is not None))
    if state is None:
        return f.out
    f.labelled_gauge(
        "table_entries",
        "Entries installed per table",
        "table",
        {alias: len(t) for alias, t in state.tables.items()},
    )
    f.gauge("multicast_groups", "Multicast groups installed", len(state.multicast_groups))
    f.gauge(
        "multicast_replicas",
        "Replicas over all multicast groups",
        sum(len(r) for r in state.multicast_groups.values()),
    )
    jobs = _slot_jobs(state)
    for alias, doc in _JOB_COUNTERS:
        counter = state.counters.get(alias)
        if counter is None:
            continue
        packets = CounterMetricFamily(f"{PREFIX}_{alias}", doc, labels=["device", "job", "slot"])
        nbytes = CounterMetricFamily(
            f"{PREFIX}_{alias}_bytes", doc + " (bytes)", labels=["device", "job", "slot"]
        )
        for slot in range(counter.size):
            p, b = counter.read(slot)
            if p == 0 and slot not in jobs:
                continue
            labels = [str(device), jobs.get(slot, "unknown"), str(slot)]
            packets.add_metric(labels, p)
            nbytes.add_metric(labels, b)
        f.out += [packets, nbytes]
    return f.out


def switch_collector(
    device: int,
    ports: SwitchPorts,
    state: Callable[[], SwitchState | None],
    p4runtime_refusals: Callable[[], Mapping[str, int]] | None = None,
) -> CallbackCollector:
    """A collector reading ``ports``, ``state()`` (the server's current state) and the P4Runtime
    server's refusals at every scrape."""

    def produce() -> Iterable[Metric]:
        refusals = p4runtime_refusals() if p4runtime_refusals is not None else None
        return switch_metrics(device, ports, state(), refusals)

    return CallbackCollector(PREFIX, produce)
