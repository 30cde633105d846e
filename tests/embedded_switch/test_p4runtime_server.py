"""The embedded switch's P4Runtime server, driven by p4runtime-shell and by raw gRPC stubs.

Every server runs in-process on 127.0.0.1 with an OS-chosen port. Error cases decode the
``grpc-status-details-bin`` trailer the way p4runtime-shell does: a ``google.rpc.Status``
whose details are one ``p4.v1.Error`` per update.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import code_pb2, status_pb2
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc

from checkmate.p4.bytestrings import encode_bytestring
from checkmate.p4.p4info import load_p4info
from checkmate.p4.program import P4INFO_PATH
from embedded_switch import program
from embedded_switch.p4runtime.errors import Failure, decode_value
from embedded_switch.p4runtime.index import ProgramIndex, translate_key
from embedded_switch.p4runtime.write import MAX_MULTICAST_GROUPS
from embedded_switch.p4runtime_server import P4RuntimeServer
from embedded_switch.state import ActionCall, FieldMatch, MatchKind, Replica

DEVICE_ID = 1
CPU_PORT = 64
TIMEOUT_S = 5.0
P4INFO = load_p4info()
TABLE_IDS = {t.preamble.alias: t.preamble.id for t in P4INFO.tables}
ACTION_IDS = {a.preamble.alias: a.preamble.id for a in P4INFO.actions}
COUNTER_IDS = {c.preamble.alias: c.preamble.id for c in P4INFO.counters}
Update = p4runtime_pb2.Update
WriteRequest = p4runtime_pb2.WriteRequest
SetRequest = p4runtime_pb2.SetForwardingPipelineConfigRequest


# ---- fixtures and helpers -----------------------------------------------------------------


@dataclass
class Switch:
    server: P4RuntimeServer
    address: str
    pipelines: list[object] = field(default_factory=list)
    packet_outs: list[tuple[bytes, int]] = field(default_factory=list)


@pytest.fixture
def switch() -> Iterator[Switch]:
    pipelines: list[object] = []
    packet_outs: list[tuple[bytes, int]] = []
    server = P4RuntimeServer(
        DEVICE_ID,
        "127.0.0.1:0",
        cpu_port=CPU_PORT,
        on_pipeline=pipelines.append,
        on_packet_out=lambda payload, port: packet_outs.append((payload, port)),
    )
    port = server.start()
    try:
        yield Switch(server, f"127.0.0.1:{port}", pipelines, packet_outs)
    finally:
        server.stop(grace=0.2)


class Controller:
    """A raw-stub P4Runtime client with its own StreamChannel."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = p4runtime_pb2_grpc.P4RuntimeStub(self.channel)
        self.election_id: int | None = None
        self._out: queue.Queue[p4runtime_pb2.StreamMessageRequest | None] = queue.Queue()
        self.inbox: queue.Queue[p4runtime_pb2.StreamMessageResponse | grpc.RpcError | None] = queue.Queue()
        self._stream = self.stub.StreamChannel(iter(self._out.get, None))
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        try:
            for msg in self._stream:
                self.inbox.put(msg)
        except grpc.RpcError as e:
            self.inbox.put(e)
        else:
            self.inbox.put(None)

    def send(self, msg: p4runtime_pb2.StreamMessageRequest) -> None:
        self._out.put(msg)

    def arbitrate(
        self, election_id: int | None, device_id: int = DEVICE_ID
    ) -> p4runtime_pb2.MasterArbitrationUpdate:
        msg = p4runtime_pb2.StreamMessageRequest()
        msg.arbitration.device_id = device_id
        if election_id is not None:
            msg.arbitration.election_id.low = election_id
        self.election_id = election_id
        self.send(msg)
        return self.next("arbitration").arbitration

    def next(self, kind: str, timeout: float = TIMEOUT_S) -> p4runtime_pb2.StreamMessageResponse:
        item = self.inbox.get(timeout=timeout)
        assert isinstance(item, p4runtime_pb2.StreamMessageResponse), f"stream ended: {item!r}"
        assert item.WhichOneof("update") == kind, item
        return item

    def ended(self, timeout: float = TIMEOUT_S) -> grpc.RpcError | None:
        item = self.inbox.get(timeout=timeout)
        assert not isinstance(item, p4runtime_pb2.StreamMessageResponse), item
        return item

    def write(self, *updates: p4runtime_pb2.Update, atomicity: int = WriteRequest.CONTINUE_ON_ERROR) -> None:
        request = WriteRequest(device_id=DEVICE_ID, updates=updates, atomicity=atomicity)
        if self.election_id is not None:
            request.election_id.low = self.election_id
        self.stub.Write(request, timeout=TIMEOUT_S)

    def read(self, *entities: p4runtime_pb2.Entity) -> list[p4runtime_pb2.Entity]:
        request = p4runtime_pb2.ReadRequest(device_id=DEVICE_ID, entities=entities)
        return [e for response in self.stub.Read(request, timeout=TIMEOUT_S) for e in response.entities]

    def set_pipeline(
        self,
        action: int = SetRequest.VERIFY_AND_COMMIT,
        p4info: p4info_pb2.P4Info | None = P4INFO,
        cookie: int | None = None,
        device_config: bytes = b"",
    ) -> None:
        request = SetRequest(device_id=DEVICE_ID, action=action)
        if self.election_id is not None:
            request.election_id.low = self.election_id
        if p4info is not None:
            request.config.p4info.CopyFrom(p4info)
            request.config.p4_device_config = device_config
            if cookie is not None:
                request.config.cookie.cookie = cookie
        self.stub.SetForwardingPipelineConfig(request, timeout=TIMEOUT_S)

    def close(self) -> None:
        self._out.put(None)
        self._thread.join(timeout=TIMEOUT_S)
        self.channel.close()


@pytest.fixture
def connect(switch: Switch) -> Iterator[Callable[[], Controller]]:
    controllers: list[Controller] = []

    def make() -> Controller:
        controllers.append(Controller(switch.address))
        return controllers[-1]

    yield make
    for c in controllers:
        c.close()


@pytest.fixture
def primary(switch: Switch, connect: Callable[[], Controller]) -> Controller:
    """A primary controller (election id 10) that has pushed the Checkmate pipeline."""
    c = connect()
    assert c.arbitrate(10).status.code == code_pb2.OK
    c.set_pipeline()
    return c


