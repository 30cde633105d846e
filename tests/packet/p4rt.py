"""A small P4Runtime client for packet tests that speaks only in P4Info names.

Raw ``p4.v1`` stubs, no controller code (values in the shared canonical bytestring form,
:mod:`checkmate.p4.bytestrings`): open a stream, win arbitration, delete
the switch's multicast groups and push the pipeline, insert the entries and groups
of tests/switch_cases.py, read counters. Every RPC carries a deadline.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc

from checkmate.p4.bytestrings import encode_bytestring
from checkmate.p4.p4info import load_p4info
from checkmate.tls import TlsFiles
from embedded_switch.testbed import open_channel
from tests.switch_cases import Entry, Group

RPC_TIMEOUT_S = 10.0


class P4RuntimeTestClient:
    """Primary controller of device ``device_id`` at ``address`` (``unix:PATH`` or ``host:port``)."""

    def __init__(
        self, address: str, device_id: int = 0, election_id: int = 10, tls: TlsFiles | None = None
    ) -> None:
        """``tls``: connect over TLS with these files (a client certificate: mutual TLS)."""
        self.device_id = device_id
        self.election_id = election_id
        self.channel = open_channel(address, tls)
        grpc.channel_ready_future(self.channel).result(timeout=RPC_TIMEOUT_S)
        self.stub = p4runtime_pb2_grpc.P4RuntimeStub(self.channel)
        self._outbox: queue.Queue[p4runtime_pb2.StreamMessageRequest | None] = queue.Queue()
        self.packet_ins: queue.Queue[p4runtime_pb2.PacketIn] = queue.Queue()
        self._arbitration: queue.Queue[p4runtime_pb2.StreamMessageResponse] = queue.Queue()
        self._stream = self.stub.StreamChannel(self._requests())
        self._reader = threading.Thread(target=self._read, name="p4rt-test-stream", daemon=True)
        self._reader.start()
        request = p4runtime_pb2.StreamMessageRequest()
        request.arbitration.device_id = device_id
        request.arbitration.election_id.low = election_id
        self._outbox.put(request)
        reply = self._arbitration.get(timeout=RPC_TIMEOUT_S)
        if reply.arbitration.status.code != 0:
            raise RuntimeError(f"not primary: {reply.arbitration.status}")
        self.p4info = load_p4info()
        self._counters = {c.preamble.alias: c for c in self.p4info.counters}

    def _requests(self) -> Iterator[p4runtime_pb2.StreamMessageRequest]:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            yield item

    def _read(self) -> None:
        try:
            for message in self._stream:
                if message.HasField("arbitration"):
                    self._arbitration.put(message)
                elif message.HasField("packet"):
                    self.packet_ins.put(message.packet)
        except grpc.RpcError:
            pass  # the stream ends when the test closes the client or stops the switch

    def close(self) -> None:
        self._outbox.put(None)
        self._stream.cancel()
        self._reader.join(timeout=RPC_TIMEOUT_S)
        self.channel.close()

    # ---- pipeline -------------------------------------------------------------------------------------
    def group_ids(self) -> list[int]:
        """Ids of the multicast groups the switch reports (none when it runs no pipeline)."""
        request = p4runtime_pb2.ReadRequest(device_id=self.device_id)
        request.entities.add().packet_replication_engine_entry.multicast_group_entry.multicast_group_id = 0
        try:
            return [
                e.packet_replication_engine_entry.multicast_group_entry.multicast_group_id
                for response in self.stub.Read(request, timeout=RPC_TIMEOUT_S)
                for e in response.entities
            ]
        except grpc.RpcError as error:
            if error.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                return []
            raise

    def delete_groups(self) -> int:
        """Delete every multicast group; how many there were. BMv2 keeps the replicas of
        groups that exist at a pipeline push in its data plane (docs/controller.md)."""
        ids = self.group_ids()
        updates = []
        for group_id in ids:
            u = p4runtime_pb2.Update(type=p4runtime_pb2.Update.DELETE)
            u.entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = group_id
            updates.append(u)
        if updates:
            self._write(*updates)
        return len(ids)

    def push_pipeline(self, device_config: bytes = b"", p4info: p4info_pb2.P4Info | None = None) -> None:
        """Delete the groups, then VERIFY_AND_COMMIT: a fresh program state (empty tables, zero counters)."""
        self.delete_groups()
        request = p4runtime_pb2.SetForwardingPipelineConfigRequest(
            device_id=self.device_id,
            action=p4runtime_pb2.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT,
        )
        request.election_id.low = self.election_id
        request.config.p4info.CopyFrom(p4info or self.p4info)
        request.config.p4_device_config = device_config
        self.stub.SetForwardingPipelineConfig(request, timeout=RPC_TIMEOUT_S * 3)

    # ---- writes ---------------------------------------------------------------------------------------
    def _write(self, *updates: p4runtime_pb2.Update) -> None:
        request = p4runtime_pb2.WriteRequest(device_id=self.device_id, updates=list(updates))
        request.election_id.low = self.election_id
        self.stub.Write(request, timeout=RPC_TIMEOUT_S)

    def table_entry(self, entry: Entry) -> p4runtime_pb2.TableEntry:
        return table_entry(self.p4info, entry)

    def insert(self, *entries: Entry) -> None:
        self._write(*entry_inserts(self.p4info, entries))

    def insert_group(self, *groups: Group) -> None:
        self._write(*group_inserts(groups))

    # ---- reads ----------------------------------------------------------------------------------------
    def read_counter(self, name: str, index: int) -> tuple[int, int]:
        """(packets, bytes) of cell ``index`` of counter ``name``."""
        request = p4runtime_pb2.ReadRequest(device_id=self.device_id)
        entity = request.entities.add()
        entity.counter_entry.counter_id = self._counters[name].preamble.id
        entity.counter_entry.index.index = index
        for response in self.stub.Read(request, timeout=RPC_TIMEOUT_S):
            for e in response.entities:
                data = e.counter_entry.data
                return data.packet_count, data.byte_count
        raise LookupError(f"counter {name}[{index}] not returned")

    def read_counters(self, name: str) -> dict[int, tuple[int, int]]:
        """Every cell of counter ``name`` (one wildcard read): index -> (packets, bytes)."""
        request = p4runtime_pb2.ReadRequest(device_id=self.device_id)
        entity = request.entities.add()
        entity.counter_entry.counter_id = self._counters[name].preamble.id
        cells: dict[int, tuple[int, int]] = {}
        for response in self.stub.Read(request, timeout=RPC_TIMEOUT_S):
            for e in response.entities:
                data = e.counter_entry.data
                cells[e.counter_entry.index.index] = (data.packet_count, data.byte_count)
        return cells

    # ---- packet I/O -----------------------------------------------------------------------------------
    def packet_out(self, payload: bytes) -> None:
        request = p4runtime_pb2.StreamMessageRequest()
        request.packet.payload = payload
        self._outbox.put(request)


def table_entry(p4info: p4info_pb2.P4Info, entry: Entry) -> p4runtime_pb2.TableEntry:
    """``entry`` (P4Info names) as a P4Runtime TableEntry."""
    table = next(t for t in p4info.tables if t.preamble.alias == entry.table)
    action = next(a for a in p4info.actions if a.preamble.alias == entry.action)
    out = p4runtime_pb2.TableEntry(table_id=table.preamble.id)
    for f in table.match_fields:
        value = entry.match[f.name]
        m = out.match.add(field_id=f.id)
        if isinstance(value, tuple):
            m.lpm.value, m.lpm.prefix_len = encode_bytestring(value[0]), value[1]
        else:
            m.exact.value = encode_bytestring(value)
    out.action.action.action_id = action.preamble.id
    for p in action.params:
        out.action.action.params.add(param_id=p.id, value=encode_bytestring(entry.params[p.name]))
    return out


def entry_inserts(p4info: p4info_pb2.P4Info, entries: Sequence[Entry]) -> list[p4runtime_pb2.Update]:
    updates = []
    for entry in entries:
        u = p4runtime_pb2.Update(type=p4runtime_pb2.Update.INSERT)
        u.entity.table_entry.CopyFrom(table_entry(p4info, entry))
        updates.append(u)
    return updates


def group_inserts(groups: Sequence[Group]) -> list[p4runtime_pb2.Update]:
    updates = []
    for g in groups:
        u = p4runtime_pb2.Update(type=p4runtime_pb2.Update.INSERT)
        group = u.entity.packet_replication_engine_entry.multicast_group_entry
        group.multicast_group_id = g.group_id
        for port, instance in g.replicas:
            group.replicas.add(egress_port=port, instance=instance)
        updates.append(u)
    return updates


def device_config_for(kind: str, repo: Path) -> bytes:
    """What to send as p4_device_config: BMv2's compiled JSON, nothing for the embedded target."""
    if kind == "bmv2":
        return (repo / "build" / "v1model" / "checkmate.json").read_bytes()
    return b""
