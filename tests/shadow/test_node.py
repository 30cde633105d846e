"""ShadowNode against a hand-driven rank 0 and fake workers: bad input, missing commits, repairs, layouts."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from checkmate import wire
from checkmate.auth import DatagramAuth, secret_from_env
from checkmate.checkpoint.shadow_memory import fetch_shard
from checkmate.control import (
    BucketLayout,
    BucketSpec,
    Certified,
    Commit,
    Diverged,
    Goodbye,
    JobStart,
    Message,
    ParamSlice,
    ParamSpec,
    recv_message,
    send_message,
)
from checkmate.fingerprint import fingerprint
from checkmate.tensors import tensor_payload
from checkmate.wire import CheckmateHeader, DType, Flags, MessageType
from shadow import cli
from shadow.node import ShadowConfig, ShadowNode
from shadow.repair import RepairPolicy

JOB = 5
SHAPES = {"w": (2, 4), "b": (4,), "other": (6,)}
INITIAL = {
    n: torch.arange(torch.Size(s).numel(), dtype=torch.float32).reshape(s) / 10 for n, s in SHAPES.items()
}
LAYOUT = [
    BucketSpec(0, "float32", 12, 0, (ParamSlice("w", 0, 8), ParamSlice("b", 8, 4))),
    BucketSpec(1, "float32", 6, 1, (ParamSlice("other", 0, 6),)),
]
GRAD = torch.linspace(-1, 1, 12)


def job_start(workers: list[tuple[str, int]], start: int = 0) -> JobStart:
    return JobStart(
        job_id=JOB,
        world_size=2,
        workers=workers,
        parameters=[ParamSpec(n, s, "float32") for n, s in SHAPES.items()],
        optimizer={"kind": "SGD", "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": list(SHAPES)}]},
        start_iteration=start,
        tensors={f"param/{n}": t for n, t in INITIAL.items()},
        job={"job_id": JOB, "workers": ["a", "b"], "shadows": ["s0", "s1"]},
    )


def datagram(iteration: int, offset: int, values: torch.Tensor, **overrides: object) -> bytes:
    fields: dict[str, object] = dict(
        msg_type=MessageType.DATA,
        job_id=JOB,
        iteration=iteration,
        bucket_id=0,
        sender_rank=0,
        element_offset=offset,
        element_count=values.numel(),
        sequence=1,
        dtype=DType.FP32,
        shard_key=0,
    )
    fields.update(overrides)
    header = CheckmateHeader(**fields)  # type: ignore[arg-type]
    return bytes(header.pack()) + bytes(tensor_payload(values))


class Rank0:
    """The control channel's sending end, by hand."""

    def __init__(self, node: ShadowNode) -> None:
        self.sock = socket.create_connection(node.control_address, timeout=2)
        self.received: list[Message] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def send(self, message: Message) -> None:
        send_message(self.sock, message, timeout=2)

    def _read(self) -> None:
        while True:
            try:
                self.received.append(recv_message(self.sock, timeout=30))
            except TimeoutError:
                continue  # send() sets the shared socket's timeout to 2 s: quiet is not the end
            except (OSError, ValueError):
                return

    def close(self) -> None:
        self.sock.close()


AUTH = DatagramAuth(secret_from_env(), JOB)


def sealed(datagram_bytes: bytes) -> bytes:
    """A repair answer or NACK with the job's MAC (checkmate.auth)."""
    return datagram_bytes + AUTH.tag([datagram_bytes])