def rich_status(error: grpc.RpcError) -> status_pb2.Status:
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            return status_pb2.Status.FromString(value)
    raise AssertionError(f"no grpc-status-details-bin in {error!r}")


def update_errors(error: grpc.RpcError) -> list[p4runtime_pb2.Error]:
    assert error.code() == grpc.StatusCode.UNKNOWN, error
    out = []
    for detail in rich_status(error).details:
        e = p4runtime_pb2.Error()
        assert detail.Unpack(e)
        out.append(e)
    return out


def write_error(
    c: Controller, *updates: p4runtime_pb2.Update, atomicity: int = 0
) -> list[p4runtime_pb2.Error]:
    with pytest.raises(grpc.RpcError) as info:
        c.write(*updates, atomicity=atomicity)
    return update_errors(info.value)


def one_error(c: Controller, update: p4runtime_pb2.Update) -> p4runtime_pb2.Error:
    (error,) = write_error(c, update)
    return error


def request_error(call: Callable[[], object]) -> tuple[grpc.StatusCode, status_pb2.Status]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    status = rich_status(info.value)
    assert status.code == info.value.code().value[0]
    assert status.message == info.value.details()
    return info.value.code(), status


def update(kind: int, entity: p4runtime_pb2.Entity) -> p4runtime_pb2.Update:
    return Update(type=kind, entity=entity)


def route(dst: int, prefix_len: int = 32, port: int = 2, kind: int = Update.INSERT) -> p4runtime_pb2.Update:
    te = p4runtime_pb2.TableEntry(table_id=TABLE_IDS["route_ipv4"])
    te.match.add(field_id=1).lpm.CopyFrom(
        p4runtime_pb2.FieldMatch.LPM(value=dst.to_bytes(4, "big"), prefix_len=prefix_len)
    )
    action = te.action.action
    action.action_id = ACTION_IDS["forward"]
    action.params.add(param_id=1, value=encode_bytestring(port))
    action.params.add(param_id=2, value=bytes.fromhex("000000000001"))
    action.params.add(param_id=3, value=bytes.fromhex("000000000002"))
    return update(kind, p4runtime_pb2.Entity(table_entry=te))


def job(job_id: int, slot: int = 1, kind: int = Update.INSERT) -> p4runtime_pb2.Update:
    te = p4runtime_pb2.TableEntry(table_id=TABLE_IDS["lookup_job"])
    te.match.add(field_id=1).exact.value = encode_bytestring(job_id)
    te.action.action.action_id = ACTION_IDS["set_job_slot"]
    te.action.action.params.add(param_id=1, value=encode_bytestring(slot))
    return update(kind, p4runtime_pb2.Entity(table_entry=te))


def group(gid: int, *replicas: tuple[int, int], kind: int = Update.INSERT) -> p4runtime_pb2.Update:
    entity = p4runtime_pb2.Entity()
    g = entity.packet_replication_engine_entry.multicast_group_entry
    g.multicast_group_id = gid
    for port, instance in replicas:
        g.replicas.add(egress_port=port, instance=instance)
    return update(kind, entity)


def table_read(table_id: int = 0, default: bool = False) -> p4runtime_pb2.Entity:
    return p4runtime_pb2.Entity(
        table_entry=p4runtime_pb2.TableEntry(table_id=table_id, is_default_action=default)
    )


def group_read(gid: int = 0) -> p4runtime_pb2.Entity:
    entity = p4runtime_pb2.Entity()
    entity.packet_replication_engine_entry.multicast_group_entry.multicast_group_id = gid
    return entity


def counter_read(counter_id: int = 0, index: int | None = None) -> p4runtime_pb2.Entity:
    entity = p4runtime_pb2.Entity()
    entity.counter_entry.counter_id = counter_id
    if index is not None:
        entity.counter_entry.index.index = index
    return entity


# ---- p4runtime-shell, the client users have ------------------------------------------------


def test_p4runtime_shell_pushes_pipeline_installs_entries_and_reads_them_back(
    switch: Switch, tmp_path: Path
) -> None:
    from p4runtime_sh import shell
    from p4runtime_sh.p4runtime import P4RuntimeWriteException

    device_config = tmp_path / "checkmate.json"
    device_config.write_bytes(b"{}")  # BMv2 JSON: stored, not read, by this target
    shell.setup(
        device_id=DEVICE_ID,
        grpc_addr=switch.address,
        election_id=(0, 1),
        config=shell.FwdPipeConfig(str(P4INFO_PATH), str(device_config)),
        verbose=False,
    )
    try:
        te = shell.TableEntry("CheckmateIngress.route_ipv4")(action="CheckmateIngress.forward")
        te.match["dst_addr"] = "10.0.0.2/32"
        te.action["port"] = "2"
        te.action["src_mac"] = "00:00:00:00:00:01"
        te.action["dst_mac"] = "00:00:00:00:00:02"
        te.insert()
        rep = shell.TableEntry("CheckmateIngress.replicate_to_shadow")(
            action="CheckmateIngress.set_multicast_group"
        )
        rep.match["job_id"] = "7"
        rep.match["ingress_port"] = "1"
        rep.match["shard_key"] = "3"
        rep.match["next_hop_port"] = "2"
        rep.action["group"] = "5"
        rep.insert()
        shell.MulticastGroupEntry(5).add(1, 0).add(2, 7).insert()
        default = shell.TableEntry("CheckmateEgress.rewrite_shadow_copy")(is_default=True)
        default.action = shell.Action("CheckmateEgress.set_shadow_destination")
        default.action["src_mac"] = "00:00:00:00:00:0a"
        default.action["dst_mac"] = "00:00:00:00:00:0b"
        default.action["dst_addr"] = "10.0.1.1"
        default.action["dst_port"] = "4791"
        default.modify()

        routes = list(shell.TableEntry("CheckmateIngress.route_ipv4").read())
        assert len(routes) == 1
        assert routes[0].match["dst_addr"].lpm.prefix_len == 32
        assert routes[0].action["port"].value == b"\x02"
        groups = list(shell.MulticastGroupEntry(5).read())
        assert [(r.egress_port, r.instance) for r in groups[0].replicas] == [(1, 0), (2, 7)]

        with pytest.raises(P4RuntimeWriteException) as dup:
            te.insert()
        assert "ALREADY_EXISTS" in str(dup.value) and "route_ipv4" in str(dup.value)
        with pytest.raises(P4RuntimeWriteException) as bad:
            shell.MulticastGroupEntry(6).add(3, 0).add(3, 0).insert()
        assert "INVALID_ARGUMENT" in str(bad.value) and "duplicate replica" in str(bad.value)

        switch.server.state.counter("ingress_drops").count(3, 100)  # type: ignore[union-attr]
        cells = {c.index: c.packet_count for c in shell.CounterEntry("CheckmateIngress.ingress_drops").read()}
        assert cells[3] == 1 and len(cells) == 8
    finally:
        shell.teardown()

    state = switch.server.state
    assert state is not None and switch.pipelines == [state]
    hit = state.table("route_ipv4").lookup((0x0A000002,))
    assert hit.hit and hit.action == ActionCall("forward", (2, 1, 2))
    assert not state.table("route_ipv4").lookup((0x0A000003,)).hit
    assert state.table("replicate_to_shadow").lookup((7, 1, 3, 2)).action == ActionCall(
        "set_multicast_group", (5,)
    )
    assert state.replicas(5) == (Replica(1, 0), Replica(2, 7))
    assert state.table("rewrite_shadow_copy").default_action == ActionCall(
        "set_shadow_destination", (0x0A, 0x0B, 0x0A000101, 4791)
    )
    assert 6 not in state.multicast_groups


