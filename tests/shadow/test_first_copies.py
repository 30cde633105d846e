"""The first iteration's copies that reach a shadow before rank 0's job_start are kept, not repaired.

Rank 0 connects, then sends the job's whole state with its job_start: for a large model that
takes seconds, and the workers' copies of the first iteration arrive meanwhile. They belong
to the run whose control connection is open, so the shadow places them once the layout
comes. Copies stashed before that connection existed (a run the shadow never knew) are stale.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from checkmate.control import BucketLayout, Commit
from shadow.node import ShadowNode
from shadow.repair import RepairPolicy
from tests.shadow.test_node import (
    GRAD,
    JOB,
    LAYOUT,
    Rank0,
    _started_node,
    datagram,
    job_start,
    reference,
    wait_for,
    worker_socket,
)

WORKERS = [("127.0.0.60", 9), ("127.0.0.61", 9)]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[ShadowNode]:
    # a long grace: a copy dropped at the job_start would be repaired only after it, and the
    # test asserts that no repair is asked at all
    shadow = _started_node(tmp_path, RepairPolicy(grace=30.0, timeout=0.05, max_attempts=6))
    yield shadow
    shadow.close()


def _send_iteration(iteration: int, node: ShadowNode) -> None:
    sender = worker_socket()
    sender.sendto(datagram(iteration, 0, GRAD[:8]), node.data_address)
    sender.sendto(datagram(iteration, 8, GRAD[8:]), node.data_address)
    sender.close()


def test_copies_arriving_while_the_job_start_is_on_its_way_are_placed_not_repaired(node: ShadowNode) -> None:
    rank0 = Rank0(node)  # connected: the job's state is on its way
    time.sleep(0.05)
    _send_iteration(0, node)
    assert wait_for(lambda: node.status()["stash"]["datagrams"] == 2), node.status()
    rank0.send(job_start(WORKERS))
    rank0.send(BucketLayout(JOB, 0, LAYOUT))
    assert wait_for(lambda: node.status()["state"] == "running", timeout=60), node.status()
    rank0.send(Commit(JOB, 0, [0.1]))
    assert node.wait_applied(0, 5), node.status()
    want = reference(1)
    assert all(torch.equal(node.parameters()[n], want[n]) for n in want)
    status = node.status()
    assert status["packets_placed"] == 2, status
    assert status["drops"].get("stale_iteration", 0) == 0, status
    assert status["repairs"]["requests"] == 0, status
    rank0.close()


def test_copies_stashed_before_the_control_connection_are_stale(node: ShadowNode) -> None:
    _send_iteration(0, node)  # no run has connected: left over from a run this shadow never knew
    assert wait_for(lambda: node.status()["stash"]["datagrams"] == 2), node.status()
    time.sleep(0.05)
    rank0 = Rank0(node)
    rank0.send(job_start(WORKERS))
    rank0.send(BucketLayout(JOB, 0, LAYOUT))
    assert wait_for(lambda: node.status()["state"] == "running", timeout=60), node.status()
    status = node.status()
    assert status["drops"].get("stale_iteration", 0) == 2, status
    assert status["stash"]["datagrams"] == 0 and status["packets_placed"] == 0, status
    rank0.close()
