"""An FSDP2 job on the ``checkmate`` backend through the emulated switch: the shadows' ports get exactly
the fully reduced shards, once each (issue 32, item 2).

The ``single`` topology on the embedded switch, a job registered with ``checkmate-ctl job add``
(shadows sh1, sh2, where ``examples.capture`` records what reaches each shadow's port), and two
workers running :mod:`tests.topologies.fsdp_switch_worker` (three FSDP modules, AdamW, gradient
clipping) with ``CHECKMATE_BACKEND_BIND`` on the job's data port. Then, for every iteration and
every FSDP module's reduce-scatter (bucket):

* the workers tagged every element exactly once, and the tags of rank r lie in rank r + 1's shard
  (the hop that brings the owner its fully reduced shard);
* the shadow owning the bucket's shard key received every element, in element order exactly the
  reduced bytes (SHA-256), and no element twice; the other shadow nothing of it, nothing else
  arrived (none of the flows' all-gathers, broadcasts or norm all-reduces), and every copy left
  the switch with REPLICATE cleared;
* the switch's ``shadow_copies`` counter equals the datagrams the shadows received and the tags
  sent, and it refused no replication; both ranks end with the same parameters.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from checkmate.job import JobSpec
from checkmate.network import Network
from checkmate.wire import CHECKMATE_UDP_PORT
from tests.topologies.harness import RunningNetwork, root_interfaces, topology_copy
from tests.topologies.test_ddp_over_switch import (
    MASTER_PORT,
    PYTHON,
    SHADOWS,
    _start,
    _stop,
    _switch_drops,
    _wait_files,
)

pytestmark = [pytest.mark.root, pytest.mark.slow]  # 103 s: the network comes up and down

WORKERS = ("h1", "h2")
JOB_ID = 52
STEPS = 3
TIMEOUT_S = 120.0


def _worker_env(net: RunningNetwork, rank: int, job_file: Path) -> list[str]:
    address = net.network.host(WORKERS[rank]).address
    values = {
        "RANK": rank,
        "WORLD_SIZE": len(WORKERS),
        "MASTER_ADDR": net.network.host(WORKERS[0]).address,
        "MASTER_PORT": MASTER_PORT,
        "OMP_NUM_THREADS": 1,
        "CHECKMATE_JOB_FILE": job_file,
        "CHECKMATE_BACKEND_BIND": f"{address}:{CHECKMATE_UDP_PORT}",  # the port the switch parses
        "CHECKMATE_TIMEOUT": 30,
    }
    return ["env", *[f"{key}={value}" for key, value in values.items()]]


def _run(folder: Path) -> tuple[JobSpec, list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    network_file = topology_copy("single", folder)
    network = Network.load(network_file)
    net = RunningNetwork(
        name="single",
        target="embedded",
        network_file=network_file,
        run_dir=folder / "run",
        state_dir=folder / "ctl",
        network=network,
        interfaces_before=root_interfaces(),
    )
    captures: dict[str, Any] = {}
    try:
        result = net.up()
        assert result.returncode == 0, f"up failed:\n{result.stdout}\n{result.stderr}"
        spec = JobSpec(JOB_ID, WORKERS, SHADOWS)
        (folder / "job.json").write_text(json.dumps(spec.to_json()))
        net.ctl("job", "add", "--spec", str(folder / "job.json"))
        job_file = folder / "job-file.json"
        job_file.write_text(
            json.dumps(
                {
                    "job": spec.to_json(),
                    "worker_addresses": [f"{network.host(w).address}:{CHECKMATE_UDP_PORT}" for w in WORKERS],
                    "shadow_control": {},  # capture only: no shadow node to wait for
                }
            )
        )
        for shadow in SHADOWS:
            argv = [PYTHON, "-m", "examples.capture", "--port", str(spec.shadow_port)]
            argv += ["--out", str(folder / f"{shadow}.json"), "--ready", str(folder / f"{shadow}.ready")]
            argv += ["--max-seconds", str(TIMEOUT_S * 2)]
            captures[shadow] = _start(net, shadow, argv, folder / f"capture-{shadow}.log")
        _wait_files([folder / f"{s}.ready" for s in SHADOWS])
        argv = [
            PYTHON,
            "-m",
            "tests.topologies.fsdp_switch_worker",
            "--steps",
            str(STEPS),
            "--out",
            str(folder),
        ]
        logs = {w: folder / f"worker-{w}.log" for w in WORKERS}
        workers = {
            w: _start(net, w, [*_worker_env(net, r, job_file), *argv], logs[w]) for r, w in enumerate(WORKERS)
        }
        deadline = time.monotonic() + TIMEOUT_S
        for worker, process in workers.items():
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert process.returncode == 0, logs[worker].read_text(errors="replace")[-4000:]
        time.sleep(0.5)  # copies still queued in the switch or a socket
        for process in captures.values():
            _stop(process, signal.SIGTERM)
        shown = json.loads(net.ctl("job", "show", str(JOB_ID), "--json").stdout)
        result = net.down()
        assert result.returncode == 0, result.stdout + result.stderr
        assert net.state is not None
        drops = _switch_drops(Path(net.state.switches["s1"].log_file))
    finally:
        for process in captures.values():
            _stop(process)
        net.finalize()
    reports = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(len(WORKERS))]
    got = {s: json.loads((folder / f"{s}.json").read_text()) for s in SHADOWS}
    return spec, reports, got, {"shown": shown, "drops": drops}


def test_fsdp2_shadow_ports_receive_exactly_the_fully_reduced_shards_once(tmp_path: Path) -> None:
    spec, reports, captures, switch = _run(tmp_path)
    world = len(WORKERS)
    numels = reports[0]["bucket_numels"]
    assert reports[1]["params_sha256"] == reports[0]["params_sha256"], "ranks ended with different parameters"
    assert reports[1]["reduced_sha256"] == reports[0]["reduced_sha256"]
    tagged: dict[str, list[tuple[int, int]]] = {}
    for rank, report in enumerate(reports):
        owner = (rank + 1) % world
        for iteration, bucket, offset, count, shard in report["tags"]:
            per_rank = numels[bucket] // world
            assert owner * per_rank <= offset and offset + count <= (owner + 1) * per_rank
            assert shard == spec.shard_key_for_bucket(bucket)
            tagged.setdefault(f"{iteration}/{bucket}", []).append((offset, count))
    expected: dict[str, set[str]] = {s: set() for s in SHADOWS}
    for iteration in range(STEPS):
        for bucket, n in enumerate(numels):
            key = f"{iteration}/{bucket}"
            cursor = 0
            for offset, count in sorted(tagged.pop(key)):
                assert offset == cursor, f"{key}: tags leave a gap or overlap at {cursor}"
                cursor += count
            assert cursor == n
            expected[spec.shadow_for_bucket(bucket)].add(key)
    assert not tagged and all(expected.values()), (tagged, expected)
    for shadow, capture in captures.items():
        assert capture["malformed"] == 0 and set(capture["by_type"]) <= {"DATA"}, capture["by_type"]
        assert capture["replicate_set"] == 0, "a copy left the switch with REPLICATE still set"
        assert set(capture["jobs"]) == {str(JOB_ID)}, f"{shadow} got copies of other jobs (the flows?)"
        got = capture["jobs"][str(JOB_ID)]
        assert set(got) == expected[shadow], (shadow, sorted(got), sorted(expected[shadow]))
        for key, coverage in got.items():
            n = numels[int(key.split("/")[1])]
            assert coverage["ranges"] == [[0, n]] and coverage["distinct"] == n, (
                shadow,
                key,
                coverage["ranges"],
            )
            assert coverage["duplicates"] == 0 and coverage["conflicting"] == 0, (shadow, key)
            assert coverage["sha256"] == reports[0]["reduced_sha256"][key], (
                f"{shadow} {key}: not the reduced bytes"
            )
    counters = switch["shown"]["counters"]["s1"]
    copies = sum(c["datagrams"] for c in captures.values())
    assert counters["shadow_copies"]["packets"] == copies == sum(len(r["tags"]) for r in reports)
    assert counters["rejected_replications"]["packets"] == 0