class FakeWorker:
    """Answers REPAIR_REQUESTs for bucket 0 with GRAD (or NACKs everything)."""

    def __init__(self, host: str, nack: bool, gate: threading.Event | None = None) -> None:
        self.gate = gate
        """When given, each answer waits until it is set (a test orders copies before repairs)."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.sock.settimeout(0.1)
        self.address = self.sock.getsockname()
        self.nack = nack
        self.requests: list[list[tuple[int, int]]] = []
        self.unauthenticated = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, addr = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            opened = AUTH.open(memoryview(data))  # a shadow's repair request carries the job's MAC
            if opened is None:
                self.unauthenticated += 1
                continue
            header = wire.decode(opened)[0]
            extra = bytes(opened[wire.HEADER_BYTES :])
            ranges = [(header.element_offset, header.element_count)]
            ranges += [struct.unpack_from("!II", extra, i) for i in range(0, len(extra), 8)]
            self.requests.append(ranges)
            if self.gate is not None:
                self.gate.wait(10.0)
            if self.nack:
                reply = CheckmateHeader(
                    MessageType.NACK,
                    JOB,
                    header.iteration,
                    header.bucket_id,
                    0,
                    header.element_offset,
                    header.element_count,
                    header.sequence,
                    DType.NONE,
                )
                self.sock.sendto(sealed(reply.pack()), addr)
                continue
            for i, (offset, count) in enumerate(ranges):
                last = Flags.LAST if i == len(ranges) - 1 else Flags.NONE
                values = GRAD[offset : offset + count].contiguous()
                self.sock.sendto(
                    sealed(
                        datagram(
                            header.iteration,
                            offset,
                            values,
                            msg_type=MessageType.REPAIR_DATA,
                            sequence=header.sequence,
                            flags=last,
                        )
                    ),
                    addr,
                )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def reference(steps: int) -> dict[str, torch.Tensor]:
    params = {n: INITIAL[n].clone().requires_grad_() for n in ("w", "b")}
    opt = torch.optim.SGD(list(params.values()), lr=0.1, momentum=0.9)
    for _ in range(steps):
        params["w"].grad = GRAD[:8].reshape(2, 4).clone()
        params["b"].grad = GRAD[8:].clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def wait_for(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def _started_node(tmp_path: Path, repair: RepairPolicy) -> ShadowNode:
    torch.set_num_threads(1)
    return ShadowNode(
        ShadowConfig(
            name="s0",
            control_bind=("127.0.0.50", 0),
            data_bind=("127.0.0.50", 0),
            status_file=tmp_path / "status.json",
            horizon=4,
            repair=repair,
        )
    ).start()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[ShadowNode]:
    shadow = _started_node(tmp_path, RepairPolicy(grace=0.01, timeout=0.05, max_attempts=6))
    yield shadow
    shadow.close()


def worker_socket(host: str = "127.0.0.60") -> socket.socket:
    """A UDP socket on a worker's host: a shadow takes copies only from the job's workers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host, 0))
    return sock


def join(node: ShadowNode, workers: list[tuple[str, int]] | None = None) -> Rank0:
    rank0 = Rank0(node)
    rank0.send(job_start(workers or [("127.0.0.60", 9), ("127.0.0.61", 9)]))
    rank0.send(BucketLayout(JOB, 0, LAYOUT))
    # the first optimizer a process builds takes seconds (more on a busy machine)
    assert wait_for(lambda: node.status()["state"] == "running", timeout=60), node.status()
    return rank0


def test_bad_input_is_dropped_and_counted_never_written(node: ShadowNode) -> None:
    rank0 = join(node)
    sender = worker_socket()
    target = node.data_address
    rank0.send(Commit(JOB, 0, [0.1]))
    assert wait_for(lambda: node.status()["latest_commit"] == 0)
    junk = {
        "other_job": datagram(0, 0, GRAD[:4], job_id=JOB + 1),
        "offset_past_bucket_end": datagram(0, 10, GRAD[:4]),
        "wrong_dtype": datagram(0, 0, GRAD[:4].to(torch.bfloat16), dtype=DType.BF16),
        "iteration_too_far_ahead": datagram(1000, 0, GRAD[:4]),
        "bucket_not_owned": datagram(0, 0, GRAD[:6], bucket_id=1, shard_key=1),
        "malformed": b"\x01\x01" + bytes(10),
    }
    for payload in junk.values():
        sender.sendto(payload, target)
    assert wait_for(lambda: all(node.status()["drops"].get(r, 0) >= 1 for r in junk)), node.status()["drops"]
    assert node.applied_iteration == -1
    assert torch.equal(node.parameters()["w"], INITIAL["w"])  # nothing was written
    sender.sendto(datagram(0, 0, GRAD[:8]), target)
    sender.sendto(datagram(0, 0, GRAD[:8]), target)  # a duplicate
    sender.sendto(datagram(0, 8, GRAD[8:]), target)
    assert node.wait_applied(0, 5)
    sender.sendto(datagram(0, 0, GRAD[:8]), target)  # far past now
    assert wait_for(lambda: node.status()["drops"].get("stale_iteration", 0) >= 1)
    want = reference(1)
    got = node.parameters()
    assert set(got) == {"w", "b"} and all(torch.equal(got[n], want[n]) for n in want)
    status = node.status()
    assert status["drops"]["duplicate"] == 1 and status["certified_iteration"] == 0
    assert wait_for(lambda: any(m.__class__.__name__ == "Certified" for m in rank0.received))
    rank0.close()