def test_capabilities_reports_the_p4runtime_version(
    switch: Switch, connect: Callable[[], Controller]
) -> None:
    response = connect().stub.Capabilities(p4runtime_pb2.CapabilitiesRequest(), timeout=TIMEOUT_S)
    assert response.p4runtime_api_version == "1.4.1"


# ---- arbitration ---------------------------------------------------------------------------


def test_highest_election_id_is_primary_and_failover_notifies_everyone(
    switch: Switch, connect: Callable[[], Controller]
) -> None:
    a, b = connect(), connect()
    first = a.arbitrate(2)
    assert first.status.code == code_pb2.OK and first.election_id.low == 2 and first.device_id == DEVICE_ID
    backup = b.arbitrate(1)
    assert backup.status.code == code_pb2.ALREADY_EXISTS and backup.election_id.low == 2

    c = connect()
    assert c.arbitrate(3).status.code == code_pb2.OK
    demoted = a.next("arbitration").arbitration
    assert demoted.status.code == code_pb2.ALREADY_EXISTS and demoted.election_id.low == 3
    assert b.next("arbitration").arbitration.election_id.low == 3

    c.close()  # the primary's stream ends: the next highest (a) takes over, all are told
    assert a.next("arbitration").arbitration.status.code == code_pb2.OK
    told = b.next("arbitration").arbitration
    assert told.status.code == code_pb2.ALREADY_EXISTS and told.election_id.low == 2
    a.close()
    assert b.next("arbitration").arbitration.status.code == code_pb2.OK


def test_arbitration_rejects_wrong_device_and_duplicate_election_id(
    switch: Switch, connect: Callable[[], Controller]
) -> None:
    wrong = connect()
    msg = p4runtime_pb2.StreamMessageRequest()
    msg.arbitration.device_id = DEVICE_ID + 1
    msg.arbitration.election_id.low = 1
    wrong.send(msg)
    ended = wrong.ended()
    assert ended is not None and ended.code() == grpc.StatusCode.NOT_FOUND
    assert rich_status(ended).code == code_pb2.NOT_FOUND

    a, b = connect(), connect()
    assert a.arbitrate(5).status.code == code_pb2.OK
    b.send(
        p4runtime_pb2.StreamMessageRequest(
            arbitration=p4runtime_pb2.MasterArbitrationUpdate(device_id=DEVICE_ID, election_id={"low": 5})
        )
    )
    ended = b.ended()
    assert ended is not None and ended.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Election id already exists" in ended.details()
    assert a.inbox.empty()  # the primary is undisturbed


def test_client_without_election_id_is_a_backup(switch: Switch, connect: Callable[[], Controller]) -> None:
    observer = connect()
    assert observer.arbitrate(None).status.code == code_pb2.NOT_FOUND  # no primary yet
    assert connect().arbitrate(1).status.code == code_pb2.OK
    assert observer.next("arbitration").arbitration.status.code == code_pb2.ALREADY_EXISTS


def test_only_the_primary_may_write_or_set_the_pipeline(
    switch: Switch, connect: Callable[[], Controller], primary: Controller
) -> None:
    backup = connect()
    assert backup.arbitrate(3).status.code == code_pb2.ALREADY_EXISTS
    code, status = request_error(lambda: backup.write(route(0x0A000001)))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "Not primary" in status.message
    code, _ = request_error(lambda: backup.set_pipeline())
    assert code == grpc.StatusCode.PERMISSION_DENIED
    backup.election_id = None  # no election id at all while controllers are connected
    code, _ = request_error(lambda: backup.write(route(0x0A000001)))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    primary.write(route(0x0A000001))
    assert len(primary.read(table_read(TABLE_IDS["route_ipv4"]))) == 1


def test_backup_p4runtime_shell_client_gets_permission_denied(switch: Switch, primary: Controller) -> None:
    from p4runtime_sh.p4runtime import P4RuntimeClient

    client = P4RuntimeClient(DEVICE_ID, switch.address, (0, 1))
    try:
        with pytest.raises(grpc.RpcError) as info:
            client.write_update(route(0x0A000001))
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        client.tear_down()


# ---- pipeline config -----------------------------------------------------------------------


def test_requests_before_a_pipeline_fail_with_failed_precondition(
    switch: Switch, connect: Callable[[], Controller]
) -> None:
    c = connect()
    c.arbitrate(1)
    for call in (
        lambda: c.write(route(0x0A000001)),
        lambda: c.read(table_read()),
        lambda: c.stub.GetForwardingPipelineConfig(
            p4runtime_pb2.GetForwardingPipelineConfigRequest(device_id=DEVICE_ID), timeout=TIMEOUT_S
        ),
    ):
        code, status = request_error(call)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "No forwarding pipeline config" in status.message
    assert switch.server.state is None


