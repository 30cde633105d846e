"""Two jobs train side by side through one emulated switch and share their shadow hosts.

``single`` comes up on the embedded target (taken down again even on failure). Job 31
(workers h1, h2) and job 32 (workers h3, h4) are registered with ``checkmate-ctl``; both
use shadow hosts sh1 and sh2, job 31 on UDP port 48879 and job 32 on port 50000 (one
shadow process per job on a host, docs/controller.md "Many jobs"). A receiver per job
and shadow host (``examples.capture``) records what reaches that job's port. Both jobs
run ``examples/train_ddp.py`` at the same time. Then, for each job, the
checks of tests/topologies/test_ddp_over_switch.py: its shadows received every reduced
element of its own buckets exactly once with the reduced bytes, and **no copy of the
other job** (the capture keys copies by job id), and the job's switch counters equal what
its shadows received. Finally job 31 is removed: job 32's groups, rids and counters stay
exactly as they were.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from checkmate.job import JobSpec
from checkmate.network import Network
from checkmate.wire import CHECKMATE_UDP_PORT
from tests.topologies.harness import RunningNetwork, root_interfaces, topology_copy
from tests.topologies.test_ddp_over_switch import (
    PYTHON,
    SCRIPT,
    SHADOWS,
    TRAIN_TIMEOUT_S,
    Run,
    _start,
    _stop,
    _train,
    _wait_files,
    check_coverage,
)

pytestmark = [pytest.mark.root, pytest.mark.slow]

JOBS = (
    JobSpec(31, ("h1", "h2"), SHADOWS),
    JobSpec(32, ("h3", "h4"), SHADOWS, shadow_port=50000),
)
STEPS = 8


def test_two_jobs_share_shadow_hosts_in_the_emulated_network(tmp_path: Path) -> None:
    network_file = topology_copy("single", tmp_path)
    network = Network.load(network_file)
    net = RunningNetwork(
        name="single",
        target="embedded",
        network_file=network_file,
        run_dir=tmp_path / "run",
        state_dir=tmp_path / "ctl",
        network=network,
        interfaces_before=root_interfaces(),
    )
    captures: list[subprocess.Popen[bytes]] = []
    runs: dict[int, Run] = {}
    try:
        result = net.up()
        assert result.returncode == 0, f"up failed:\n{result.stdout}\n{result.stderr}"
        for spec in JOBS:
            folder = tmp_path / f"job{spec.job_id}"
            folder.mkdir()
            (folder / "job.json").write_text(json.dumps(spec.to_json()))
            net.ctl("job", "add", "--spec", str(folder / "job.json"))
            (folder / "job-file.json").write_text(
                json.dumps(
                    {
                        "job": spec.to_json(),
                        "worker_addresses": [
                            f"{network.host(w).address}:{CHECKMATE_UDP_PORT}" for w in spec.workers
                        ],
                        "shadow_control": {},
                    }
                )
            )
            for shadow in SHADOWS:
                argv = [PYTHON, "-m", "examples.capture", "--port", str(spec.shadow_port)]
                argv += ["--out", str(folder / f"{shadow}.json"), "--ready", str(folder / f"{shadow}.ready")]
                argv += ["--max-seconds", str(TRAIN_TIMEOUT_S * 2)]
                captures.append(_start(net, shadow, argv, folder / f"capture-{shadow}.log"))
        _wait_files([tmp_path / f"job{s.job_id}" / f"{sh}.ready" for s in JOBS for sh in SHADOWS])

        # both jobs at once
        outcomes: dict[int, Any] = {}

        def train(spec: JobSpec) -> None:
            folder = tmp_path / f"job{spec.job_id}"
            argv = [PYTHON, "-m", "examples.ddp_probe", "--out", str(folder / "probe"), str(SCRIPT)]
            argv += ["--steps", str(STEPS), "--save", str(folder / "checkmate.pt")]
            try:
                outcomes[spec.job_id] = _train(net, folder, spec.workers, argv, f"job{spec.job_id}")
            except BaseException as exc:  # noqa: BLE001 - reported below, in the test's thread
                outcomes[spec.job_id] = exc

        threads = [threading.Thread(target=train, args=(spec,)) for spec in JOBS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TRAIN_TIMEOUT_S * 2)
        for spec in JOBS:
            outcome = outcomes.get(spec.job_id)
            assert outcome is not None and not isinstance(outcome, BaseException), (spec.job_id, outcome)
        time.sleep(0.5)  # copies still queued in the switch or a socket
        for process in captures:
            _stop(process, signal.SIGTERM)
        shown = {
            s.job_id: json.loads(net.ctl("job", "show", str(s.job_id), "--json", "--no-shadows").stdout)
            for s in JOBS
        }
        for spec in JOBS:
            folder = tmp_path / f"job{spec.job_id}"
            outputs, seconds = outcomes[spec.job_id]
            runs[spec.job_id] = Run(
                spec=spec,
                probes=[json.loads((folder / "probe" / f"rank{r}.json").read_text()) for r in range(2)],
                captures={s: json.loads((folder / f"{s}.json").read_text()) for s in SHADOWS},
                shown=shown[spec.job_id],
                outputs=outputs,
                train_seconds=seconds,
            )

        # removing job 31 leaves job 32 exactly as it was (entries, ids, counters)
        listing = json.loads(net.ctl("job", "list", "--json").stdout)
        assert [j["job"]["job_id"] for j in listing["jobs"]] == [31, 32]
        net.ctl("job", "remove", "31")
        after = json.loads(net.ctl("job", "show", "32", "--json", "--no-shadows").stdout)
        assert after == shown[32]
        assert "in sync" in net.ctl("reconcile").stdout
        result = net.down()
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        for process in captures:
            _stop(process)
        net.finalize()

    figures = {}
    for job_id, run in runs.items():
        figures[job_id] = check_coverage(run, lossless=True)  # includes: no copy of another job
    # the two jobs' copies really did cross the same switch to the same hosts at the same time
    assert all(f["shadow_copies"] > 0 for f in figures.values())
    print(f"\ntwo jobs side by side: {json.dumps(figures)}")