def test_a_commit_that_never_comes_is_never_certified_and_says_why(node: ShadowNode, tmp_path: Path) -> None:
    rank0 = join(node)
    sender = worker_socket()
    sender.sendto(datagram(0, 0, GRAD[:8]), node.data_address)
    sender.sendto(datagram(0, 8, GRAD[8:]), node.data_address)
    assert wait_for(lambda: "no commit record" in (node.status()["blocked"] or ""), timeout=4), node.status()
    status = (
        json.loads((tmp_path / "status.json").read_text())
        if wait_for(lambda: "no commit" in (tmp_path / "status.json").read_text(), 3)
        else {}
    )
    assert status.get("state") == "stalled" and status["certified_iteration"] == -1
    assert node.applied_iteration == -1
    rank0.close()


def test_with_fingerprints_every_k_only_verified_iterations_are_certified_and_a_divergence_halts(
    node: ShadowNode,
) -> None:
    start = job_start([("127.0.0.60", 9), ("127.0.0.61", 9)])
    start.extra["fingerprint_every"] = 2
    rank0 = Rank0(node)
    rank0.send(start)
    rank0.send(BucketLayout(JOB, 0, LAYOUT))
    assert wait_for(lambda: node.status()["state"] == "running", timeout=60), node.status()
    # rank 0's state after each iteration; its gradient is halved at iteration 2 behind the shadow's back
    w, b = INITIAL["w"].clone().requires_grad_(), INITIAL["b"].clone().requires_grad_()
    optimizer = torch.optim.SGD([w, b], lr=0.1, momentum=0.9, foreach=False)
    prints = []
    for step in range(5):
        scale = 0.5 if step == 2 else 1.0
        w.grad, b.grad = GRAD[:8].reshape(2, 4) * scale, GRAD[8:] * scale
        optimizer.step()
        prints.append(fingerprint([("w", w), ("b", b)], optimizer.state))
    sender = worker_socket()

    def iteration(i: int) -> None:
        rank0.send(Commit(JOB, i, [0.1], optimizer_step=i + 1, fingerprint=prints[i] if i % 2 else None))
        sender.sendto(datagram(i, 0, GRAD[:8]), node.data_address)
        sender.sendto(datagram(i, 8, GRAD[8:]), node.data_address)

    iteration(0)
    assert node.wait_applied(0, 5), node.status()
    time.sleep(0.2)
    assert node.status()["certified_iteration"] == -1  # applied, but not yet known to match
    iteration(1)
    assert wait_for(lambda: node.status()["certified_iteration"] == 1), node.status()
    iteration(2)
    assert node.wait_applied(2, 5), node.status()
    # a restore now gets iteration 2's state, and is told it is verified only up to iteration 1
    shard = fetch_shard(node.control_address, 2, 5.0, 10.0, JOB)
    assert isinstance(shard, JobStart), shard
    assert shard.start_iteration == 3 and shard.extra["last_verified"] == 1
    iteration(3)
    assert wait_for(lambda: node.status()["state"] == "diverged"), node.status()
    iteration(4)  # a diverged shadow applies nothing more until rank 0 re-seeds it
    time.sleep(0.3)
    status = node.status()
    assert status["applied_iteration"] == 3 and status["divergences"] == 1, status
    assert status["certified_iteration"] == 1 and status["divergence"]["last_verified"] == 1
    # rank 0 heard one certificate (1: it covers 0), then the divergence, then goodbye, in that order,
    # and the shadow closed its side only after them (no reset that could lose them)
    assert wait_for(lambda: any(isinstance(m, Goodbye) for m in rank0.received)), rank0.received
    kinds = [(type(m).__name__, getattr(m, "iteration", None)) for m in rank0.received]
    assert kinds == [("Certified", 1), ("Diverged", 3), ("Goodbye", None)], kinds
    assert [m.iteration for m in rank0.received if isinstance(m, Certified)] == [1]
    assert [m.last_verified for m in rank0.received if isinstance(m, Diverged)] == [1]
    rank0.close()


