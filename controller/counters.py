"""Reads the per-job counters the data plane keeps, indexed by job slot.

``shadow_copies`` (egress) counts copies re-addressed to a shadow;
``rejected_replications`` (ingress) counts tagged packets of the job that
matched no replication entry (a port not enrolled, an unknown shard key, or
an unexpected next hop) and were forwarded without a copy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from p4.v1 import p4runtime_pb2

from checkmate.p4 import names
from controller.entities import EntityCodec
from controller.switch_connection import SwitchConnection

logger = logging.getLogger(__name__)

JOB_COUNTERS = (names.ShadowCopies.NAME, names.RejectedReplications.NAME)


@dataclass(frozen=True)
class CounterValue:
    packets: int = 0
    bytes: int = 0

    def since(self, baseline: tuple[int, int]) -> CounterValue:
        """Counts since ``baseline``; if the counter went backwards (switch restarted), all of it."""
        packets, nbytes = baseline
        if self.packets < packets or self.bytes < nbytes:
            return self
        return CounterValue(self.packets - packets, self.bytes - nbytes)

    def __add__(self, other: CounterValue) -> CounterValue:
        return CounterValue(self.packets + other.packets, self.bytes + other.bytes)


def read_counters(
    connection: SwitchConnection, codec: EntityCodec, index: int, names: Iterable[str] = JOB_COUNTERS
) -> dict[str, CounterValue]:
    """Each named counter's value at ``index``, in one Read."""
    wanted = list(names)
    requests = []
    by_id: dict[int, str] = {}
    for name in wanted:
        counter_id = codec.names.counter_id(name)
        by_id[counter_id] = name
        request = p4runtime_pb2.Entity()
        request.counter_entry.counter_id = counter_id
        request.counter_entry.index.index = index
        requests.append(request)
    values = {name: CounterValue() for name in wanted}
    for message in connection.read(requests):
        entry = message.counter_entry
        found = by_id.get(entry.counter_id)
        if found is not None and entry.index.index == index:
            values[found] = CounterValue(entry.data.packet_count, entry.data.byte_count)
    return values
