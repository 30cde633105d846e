"""Failures of the emulated network: nothing is left behind after any of them.

* a step of ``up`` fails after everything was created -> ``up`` exits non-zero
  and has taken the half-built network down;
* the supervisor is killed (SIGKILL) while processes run inside the hosts ->
  ``down`` finds and removes everything from the run's record;
* ``up`` while a network is up in the same run directory -> a clear error and
  the running network untouched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from checkmate.network import Network
from tests.topologies.harness import NET, RunningNetwork, root_interfaces, topology_copy
from topologies.runstate import LAST_STATE_FILE, RunState

pytestmark = pytest.mark.root


def _network(tmp_path: Path, edit: dict[str, list[str]] | None = None) -> RunningNetwork:
    path = topology_copy("single", tmp_path)
    if edit:
        data = json.loads(path.read_text())
        for host, commands in edit.items():
            data["hosts"][host]["commands"] = commands
        path.write_text(json.dumps(data))
    return RunningNetwork(
        name="single",
        target="embedded",
        network_file=path,
        run_dir=tmp_path / "run",
        state_dir=tmp_path / "ctl",
        network=Network.load(path),
        interfaces_before=root_interfaces(),
    )


def test_a_failed_up_takes_the_half_built_network_down(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    net = _network(tmp_path, {"sh2": ["echo configured > /dev/null", "exit 3"]})
    request.addfinalizer(net.finalize)
    result = net.up()
    assert result.returncode == 1, result.stdout
    assert "bring-up failed" in result.stderr and "host sh2: command 'exit 3' failed" in result.stderr
    assert net.state is None, "a failed up removes its record once everything is gone"
    net.state = RunState.load(net.run_dir, LAST_STATE_FILE)
    assert net.state.status == "failed" and set(net.state.hosts) == set(net.network.hosts)
    assert net.leftovers() == []


def test_down_cleans_up_after_a_killed_supervisor(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    net = _network(tmp_path)
    request.addfinalizer(net.finalize)
    assert net.up().returncode == 0
    assert net.state is not None
    # A process started inside a host keeps its namespace (and so its veth pair) alive on its own.
    sleeper = net.popen("h1", ["sleep", "300"], start_new_session=True)
    time.sleep(0.3)
    os.kill(net.state.supervisor_pid, signal.SIGKILL)
    time.sleep(0.3)
    assert net.leftovers(), "killing the supervisor alone leaves things behind"
    result = net.down()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "killed" in result.stdout
    assert net.leftovers() == []
    sleeper.wait(timeout=10)


def test_up_twice_in_one_run_dir_is_refused(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    net = _network(tmp_path)
    request.addfinalizer(net.finalize)
    assert net.up().returncode == 0
    first = net.state
    again = subprocess.run(
        [*NET, "up", str(net.network_file), "--run-dir", str(net.run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert again.returncode == 1 and "is already up" in again.stderr, again.stderr
    assert first is not None
    net.exec("h1", ["ping", "-c1", "-W5", "10.0.1.2"])
    assert net.down().returncode == 0
    assert net.leftovers() == []