def test_a_p4info_of_another_program_is_rejected_with_a_clear_message(
    switch: Switch, connect: Callable[[], Controller]
) -> None:
    c = connect()
    c.arbitrate(1)
    foreign = p4info_pb2.P4Info()
    foreign.CopyFrom(P4INFO)
    foreign.tables[0].preamble.name = "CheckmateIngress.route_ipv6"
    for action in (SetRequest.VERIFY, SetRequest.VERIFY_AND_COMMIT):
        code, status = request_error(lambda a=action: c.set_pipeline(a, foreign))  # type: ignore[misc]
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "Checkmate program" in status.message and "CheckmateIngress.route_ipv6" in status.message
    assert switch.server.state is None
    code, _ = request_error(lambda: c.set_pipeline(SetRequest.VERIFY_AND_COMMIT, None))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_pipeline_actions_and_get_response_types(switch: Switch, connect: Callable[[], Controller]) -> None:
    c = connect()
    c.arbitrate(1)
    c.set_pipeline(SetRequest.VERIFY)
    assert switch.server.state is None
    code, _ = request_error(lambda: c.set_pipeline(SetRequest.COMMIT, None))
    assert code == grpc.StatusCode.FAILED_PRECONDITION  # nothing saved

    c.set_pipeline(SetRequest.VERIFY_AND_SAVE, cookie=42, device_config=b"bmv2-json")
    c.write(route(0x0A000001))  # addresses the saved pipeline
    assert switch.server.state is None and switch.pipelines == []
    code, _ = request_error(lambda: c.set_pipeline(SetRequest.COMMIT))
    assert code == grpc.StatusCode.INVALID_ARGUMENT  # COMMIT takes no config
    c.set_pipeline(SetRequest.COMMIT, None)
    state = switch.server.state
    assert state is not None and switch.pipelines == [state]
    assert state.table("route_ipv4").lookup((0x0A000001,)).hit

    get = p4runtime_pb2.GetForwardingPipelineConfigRequest

    def fetch(kind: int) -> p4runtime_pb2.ForwardingPipelineConfig:
        request = get(device_id=DEVICE_ID, response_type=kind)
        return c.stub.GetForwardingPipelineConfig(request, timeout=TIMEOUT_S).config

    full = fetch(get.ALL)
    assert full.p4info == P4INFO and full.p4_device_config == b"bmv2-json" and full.cookie.cookie == 42
    cookie_only = fetch(get.COOKIE_ONLY)
    assert (
        not cookie_only.HasField("p4info")
        and not cookie_only.p4_device_config
        and cookie_only.cookie.cookie == 42
    )
    assert fetch(get.P4INFO_AND_COOKIE).p4info == P4INFO
    device_only = fetch(get.DEVICE_CONFIG_AND_COOKIE)
    assert device_only.p4_device_config == b"bmv2-json" and not device_only.HasField("p4info")

    c.set_pipeline(SetRequest.RECONCILE_AND_COMMIT)  # forwarding state preserved
    assert switch.server.state is state and state.table("route_ipv4").lookup((0x0A000001,)).hit
    c.set_pipeline(SetRequest.VERIFY_AND_COMMIT)  # forwarding state cleared
    fresh = switch.server.state
    assert fresh is not state and fresh is not None and len(fresh.table("route_ipv4")) == 0
    assert not fetch(get.ALL).HasField("cookie")


def test_a_p4info_with_other_ids_is_accepted_and_its_ids_are_used(
    switch: Switch, connect: Callable[[], Controller]
) -> None:
    c = connect()
    c.arbitrate(1)
    renumbered = p4info_pb2.P4Info()
    renumbered.CopyFrom(P4INFO)
    routes = next(t for t in renumbered.tables if t.preamble.alias == "route_ipv4")
    routes.preamble.id = 0x02000001
    routes.preamble.alias = "CheckmateIngress.route_ipv4"  # a compiler's longer alias
    c.set_pipeline(p4info=renumbered)
    update_ = route(0x0A000001)
    error = one_error(c, update_)
    assert error.canonical_code == code_pb2.INVALID_ARGUMENT and "unknown table id" in error.message
    update_.entity.table_entry.table_id = 0x02000001
    c.write(update_)
    assert (
        switch.server.state is not None and switch.server.state.table("route_ipv4").lookup((0x0A000001,)).hit
    )


def test_load_pipeline_api(tmp_path: Path) -> None:
    seen = []
    server = P4RuntimeServer(DEVICE_ID, "127.0.0.1:0", on_pipeline=seen.append)
    assert server.state is None
    server.load_pipeline(P4INFO_PATH)
    assert seen == [server.state] and server.state is not None
    foreign = p4info_pb2.P4Info()
    foreign.CopyFrom(P4INFO)
    del foreign.counters[0]
    with pytest.raises(program.ProgramMismatchError, match="ingress_drops"):
        server.load_pipeline(foreign)
    server.load_default_pipeline()
    assert len(seen) == 2


# ---- table entries ---------------------------------------------------------------------------


def test_insert_modify_delete_and_default_action(switch: Switch, primary: Controller) -> None:
    primary.write(route(0x0A000000, 8, port=3))
    specific = route(0x0A000000, 8).entity
    specific.table_entry.ClearField("action")
    (entry,) = primary.read(specific)
    assert entry.table_entry.action.action.params[0].value == b"\x03"

    state = switch.server.state
    assert state is not None
    generation = state.table("route_ipv4").generation
    primary.write(route(0x0A000000, 8, port=4, kind=Update.MODIFY))
    assert state.table("route_ipv4").generation > generation  # published: the pipeline drops its cache
    assert state.table("route_ipv4").lookup((0x0A010203,)).action.params == (4, 1, 2)

    primary.write(route(0x0A000000, 8, kind=Update.DELETE))
    assert not state.table("route_ipv4").lookup((0x0A010203,)).hit
    code, status = request_error(lambda: primary.read(specific))
    assert code == grpc.StatusCode.NOT_FOUND and "route_ipv4" in status.message
    for kind in (Update.DELETE, Update.MODIFY):
        error = one_error(primary, route(0x0A000000, 8, kind=kind))
        assert error.canonical_code == code_pb2.NOT_FOUND

    (default,) = primary.read(table_read(TABLE_IDS["route_ipv4"], default=True))
    assert default.table_entry.is_default_action
    assert default.table_entry.action.action.action_id == ACTION_IDS["drop_no_route"]
    to_default = route(0, kind=Update.MODIFY)
    to_default.entity.table_entry.ClearField("match")
    to_default.entity.table_entry.is_default_action = True
    primary.write(to_default)
    assert state.table("route_ipv4").default_action == ActionCall("forward", (2, 1, 2))
    to_default.entity.table_entry.ClearField("action")  # MODIFY without action: back to the P4 default
    primary.write(to_default)
    assert state.table("route_ipv4").default_action == ActionCall("drop_no_route")
    to_default.type = Update.INSERT
    error = one_error(primary, to_default)
    assert error.canonical_code == code_pb2.INVALID_ARGUMENT and "MODIFY" in error.message