def test_gaps_are_repaired_from_another_worker_after_a_nack(node: ShadowNode) -> None:
    refusing, answering = FakeWorker("127.0.0.60", nack=True), FakeWorker("127.0.0.61", nack=False)
    try:
        # iteration 0: bucket 0 ranges [4, 8) and [10, 12) lost; worker (0 + 0) % 2 = 0 is asked first
        rank0 = join(node, [refusing.address, answering.address])
        sender = worker_socket()
        sender.sendto(datagram(0, 0, GRAD[:4]), node.data_address)
        sender.sendto(datagram(0, 8, GRAD[8:10]), node.data_address)
        rank0.send(Commit(JOB, 0, [0.1]))
        assert node.wait_applied(0, 5), node.status()
        assert refusing.requests == [[(4, 4), (10, 2)]]
        assert answering.requests[0] == [(4, 4), (10, 2)]
        repairs = node.status()["repairs"]
        assert repairs["nacks"] == 1 and repairs["elements_repaired"] == 6 and repairs["unrepairable"] == 0
        want = reference(1)
        assert all(torch.equal(node.parameters()[n], want[n]) for n in want)
        rank0.close()
    finally:
        refusing.close()
        answering.close()


def _repairs_when(node: ShadowNode, done: Callable[[dict[str, object]], bool], timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        repairs = node.status()["repairs"]
        if done(repairs) or time.monotonic() > deadline:
            return repairs
        time.sleep(0.01)


def test_copies_that_arrive_after_their_repair_raise_the_repair_grace(node: ShadowNode) -> None:
    """Late, not lost: the repair was premature, so the grace doubles (once per iteration)."""
    answering = FakeWorker("127.0.0.61", nack=False)
    try:
        rank0 = join(node, [answering.address, answering.address])
        sender = worker_socket(answering.address[0])  # copies come from the job's workers only
        sender.sendto(datagram(0, 0, GRAD[:4]), node.data_address)
        sender.sendto(datagram(0, 8, GRAD[8:10]), node.data_address)
        rank0.send(Commit(JOB, 0, [0.1]))
        assert node.wait_applied(0, 5), node.status()
        assert answering.requests and node.status()["repairs"]["grace_s"] == pytest.approx(0.01)
        # iteration 1 arrives whole, twice: duplicates of an iteration never repaired change nothing
        for _ in range(2):
            sender.sendto(datagram(1, 0, GRAD), node.data_address)
        rank0.send(Commit(JOB, 1, [0.1]))
        assert node.wait_applied(1, 5), node.status()
        assert node.status()["repairs"]["late_copies"] == 0
        # the "lost" copies of iteration 0 turn up after all: late
        sender.sendto(datagram(0, 4, GRAD[4:8]), node.data_address)
        sender.sendto(datagram(0, 10, GRAD[10:12]), node.data_address)
        repairs = _repairs_when(node, lambda r: r["late_copies"] == 2)
        assert repairs["late_copies"] == 2 and repairs["grace_raised"] == 1, repairs
        assert repairs["grace_s"] == pytest.approx(0.02)
        want = reference(2)  # the late copies changed nothing applied
        assert all(torch.equal(node.parameters()[n], want[n]) for n in want)
        rank0.close()
    finally:
        answering.close()


def test_a_socket_that_never_drains_defers_repairs_only_for_a_bounded_time(
    node: ShadowNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies always waiting unread (steady traffic on a loaded shadow) must not starve repairs."""
    from shadow import node_maintenance, node_receive

    monkeypatch.setattr(node_receive, "receive_queued", lambda sock: True)
    monkeypatch.setattr(node_maintenance, "REPAIR_DEFER_LIMIT_S", 3600.0)
    answering = FakeWorker("127.0.0.61", nack=False)
    try:
        rank0 = join(node, [answering.address, answering.address])
        sender = worker_socket()
        sender.sendto(datagram(0, 0, GRAD[:4]), node.data_address)
        sender.sendto(datagram(0, 8, GRAD[8:10]), node.data_address)
        rank0.send(Commit(JOB, 0, [0.1]))
        assert not node.wait_applied(0, 1.0)  # deferred: the socket looks busy
        assert answering.requests == []
        monkeypatch.setattr(node_maintenance, "REPAIR_DEFER_LIMIT_S", 0.3)
        assert node.wait_applied(0, 5), node.status()
        assert answering.requests  # repaired from the worker, after the bounded deferral
        want = reference(1)
        assert all(torch.equal(node.parameters()[n], want[n]) for n in want)
        rank0.close()
    finally:
        answering.close()


def test_unrepairable_gap_blocks_certification_and_asks_for_state(node: ShadowNode) -> None:
    workers = [FakeWorker("127.0.0.60", nack=True), FakeWorker("127.0.0.61", nack=True)]
    try:
        rank0 = join(node, [w.address for w in workers])
        sender = worker_socket()
        sender.sendto(datagram(0, 0, GRAD[:8]), node.data_address)
        rank0.send(Commit(JOB, 0, [0.1]))
        assert wait_for(lambda: "every worker" in (node.status()["blocked"] or "")), node.status()
        assert node.applied_iteration == -1 and node.status()["certified_iteration"] == -1
        assert wait_for(lambda: any(isinstance(m, Goodbye) and "resync" in m.reason for m in rank0.received))
        rank0.close()
    finally:
        for w in workers:
            w.close()


@pytest.fixture
def patient_node(tmp_path: Path) -> Iterator[ShadowNode]:
    """:func:`node` with repair timeouts a loaded machine meets (a FakeWorker thread may answer late)."""
    shadow = _started_node(tmp_path, RepairPolicy(grace=0.01, timeout=1.0, max_attempts=12))
    yield shadow
    shadow.close()


def test_a_refused_bucket_is_repaired_and_asks_for_state_only_if_the_repair_fails_its_tag_too(
    patient_node: ShadowNode,
) -> None:
    """Copies that fail rank 0's gradient tag are repaired from the workers; a failed repair re-seeds."""
    from checkmate.auth import GradientDigests

    node = patient_node

    tags = GradientDigests(secret_from_env(), JOB)
    worker = FakeWorker("127.0.0.60", nack=False)  # answers every repair with GRAD
    try:
        rank0 = join(node, [worker.address, worker.address])
        sender = worker_socket()
        # iteration 0: the copies are wrong, the repair (GRAD) matches the tag: applied, no re-seed
        tags.record(0, 0, tensor_payload(GRAD.contiguous()))
        sender.sendto(datagram(0, 0, GRAD[:8] * 7), node.data_address)
        sender.sendto(datagram(0, 8, GRAD[8:]), node.data_address)
        rank0.send(Commit(JOB, 0, [0.1], gradient_digests=tags.take(0)))
        assert node.wait_applied(0, 10), node.status()
        want = reference(1)
        assert all(torch.equal(node.parameters()[n], want[n]) for n in want)
        status = node.status()
        assert status["drops"]["forged_gradient"] == 1 and status["resync_requests"] == 0, status
        assert worker.requests[0] == [(0, GRAD.numel())]  # the whole bucket
        # a genuine copy that comes late for the refused bucket is not placed
        sender.sendto(datagram(0, 0, GRAD[:8]), node.data_address)
        # iteration 1: rank 0 tagged other values than every worker sent: repaired, still
        # wrong, so the iteration is dropped and rank 0 asked for fresh state
        tags.record(1, 0, tensor_payload((GRAD * 2).contiguous()))
        sender.sendto(datagram(1, 0, GRAD[:8]), node.data_address)
        sender.sendto(datagram(1, 8, GRAD[8:]), node.data_address)
        rank0.send(Commit(JOB, 1, [0.1], gradient_digests=tags.take(1)))
        assert wait_for(lambda: any(isinstance(m, Goodbye) and "resync" in m.reason for m in rank0.received))
        status = node.status()
        assert status["drops"]["forged_gradient"] == 3 and status["applied_iteration"] == 0, status
        assert [(0, GRAD.numel())] in worker.requests[1:]  # iteration 1's bucket, asked again in whole
        rank0.close()
        sender.close()
    finally:
        worker.close()


def test_layout_change_without_state_makes_the_shadow_ask_for_state(node: ShadowNode) -> None:
    rank0 = join(node)
    moved = [
        BucketSpec(0, "float32", 10, 0, (ParamSlice("w", 0, 8), ParamSlice("other", 8, 2))),
    ]
    rank0.send(BucketLayout(JOB, 3, moved))
    assert wait_for(lambda: any(isinstance(m, Goodbye) and "resync" in m.reason for m in rank0.received))
    assert node.status()["resync_requests"] == 1
    # a re-seed (state before iteration 3, then its layout) is accepted
    rank0 = Rank0(node)
    rank0.send(job_start([("127.0.0.60", 9)], start=3))
    rank0.send(BucketLayout(JOB, 3, LAYOUT))
    assert wait_for(lambda: node.status()["next_iteration"] == 3)
    assert node.status()["certified_iteration"] == 2
    rank0.close()


def test_cli_status_prints_the_status_json(node: ShadowNode, capsys: pytest.CaptureFixture[str]) -> None:
    host, port = node.control_address
    assert cli.main(["status", f"{host}:{port}"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["shadow"] == "s0" and document["state"] == "waiting_for_job"


def test_copies_placed_before_their_commit_follow_a_layout_change_and_apply_exactly(node: ShadowNode) -> None:
    """One pass: copies are placed at once; rank 0 changing the layout first puts them back in the stash."""
    rank0 = join(node)
    # rank 0 rebuilt its buckets for iteration 0: bucket 0 now holds b first, then w
    rebuilt = [
        BucketSpec(0, "float32", 12, 0, (ParamSlice("b", 0, 4), ParamSlice("w", 4, 8))),
        BucketSpec(1, "float32", 6, 1, (ParamSlice("other", 0, 6),)),
    ]
    values = torch.cat([GRAD[8:], GRAD[:8]])  # the same gradients in the new order
    sender = worker_socket()
    sender.sendto(datagram(0, 0, values[:5]), node.data_address)
    sender.sendto(datagram(0, 5, values[5:]), node.data_address)
    # both fit the layout in force, so both are placed ahead of the commit, in one pass
    assert wait_for(lambda: node.status()["stash"]["placed_ahead"] == 2), node.status()
    assert node.status()["stash"]["datagrams"] == 0
    rank0.send(job_start([("127.0.0.60", 9), ("127.0.0.61", 9)], start=0))
    rank0.send(BucketLayout(JOB, 0, rebuilt))
    assert wait_for(lambda: node.status()["state"] == "running" and node.status()["stash"]["datagrams"] == 2)
    rank0.send(Commit(JOB, 0, [0.1]))
    assert node.wait_applied(0, 5), node.status()
    want = reference(1)
    assert all(torch.equal(node.parameters()[n], want[n]) for n in want)
    assert node.status()["stash"] == {"datagrams": 0, "bytes": 0, "placed_ahead": 0}
    rank0.close()


def test_copies_placed_before_their_commit_are_applied_once_it_comes(node: ShadowNode) -> None:
    rank0 = join(node)
    sender = worker_socket()
    for iteration in range(3):
        sender.sendto(datagram(iteration, 0, GRAD[:8]), node.data_address)
        sender.sendto(datagram(iteration, 8, GRAD[8:]), node.data_address)
    assert wait_for(lambda: node.status()["stash"]["placed_ahead"] == 6), node.status()
    for iteration in range(3):
        rank0.send(Commit(JOB, iteration, [0.1]))
    assert node.wait_applied(2, 5), node.status()
    want = reference(3)
    assert all(torch.equal(node.parameters()[n], want[n]) for n in want)
    status = node.status()
    assert status["stash"]["placed_ahead"] == 0 and status["packets_placed"] == 6
    rank0.close()
