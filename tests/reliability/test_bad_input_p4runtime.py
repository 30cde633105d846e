"""Malformed P4Runtime writes to the embedded switch's server: named cases and random mutations.

Every bad write must end in a gRPC error carrying a ``google.rpc.Status`` (the
``grpc-status-details-bin`` trailer) -- per-update ``p4.v1.Error`` details for a
failed batch, the request's canonical code otherwise -- never INTERNAL; the
server keeps serving; and a full Read afterwards shows exactly what was validly
written: a rejected ROLLBACK_ON_ERROR / DATAPLANE_ATOMIC batch changes nothing, a
CONTINUE_ON_ERROR batch keeps exactly its updates answered OK, a rejected
request changes nothing.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, status_pb2
from p4.v1 import p4runtime_pb2
from p4.v1.p4runtime_pb2 import Update, WriteRequest

from checkmate.p4.bytestrings import encode_bytestring
from embedded_switch.p4runtime_server import P4RuntimeServer
from tests.embedded_switch.test_p4runtime_server import (
    ACTION_IDS,
    DEVICE_ID,
    P4INFO,
    TABLE_IDS,
    TIMEOUT_S,
    Controller,
    group,
    group_read,
    job,
    route,
    table_read,
)
from tests.reliability.fuzz_frames import tally
from tests.reliability.record import Recorder

ELECTION_ID = 10
ATOMICITIES = (WriteRequest.CONTINUE_ON_ERROR, WriteRequest.ROLLBACK_ON_ERROR, WriteRequest.DATAPLANE_ATOMIC)
REQUEST_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
}
UPDATE_CODES = {
    code_pb2.INVALID_ARGUMENT,
    code_pb2.NOT_FOUND,
    code_pb2.ALREADY_EXISTS,
    code_pb2.OUT_OF_RANGE,
    code_pb2.RESOURCE_EXHAUSTED,
    code_pb2.UNIMPLEMENTED,
    code_pb2.FAILED_PRECONDITION,
    code_pb2.PERMISSION_DENIED,
}
TABLES = {t.preamble.id: t for t in P4INFO.tables}
ACTIONS = {a.preamble.id: a for a in P4INFO.actions}


@dataclass
class Rig:
    server: P4RuntimeServer
    primary: Controller
    backup: Controller

    def snapshot(self) -> set[bytes]:
        """Every table entry (and default action) and multicast group, serialized."""
        entities = self.primary.read(table_read(0), group_read(0))
        return {e.SerializeToString(deterministic=True) for e in entities}


@pytest.fixture
def rig() -> Iterator[Rig]:
    server = P4RuntimeServer(DEVICE_ID, "127.0.0.1:0")
    address = f"127.0.0.1:{server.start()}"
    primary = Controller(address)
    backup = Controller(address)
    try:
        assert primary.arbitrate(ELECTION_ID).status.code == code_pb2.OK
        primary.set_pipeline()
        assert backup.arbitrate(3).status.code == code_pb2.ALREADY_EXISTS
        yield Rig(server, primary, backup)
    finally:
        primary.close()
        backup.close()
        server.stop(grace=0.2)


def rich_status(error: grpc.RpcError) -> status_pb2.Status:
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            return status_pb2.Status.FromString(value)
    raise AssertionError(f"no grpc-status-details-bin in {error!r}")


def per_update(error: grpc.RpcError) -> list[p4runtime_pb2.Error]:
    out = []
    for detail in rich_status(error).details:
        e = p4runtime_pb2.Error()
        assert detail.Unpack(e), detail
        out.append(e)
    return out


def write_raw(rig: Rig, payload: bytes) -> grpc.RpcError | None:
    try:
        rig.primary.channel.unary_unary("/p4.v1.P4Runtime/Write")(payload, timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc
    return None


def request(*updates: Update, atomicity: int = 0, election: int | None = ELECTION_ID) -> WriteRequest:
    r = WriteRequest(device_id=DEVICE_ID, updates=updates, atomicity=atomicity)
    if election is not None:
        r.election_id.low = election
    return r


# ---- valid updates, and their mutations --------------------------------------------------------------
def _random_value(rng: random.Random, bits: int) -> int:
    return rng.randrange(1 << bits)


def valid_entry(rng: random.Random, table_alias: str, unique: int) -> Update:
    """A valid INSERT into ``table_alias`` whose key is made unique by ``unique``."""
    table = next(t for t in P4INFO.tables if t.preamble.alias == table_alias)
    te = p4runtime_pb2.TableEntry(table_id=table.preamble.id)
    for i, mf in enumerate(table.match_fields):
        value = unique if i == 0 else _random_value(rng, mf.bitwidth)
        value &= (1 << mf.bitwidth) - 1
        fm = te.match.add(field_id=mf.id)
        if mf.match_type == mf.LPM:
            fm.lpm.value = encode_bytestring(value)
            fm.lpm.prefix_len = mf.bitwidth
        else:
            fm.exact.value = encode_bytestring(value)
    action = ACTIONS[next(r.id for r in table.action_refs if ACTIONS[r.id].preamble.alias != "NoAction")]
    te.action.action.action_id = action.preamble.id
    for p in action.params:
        te.action.action.params.add(param_id=p.id, value=encode_bytestring(_random_value(rng, p.bitwidth)))
    return Update(type=Update.INSERT, entity=p4runtime_pb2.Entity(table_entry=te))


def _bytes(rng: random.Random) -> bytes:
    return rng.choice([b"", b"\x00", b"\xff" * rng.randint(1, 20), rng.randbytes(rng.randint(1, 8))])


def mutate_update(update: Update, rng: random.Random) -> tuple[str, Update]:
    """1..3 random structural mutations of a valid update."""
    u = Update()
    u.CopyFrom(update)
    names = []
    for _ in range(rng.randint(1, 3)):
        names.append(_mutate_once(u, rng))
    return "+".join(names), u


def _mutate_once(u: Update, rng: random.Random) -> str:
    entity = u.entity
    if entity.WhichOneof("entity") == "packet_replication_engine_entry":
        g = entity.packet_replication_engine_entry.multicast_group_entry
        choice = rng.randrange(6)
        if choice == 0:
            g.multicast_group_id = rng.choice([0, 32767, 32768, 1 << 31, rng.randrange(1 << 32)])
            return "group id"
        if choice == 1 and g.replicas:
            g.replicas.append(g.replicas[rng.randrange(len(g.replicas))])
            return "duplicate replica"
        if choice == 2:
            r = g.replicas.add(instance=rng.choice([0, 1, 0xFFFF, 1 << 16, rng.randrange(1 << 32)]))
            r.egress_port = rng.choice([0, 511, 512, rng.randrange(1 << 32)])
            return "replica port/instance"
        if choice == 3:
            g.replicas.add(port=_bytes(rng), instance=rng.randrange(4))
            return "replica port bytes"
        if choice == 4:
            u.type = rng.choice([0, 1, 2, 3, 4, 99])
            return "update type"
        entity.ClearField("packet_replication_engine_entry")
        entity.packet_replication_engine_entry.clone_session_entry.session_id = rng.randrange(10)
        return "clone session"
    te = entity.table_entry
    choice = rng.randrange(14)
    if choice == 0:
        te.table_id = rng.choice([0, 1, rng.randrange(1 << 32), *TABLES])
        return "table id"
    if choice == 1 and te.match:
        del te.match[rng.randrange(len(te.match))]
        return "missing match field"
    if choice == 2 and te.match:
        te.match.append(te.match[rng.randrange(len(te.match))])
        return "duplicate match field"
    if choice == 3 and te.match:
        te.match[rng.randrange(len(te.match))].field_id = rng.choice([0, 5, rng.randrange(1 << 32)])
        return "field id"
    if choice == 4 and te.match:
        fm = te.match[rng.randrange(len(te.match))]
        kind = fm.WhichOneof("field_match_type")
        if kind == "lpm":
            fm.lpm.value = _bytes(rng)
        elif kind == "exact":
            fm.exact.value = _bytes(rng)
        return "match value bytes (bit width)"
    if choice == 5 and te.match:
        fm = te.match[rng.randrange(len(te.match))]
        if rng.random() < 0.5:
            fm.lpm.prefix_len = rng.choice([0, 1, 31, 33, 1 << 20, -1])
            fm.lpm.value = fm.lpm.value or b"\x01"
        else:
            fm.ternary.value, fm.ternary.mask = _bytes(rng), _bytes(rng)
        return "match kind / prefix"
    if choice == 6:
        te.priority = rng.choice([-1, 1, 10, (1 << 31) - 1, -(1 << 31)])
        return "priority"
    if choice == 7:
        te.action.action.action_id = rng.choice([0, rng.randrange(1 << 32), *ACTIONS])
        return "action id"
    if choice == 8 and te.action.action.params:
        del te.action.action.params[rng.randrange(len(te.action.action.params))]
        return "missing param"
    if choice == 9 and te.action.action.params:
        p = te.action.action.params[rng.randrange(len(te.action.action.params))]
        if rng.random() < 0.5:
            p.value = _bytes(rng)
        else:
            p.param_id = rng.choice([0, 9, rng.randrange(1 << 32)])
        return "param value / id"
    if choice == 10:
        te.is_default_action = True
        return "default action"
    if choice == 11:
        u.type = rng.choice([0, 2, 3, 4, 99])
        return "update type"
    if choice == 12:
        te.action.action.params.add(param_id=rng.randrange(5), value=_bytes(rng))
        return "extra param"
    te.idle_timeout_ns = rng.randrange(1, 1000)
    return "idle timeout"


def mutate_bytes(payload: bytes, rng: random.Random) -> bytes:
    out = bytearray(payload)
    choice = rng.randrange(4)
    if choice == 0 and out:
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
    elif choice == 1:
        del out[rng.randrange(len(out) + 1) :]
    elif choice == 2:
        out += rng.randbytes(rng.randint(1, 30))
    else:
        i = rng.randrange(len(out) + 1)
        out[i:i] = rng.randbytes(rng.randint(1, 10))
    return bytes(out)


# ---- the oracle --------------------------------------------------------------------------------------
class Oracle:
    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.state = rig.snapshot()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.writes = 0

    def write(self, payload: bytes, updates: list[Update], atomicity: int) -> grpc.RpcError | None:
        """Send one (possibly malformed) WriteRequest, check the outcome against a Read; return the error."""
        self.writes += 1
        try:  # what the server will see (a byte-level mutation may change the updates or the atomicity)
            sent = WriteRequest.FromString(payload)
            updates, atomicity = list(sent.updates), sent.atomicity
        except (DecodeError, UnicodeDecodeError):
            pass  # refused as a whole: checked below
        error = write_raw(self.rig, payload)
        after = self.rig.snapshot()
        added, removed = after - self.state, self.state - after
        if error is None:
            self.outcomes["accepted"] += 1
            self.state = after
            return None
        assert error.code() != grpc.StatusCode.INTERNAL, error.details()
        status = rich_status(error)
        assert status.code == error.code().value[0] and status.message == error.details()
        if error.code() != grpc.StatusCode.UNKNOWN:  # the whole request was refused
            assert error.code() in REQUEST_CODES, error
            assert not added and not removed, f"a refused request changed the switch: {error.details()}"
            self.outcomes[f"request {error.code().name}"] += 1
            return error
        details = per_update(error)
        assert details, "a failed batch without per-update details"
        assert all(d.canonical_code in UPDATE_CODES | {code_pb2.OK, code_pb2.ABORTED} for d in details)
        failed = [d for d in details if d.canonical_code not in (code_pb2.OK, code_pb2.ABORTED)]
        if len(details) < len(updates) or not updates:  # details cut to fit the trailer
            assert "per-update details cover updates" in error.details(), error.details()
            first = error.details().split("(updates ", 1)[1].split(",", 1)[0]
            assert "ABORTED" not in first, f"the message does not name the cause: {error.details()}"
        else:
            assert failed, details
        for d in failed:
            self.outcomes[f"update {code_pb2.Code.Name(d.canonical_code)}"] += 1
            assert d.message, d
        if atomicity != WriteRequest.CONTINUE_ON_ERROR:
            assert not added and not removed, "a rejected atomic batch left changes behind"
            return error
        # CONTINUE_ON_ERROR: exactly the updates answered OK took effect
        ok = [u for u, d in zip(updates, details, strict=False) if d.canonical_code == code_pb2.OK]
        inserts = sum(u.type == Update.INSERT for u in ok)
        deletes = sum(u.type == Update.DELETE for u in ok)
        modifies = sum(u.type == Update.MODIFY for u in ok)
        assert len(added) - len(removed) == inserts - deletes, (len(added), len(removed), inserts, deletes)
        assert len(added) <= inserts + modifies and len(removed) <= deletes + modifies
        self.state = after
        return error


def _check_named_cases(rig: Rig, oracle: Oracle) -> int:
    """The classes of bad input the issue names, each with its code and message."""
    primary = rig.primary
    primary.write(route(0x0A000001), job(7), group(5, (1, 0), (2, 1)))
    oracle.state = rig.snapshot()
    te_route = route(0x0A000009)

    def with_entry(fn: Callable[[p4runtime_pb2.TableEntry], object]) -> Update:
        u = Update()
        u.CopyFrom(te_route)
        fn(u.entity.table_entry)
        return u

    cases: list[tuple[str, Update, int, str]] = [
        (
            "unknown table id",
            with_entry(lambda te: setattr(te, "table_id", 12345)),
            code_pb2.INVALID_ARGUMENT,
            "unknown table id",
        ),
        (
            "unknown action id",
            with_entry(lambda te: setattr(te.action.action, "action_id", 999)),
            code_pb2.INVALID_ARGUMENT,
            "unknown action id",
        ),
        (
            "unknown field id",
            with_entry(lambda te: setattr(te.match[0], "field_id", 7)),
            code_pb2.INVALID_ARGUMENT,
            "no match field with id 7",
        ),
        (
            "value wider than the field",
            with_entry(lambda te: setattr(te.match[0].lpm, "value", b"\x01" * 5)),
            code_pb2.INVALID_ARGUMENT,
            "does not fit",
        ),
        (
            "param wider than its bit width",
            with_entry(lambda te: setattr(te.action.action.params[0], "value", b"\x02\x00")),
            code_pb2.INVALID_ARGUMENT,
            "does not fit the field's 9 bits",
        ),
        (
            "garbage bytes in a value",
            with_entry(lambda te: setattr(te.match[0].lpm, "value", b"\xde\xad" * 9)),
            code_pb2.INVALID_ARGUMENT,
            "does not fit",
        ),
        # (an LPM field may be omitted: that is the wildcard; an exact one may not)
        (
            "missing exact match field",
            _job_without_match(),
            code_pb2.INVALID_ARGUMENT,
            "exact match field job_id is missing",
        ),
        (
            "priority on an LPM table",
            with_entry(lambda te: setattr(te, "priority", 10)),
            code_pb2.INVALID_ARGUMENT,
            "priority must be 0",
        ),
        (
            "negative priority",
            with_entry(lambda te: setattr(te, "priority", -5)),
            code_pb2.INVALID_ARGUMENT,
            "priority",
        ),
        ("group id 0", group(0, (1, 0)), code_pb2.INVALID_ARGUMENT, "group id 0 is invalid"),
        ("duplicate replicas", group(6, (1, 0), (1, 0)), code_pb2.INVALID_ARGUMENT, "duplicate replica"),
        ("existing group", group(5, (1, 0)), code_pb2.ALREADY_EXISTS, "already exists"),
        ("missing group deleted", group(77, kind=Update.DELETE), code_pb2.NOT_FOUND, "does not exist"),
        (
            "update type unspecified",
            Update(type=Update.UNSPECIFIED, entity=te_route.entity),
            code_pb2.INVALID_ARGUMENT,
            "is not INSERT, MODIFY or DELETE",
        ),
    ]
    for name, update, code, fragment in cases:
        for atomicity in ATOMICITIES:
            ok_first = route(0x0B000000 + oracle.writes)  # a valid update in the same batch
            req = request(ok_first, update, atomicity=atomicity)
            before = oracle.state
            errors = per_update(_error(oracle.write(req.SerializeToString(), [ok_first, update], atomicity)))
            assert errors[1].canonical_code == code and fragment in errors[1].message, (name, errors[1])
            if atomicity == WriteRequest.CONTINUE_ON_ERROR:
                assert errors[0].canonical_code == code_pb2.OK and len(oracle.state) == len(before) + 1
                primary.write(Update(type=Update.DELETE, entity=ok_first.entity))  # back to the baseline
                oracle.state = rig.snapshot()
            else:
                assert errors[0].canonical_code == code_pb2.ABORTED and oracle.state == before

    # request-level refusals
    refused = [
        ("wrong device id", request(route(0x0A000002)), grpc.StatusCode.NOT_FOUND, "device id"),
        (
            "garbage bytes as a WriteRequest",
            b"\xff\xff\xff\x0a",
            grpc.StatusCode.INVALID_ARGUMENT,
            "malformed",
        ),
        (
            "unknown atomicity",
            request(route(0x0A000002), atomicity=7),
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown atomicity",
        ),
        (
            "no election id while a primary is connected",
            request(route(0x0A000002), election=None),
            grpc.StatusCode.PERMISSION_DENIED,
            "Not primary",
        ),
        (
            "a backup's election id",
            request(route(0x0A000002), election=3),
            grpc.StatusCode.PERMISSION_DENIED,
            "Not primary",
        ),
    ]
    for name, req, grpc_code, fragment in refused:
        if name == "wrong device id":
            assert isinstance(req, WriteRequest)
            req.device_id = DEVICE_ID + 1
        payload = req if isinstance(req, bytes) else req.SerializeToString()
        before = oracle.state
        error = write_raw(rig, payload)
        assert error is not None and error.code() == grpc_code and fragment in error.details(), (name, error)
        assert rich_status(error).code == grpc_code.value[0]
        assert rig.snapshot() == before
    with pytest.raises(grpc.RpcError) as info:
        rig.backup.write(route(0x0A000002))  # through the backup's own stub and stream
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED

    # an oversized batch: more lookup_job entries than the table holds, all-or-nothing
    size = next(t.size for t in P4INFO.tables if t.preamble.alias == "lookup_job")
    many = [job(1000 + j) for j in range(size + 10)]
    for atomicity in (WriteRequest.ROLLBACK_ON_ERROR, WriteRequest.DATAPLANE_ATOMIC):
        req = request(*many, atomicity=atomicity)
        error = _error(oracle.write(req.SerializeToString(), many, atomicity))
        assert f"(updates {size - 1} RESOURCE_EXHAUSTED, 0 ABORTED" in error.details(), error.details()
        assert all(e.canonical_code == code_pb2.ABORTED for e in per_update(error))
    return len(cases) * len(ATOMICITIES) + len(refused) + 1 + 2


def _job_without_match() -> Update:
    u = job(99)
    u.entity.table_entry.ClearField("match")
    return u


def _error(error: grpc.RpcError | None) -> grpc.RpcError:
    assert error is not None, "the request was accepted"
    return error


def _fuzz(rig: Rig, writes: int, seed: int) -> tuple[Oracle, collections.Counter[str]]:
    rng = random.Random(seed)
    oracle = Oracle(rig)
    mutations: collections.Counter[str] = collections.Counter()
    aliases = [t.preamble.alias for t in P4INFO.tables]
    for i in range(writes):
        if rng.random() < 0.2:
            base = group(rng.randrange(1, 40), *[(p, rng.randrange(3)) for p in rng.sample(range(1, 9), 2)])
        else:
            base = valid_entry(rng, rng.choice(aliases), unique=rng.randrange(1, 200))
        name, bad = mutate_update(base, rng)
        fresh = valid_entry(rng, "route_ipv4", unique=0x0C000000 + i)
        atomicity = rng.choice(ATOMICITIES)
        updates = [fresh, bad] if rng.random() < 0.5 else [bad]
        payload = request(*updates, atomicity=atomicity).SerializeToString()
        if rng.random() < 0.25:
            payload = mutate_bytes(payload, rng)
            name = "bytes"
        mutations[name.split("+")[0]] += 1
        oracle.write(payload, updates, atomicity)
    return oracle, mutations


def _final_check(rig: Rig, oracle: Oracle) -> int:
    """The server still serves, and a Read shows exactly the validly written state."""
    assert rig.snapshot() == oracle.state
    rig.primary.write(route(0x0D000001))
    assert len(rig.snapshot()) == len(oracle.state) + 1
    entries = rig.primary.read(table_read(TABLE_IDS["route_ipv4"]))
    # (a wildcard route, written validly by the fuzz, has no match field)
    assert any(
        e.table_entry.match and e.table_entry.match[0].lpm.value == b"\x0d\x00\x00\x01" for e in entries
    )
    assert rig.server.state is not None
    return len(oracle.state)


def test_malformed_p4runtime_writes(rig: Rig, reliability: Recorder) -> None:
    oracle = Oracle(rig)
    named = _check_named_cases(rig, oracle)
    fuzz, mutations = _fuzz(rig, 400, seed=50)
    entries = _final_check(rig, fuzz)
    assert fuzz.outcomes["accepted"] < fuzz.writes // 2  # most mutations are refused
    reliability.record(
        area="bad input",
        case="malformed P4Runtime writes: unknown table/action/field ids, wrong bit widths, missing match "
        "fields, bad priorities, group id 0, duplicate replicas, oversized batches, garbage bytes, wrong "
        "device id, non-primary writers",
        target="switch (embedded P4Runtime server)",
        trials=named,
        lost=0,
        held="each answered with its canonical code and a google.rpc.Status (per-update p4.v1.Error details "
        "for batches), under all three atomicities; rejected atomic batches and refused requests changed "
        "nothing, CONTINUE_ON_ERROR kept exactly the OK updates; the server kept serving",
    )
    reliability.record(
        area="bad input",
        case=f"randomly mutated WriteRequests (structural and byte-level: {tally(mutations)})",
        target="switch (embedded P4Runtime server)",
        trials=fuzz.writes,
        lost=0,
        held=f"outcomes {tally(fuzz.outcomes)}; never INTERNAL, every error with a google.rpc.Status; a full "
        f"Read after each write equals the previous state plus exactly the updates answered OK; "
        f"{entries} entries validly written, all read back; the server kept serving",
    )


@pytest.mark.soak
@pytest.mark.timeout(1200)
def test_malformed_p4runtime_writes_soak(rig: Rig, reliability: Recorder) -> None:
    fuzz, mutations = _fuzz(rig, 1500, seed=51)
    entries = _final_check(rig, fuzz)
    reliability.record(
        area="bad input",
        case="randomly mutated WriteRequests, 1500 writes",
        target="switch (embedded P4Runtime server)",
        trials=fuzz.writes,
        lost=0,
        held=f"outcomes {tally(fuzz.outcomes)}; never INTERNAL; each Read equals the validly written state "
        f"({entries} entries at the end)",
    )


def test_action_ids_are_the_p4info_ones() -> None:
    assert set(ACTION_IDS.values()) <= set(ACTIONS)
