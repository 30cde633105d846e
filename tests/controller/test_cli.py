"""``checkmate-ctl`` through ``main([...])``: help, usage errors, a whole session, clear failures."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from controller.cli import main
from tests.controller.conftest import Fabric, cli_session, gradient

HELP = [
    [],
    ["pipeline", "push"],
    ["forwarding", "install"],
    ["job", "add"],
    ["job", "remove"],
    ["job", "list"],
    ["job", "show"],
    ["shadow", "move"],
    ["reconcile"],
]


@pytest.mark.parametrize("command", HELP, ids=[" ".join(c) or "top" for c in HELP])
def test_every_command_has_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: checkmate-ctl") and ("COMMAND" in out or " ".join(command) in out)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["job"], "required: ACTION"),
        (["--timeout", "-1", "reconcile"], "must be > 0"),
        (["job", "add", "--job-id", "x"], "invalid int value"),
        (["job", "add", "--shard", "0:sh1"], "must be SHARD=SHADOW"),
        (
            ["--network", "{net}", "job", "add", "--job-id", "7"],
            "--job-id, --workers and --shadows are required",
        ),
        (["--network", "{net}", "job", "add", "--spec", "x.json", "--job-id", "7"], "either --spec or"),
        (["reconcile"], "--network FILE is required"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CHECKMATE_NETWORK", raising=False)
    net = tmp_path / "net.json"
    net.write_text((Path(__file__).parents[2] / "topologies" / "single.json").read_text())
    argv = [a.replace("{net}", str(net)) for a in argv]
    assert main(["--state-dir", str(tmp_path / "state"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_whole_session(
    fabric: Callable[..., Fabric], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = fabric("single")
    ctl = cli_session(f, tmp_path, capsys)
    assert "pushed the embedded pipeline to s1" in ctl("pipeline", "push")
    assert "in sync" in ctl("forwarding", "install")
    assert "job 7 added: slot 1, 8 multicast group(s), 2 shadow rewrite(s)" in ctl(
        "job", "add", "--job-id", "7", "--workers", "h1,h2,h3,h4", "--shadows", "sh1,sh2"
    )
    spec = tmp_path / "job8.json"
    spec.write_text(
        json.dumps({"job_id": 8, "workers": ["h1", "h3"], "shadows": ["sh2"], "shadow_port": 50000})
    )
    assert "job 8 added" in ctl("job", "add", "--spec", str(spec))
    listing = ctl("job", "list")
    assert "job 7  slot 1  workers h1,h2,h3,h4  shadows sh1,sh2  shards 0->sh1, 1->sh2" in listing
    assert "job 8  slot 2" in listing

    for _ in range(3):
        f.send("h2", gradient("h2", "h3", f.network, shard_key=1))
    shown = ctl("job", "show", "7")
    assert "s1: shadow_copies 3 / " in shown and "rejected_replications 0 / 0" in shown
    assert "s1: multicast group 1: next hop port 1 + copy to sh1 (rid 1)" in shown

    assert "shard 1 now goes to sh1" in ctl("shadow", "move", "--job", "7", "--shard", "1", "--to", "sh1")
    delivered = f.send("h2", gradient("h2", "h3", f.network, shard_key=1))
    assert sorted(delivered) == ["h3", "sh1"]
    shown = json.loads(ctl("job", "show", "7", "--json"))
    assert shown["job"]["shard_to_shadow"] == {"0": "sh1", "1": "sh1"}
    assert shown["counters"]["s1"]["shadow_copies"]["packets"] == 4

    assert "in sync" in ctl("reconcile")
    assert "job 7 removed" in ctl("job", "remove", "7")
    assert "job 7 is not registered" in ctl("job", "remove", "7", status=1)
    err = ctl("job", "add", "--job-id", "9", "--workers", "h1,h9", "--shadows", "sh1", status=1)
    assert err.startswith("checkmate-ctl: error: job 9: unknown host(s) ['h9']")
    err = ctl("job", "add", "--job-id", "9", "--workers", "h1,h2", "--shadows", "h1", status=1)
    assert "cannot be both worker and shadow" in err
    ctl("job", "remove", "8")
    assert "no jobs registered" in ctl("job", "list")


def test_unreachable_switch_and_bad_network_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    data = json.loads((Path(__file__).parents[2] / "topologies" / "single.json").read_text())
    data["switches"]["s1"]["grpc"] = f"127.0.0.1:{closed}"
    net = tmp_path / "net.json"
    net.write_text(json.dumps(data))
    state = ["--state-dir", str(tmp_path / "state")]
    assert main(["--network", str(net), *state, "--timeout", "0.3", "forwarding", "install"]) == 1
    assert f"switch s1 (127.0.0.1:{closed}, device 1) is unreachable" in capsys.readouterr().err
    data["links"].append(["h1", "s1-p9"])
    net.write_text(json.dumps(data))
    assert main(["--network", str(net), *state, "reconcile"]) == 1
    assert "host h1 is already linked" in capsys.readouterr().err
