"""The bring-up plan, without creating anything: switch command lines and interface names."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkmate.p4.program import Target
from tests.topologies.harness import REPO
from topologies import preflight
from topologies.preflight import make_plan
from topologies.targets import BINARIES


def test_embedded_plan_for_leafspine(tmp_path: Path) -> None:
    plan = make_plan(REPO / "topologies" / "leafspine.json", Target.EMBEDDED, tmp_path)
    assert plan.switch_binary.endswith("checkmate-switch")
    assert sorted(plan.interfaces) == sorted(f"s{s}-p{p}" for s in (1, 2, 3) for p in (1, 2, 3)) + [
        "s4-p1",
        "s4-p2",
        "s4-p3",
    ]
    argv = plan.switches["s2"].command(plan.switch_binary)
    assert argv[1:] == [
        "-i",
        "1@s2-p1",
        "-i",
        "2@s2-p2",
        "-i",
        "3@s2-p3",
        "--device-id",
        "2",
        "--thrift-port",
        "9091",
        "--log-console",
        "--log-level",
        "info",
        "--no-p4",
        "--",
        "--grpc-server-addr",
        "127.0.0.1:50002",
    ]


def test_bmv2_plan_uses_the_same_command_line_and_pushes_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bmv2_json = tmp_path / "checkmate.json"
    bmv2_json.write_text("{}")
    monkeypatch.setattr(preflight, "find_binary", lambda target: f"/opt/bmv2/{BINARIES[target]}")
    monkeypatch.setattr(
        preflight, "pipeline_files", lambda target: (REPO / "p4src/checkmate.p4info.txtpb", bmv2_json)
    )
    plan = make_plan(REPO / "topologies" / "single.json", Target.BMV2, tmp_path / "run", pcap=True)
    argv = plan.switches["s1"].command(plan.switch_binary)
    assert argv[0] == "/opt/bmv2/simple_switch_grpc"
    assert argv[argv.index("--pcap") + 1] == str(tmp_path / "run" / "pcap")
    assert argv[argv.index("--") + 1 :] == ["--grpc-server-addr", "127.0.0.1:50001"]
    assert plan.bmv2_json == bmv2_json


def test_switch_args_pass_through_to_the_named_switch_before_the_target_options(tmp_path: Path) -> None:
    plan = make_plan(
        REPO / "topologies" / "leafspine.json",
        Target.EMBEDDED,
        tmp_path,
        switch_args=["s1=--drop-egress 1:0.01 --drop-seed 7", "--log-level warn"],
    )
    s1 = plan.switches["s1"].command(plan.switch_binary)
    assert s1[s1.index("--no-p4") + 1 : s1.index("--")] == [
        "--drop-egress",
        "1:0.01",
        "--drop-seed",
        "7",
        "--log-level",
        "warn",
    ]
    s2 = plan.switches["s2"].command(plan.switch_binary)
    assert s2[s2.index("--no-p4") + 1 : s2.index("--")] == ["--log-level", "warn"]


@pytest.mark.parametrize(
    ("value", "message"), [("s9=--drop-seed 1", "no switch 's9'"), ("s1=--x 'open", "No closing quotation")]
)
def test_bad_switch_args_are_preflight_errors(tmp_path: Path, value: str, message: str) -> None:
    with pytest.raises(preflight.PreflightError, match=message):
        make_plan(REPO / "topologies" / "single.json", Target.EMBEDDED, tmp_path, switch_args=[value])