def _mutate(
    update_: p4runtime_pb2.Update, fn: Callable[[p4runtime_pb2.TableEntry], object]
) -> p4runtime_pb2.Update:
    fn(update_.entity.table_entry)
    return update_


def _set_param(te: p4runtime_pb2.TableEntry, index: int, **kwargs: object) -> None:
    for k, v in kwargs.items():
        setattr(te.action.action.params[index], k, v)


BAD_ENTRIES = {
    "unknown table": (
        lambda te: setattr(te, "table_id", 12345),
        code_pb2.INVALID_ARGUMENT,
        "unknown table id 12345",
    ),
    "unknown action": (
        lambda te: setattr(te.action.action, "action_id", 999),
        code_pb2.INVALID_ARGUMENT,
        "unknown action id 999",
    ),
    "foreign action": (
        lambda te: setattr(te.action.action, "action_id", ACTION_IDS["set_job_slot"]),
        code_pb2.INVALID_ARGUMENT,
        "is not an action of table CheckmateIngress.route_ipv4",
    ),
    "unknown param": (
        lambda te: _set_param(te, 2, param_id=9),
        code_pb2.INVALID_ARGUMENT,
        "has no parameter with id 9",
    ),
    "missing param": (
        lambda te: te.action.action.params.pop(),
        code_pb2.INVALID_ARGUMENT,
        "missing parameter(s) dst_mac",
    ),
    "param too wide": (
        lambda te: _set_param(te, 0, value=b"\x02\x00"),
        code_pb2.INVALID_ARGUMENT,
        "parameter port: value 0x0200 (2 bytes, 10 significant bits) does not fit the field's 9 bits",
    ),
    "empty param": (lambda te: _set_param(te, 0, value=b""), code_pb2.INVALID_ARGUMENT, "empty bytestring"),
    "value too wide": (
        lambda te: setattr(te.match[0].lpm, "value", b"\x01\x0a\x00\x00\x01"),
        code_pb2.INVALID_ARGUMENT,
        "field dst_addr: value 0x010a000001 (5 bytes",
    ),
    "prefix too long": (
        lambda te: setattr(te.match[0].lpm, "prefix_len", 33),
        code_pb2.INVALID_ARGUMENT,
        "prefix length 33 is outside 1..32",
    ),
    "bits past prefix": (
        lambda te: setattr(te.match[0].lpm, "prefix_len", 8),
        code_pb2.INVALID_ARGUMENT,
        "bits set beyond its /8 prefix",
    ),
    "wrong match kind": (
        lambda te: te.match[0].exact.SetInParent(),
        code_pb2.INVALID_ARGUMENT,
        "is an lpm match in the P4Info, the entry gives exact",
    ),
    "unknown field": (
        lambda te: setattr(te.match[0], "field_id", 7),
        code_pb2.INVALID_ARGUMENT,
        "has no match field with id 7",
    ),
    "priority on lpm": (
        lambda te: setattr(te, "priority", 10),
        code_pb2.INVALID_ARGUMENT,
        "priority must be 0",
    ),
    "no action": (lambda te: te.ClearField("action"), code_pb2.INVALID_ARGUMENT, "has no action"),
    "action profile": (
        lambda te: setattr(te.action, "action_profile_member_id", 3),
        code_pb2.INVALID_ARGUMENT,
        "has no action profile",
    ),
    "direct counter": (
        lambda te: te.counter_data.SetInParent(),
        code_pb2.INVALID_ARGUMENT,
        "no direct resource",
    ),
    "idle timeout": (
        lambda te: setattr(te, "idle_timeout_ns", 10),
        code_pb2.INVALID_ARGUMENT,
        "does not support idle timeout",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ENTRIES))
def test_bad_table_entries_are_rejected_naming_the_problem(
    switch: Switch, primary: Controller, case: str
) -> None:
    mutate, code, fragment = BAD_ENTRIES[case]
    error = one_error(primary, _mutate(route(0x0A000001), mutate))
    assert error.canonical_code == code
    assert fragment in error.message
    state = switch.server.state
    assert state is not None and len(state.table("route_ipv4")) == 0


def test_exact_table_errors_and_table_size(switch: Switch, primary: Controller) -> None:
    missing = job(1)
    missing.entity.table_entry.ClearField("match")
    error = one_error(primary, missing)
    assert (
        error.canonical_code == code_pb2.INVALID_ARGUMENT
        and "exact match field job_id is missing" in error.message
    )
    padded = job(1)
    padded.entity.table_entry.match[0].exact.value = b"\x00\x00\x00\x01"  # full-width padding is fine
    primary.write(padded)
    (read,) = primary.read(table_read(TABLE_IDS["lookup_job"]))
    assert read.table_entry.match[0].exact.value == b"\x01"  # read back canonical
    size = next(t for t in P4INFO.tables if t.preamble.alias == "lookup_job").size
    primary.write(*(job(j) for j in range(2, size)))
    errors = write_error(primary, job(size), job(size + 1))
    assert errors[0].canonical_code == code_pb2.OK
    assert (
        errors[1].canonical_code == code_pb2.RESOURCE_EXHAUSTED
        and "is full (255 entries)" in errors[1].message
    )
    state = switch.server.state
    assert state is not None and len(state.table("lookup_job")) == size


# ---- batches ---------------------------------------------------------------------------------


def test_continue_on_error_applies_the_rest_and_reports_each_update(
    switch: Switch, primary: Controller
) -> None:
    errors = write_error(primary, route(0x0A000001), route(0x0A000001), route(0x0A000002))
    assert [e.canonical_code for e in errors] == [code_pb2.OK, code_pb2.ALREADY_EXISTS, code_pb2.OK]
    state = switch.server.state
    assert state is not None and len(state.table("route_ipv4")) == 2


