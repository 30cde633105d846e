"""Bad input: a Stateful object whose state cannot travel is refused when it happens, naming it.

At enable (every rank raises CheckmateConfigError), or later at the optimizer step
of the iteration where it goes bad (rank 0 raises JobStateError; the commit is not
sent): the shadows keep the last certified state, and a restore returns it.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest

from checkmate.checkpoint.shadow_memory import fetch_state
from tests.gallery.test_gallery import Job, _shadows


def _run(mode: str) -> tuple[Path, list]:
    tmp = Path(tempfile.mkdtemp(prefix=f"bad-state-{mode}-"))
    nodes = _shadows(tmp)
    job = Job("bad_stateful.py", ["--iterations", "6", "--out", str(tmp / "out"), "--option", mode], nodes)
    return tmp, nodes, job  # type: ignore[return-value]


def test_a_param_group_value_that_cannot_travel_is_refused_at_enable_naming_group_and_key() -> None:
    tmp, nodes, job = _run("group")
    try:
        assert job.wait(60) == [0, 0]
        for rank in range(2):
            message = (tmp / "out" / f"rank{rank}.err").read_text()
            assert message.startswith("CheckmateConfigError: optimizer param group 0['frozen_layers']"), (
                message
            )
            assert "builtins.set, which cannot be stored" in message
    finally:
        job.kill()
        for n in nodes:
            n.close()


def test_a_stateful_object_that_cannot_travel_is_refused_at_enable() -> None:
    tmp, nodes, job = _run("enable")
    try:
        assert job.wait(60) == [0, 0]
        for rank in range(2):
            message = (tmp / "out" / f"rank{rank}.err").read_text()
            assert message.startswith("CheckmateConfigError: stateful object 'loader': state_dict()['rng']")
            assert "Generator, which cannot be stored" in message
    finally:
        job.kill()
        for n in nodes:
            n.close()


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("unserializable", "stateful object 'loader': state_dict()['rng'] is a torch._C.Generator"),
        ("too-large", "bytes a commit record may carry; the largest stateful object is 'loader'"),
    ],
)
def test_a_stateful_object_going_bad_mid_run_is_named_and_the_certified_state_stays(
    mode: str, expected: str
) -> None:
    tmp, nodes, job = _run(mode)
    try:
        error = tmp / "out" / "rank0.err"
        deadline = time.monotonic() + 60
        while not error.is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert error.is_file(), "rank 0 did not report the bad state"
        message = error.read_text()
        assert message.startswith("JobStateError: ") and expected in message, message
        # the sampler goes bad in iteration 2: iteration 1 (its commit left at 2's forward pass) is
        # the last certified one, and nothing after it arrives
        for n in nodes:
            assert n.wait_applied(1, 30), n.status()
        time.sleep(0.5)
        job.kill()  # rank 1 waits for rank 0 in iteration 3's all-reduce
        for n in nodes:
            status = n.status()
            assert status["applied_iteration"] == 1 and status["certified_iteration"] == 1, status
        state = fetch_state([n.control_address for n in nodes], timeout=10)
        assert state["iteration"] == 1
        assert state["job_state"].stateful == {"loader": {"position": 2}}  # after iteration 1
    finally:
        job.kill()
        for n in nodes:
            n.close()
