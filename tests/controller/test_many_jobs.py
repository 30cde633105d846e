"""Jobs side by side (one switch, leaf-spine) with shared shadow hosts; job list/show; remove --forget.

Shared shadow hosts: one shadow *process per job* on a host, each on the job's own UDP
port (``JobSpec.shadow_port``). The switch must copy each job's tagged packets only from
that job's worker ports, to that job's shadow port, and removing one job must leave the
other's entries and counters as they were.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from scapy.layers.inet import UDP

from checkmate.job import JobSpec
from checkmate.scapy_layer import Checkmate
from controller.cli import main
from controller.job_secrets import JobSecrets
from controller.jobs import plan_entities
from controller.registry import Registry
from tests.controller.conftest import Fabric, gradient


def _copies(delivered: dict[str, list[object]], shadow: str) -> list[tuple[int, int]]:
    """(job id, UDP destination port) of every copy ``shadow`` received."""
    return [(int(p[Checkmate].job_id), int(p[UDP].dport)) for p in delivered.get(shadow, [])]  # type: ignore[index]


@pytest.mark.parametrize(
    "topology,workers_a,workers_b",
    [("single", ("h1", "h2"), ("h3", "h4")), ("leafspine", ("h1", "h3"), ("h2", "h4"))],
)
def test_two_jobs_share_shadow_hosts_and_stay_isolated(
    fabric: Callable[..., Fabric], topology: str, workers_a: tuple[str, str], workers_b: tuple[str, str]
) -> None:
    f = fabric(topology)
    job_a = JobSpec(7, workers_a, ("sh1", "sh2"))
    job_b = JobSpec(8, workers_b, ("sh1", "sh2"), shadow_port=50000)
    ctl = f.controller()
    ctl.install_forwarding()
    ctl.add_job(job_a)
    ctl.add_job(job_b)
    a0, a1 = workers_a
    b0, b1 = workers_b
    # each job's copy reaches its own shadow process on the shared host, exactly once
    delivered = f.send(a0, gradient(a0, a1, f.network, job_id=7, shard_key=1))
    assert sorted(delivered) == [a1, "sh2"] and _copies(delivered, "sh2") == [(7, 48879)]
    delivered = f.send(b0, gradient(b0, b1, f.network, job_id=8, shard_key=0))
    assert sorted(delivered) == [b1, "sh1"] and _copies(delivered, "sh1") == [(8, 50000)]
    # a packet claiming job B from job A's worker ports, and job A from B's: forwarded, never copied
    for src, dst, job in ((a0, a1, 8), (a1, a0, 8), (b0, b1, 7)):
        delivered = f.send(src, gradient(src, dst, f.network, job_id=job, shard_key=0))
        assert sorted(delivered) == [dst], (src, job, delivered)
    status_b = ctl.job_status(8)
    assert status_b.total("shadow_copies").packets == 1
    assert (
        status_b.total("rejected_replications").packets >= 2
    )  # the forged job-8 packets (per switch crossed)
    switches = sorted(f.network.switches)
    before = {s: ctl.read_installed(s) for s in switches}
    planned_a = plan_entities(f.network, ctl.job(7))
    planned_b = plan_entities(f.network, ctl.job(8))
    ctl.remove_job(7)
    for switch in switches:
        after = ctl.read_installed(switch)
        assert not set(planned_a[switch]) & set(planned_b[switch])
        # job A's entries are all gone, job B's exactly as they were, nothing else changed
        assert set(before[switch]) - set(after) == set(planned_a[switch]), switch
        assert set(planned_b[switch]) <= set(after), switch
        assert all(after[key] == before[switch][key] for key in after), switch
    assert ctl.job_status(8).total("shadow_copies").packets == 1  # counters untouched
    delivered = f.send(b0, gradient(b0, b1, f.network, job_id=8, shard_key=1))
    assert _copies(delivered, "sh2") == [(8, 50000)]
    delivered = f.send(a0, gradient(a0, a1, f.network, job_id=7, shard_key=1))
    assert sorted(delivered) == [a1]


def _ctl(base: list[str], capsys: pytest.CaptureFixture[str], *argv: str, status: int = 0) -> str:
    code = main([*base, *argv])
    out, err = capsys.readouterr()
    assert code == status, err
    return out if status == 0 else err


def test_list_and_show_many_jobs(
    fabric: Callable[..., Fabric], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = fabric("single")
    net = tmp_path / "net.json"
    net.write_text(json.dumps(f.network.to_json()))
    base = ["--network", str(net), "--state-dir", str(f.state_dir), "--timeout", "2"]
    _ctl(base, capsys, "forwarding", "install")
    jobs = {7: ("h1,h2", "sh1"), 8: ("h3,h4", "sh1"), 9: ("h2,h4", "sh2")}
    for job_id, (workers, shadows) in jobs.items():
        extra = ["--shadow-port", str(50000 + job_id)]
        _ctl(
            base,
            capsys,
            "job",
            "add",
            "--job-id",
            str(job_id),
            "--workers",
            workers,
            "--shadows",
            shadows,
            *extra,
        )
    listing = _ctl(base, capsys, "job", "list")
    assert all(f"job {j}  slot {i + 1}  workers {w}" in listing for i, (j, (w, _)) in enumerate(jobs.items()))
    assert "3 job(s) registered: 6 multicast group(s), 3 shadow rewrite(s)" in listing
    document = json.loads(_ctl(base, capsys, "job", "list", "--json"))
    assert [j["job"]["job_id"] for j in document["jobs"]] == [7, 8, 9]
    assert document["jobs"][2]["per_switch"] == {"s1": {"multicast_groups": 2, "rids": 1}}
    shown = _ctl(base, capsys, "job", "show", "--no-shadows")
    assert all(f"job {j}  slot" in shown for j in jobs)
    both = json.loads(_ctl(base, capsys, "job", "show", "7", "9", "--json", "--no-shadows"))
    assert [j["job"]["job_id"] for j in both["jobs"]] == [7, 9]
    one = json.loads(_ctl(base, capsys, "job", "show", "8", "--json", "--no-shadows"))
    assert one["job"]["job_id"] == 8 and one["slot"] == 2  # one id: the document itself, as before
    assert "job 5 is not registered" in _ctl(base, capsys, "job", "show", "5", "--no-shadows", status=1)


def test_forget_works_without_switches_and_nothing_installs_it_again(
    fabric: Callable[..., Fabric], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = fabric("single")
    live = tmp_path / "net.json"
    live.write_text(json.dumps(f.network.to_json()))
    gone = json.loads(live.read_text())
    gone["switches"]["s1"]["grpc"] = "127.0.0.1:9"  # nothing listens: the switch is gone
    dead = tmp_path / "gone.json"
    dead.write_text(json.dumps(gone))
    state = ["--state-dir", str(f.state_dir), "--timeout", "0.5"]
    _ctl(["--network", str(live), *state], capsys, "forwarding", "install")
    _ctl(
        ["--network", str(live), *state],
        capsys,
        "job",
        "add",
        "--job-id",
        "7",
        "--workers",
        "h1,h2",
        "--shadows",
        "sh1",
    )
    _ctl(
        ["--network", str(live), *state],
        capsys,
        "job",
        "add",
        "--job-id",
        "8",
        "--workers",
        "h3,h4",
        "--shadows",
        "sh2",
    )
    secrets = JobSecrets(f.state_dir)
    assert secrets.path(7).exists()
    with_both = f.full_read("s1")
    # today's remove needs the switches
    err = _ctl(["--network", str(dead), *state], capsys, "job", "remove", "7", status=1)
    assert "unreachable" in err
    # --forget needs neither the switch nor the network file
    out = _ctl(state, capsys, "job", "remove", "7", "--forget")
    assert "job 7 forgotten: removed from the registry only" in out
    with Registry(f.state_dir) as registry:
        assert registry.job_ids() == [8]
    assert not secrets.path(7).exists() and secrets.path(8).exists()
    assert "job 7 is not registered" in _ctl(state, capsys, "job", "remove", "7", "--forget", status=1)
    assert f.full_read("s1") == with_both  # no switch was touched
    # the next reconcile (what checkmate-net up runs) deletes job 7's leftovers and installs it nowhere
    out = _ctl(["--network", str(live), *state], capsys, "reconcile")
    assert f.full_read("s1") != with_both
    delivered = f.send("h1", gradient("h1", "h2", f.network, job_id=7, shard_key=0))
    assert sorted(delivered) == ["h2"], "job 7 still replicated after forget + reconcile"
    delivered = f.send("h3", gradient("h3", "h4", f.network, job_id=8, shard_key=0))
    assert sorted(delivered) == ["h4", "sh2"]
    out = _ctl(["--network", str(live), *state], capsys, "reconcile")
    assert "in sync" in out