@pytest.mark.parametrize("atomicity", [WriteRequest.ROLLBACK_ON_ERROR, WriteRequest.DATAPLANE_ATOMIC])
def test_rollback_on_error_undoes_the_whole_batch(
    switch: Switch, primary: Controller, atomicity: int
) -> None:
    primary.write(group(9, (1, 0)), job(5, slot=1))
    counter = COUNTER_IDS["shadow_copies"]
    reset = p4runtime_pb2.Entity()
    reset.counter_entry.counter_id = counter
    reset.counter_entry.index.index = 0
    state = switch.server.state
    assert state is not None
    state.counter("shadow_copies").count(0, 64)
    errors = write_error(
        primary,
        route(0x0A000001),
        group(10, (2, 0)),
        group(9, (3, 1), kind=Update.MODIFY),
        job(5, slot=2, kind=Update.MODIFY),
        update(Update.MODIFY, reset),
        group(9, kind=Update.DELETE),
        route(0x0A000001),  # duplicate: fails
        route(0x0A000003),
        atomicity=atomicity,
    )
    codes = [e.canonical_code for e in errors]
    assert codes == [code_pb2.ABORTED] * 6 + [code_pb2.ALREADY_EXISTS, code_pb2.ABORTED]
    assert "rolled back" in errors[0].message and "not attempted" in errors[7].message
    assert len(state.table("route_ipv4")) == 0
    assert state.multicast_groups == {9: (Replica(1, 0),)}
    assert state.table("lookup_job").lookup((5,)).action == ActionCall("set_job_slot", (1,))
    assert state.counter("shadow_copies").read(0) == (1, 64)


# ---- multicast groups -----------------------------------------------------------------------


def test_multicast_group_errors(switch: Switch, primary: Controller) -> None:
    primary.write(group(5, (1, 0), (2, 7)))
    cases = [
        (group(0, (1, 0)), code_pb2.INVALID_ARGUMENT, "group id 0 is invalid"),
        (group(32768, (1, 0)), code_pb2.INVALID_ARGUMENT, "must be below 32768"),
        (group(5, (1, 0)), code_pb2.ALREADY_EXISTS, "multicast group 5 already exists"),
        (
            group(6, (1, 0), (1, 0)),
            code_pb2.INVALID_ARGUMENT,
            "duplicate replica (egress port 1, instance 0)",
        ),
        (group(6, (512, 0)), code_pb2.INVALID_ARGUMENT, "egress port 512 is out of range"),
        (group(6, (1, 1 << 16)), code_pb2.INVALID_ARGUMENT, "does not fit the 16-bit egress_rid"),
        (group(6, kind=Update.DELETE), code_pb2.NOT_FOUND, "multicast group 6 does not exist"),
        (group(6, (1, 0), kind=Update.MODIFY), code_pb2.NOT_FOUND, "multicast group 6 does not exist"),
    ]
    errors = write_error(primary, *(u for u, _, _ in cases))
    for (_, code, fragment), error in zip(cases, errors, strict=True):
        assert error.canonical_code == code, error
        assert fragment in error.message
    code, status = request_error(lambda: primary.read(group_read(6)))
    assert code == grpc.StatusCode.NOT_FOUND and "multicast group 6 does not exist" in status.message

    by_port_field = group(7)
    by_port_field.entity.packet_replication_engine_entry.multicast_group_entry.replicas.add(
        port=b"\x03", instance=1
    )
    primary.write(by_port_field, group(5, (4, 0), kind=Update.MODIFY))
    state = switch.server.state
    assert (
        state is not None and state.replicas(7) == (Replica(3, 1),) and state.replicas(5) == (Replica(4, 0),)
    )
    primary.write(group(5, kind=Update.DELETE))
    assert 5 not in state.multicast_groups


def test_multicast_group_limit(switch: Switch, primary: Controller) -> None:
    primary.write(*(group(g) for g in range(1, MAX_MULTICAST_GROUPS + 1)))
    error = one_error(primary, group(MAX_MULTICAST_GROUPS + 1))
    assert error.canonical_code == code_pb2.RESOURCE_EXHAUSTED and "4096 multicast groups" in error.message
    state = switch.server.state
    assert state is not None and len(state.multicast_groups) == MAX_MULTICAST_GROUPS


def test_a_large_failed_batch_keeps_its_error_trailer_within_grpc_limits(
    switch: Switch, primary: Controller
) -> None:
    updates = [group(g, (1, 0)) for g in range(1, 1001)] + [group(1, (1, 0))]
    with pytest.raises(grpc.RpcError) as info:
        primary.write(*updates)
    errors = update_errors(info.value)
    assert 0 < len(errors) < len(updates) and all(e.canonical_code == code_pb2.OK for e in errors)
    assert "1 of 1001 updates failed (updates 1000 ALREADY_EXISTS)" in info.value.details()
    state = switch.server.state
    assert state is not None and len(state.multicast_groups) == 1000


# ---- reads and counters ---------------------------------------------------------------------


