"""checkmate-switch's command line: simple_switch_grpc's options, and clear errors (exit 2)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from checkmate.p4.program import P4INFO_PATH
from embedded_switch.cli import parse_config
from embedded_switch.testbed import switch_program


def error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_config(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_simple_switch_grpc_command_line_is_accepted() -> None:
    config = parse_config(
        ["--no-p4", "-i", "1@lo", "--device-id", "3", "--log-console", "--thrift-port", "9090", "--",
         "--grpc-server-addr", "127.0.0.1:50001", "--cpu-port", "255"]
    )  # fmt: skip
    assert [(b.port, b.iface) for b in config.bindings] == [(1, "lo")]
    assert (config.device_id, config.grpc_address, config.cpu_port) == (3, "127.0.0.1:50001", 255)
    assert config.p4info is None and config.pcap_dir is None
    assert parse_config(["--no-p4", "--pcap"]).pcap_dir == Path(".")


def test_json_config_is_checked_and_the_program_preloaded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    json_path = tmp_path / "checkmate.json"
    json_path.write_text('{"program": "checkmate.p4"}')
    assert parse_config([str(json_path), "-i", "0@lo"]).p4info == P4INFO_PATH
    assert parse_config([str(P4INFO_PATH)]).p4info == P4INFO_PATH
    json_path.write_text("not json")
    assert "is not JSON" in error_of([str(json_path)], capsys)
    assert "does not exist" in error_of([str(tmp_path / "missing.json")], capsys)


def test_fault_injection_options() -> None:
    config = parse_config(["--no-p4", "-i", "1@lo", "--drop-egress", "1:0.25", "--drop-seed", "9"])
    assert config.drop_egress == {1: 0.25} and config.drop_seed == 9


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--no-p4", "-i", "1lo"], "expected PORT@IFACE"),
        (["--no-p4", "-i", "x@lo"], "is not a port number"),
        (["--no-p4", "-i", "600@lo"], "out of range"),
        (["--no-p4", "-i", "1@no-such-if0"], "no interface named 'no-such-if0'"),
        (["--no-p4", "-i", "1@lo", "-i", "1@lo"], "bound more than once"),
        (["--no-p4", "-i", "1@lo", "--drop-egress", "1:1.5"], "must lie in [0, 1]"),
        (["--no-p4", "-i", "1@lo", "--drop-egress", "1:-0.1"], "must lie in [0, 1]"),
        (["--no-p4", "-i", "1@lo", "--drop-egress", "2:0.1"], "port 2 is not bound"),
        (["--no-p4", "-i", "1@lo", "--drop-egress", "1"], "expected PORT:FRACTION"),
        (["--no-p4", "-i", "1@lo", "--cpu-port", "1"], "also bound to an interface"),
        (["-i", "1@lo"], "--no-p4"),
        (["--p4info", "/nonexistent.txt"], "does not exist"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in error_of(argv, capsys)


def test_console_script_exits_2_on_a_missing_interface() -> None:
    result = subprocess.run(
        [*switch_program(), "--no-p4", "-i", "1@no-such-if0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "no interface named 'no-such-if0'" in result.stderr
