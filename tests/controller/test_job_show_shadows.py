"""``checkmate-ctl job show`` asks the job's shadows for their status.

Shadows here are a real :class:`shadow.node.ShadowNode` (no job: it answers
``waiting_for_job``) and a tiny fake that answers a status request with a
chosen document, garbage, or nothing; both listen on 127.0.0.x and the CLI
is pointed at them with ``--shadow-address``. Whatever a shadow does,
``job show`` exits 0 and still shows the switch counters.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from checkmate.control import (
    DEFAULT_CONTROL_PORT,
    ShadowStatusError,
    StatusReport,
    StatusRequest,
    query_status,
    recv_message,
    send_message,
)
from checkmate.control_frame import bind
from checkmate.job import JobSpec
from controller.cli import main
from controller.shadow_status import (
    SHADOW_CONTROL_PORT,
    ShadowStatus,
    protection,
    protection_line,
    shadow_addresses,
    summary_line,
)
from shadow.node import ShadowConfig, ShadowNode
from tests.controller.conftest import Fabric, gradient

STATUS: dict[str, Any] = {
    "shadow": "sh1",
    "job_id": 7,
    "state": "running",
    "blocked": None,
    "applied_iteration": 41,
    "certified_iteration": 40,
    "next_iteration": 42,
    "latest_commit": 43,
    "lag_iterations": 2,
    "packets_received": 1234,
    "bytes_received": 1727600,
    "drops": {"duplicate": 5, "stale_iteration": 2, "wrong_dtype": 0},
    "repairs": {"requests": 3, "elements_repaired": 120, "nacks": 0, "unrepairable": 0},
}


class FakeShadow:
    """Answers every connection on 127.0.0.x like a shadow's control port, or misbehaves (``mode``)."""

    def __init__(
        self,
        mode: str = "status",
        host: str = "127.0.0.2",
        status: dict[str, Any] | None = None,
        name: str = "sh1",
    ):
        self.mode = mode
        self.name = name
        self.requests = 0
        self.status = STATUS if status is None else status
        self.connections = 0
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.05)
        self.address = self._listener.getsockname()
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def where(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            bind(conn, server=True, name=self.name)  # the hello names the node, as a shadow's does
            self.connections += 1
            if self.mode == "silent":  # accept, read nothing, never answer
                self._held.append(conn)
                continue
            with conn:
                try:
                    request = recv_message(conn, timeout=2.0)
                    assert isinstance(request, StatusRequest)
                    self.requests += 1
                    if self.mode == "garbage":
                        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\nnot a shadow")
                    elif self.mode == "wrong_type":
                        send_message(conn, StatusRequest(7), timeout=2.0)
                    else:
                        send_message(conn, StatusReport(7, self.status), timeout=2.0)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(timeout=2.0)
        for conn in self._held:
            conn.close()


@pytest.fixture
def fakes() -> Iterator[Callable[..., FakeShadow]]:
    made: list[FakeShadow] = []

    def make(mode: str = "status", **kwargs: Any) -> FakeShadow:
        made.append(FakeShadow(mode, **kwargs))
        return made[-1]

    yield make
    for fake in made:
        fake.close()


@pytest.fixture
def real_shadow() -> Iterator[ShadowNode]:
    config = ShadowConfig(name="sh2", control_bind=("127.0.0.3", 0), data_bind=("127.0.0.3", 0))
    node = ShadowNode(config).start()
    yield node
    node.close(timeout=2.0)


def closed_port(host: str = "127.0.0.4") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def job_cli(
    fabric: Callable[..., Fabric], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> Callable[..., tuple[int, str, str]]:
    """A single-switch fabric with job 7 (workers h1..h4, shadows sh1, sh2) and 2 copies counted."""
    f = fabric("single")
    net = tmp_path / "net.json"
    net.write_text(json.dumps(f.network.to_json()))
    base = ["--network", str(net), "--state-dir", str(f.state_dir), "--timeout", "2"]
    assert main([*base, "pipeline", "push"]) == 0
    secret = tmp_path / "job.secret"  # the fake and real shadows here hold the tests' secret
    secret.write_text(os.environ["CHECKMATE_JOB_SECRET"])
    secret.chmod(0o600)  # a secret file others may read is refused (docs/security.md)
    job = ["--job-id", "7", "--workers", "h1,h2,h3,h4", "--shadows", "sh1,sh2", "--secret-file", str(secret)]
    assert main([*base, "job", "add", *job]) == 0
    for _ in range(2):
        f.send("h2", gradient("h2", "h3", f.network, shard_key=1))
    capsys.readouterr()

    def run(*argv: str) -> tuple[int, str, str]:
        code = main([*base, "job", "show", "7", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_human_output_has_a_line_per_shadow(
    job_cli: Callable[..., tuple[int, str, str]],
    fakes: Callable[..., FakeShadow],
    real_shadow: ShadowNode,
) -> None:
    fake = fakes()
    host, port = real_shadow.control_address
    code, out, err = job_cli(
        "--shadow-address", f"sh1={fake.where}", "--shadow-address", f"sh2={host}:{port}"
    )
    assert code == 0, err
    assert "s1: shadow_copies 2 / " in out
    assert "shadows (status on their control port, 2 s timeout):" in out
    sh1 = next(line.strip() for line in out.splitlines() if line.strip().startswith("sh1 "))
    assert sh1 == (
        f"sh1 {fake.where}: running  certified 40  applied 41  lag 2  "
        "received 1234 packets / 1727600 bytes  repairs 3 requests / 120 elements  "
        "drops duplicate 5, stale_iteration 2"
    )
    sh2 = next(line.strip() for line in out.splitlines() if line.strip().startswith("sh2 "))
    assert sh2.startswith(
        f"sh2 {host}:{port}: waiting_for_job  certified -1  applied -1  lag -  received 0 packets"
    )
    assert sh2.endswith("drops 0")
    # sh2 has no job: the job is not protected, and job show says why
    assert "  protection: UNPROTECTED: sh2: waiting_for_job" in out


def test_json_output_has_each_shadows_status_document(
    job_cli: Callable[..., tuple[int, str, str]],
    fakes: Callable[..., FakeShadow],
    real_shadow: ShadowNode,
) -> None:
    fake = fakes()
    host, port = real_shadow.control_address
    code, out, err = job_cli(
        "--json", "--shadow-address", f"sh1={fake.where}", "--shadow-address", f"sh2={host}:{port}"
    )
    assert code == 0, err
    shown = json.loads(out)
    assert shown["counters"]["s1"]["shadow_copies"]["packets"] == 2
    assert list(shown["shadows"]) == ["sh1", "sh2"]
    assert shown["shadows"]["sh1"] == STATUS
    real = shown["shadows"]["sh2"]
    assert real["shadow"] == "sh2" and real["state"] == "waiting_for_job"
    for field in ("applied_iteration", "certified_iteration", "lag_iterations", "packets_received"):
        assert field in real
    assert isinstance(real["drops"], dict) and isinstance(real["repairs"], dict)
    assert shown["protection"]["protected"] is False
    assert shown["protection"]["problems"] == ["sh2: waiting_for_job"]


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("refused", "connection refused (no shadow listening)"),
        ("silent", "no answer within 0.5 s"),
        ("garbage", "bad reply: bad frame magic b'HTTP', expected b'CMC3'"),
        ("wrong_type", "bad reply: 'status_request' to a status request"),
        ("another_node", "refused: the server says it is 'sh2', not 'sh1': connected to another node"),
    ],
)
def test_a_shadow_that_fails_gets_an_error_line_and_show_still_works(
    mode: str,
    error: str,
    job_cli: Callable[..., tuple[int, str, str]],
    fakes: Callable[..., FakeShadow],
) -> None:
    good = fakes(name="sh2")
    impostor = None
    if mode == "refused":
        where = f"127.0.0.4:{closed_port()}"
    elif mode == "another_node":  # sh1's address leads to the job's other shadow: not asked
        impostor = fakes(host="127.0.0.5", name="sh2")
        where = impostor.where
    else:
        where = fakes(mode, host="127.0.0.5").where
    overrides = ["--shadow-address", f"sh1={where}", "--shadow-address", f"sh2={good.where}"]

    started = time.monotonic()
    code, out, err = job_cli("--shadow-timeout", "0.5", *overrides)
    assert time.monotonic() - started < 3.0
    assert code == 0, err
    assert "s1: shadow_copies 2 / " in out and "total: shadow_copies 2 / " in out
    assert f"    sh1 {where}: error: {error}\n" in out
    assert f"    sh2 {good.where}: running  certified 40" in out

    code, out, err = job_cli("--json", "--shadow-timeout", "0.5", *overrides)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["counters"]["s1"]["shadow_copies"]["packets"] == 2
    assert shown["shadows"]["sh1"] == {"error": error}
    assert shown["shadows"]["sh2"]["applied_iteration"] == 41
    if impostor is not None:
        assert impostor.connections == 2 and impostor.requests == 0  # refused at its hello


def test_no_shadows_asks_none(
    job_cli: Callable[..., tuple[int, str, str]], fakes: Callable[..., FakeShadow]
) -> None:
    fake = fakes()
    overrides = ["--shadow-address", f"sh1={fake.where}", "--shadow-address", f"sh2={fake.where}"]
    code, out, _ = job_cli("--no-shadows", *overrides)
    assert code == 0 and "s1: shadow_copies 2 / " in out and "shadows (" not in out
    code, out, _ = job_cli("--no-shadows", "--json", *overrides)
    assert code == 0 and "shadows" not in json.loads(out)
    assert fake.connections == 0


def test_bad_shadow_address_is_a_usage_error(
    job_cli: Callable[..., tuple[int, str, str]],
) -> None:
    code, _, err = job_cli("--shadow-address", "sh1")
    assert code == 2 and "must be SHADOW=HOST[:PORT]" in err
    code, _, err = job_cli("--shadow-address", "sh1=127.0.0.1:70000")
    assert code == 2 and "port 70000 is outside 1..65535" in err


def test_shadows_are_asked_at_their_network_ip_on_the_control_port(
    fabric: Callable[..., Fabric],
) -> None:
    network = fabric("single").network
    spec = JobSpec(7, ("h1", "h2"), ("sh1", "sh2", "ghost"), {0: "sh1"}, 48879)
    assert SHADOW_CONTROL_PORT == DEFAULT_CONTROL_PORT
    addresses = shadow_addresses(spec, network, overrides={"sh2": ("127.0.0.9", 1234)})
    assert addresses["sh1"] == (str(network.host("sh1").address), DEFAULT_CONTROL_PORT)
    assert addresses["sh2"] == ("127.0.0.9", 1234)
    ghost = addresses["ghost"]
    assert isinstance(ghost, ShadowStatusError) and "unknown host 'ghost'" in str(ghost)
    assert shadow_addresses(spec, network, control_port=5000)["sh1"][1] == 5000  # type: ignore[index]


def test_a_status_with_odd_fields_still_makes_one_line(fakes: Callable[..., FakeShadow]) -> None:
    odd = {"state": "stalled", "blocked": "no commit for 12", "job_id": 9, "drops": "lots", "repairs": None}
    fake = fakes(status=odd)
    status = query_status(fake.address, timeout=1.0, job_id=7)
    assert status == odd
    line = summary_line(ShadowStatus("sh1", fake.where, status=status), job_id=7)
    assert line == (
        f"sh1 {fake.where}: stalled  certified -  applied -  lag -  received - packets / - bytes  "
        "repairs 0 requests / 0 elements  drops 0  blocked: no commit for 12  serves job 9, not 7"
    )


def test_a_diverged_shadow_says_so_in_its_line() -> None:
    divergence = {
        "iteration": 12,
        "last_verified": 10,
        "mismatched_tensors": 4,
        "mismatches": ["head.weight::param", "head.weight::momentum_buffer", "head.bias::param", "x::param"],
    }
    status = {**STATUS, "state": "diverged", "divergence": divergence, "divergences": 1}
    line = summary_line(ShadowStatus("sh1", "127.0.0.2:1", status=status))
    assert "sh1 127.0.0.2:1: diverged  certified 40" in line
    assert line.endswith(
        "DIVERGED after iteration 12: 4 tensors differ from rank 0's (head.weight::param, "
        "head.weight::momentum_buffer, head.bias::param); certified only through 10, re-seeding"
    )
    healed = {**STATUS, "divergence": None, "divergences": 2, "last_divergence": divergence}
    line = summary_line(ShadowStatus("sh1", "127.0.0.2:1", status=healed))
    assert line.endswith("divergences 2 (last after iteration 12; re-seeded)")


def test_the_line_says_how_old_the_newest_checkpoint_on_disk_is() -> None:
    status = {"state": "running", "applied_iteration": 41, "certified_iteration": 41, "lag_iterations": 0}
    disk = {"newest_complete_step": 38, "age_iterations": 3, "age_seconds": 1.25}
    line = summary_line(ShadowStatus("sh1", "127.0.0.2:1", status={**status, "disk": disk}))
    assert "  disk step 38 (3 behind, 1.25 s old)  repairs" in line
    none = {"newest_complete_step": None, "age_iterations": None, "age_seconds": None}
    empty = summary_line(ShadowStatus("sh1", "127.0.0.2:1", status={**status, "disk": none}))
    assert "  disk none  " in empty
    assert " disk " not in summary_line(ShadowStatus("sh1", "127.0.0.2:1", status=status))  # no snapshots


def test_protection_says_how_far_every_shadow_certified_or_why_the_job_is_unprotected() -> None:
    one = ShadowStatus("sh1", "127.0.0.2:1", status=STATUS)
    two = ShadowStatus(
        "sh2", "127.0.0.3:1", status={**STATUS, "certified_iteration": 38, "lag_iterations": 4}
    )
    summary = protection([one, two], 7)
    assert summary == {
        "protected": True,
        "certified_through": 38,
        "lag_iterations": 4,
        "problems": [],
        "warnings": [],
    }
    assert (
        protection_line(summary)
        == "protection: every shadow certified through iteration 38 (the slowest lags 4)"
    )
    refused = {**STATUS, "state": "waiting_for_layout", "blocked": "cannot join: Adam rejects param group 0"}
    gone = ShadowStatus("sh3", "127.0.0.4:1", error="connection refused (no shadow listening)")
    summary = protection([one, ShadowStatus("sh2", "x", status=refused), gone], 7)
    assert not summary["protected"]
    assert protection_line(summary) == (
        "protection: UNPROTECTED: sh2: waiting_for_layout (cannot join: Adam rejects param group 0); "
        "sh3: no answer (connection refused (no shadow listening))"
    )
    other = protection([ShadowStatus("sh1", "x", status={**STATUS, "job_id": 8})], 7)
    assert other["problems"] == ["sh1: serves job 8"]
    fresh = protection([ShadowStatus("sh1", "x", status={**STATUS, "certified_iteration": -1})], 7)
    assert fresh["problems"] == ["no iteration certified by every shadow yet"]