def test_wildcard_reads(switch: Switch, primary: Controller) -> None:
    primary.write(route(0x0A000001), route(0x0A000002), job(3), group(2, (1, 0)), group(1, (2, 0), (3, 5)))
    entries = primary.read(table_read(0))
    assert sorted(e.table_entry.table_id for e in entries) == sorted(
        [TABLE_IDS["route_ipv4"]] * 2 + [TABLE_IDS["lookup_job"]]
    )
    assert all(not e.table_entry.is_default_action for e in entries)
    defaults = primary.read(table_read(0, default=True))
    assert len(defaults) == len(P4INFO.tables) and all(e.table_entry.is_default_action for e in defaults)
    groups = primary.read(group_read(0))
    assert [g.packet_replication_engine_entry.multicast_group_entry.multicast_group_id for g in groups] == [
        1,
        2,
    ]
    cells = primary.read(counter_read(0))
    assert len(cells) == sum(c.size for c in P4INFO.counters)
    several = primary.read(table_read(TABLE_IDS["lookup_job"]), group_read(2))
    assert [e.WhichOneof("entity") for e in several] == ["table_entry", "packet_replication_engine_entry"]
    code, _ = request_error(lambda: primary.read(table_read(999)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_counter_reads_follow_the_counter_array_and_modify_sets_a_cell(
    switch: Switch, primary: Controller
) -> None:
    state = switch.server.state
    assert state is not None
    state.counter("rejected_replications").count(4, 1500)
    state.counter("rejected_replications").count(4, 500)
    state.counter("ingress_drops").count(2, 60)
    (cell,) = primary.read(counter_read(COUNTER_IDS["rejected_replications"], 4))
    assert (cell.counter_entry.data.packet_count, cell.counter_entry.data.byte_count) == (2, 2000)
    (drops,) = primary.read(counter_read(COUNTER_IDS["ingress_drops"], 2))
    assert (
        drops.counter_entry.data.packet_count == 1 and drops.counter_entry.data.byte_count == 0
    )  # PACKETS unit
    all_cells = primary.read(counter_read(COUNTER_IDS["ingress_drops"]))
    assert [c.counter_entry.index.index for c in all_cells] == list(range(8))

    reset = p4runtime_pb2.Entity()
    reset.counter_entry.counter_id = COUNTER_IDS["rejected_replications"]
    reset.counter_entry.index.index = 4
    primary.write(update(Update.MODIFY, reset))
    assert state.counter("rejected_replications").read(4) == (0, 0)
    reset.counter_entry.index.index = 256
    error = one_error(primary, update(Update.MODIFY, reset))
    assert error.canonical_code == code_pb2.INVALID_ARGUMENT and "out of range" in error.message
    reset.counter_entry.index.index = 1
    error = one_error(primary, update(Update.INSERT, reset))
    assert error.canonical_code == code_pb2.INVALID_ARGUMENT and "MODIFY" in error.message
    code, _ = request_error(lambda: primary.read(counter_read(COUNTER_IDS["ingress_drops"], 8)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_unsupported_entities_are_unimplemented(switch: Switch, primary: Controller) -> None:
    register = p4runtime_pb2.Entity()
    register.register_entry.register_id = 1
    clone = p4runtime_pb2.Entity()
    clone.packet_replication_engine_entry.clone_session_entry.session_id = 1
    errors = write_error(
        primary,
        update(Update.MODIFY, register),
        update(Update.INSERT, clone),
        update(Update.INSERT, p4runtime_pb2.Entity()),
        Update(type=Update.UNSPECIFIED),
    )
    assert [e.canonical_code for e in errors] == [
        code_pb2.UNIMPLEMENTED,
        code_pb2.UNIMPLEMENTED,
        code_pb2.INVALID_ARGUMENT,
        code_pb2.INVALID_ARGUMENT,
    ]
    code, _ = request_error(lambda: primary.read(register))
    assert code == grpc.StatusCode.UNIMPLEMENTED


def raw_call(channel: grpc.Channel, method: str, payload: bytes) -> object:
    path = f"/p4.v1.P4Runtime/{method}"
    if method == "Read":
        return list(channel.unary_stream(path)(payload, timeout=TIMEOUT_S))
    return channel.unary_unary(path)(payload, timeout=TIMEOUT_S)


def test_malformed_requests_get_invalid_argument_and_the_server_keeps_serving(
    switch: Switch, primary: Controller
) -> None:
    for method in (
        "Write",
        "Read",
        "SetForwardingPipelineConfig",
        "GetForwardingPipelineConfig",
        "Capabilities",
    ):
        for garbage in (b"\xff\xff\xff", b"\x0a\x05abc"):
            with pytest.raises(grpc.RpcError) as info:
                raw_call(primary.channel, method, garbage)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value)
            assert "malformed" in info.value.details()
    bad_role = primary.channel.unary_unary("/p4.v1.P4Runtime/Write")
    with pytest.raises(grpc.RpcError) as info:
        bad_role(b"\x08\x01\x32\x02\xff\xfe", timeout=TIMEOUT_S)  # device 1, role: invalid UTF-8
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    unknown_fields = (
        WriteRequest(device_id=DEVICE_ID).SerializeToString() + b"\xb8\x3e\x01"
    )  # field 999, varint
    primary.channel.unary_unary("/p4.v1.P4Runtime/Write")(
        unknown_fields + p4runtime_pb2.WriteRequest(election_id={"low": 10}).SerializeToString(),
        timeout=TIMEOUT_S,
    )
    primary.send(p4runtime_pb2.StreamMessageRequest())  # no update set
    assert primary.next("error").error.canonical_code == code_pb2.INVALID_ARGUMENT
    primary.write(route(0x0A000001))
    response = primary.stub.Capabilities(p4runtime_pb2.CapabilitiesRequest(), timeout=TIMEOUT_S)
    assert response.p4runtime_api_version


def test_wrong_device_id_in_requests_is_not_found(switch: Switch, primary: Controller) -> None:
    request = WriteRequest(device_id=DEVICE_ID + 1, election_id={"low": 10}, updates=[route(0x0A000001)])
    code, status = request_error(lambda: primary.stub.Write(request, timeout=TIMEOUT_S))
    assert code == grpc.StatusCode.NOT_FOUND and "device id 2 not found" in status.message


# ---- packet I/O -------------------------------------------------------------------------------


def test_packet_in_goes_to_the_primary_and_packet_out_only_from_it(
    switch: Switch, connect: Callable[[], Controller], primary: Controller
) -> None:
    backup = connect()
    backup.arbitrate(1)
    switch.server.send_packet_in(b"\x01\x02frame", 3)
    packet = primary.next("packet").packet
    assert packet.payload == b"\x01\x02frame" and not packet.metadata
    assert backup.inbox.empty()

    primary.send(p4runtime_pb2.StreamMessageRequest(packet=p4runtime_pb2.PacketOut(payload=b"out")))
    backup.send(p4runtime_pb2.StreamMessageRequest(packet=p4runtime_pb2.PacketOut(payload=b"nope")))
    error = backup.next("error").error
    assert (
        error.canonical_code == code_pb2.PERMISSION_DENIED and error.packet_out.packet_out.payload == b"nope"
    )
    # The two streams are served independently: the backup's refusal can come back before the
    # primary's packet-out has reached the data plane.
    deadline = time.monotonic() + 5
    while not switch.packet_outs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert switch.packet_outs == [(b"out", CPU_PORT)]
    assert switch.server.stats.packet_outs_accepted == 1 and switch.server.stats.packet_outs_rejected == 1

    primary.close()  # no primary: packet-ins are dropped and counted, not queued
    backup.next("arbitration")
    backup.close()
    switch.server.send_packet_in(b"lost", 1)
    assert switch.server.stats.packet_ins_dropped == 1


# ---- key translation for ternary / range / optional tables (none in our program) ---------------


def _tcam_table() -> Any:
    info = p4info_pb2.P4Info()
    t = info.tables.add()
    t.preamble.id, t.preamble.name = 1, "Ingress.acl"
    for fid, (name, kind) in enumerate(
        [
            ("ttl", p4info_pb2.MatchField.TERNARY),
            ("port", p4info_pb2.MatchField.RANGE),
            ("vlan", p4info_pb2.MatchField.OPTIONAL),
        ],
        start=1,
    ):
        t.match_fields.add(id=fid, name=name, bitwidth=8, match_type=kind)
    return ProgramIndex(info).tables[1]


def _fm(field_id: int, **kind: object) -> p4runtime_pb2.FieldMatch:
    return p4runtime_pb2.FieldMatch(field_id=field_id, **kind)  # type: ignore[arg-type]


def test_ternary_range_optional_keys() -> None:
    table = _tcam_table()
    key = translate_key(
        table,
        [
            _fm(1, ternary={"value": b"\x10", "mask": b"\xf0"}),  # type: ignore[arg-type]
            _fm(3, optional={"value": b"\x05"}),
        ],
        priority=7,
    )
    assert key == (
        FieldMatch(MatchKind.TERNARY, 0x10, mask=0xF0),
        FieldMatch(MatchKind.RANGE, 0, high=0xFF),
        FieldMatch(MatchKind.OPTIONAL, 5),
    )
    assert translate_key(table, [], priority=1)[2].wildcard  # type: ignore[arg-type]
    bad = [
        ([_fm(1, ternary={"value": b"\x11", "mask": b"\xf0"})], 1, "bits outside mask"),
        ([_fm(1, ternary={"value": b"\x00", "mask": b"\x00"})], 1, "all-zero mask"),
        ([_fm(2, range={"low": b"\x09", "high": b"\x03"})], 1, "is above high"),
        ([_fm(2, range={"low": b"\x00", "high": b"\xff"})], 1, "covers every value"),
        ([_fm(3, optional={"value": b"\x01\x00"})], 1, "does not fit the field's 8 bits"),
        ([], 0, "priority must be > 0"),
        ([_fm(1, ternary={"value": b"\x01", "mask": b"\x01"})] * 2, 1, "given twice"),
    ]
    for matches, priority, fragment in bad:
        with pytest.raises(Failure) as info:
            translate_key(table, matches, priority)  # type: ignore[arg-type]
        assert info.value.code == code_pb2.INVALID_ARGUMENT and fragment in info.value.message


def test_bytestrings_follow_the_canonical_rules() -> None:
    assert decode_value(b"\x01", 9, "f") == 1
    assert decode_value(b"\x00\x01", 9, "f") == 1  # padded to the full width
    assert decode_value(b"\x01\xff", 9, "f") == 511
    for bad in (b"", b"\x02\x00", b"\x00\x00\x01"):
        with pytest.raises(Failure):
            decode_value(bad, 9, "f")
    assert encode_bytestring(0) == b"\x00" and encode_bytestring(256) == b"\x01\x00"


def test_packet_metadata_when_the_p4info_declares_it(
    switch: Switch, connect: Callable[[], Controller]
) -> None:
    with_headers = p4info_pb2.P4Info()
    with_headers.CopyFrom(P4INFO)
    packet_in = with_headers.controller_packet_metadata.add()
    packet_in.preamble.id, packet_in.preamble.name = 0x40000001, "packet_in"
    packet_in.metadata.add(id=1, name="ingress_port", bitwidth=9)
    packet_out = with_headers.controller_packet_metadata.add()
    packet_out.preamble.id, packet_out.preamble.name = 0x40000002, "packet_out"
    packet_out.metadata.add(id=1, name="egress_port", bitwidth=9)
    c = connect()
    c.arbitrate(1)
    c.set_pipeline(p4info=with_headers)

    switch.server.send_packet_in(b"in", 300)
    (metadata,) = c.next("packet").packet.metadata
    assert (metadata.metadata_id, metadata.value) == (1, b"\x01\x2c")
    out = p4runtime_pb2.PacketOut(payload=b"out")
    out.metadata.add(metadata_id=1, value=b"\x05")
    c.send(p4runtime_pb2.StreamMessageRequest(packet=out))
    out.metadata[0].metadata_id = 2
    c.send(p4runtime_pb2.StreamMessageRequest(packet=out))
    assert c.next("error").error.canonical_code == code_pb2.INVALID_ARGUMENT
    assert switch.packet_outs == [(b"out", 5)]


def test_requests_without_election_id_are_accepted_while_no_controller_is_connected(switch: Switch) -> None:
    channel = grpc.insecure_channel(switch.address)
    stub = p4runtime_pb2_grpc.P4RuntimeStub(channel)
    try:
        request = SetRequest(device_id=DEVICE_ID, action=SetRequest.VERIFY_AND_COMMIT)
        request.config.p4info.CopyFrom(P4INFO)
        stub.SetForwardingPipelineConfig(request, timeout=TIMEOUT_S)  # as PI: handy for scripts
        stub.Write(WriteRequest(device_id=DEVICE_ID, updates=[job(1)]), timeout=TIMEOUT_S)
        with_id = WriteRequest(device_id=DEVICE_ID, election_id={"low": 1}, updates=[job(2)])
        code, _ = request_error(lambda: stub.Write(with_id, timeout=TIMEOUT_S))
        assert code == grpc.StatusCode.PERMISSION_DENIED  # there is no primary to match
    finally:
        channel.close()
    state = switch.server.state
    assert state is not None and len(state.table("lookup_job")) == 1


def test_a_data_path_that_refuses_the_pipeline_leaves_the_old_one() -> None:
    def refuse(state: object) -> None:
        raise RuntimeError("ports not bound")

    server = P4RuntimeServer(DEVICE_ID, "127.0.0.1:0", on_pipeline=refuse)
    port = server.start()
    c = Controller(f"127.0.0.1:{port}")
    try:
        c.arbitrate(1)
        code, status = request_error(lambda: c.set_pipeline())
        assert code == grpc.StatusCode.INTERNAL and "ports not bound" in status.message
        assert server.state is None
    finally:
        c.close()
        server.stop(grace=0.2)
