"""A shadow whose state differs from rank 0's fingerprint withdraws certification, says so, and re-seeds."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from checkmate.control import (
    BucketLayout,
    Commit,
    Diverged,
    Goodbye,
    RestoreRefused,
    RestoreRequest,
    recv_message,
    send_message,
)
from checkmate.fingerprint import fingerprint
from shadow.node import ShadowConfig, ShadowNode
from shadow.repair import RepairPolicy
from tests.shadow.test_node import (
    GRAD,
    INITIAL,
    JOB,
    LAYOUT,
    Rank0,
    datagram,
    job_start,
    join,
    wait_for,
    worker_socket,
)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[ShadowNode]:
    torch.set_num_threads(1)
    shadow = ShadowNode(
        ShadowConfig(
            name="s0",
            control_bind=("127.0.0.53", 0),
            data_bind=("127.0.0.53", 0),
            status_file=tmp_path / "status.json",
            horizon=4,
            repair=RepairPolicy(grace=5.0),  # every copy is sent: no repairs
        )
    ).start()
    yield shadow
    shadow.close()


def _rank0_fingerprints(iterations: int, tamper_at: int) -> list[dict[str, dict[str, int]]]:
    """What rank 0 would send: its SGD state after each iteration, its gradient halved at ``tamper_at``."""
    w = INITIAL["w"].clone().requires_grad_()
    b = INITIAL["b"].clone().requires_grad_()
    optimizer = torch.optim.SGD([w, b], lr=0.1, momentum=0.9, foreach=False)
    out = []
    for iteration in range(iterations):
        scale = 0.5 if iteration == tamper_at else 1.0
        w.grad, b.grad = GRAD[:8].reshape(2, 4) * scale, GRAD[8:] * scale
        optimizer.step()
        out.append(fingerprint([("w", w), ("b", b)], optimizer.state))
    return out


def _iteration(node: ShadowNode, rank0: Rank0, iteration: int, print_: dict[str, dict[str, int]]) -> None:
    rank0.send(Commit(JOB, iteration, [0.1], optimizer_step=iteration + 1, fingerprint=print_))
    with worker_socket("127.0.0.60") as sender:
        sender.sendto(datagram(iteration, 0, GRAD[:8]), node.data_address)
        sender.sendto(datagram(iteration, 8, GRAD[8:]), node.data_address)


def test_a_mismatch_withdraws_certification_reports_it_and_the_shadow_is_reseeded(node: ShadowNode) -> None:
    rank0 = join(node)
    prints = _rank0_fingerprints(3, tamper_at=1)
    _iteration(node, rank0, 0, prints[0])
    assert wait_for(lambda: node.status()["certified_iteration"] == 0), node.status()
    assert node.status()["verified_iteration"] == 0 and node.status()["fingerprints_checked"] == 1

    _iteration(node, rank0, 1, prints[1])  # rank 0's gradient was halved behind the shadow's back
    assert wait_for(lambda: node.status()["state"] == "diverged"), node.status()
    status = node.status()
    assert status["certified_iteration"] == 0 and status["divergences"] == 1
    assert status["divergence"]["iteration"] == 1 and status["divergence"]["last_verified"] == 0
    assert status["divergence"]["mismatches"] == [
        "b::momentum_buffer",
        "b::param",
        "w::momentum_buffer",
        "w::param",
    ]
    assert wait_for(lambda: any(isinstance(m, Goodbye) and "resync" in m.reason for m in rank0.received))
    reports = [m for m in rank0.received if isinstance(m, Diverged)]
    assert len(reports) == 1 and (reports[0].iteration, reports[0].last_verified) == (1, 0)
    # its state is never handed out meanwhile
    with socket.create_connection(node.control_address, timeout=2) as asker:
        send_message(asker, RestoreRequest(JOB), timeout=2)
        answer = recv_message(asker, timeout=5)
    assert isinstance(answer, RestoreRefused) and "diverged" in answer.reason, answer

    # rank 0 re-seeds it with its own state before iteration 2: certified again from there
    rank0.close()
    rank0 = Rank0(node)
    rank0.send(job_start([("127.0.0.60", 9), ("127.0.0.61", 9)], start=2))
    rank0.send(BucketLayout(JOB, 2, LAYOUT))
    assert wait_for(lambda: node.status()["state"] == "running", timeout=60), node.status()
    status = node.status()
    assert status["divergence"] is None and status["last_divergence"]["iteration"] == 1
    assert status["certified_iteration"] == 1 and status["verified_iteration"] == 1
    rank0.close()


def test_a_shadow_that_cannot_import_the_optimizer_refuses_the_job_and_rank0_logs_why(
    node: ShadowNode, caplog: pytest.LogCaptureFixture
) -> None:
    from hosts.control_channel import ControlChannel, ControlConfig

    start = job_start([("127.0.0.60", 9)])
    start.optimizer = {**start.optimizer, "kind": "Lion", "module": "no_such_optimizers", "qualname": "Lion"}
    channel = ControlChannel(JOB, {"s0": node.control_address}, ControlConfig(reconnect_interval=0.05))
    try:
        assert channel.wait_connected(5.0) == 1
        channel.post_state(lambda: [start])
        link = channel.links[0]
        assert wait_for(lambda: link.refusal is not None), link.counters
        assert "refused: optimizer no_such_optimizers.Lion: cannot import module 'no_such_optimizers'" in str(
            link.refusal
        )
        assert any(
            r.levelname == "ERROR"
            and "shadow s0 refused: optimizer no_such_optimizers.Lion" in r.getMessage()
            for r in caplog.records
        )
        assert node.status()["job_id"] is None  # the job was not taken on
    finally:
        channel.close(1.0)
