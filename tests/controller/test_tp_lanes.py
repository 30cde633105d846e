"""``checkmate-ctl job add --tp-degree``: a TP x DP job's lanes, each its own job with its own secret.

Against the embedded switch of ``single`` (h1-h4, sh1, sh2) through ``main([...])``: the lanes
a whole TP job is split into (workers and shadows dealt by rank), what ``job show`` and
``job list`` say of them, secrets that differ per lane (issued, or derived from one file) so
that one lane's secret opens no other, a lane added on its own against the registered ones,
and every mismatch refused with its cause, leaving nothing behind.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from checkmate.auth import DatagramAuth, read_secret_file
from controller.cli import main
from controller.job_secrets import lane_secret
from tests.controller.conftest import Fabric


class Ctl:
    def __init__(self, fabric: Fabric, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        net = tmp_path / "net.json"
        net.write_text(json.dumps(fabric.network.to_json()))
        self.state_dir = fabric.state_dir
        self.base = ["--network", str(net), "--state-dir", str(fabric.state_dir), "--timeout", "2"]
        self.capsys = capsys

    def __call__(self, *argv: str, status: int = 0) -> str:
        code = main([*self.base, *argv])
        out, err = self.capsys.readouterr()
        assert code == status, (out, err)
        return out if status == 0 else err

    def secret(self, job_id: int) -> bytes:
        return read_secret_file(Path(self(*("job", "secret", str(job_id))).strip()))


@pytest.fixture
def ctl(fabric: Callable[..., Fabric], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Ctl:
    c = Ctl(fabric("single"), tmp_path, capsys)
    c("pipeline", "push")
    return c


def _secret_file(path: Path, hex_text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(hex_text + "\n")
    return path


def test_a_tp_job_is_added_as_one_lane_per_tp_index_each_with_its_own_secret(ctl: Ctl) -> None:
    out = ctl(
        "job", "add", "--job-id", "9", "--workers", "h1,h2,h3,h4", "--shadows", "sh1,sh2", "--tp-degree", "2"
    )
    assert "job 9 (lane 0 of TP=2) added: slot 1, 2 multicast group(s), 1 shadow rewrite(s)" in out
    assert "job 10 (lane 1 of TP=2) added: slot 2, 2 multicast group(s), 1 shadow rewrite(s)" in out
    lanes = [json.loads(ctl("job", "show", str(j), "--json", "--no-shadows")) for j in (9, 10)]
    assert [(d["job"]["workers"], d["job"]["shadows"]) for d in lanes] == [
        (["h1", "h3"], ["sh1"]),
        (["h2", "h4"], ["sh2"]),
    ]
    assert [(d["job"]["tp_degree"], d["job"]["tp_index"]) for d in lanes] == [(2, 0), (2, 1)]
    assert lanes[1]["lanes"] == {"tp_degree": 2, "tp_index": 1, "lane_job_ids": [9, 10], "missing_lanes": []}
    assert "lane 0 of a TP=2 job (lanes: jobs 9, 10)" in ctl("job", "show", "9", "--no-shadows")
    listing = ctl("job", "list")
    assert "lane 1 of a TP=2 job (lanes: jobs 9, 10)" in listing
    assert json.loads(ctl("job", "list", "--json"))["jobs"][0]["lanes"]["lane_job_ids"] == [9, 10]

    # each lane its own secret: lane 9's key does not open lane 10's datagrams, nor its job file
    nine, ten = ctl.secret(9), ctl.secret(10)
    assert nine != ten
    sealed = b"".join(DatagramAuth(ten, 10).seal([b"\x00" * 32, b"repair"]))
    assert DatagramAuth(ten, 10).open(memoryview(sealed)) is not None
    assert DatagramAuth(nine, 10).open(memoryview(sealed)) is None
    job_file = ctl.state_dir / "lane9.json"
    fd = os.open(job_file, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"secret": nine.hex()}, f)
    assert "differs from job 10's" in ctl("job", "secret", "10", "--check", str(job_file), status=1)


def test_one_secret_file_gives_every_lane_a_derived_secret_of_its_own(ctl: Ctl, tmp_path: Path) -> None:
    base = "ab" * 32
    source = _secret_file(tmp_path / "tp.hex", base)
    argv = [
        "--workers",
        "h1,h2,h3,h4",
        "--shadows",
        "sh1,sh2",
        "--tp-degree",
        "2",
        "--secret-file",
        str(source),
    ]
    ctl("job", "add", "--job-id", "3", *argv)
    secrets = [ctl.secret(3), ctl.secret(4)]
    assert [s.hex() for s in secrets] == [lane_secret(bytes.fromhex(base), j) for j in (3, 4)]
    assert len({*secrets, bytes.fromhex(base)}) == 3


def test_a_lane_added_on_its_own_must_match_the_registered_lanes(ctl: Ctl, tmp_path: Path) -> None:
    ctl(
        "job",
        "add",
        "--job-id",
        "20",
        "--workers",
        "h1,h3",
        "--shadows",
        "sh1",
        "--tp-degree",
        "2",
        "--tp-index",
        "0",
    )
    assert "lane(s) [1] not registered" in ctl("job", "show", "20", "--no-shadows")
    refused = {
        "another degree": (["--workers", "h2,h4", "--tp-degree", "4", "--tp-index", "1"], "is lane 0 of 2"),
        "another DP degree": (
            ["--workers", "h2,h4,h1", "--tp-degree", "2", "--tp-index", "1"],
            "has 3 workers but its lane 0 (job 20) has 2",
        ),
        "a shared worker": (
            ["--workers", "h2,h3", "--tp-degree", "2", "--tp-index", "1"],
            "share worker(s) ['h3']",
        ),
        "lane 0's secret": (
            ["--workers", "h2,h4", "--tp-degree", "2", "--tp-index", "1", "--secret-file", "{lane0}"],
            "this secret is job 20's, another lane",
        ),
    }
    lane0 = _secret_file(tmp_path / "lane0.hex", ctl.secret(20).hex())
    for what, (argv, message) in refused.items():
        argv = [a.replace("{lane0}", str(lane0)) for a in argv]
        err = ctl("job", "add", "--job-id", "21", "--shadows", "sh2", *argv, status=1)
        assert message in err, (what, err)
    assert "job 21" not in ctl("job", "list")
    ctl(
        "job",
        "add",
        "--job-id",
        "21",
        "--workers",
        "h2,h4",
        "--shadows",
        "sh2",
        "--tp-degree",
        "2",
        "--tp-index",
        "1",
    )
    assert "lanes: jobs 20, 21)" in ctl("job", "show", "21", "--no-shadows")
    # a plain job sitting where a new TP job's lane would be
    ctl("job", "add", "--job-id", "31", "--workers", "h1,h2", "--shadows", "sh1")
    err = ctl(
        "job",
        "add",
        "--job-id",
        "30",
        "--workers",
        "h3,h4",
        "--shadows",
        "sh2",
        "--tp-degree",
        "2",
        "--tp-index",
        "0",
        status=1,
    )
    assert "job 31 is registered without tensor parallelism" in err and "do not match" in err


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["--tp-degree", "0"], 2, "0: a tensor-parallel degree is at least 1"),
        (["--tp-degree", "-3"], 2, "a tensor-parallel degree is at least 1"),
        (["--tp-index", "1"], 2, "--tp-index needs --tp-degree"),
        (["--tp-degree", "2", "--tp-index", "2"], 1, "--tp-index 2 is outside 0..1"),
        (["--tp-degree", "3"], 1, "multiple of 3 with at least 2 per lane"),
        (["--tp-degree", "4"], 1, "at least 2 per lane"),
        (["--tp-degree", "2", "--shard", "0=sh2"], 1, "a shard map (--shard) cannot be dealt to lanes"),
    ],
)
def test_bad_tp_input_is_refused_with_its_cause_and_nothing_registered(
    ctl: Ctl, argv: list[str], status: int, message: str
) -> None:
    err = ctl(
        "job",
        "add",
        "--job-id",
        "5",
        "--workers",
        "h1,h2,h3,h4",
        "--shadows",
        "sh1,sh2",
        *argv,
        status=status,
    )
    assert message in err
    assert "no jobs registered" in ctl("job", "list")


def test_a_lane_that_cannot_be_installed_takes_the_lanes_before_it_back_out(ctl: Ctl) -> None:
    err = ctl(
        "job",
        "add",
        "--job-id",
        "5",
        "--workers",
        "h1,h2,h3,h9",
        "--shadows",
        "sh1,sh2",
        "--tp-degree",
        "2",
        status=1,
    )
    assert "unknown host(s) ['h9']" in err and "lanes [5] added before it were removed again" in err
    assert "no jobs registered" in ctl("job", "list")
    assert not (ctl.state_dir / "secrets" / "job-5.secret").exists()


def test_each_rank_finds_its_own_lanes_secret_through_tp_index_in_the_job_file(tmp_path: Path) -> None:
    from checkmate.auth import secret_from_env

    lanes = [lane_secret(b"\x11" * 32, job_id) for job_id in (1, 2)]
    for t, secret in enumerate(lanes):
        path = tmp_path / f"job-file-tp{t}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"secret": secret}, f)
    template = str(tmp_path / "job-file-tp{tp_index}.json")
    for rank in range(4):  # rank = dp_index * 2 + tp_index
        env = {"RANK": str(rank), "CHECKMATE_TP_DEGREE": "2", "CHECKMATE_JOB_FILE": template}
        assert secret_from_env(env).hex() == lanes[rank % 2]
