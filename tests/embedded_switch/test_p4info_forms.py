"""The embedded target takes the program's P4Info in p4c's form and in the older form alike.

p4c 1.2.5 lists each table's ``initial_default_action`` and the directly called
action ``drop``; the P4Info committed before it did not. Both describe the same
program, from a file or pushed over P4Runtime.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import text_format
from p4.config.v1 import p4info_pb2
from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc

from checkmate.p4.p4info import load_p4info
from checkmate.p4.program import P4INFO_PATH
from embedded_switch import program
from embedded_switch.p4runtime_server import P4RuntimeServer

TIMEOUT_S = 5.0
P4C_FORM = load_p4info()


def older_form() -> p4info_pb2.P4Info:
    """The committed P4Info as it was before p4c's form: no initial_default_action, no ``drop``."""
    info = p4info_pb2.P4Info()
    info.CopyFrom(P4C_FORM)
    for table in info.tables:
        table.ClearField("initial_default_action")
    kept = [a for a in info.actions if a.preamble.alias != "drop"]
    del info.actions[:]
    info.actions.extend(kept)
    return info


def test_the_committed_p4info_is_p4cs_form() -> None:
    assert P4INFO_PATH.suffix == ".txtpb"
    assert all(t.HasField("initial_default_action") for t in P4C_FORM.tables)
    assert "drop" in {a.preamble.alias for a in P4C_FORM.actions}
    names = {a.preamble.id: a.preamble.alias for a in P4C_FORM.actions}
    defaults = {t.preamble.alias: names[t.initial_default_action.action_id] for t in P4C_FORM.tables}
    assert defaults == {alias: call.name for alias, call in program.DEFAULT_ACTIONS.items()}


@pytest.mark.parametrize("suffix", [".txt", ".txtpb"])
@pytest.mark.parametrize("form", ["p4c", "older"])
def test_either_form_loads_from_a_file(tmp_path: Path, form: str, suffix: str) -> None:
    info = P4C_FORM if form == "p4c" else older_form()
    path = tmp_path / f"checkmate.p4info{suffix}"
    path.write_text(text_format.MessageToString(info))
    server = P4RuntimeServer(0, "127.0.0.1:0")
    server.load_pipeline(path)
    assert server.state is not None
    assert {name: t.default_action for name, t in server.state.tables.items()} == program.DEFAULT_ACTIONS


@pytest.fixture
def stub() -> Iterator[p4runtime_pb2_grpc.P4RuntimeStub]:
    server = P4RuntimeServer(0, "127.0.0.1:0")
    port = server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield p4runtime_pb2_grpc.P4RuntimeStub(channel)
    finally:
        channel.close()
        server.stop(grace=0.1)


def push(stub: p4runtime_pb2_grpc.P4RuntimeStub, info: p4info_pb2.P4Info) -> None:
    request = p4runtime_pb2.SetForwardingPipelineConfigRequest(
        device_id=0, action=p4runtime_pb2.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT
    )
    request.config.p4info.CopyFrom(info)
    stub.SetForwardingPipelineConfig(request, timeout=TIMEOUT_S)


def test_either_form_is_accepted_over_p4runtime_and_read_back_as_pushed(
    stub: p4runtime_pb2_grpc.P4RuntimeStub,
) -> None:
    for info in (older_form(), P4C_FORM, older_form()):
        push(stub, info)
        request = p4runtime_pb2.GetForwardingPipelineConfigRequest(device_id=0)
        assert stub.GetForwardingPipelineConfig(request, timeout=TIMEOUT_S).config.p4info == info


def test_an_initial_default_action_other_than_the_programs_is_refused(
    stub: p4runtime_pb2_grpc.P4RuntimeStub,
) -> None:
    info = p4info_pb2.P4Info()
    info.CopyFrom(P4C_FORM)
    ids = {a.preamble.alias: a.preamble.id for a in info.actions}
    route = next(t for t in info.tables if t.preamble.alias == "route_ipv4")
    route.initial_default_action.action_id = ids["drop"]
    with pytest.raises(grpc.RpcError) as error:
        push(stub, info)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "initial default action CheckmateIngress.drop differs" in (error.value.details() or "")
    assert "drop_no_route" in (error.value.details() or "")
