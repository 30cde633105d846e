"""The native data path against the Python one (the reference): results, wire bytes, faults, bad input.

* its HMAC-SHA256 equals Python's ``hmac``, its adds equal torch's ``add_`` bit for bit;
* the same all-reduces (2-4 ranks, fp32/bf16/fp16, odd sizes, SUM and AVG) give bit-identical
  results on both paths, also under injected loss, duplication and reordering;
* the same all-reduce puts the same DATA datagrams on the wire (captured on the loopback device:
  headers with REPLICATE exactly where the Python ring puts it, payloads, each flow numbered
  0, 1, 2, ...);
* one corpus of mutated and forged datagrams is dropped with the same counters on both paths;
* a transport asked for the native path where the extension is missing warns once and runs Python.
"""

from __future__ import annotations

import hmac
import logging
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from checkmate.auth import DatagramAuth, derive_key, needs_tag, secret_from_env
from checkmate.wire import (
    HEADER_BYTES,
    CheckmateHeader,
    DType,
    Flags,
    MessageType,
    pack_data_header,
)
from hosts import native
from hosts.faults import FaultConfig
from hosts.ring_allreduce import RingAllReduce
from hosts.ring_config import ReduceOp, RingConfig, reference_allreduce
from hosts.transport import Transport, TransportConfig, datapath_from_env
from tests.hosts.datapaths import NATIVE_BUILT
from tests.hosts.harness import run_ranks
from tests.reliability.fuzz_frames import mutate_datagram

pytestmark = pytest.mark.skipif(not NATIVE_BUILT, reason="hosts.native._datapath is not built")

JOB = 91
NO_FAULTS = FaultConfig()
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ring(world: int, datapath: str, faults: FaultConfig = NO_FAULTS, base: int = 40) -> list[RingAllReduce]:
    transports = [
        Transport(
            TransportConfig(
                bind=(f"127.0.0.{base + r}", 0),
                datapath=datapath,
                faults=FaultConfig(
                    seed=faults.seed + r,
                    send_drop=faults.send_drop,
                    recv_drop=faults.recv_drop,
                    duplicate=faults.duplicate,
                    reorder=faults.reorder,
                ),
                peer_timeout=20.0,
            )
        )
        for r in range(world)
    ]
    assert all(t.datapath == datapath for t in transports)
    workers = tuple(t.address for t in transports)
    return [
        RingAllReduce(
            t,
            RingConfig(
                job_id=JOB, rank=r, workers=workers, shard_key_for_bucket=lambda b: b % 3, timeout=30.0
            ),
        )
        for r, t in enumerate(transports)
    ]


def _close(rings: Sequence[RingAllReduce]) -> None:
    for ring in rings:
        ring.close()
    for ring in rings:
        ring.transport.close()


def _inputs(world: int, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 3).to(dtype) for _ in range(world)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _run(
    rings: Sequence[RingAllReduce], cases: Sequence[tuple[int, int, torch.dtype, ReduceOp]]
) -> list[list[torch.Tensor]]:
    """Every case as one bucket of iteration 0, all started before any is waited for."""
    futures = []
    for bucket, (n, seed, dtype, op) in enumerate(cases):
        xs = _inputs(len(rings), n, dtype, seed)
        futures.append([r.allreduce_async(0, bucket, x, op) for r, x in zip(rings, xs, strict=True)])
    return [[f.wait() for f in fs] for fs in futures]


def test_hmac_and_adds_match_python_and_torch() -> None:
    module = native.load()
    assert module is not None
    rng = random.Random(1)
    for n in (0, 1, 55, 56, 63, 64, 65, 119, 1200, 9000):
        key, data = rng.randbytes(32), rng.randbytes(n)
        assert module.hmac_tag(key, data) == hmac.digest(key, data, "sha256")
    specials = [0.0, -0.0, float("inf"), float("-inf"), 1e-40, -1e-40, 65504.0, 3.4e38, 1e-8, 6e-8]
    for dtype, code in ((torch.float32, 1), (torch.bfloat16, 2), (torch.float16, 3)):
        g = torch.Generator().manual_seed(code)
        a = torch.cat([(torch.randn(20011, generator=g) * 1000).to(dtype), torch.tensor(specials).to(dtype)])
        b = torch.cat(
            [(torch.randn(20011, generator=g) * 1000).to(dtype), torch.tensor(specials[::-1]).to(dtype)]
        )
        b[:5000] = a[:5000] * -1  # exact cancellations
        want = a.clone().add_(b)
        got = a.clone()
        module.reduce_into(code, _bits(got).numpy().data.cast("B"), bytes(_bits(b).numpy().data.cast("B")))
        finite = torch.isfinite(want.float()) | torch.isinf(want.float())
        assert torch.equal(_bits(got)[finite], _bits(want)[finite]), dtype


@pytest.mark.parametrize("world", [2, 3, 4])
def test_results_are_bit_identical_on_both_paths(world: int) -> None:
    cases = [
        (n, 7 * n + k, dtype, op)
        for k, dtype in enumerate(DTYPES)
        for n in (0, 1, world - 1, 4475, 2 * 2237 * world + 13, 40_001)
        for op in (ReduceOp.SUM, ReduceOp.AVG)
    ]
    results = {}
    for datapath in ("native", "python"):
        rings = _ring(world, datapath)
        try:
            results[datapath] = _run(rings, cases)
        finally:
            _close(rings)
    for (n, seed, dtype, op), native_out, python_out in zip(
        cases, results["native"], results["python"], strict=True
    ):
        want = reference_allreduce(_inputs(world, n, dtype, seed), op)
        for a, b in zip(native_out, python_out, strict=True):
            assert torch.equal(_bits(a), _bits(b)), (world, n, dtype, op)
            assert torch.equal(_bits(a), _bits(want)), (world, n, dtype, op)


@pytest.mark.parametrize(
    "faults",
    [
        FaultConfig(seed=3, send_drop=0.03, recv_drop=0.02),
        FaultConfig(seed=4, duplicate=0.05, reorder=0.1),
        FaultConfig(seed=5, send_drop=0.03, duplicate=0.03, reorder=0.05, recv_drop=0.02),
    ],
    ids=["loss", "dup-reorder", "all"],
)
def test_faults_complete_exactly_on_both_paths(faults: FaultConfig) -> None:
    cases = [(n, n + 1, dtype, ReduceOp.AVG) for dtype in DTYPES for n in (3, 30_011)]
    outs = {}
    for datapath in ("native", "python"):
        rings = _ring(3, datapath, faults)
        try:
            outs[datapath] = _run(rings, cases)
            stats = rings[0].transport.stats()
            assert sum(v for k, v in stats.items() if k.startswith("fault.")) > 0, stats
        finally:
            _close(rings)
    for native_out, python_out in zip(outs["native"], outs["python"], strict=True):
        for a, b in zip(native_out, python_out, strict=True):
            assert torch.equal(_bits(a), _bits(b))


# ---- the wire ---------------------------------------------------------------------------------
class LoopbackCapture(threading.Thread):
    """Every UDP payload that arrives on ``lo`` for ``ports`` (AF_PACKET; root only), GSO runs split."""

    def __init__(self, ports: set[int]) -> None:
        super().__init__(daemon=True)
        self.ports = ports
        self.datagrams: list[tuple[int, bytes]] = []
        self.stop = threading.Event()
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.05)

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                frame, meta = self.sock.recvfrom(1 << 17)
            except TimeoutError:
                continue
            if meta[2] == socket.PACKET_OUTGOING:
                continue  # each loopback packet is seen leaving and arriving: keep the arrival
            ip = frame[14:]
            if len(ip) < 28 or ip[9] != 17:
                continue
            ihl = (ip[0] & 15) * 4
            dport = struct.unpack_from("!H", ip, ihl + 2)[0]
            if dport not in self.ports:
                continue
            payload = ip[ihl + 8 :]
            # a GSO run keeps one UDP header: its datagrams follow one another, each sized by its header
            while len(payload) >= HEADER_BYTES:
                size = HEADER_BYTES + struct.unpack_from("!I", payload, 24)[0] * (4 if payload[3] == 1 else 2)
                if payload[1] != MessageType.DATA:
                    break
                self.datagrams.append((dport, bytes(payload[:size])))
                payload = payload[size:]

    def close(self) -> None:
        self.stop.set()
        self.join(5.0)
        self.sock.close()


@pytest.mark.root
@pytest.mark.parametrize("world", [2, 3])
def test_both_paths_put_the_same_datagrams_on_the_wire(world: int) -> None:
    import os

    if os.geteuid() != 0:
        pytest.skip("capturing on lo needs root")
    cases = [(n, n, dtype, ReduceOp.SUM) for dtype in (torch.float32, torch.bfloat16) for n in (5, 20_011)]
    seen: dict[str, Counter[tuple[int, bytes]]] = {}
    for k, datapath in enumerate(("native", "python")):
        rings = _ring(world, datapath, base=60 + 10 * k)
        ports = {r.transport.address[1] for r in rings}
        capture = LoopbackCapture(ports)
        capture.start()
        try:
            _run(rings, cases)
            for r in rings:
                assert r.transport.wait_idle(10.0)
            time.sleep(0.3)
        finally:
            capture.close()
            rank_of_port = {r.transport.address[1]: i for i, r in enumerate(rings)}
            _close(rings)
        per_flow: dict[int, list[int]] = {}
        datagrams: Counter[tuple[int, bytes]] = Counter()
        for port, data in capture.datagrams:
            if data[2] & Flags.RETRANSMIT:
                continue  # a resend under load: its first transmission is counted
            per_flow.setdefault(rank_of_port[port], []).append(struct.unpack_from("!I", data, 28)[0])
            datagrams[(rank_of_port[port], data[:28] + bytes(4) + data[32:])] += 1  # sequence aside
        for rank, seqs in per_flow.items():
            assert sorted(seqs) == list(range(len(seqs))), (datapath, rank)
        seen[datapath] = datagrams
    only_native, only_python = seen["native"] - seen["python"], seen["python"] - seen["native"]
    assert not only_native and not only_python, (
        sum(seen["native"].values()),
        sum(seen["python"].values()),
        sorted((r, d[:32].hex(), len(d)) for r, d in only_native)[:6],
        sorted((r, d[:32].hex(), len(d)) for r, d in only_python)[:6],
    )
    tagged = [d for (_, d) in seen["native"] if d[2] & Flags.REPLICATE]
    assert tagged, "the owners' first all-gather sends carry REPLICATE"


# ---- bad input ----------------------------------------------------------------------------
def _corpus(seed: int, count: int, key: bytes, peer_rank: int) -> list[bytes]:
    """Mutated DATA, ACK, NACK and repair datagrams; half of the tagged types carry a valid MAC."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        kind = rng.randrange(4)
        if kind <= 1:
            n = rng.choice([1, 5, 100])
            header = CheckmateHeader(
                MessageType.DATA,
                JOB,
                rng.randrange(3),
                rng.randrange(3),
                rng.choice([peer_rank, 0, 5]),
                rng.randrange(3000),
                n,
                rng.randrange(70),
                DType.FP32,
                Flags(rng.choice([0, 1, 4, 5])),
                0,
            )
            base = header.pack() + rng.randbytes(4 * n)
        elif kind == 2:
            ranges = sorted(rng.sample(range(0, 200), 4))
            header = CheckmateHeader(
                rng.choice([MessageType.ACK, MessageType.NACK]),
                JOB,
                0,
                0,
                rng.choice([peer_rank, 0]),
                1024,
                2,
                rng.randrange(100),
                DType.NONE,
            )
            base = header.pack() + struct.pack("!IIII", *ranges)
        else:
            header = CheckmateHeader(MessageType.REPAIR_REQUEST, JOB, 1, 0, 0, 3, 4, 7, DType.NONE)
            base = header.pack() + struct.pack("!II", 10, 3)
        _, data = mutate_datagram(base, rng) if rng.random() < 0.8 else ("none", base)
        data = data[:9000]
        if needs_tag(data) and rng.random() < 0.5:
            data = data + hmac.digest(key, data, "sha256")[:16]
        out.append(data)
    return out


def _drops_for(datapath: str, corpus: list[bytes], base: int) -> dict[str, int]:
    peer_addr = (f"127.0.0.{base + 1}", 0)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sender.bind(peer_addr)
    transport = Transport(TransportConfig(bind=(f"127.0.0.{base}", 0), datapath=datapath))
    assert transport.datapath == datapath
    delivered: list[int] = []
    try:
        transport.add_job(JOB, 0, {1: sender.getsockname()}, on_data=lambda h, p, a: delivered.append(1))
        for data in corpus:
            sender.sendto(data, transport.address)
            time.sleep(0.0002)
        deadline = time.monotonic() + 10
        last: dict[str, int] = {}
        while time.monotonic() < deadline:
            time.sleep(0.3)
            now = transport.stats()
            if now == last:
                break
            last = now
        stats = transport.stats()
    finally:
        transport.close()
        sender.close()
    keep = ("drop.", "data_received", "acks_received", "nacks_received", "handler_error")
    out = {k: v for k, v in stats.items() if k.startswith(keep)}
    out["delivered"] = len(delivered)
    return out


def test_bad_datagrams_are_dropped_with_the_same_counters_on_both_paths() -> None:
    key = derive_key(secret_from_env(), "transport", JOB)
    corpus = _corpus(seed=17, count=3000, key=key, peer_rank=1)
    native_drops = _drops_for("native", corpus, base=80)
    python_drops = _drops_for("python", corpus, base=90)
    assert native_drops == python_drops
    assert native_drops.get("drop.malformed", 0) > 300
    assert native_drops.get("drop.unauthenticated", 0) > 50
    assert native_drops.get("handler_error", 0) == 0


# ---- selection --------------------------------------------------------------------------------
def test_missing_extension_warns_once_and_runs_python(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import builtins

    real_import = builtins.__import__

    def no_native(name: str, *args: object, **kwargs: object) -> object:
        if name == "hosts.native" and args and args[2] and "_datapath" in args[2]:  # type: ignore[operator]
            raise ImportError("simulated: no compiler")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_native)
    monkeypatch.setattr(native, "_warned", False)
    monkeypatch.delattr(native, "_datapath", raising=False)
    import sys

    monkeypatch.delitem(sys.modules, "hosts.native._datapath", raising=False)
    with caplog.at_level(logging.WARNING, logger="hosts.native"):
        transports = [Transport(TransportConfig(bind=("127.0.0.50", 0))) for _ in range(2)]
    try:
        assert [t.datapath for t in transports] == ["python", "python"]
        warnings = [r for r in caplog.records if r.name == "hosts.native"]
        assert len(warnings) == 1 and "Python data path" in warnings[0].getMessage()
    finally:
        for t in transports:
            t.close()


def test_checkmate_transport_environment_selects_the_path() -> None:
    assert datapath_from_env({}) == "native"
    assert datapath_from_env({"CHECKMATE_TRANSPORT": "python"}) == "python"
    assert datapath_from_env({"CHECKMATE_TRANSPORT": "Native"}) == "native"
    with pytest.raises(ValueError, match="CHECKMATE_TRANSPORT"):
        datapath_from_env({"CHECKMATE_TRANSPORT": "rdma"})
    with pytest.raises(ValueError, match="datapath"):
        TransportConfig(datapath="fast")


def test_an_idle_native_transport_does_not_wake() -> None:
    rings = _ring(2, "native", base=100)
    try:
        _run(rings, [(10_000, 1, torch.float32, ReduceOp.SUM)])
        for r in rings:
            assert r.transport.wait_idle(5.0)
        time.sleep(0.3)
        before = [r.transport.stats()["native.wakeups"] for r in rings]
        time.sleep(1.0)
        after = [r.transport.stats()["native.wakeups"] for r in rings]
        assert after == before, (before, after)
    finally:
        _close(rings)


def test_datagram_auth_key_matches_the_engine_key() -> None:
    auth = DatagramAuth(secret_from_env(), JOB)
    key = derive_key(secret_from_env(), "transport", JOB)
    message = b"x" * 40
    assert auth.tag([message]) == hmac.digest(key, message, "sha256")[:16]
    assert np.frombuffer(key, dtype=np.uint8).size == 32


def test_a_forked_child_closes_its_copy_of_a_native_transport() -> None:
    import os
    import signal

    transport = Transport(TransportConfig(bind=("127.0.0.51", 0)))
    assert transport.datapath == "native"
    try:
        pid = os.fork()
        if pid == 0:  # the child (a DataLoader worker, say): the engine's thread is not here
            signal.alarm(10)
            try:
                transport.close()
                from hosts.transport_native import _stop_all

                _stop_all()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        assert transport.stats()["flows.send"] == 0  # the parent's engine still answers
    finally:
        transport.close()


def test_result_buffers_are_reused_only_when_nobody_holds_them() -> None:
    rings = _ring(2, "native", base=110)
    try:
        kept: torch.Tensor | None = None
        for iteration in range(12):
            xs = _inputs(2, 5000, torch.float32, iteration)
            futures = [
                r.allreduce_async(iteration, 0, x, ReduceOp.SUM) for r, x in zip(rings, xs, strict=True)
            ]
            outs = [f.wait() for f in futures]
            assert torch.equal(outs[0], reference_allreduce(xs, ReduceOp.SUM))
            if iteration == 0:
                kept, want = outs[0], outs[0].clone()
        assert kept is not None and torch.equal(kept, want)  # held by the caller: never reused
        assert rings[0].stats().get("buffers_reused", 0) > 0  # the others were
    finally:
        _close(rings)


def _echo_under_contention(rank: int, world: int) -> int:
    """Rank 0 sends 3,000 DATA to rank 1, whose handler echoes each; two threads call rank 1's
    engine without pause. Returns how many echoes arrived (one process, both transports)."""
    transports = [
        Transport(TransportConfig(bind=(f"127.0.0.{120 + r}", 0), datapath="native", peer_timeout=20.0))
        for r in range(2)
    ]
    count = 3000
    echoed = threading.Event()
    received: list[int] = []

    def on_rank0(fields: tuple[int, ...], payload: memoryview, addr: tuple[str, int]) -> None:
        received.append(fields[5])
        if len(received) == count:
            echoed.set()

    def on_rank1(fields: tuple[int, ...], payload: memoryview, addr: tuple[str, int]) -> None:
        echo = bytearray(32)  # on the engine's thread, holding the GIL: a call back into the engine
        pack_data_header(echo, 0, int(DType.FP32), JOB, fields[5], 0, 1, 0, 0, len(payload) // 4)
        transports[1].send_packed(transports[0].address, JOB, echo, payload)

    stop = threading.Event()

    def call_in() -> None:
        while not stop.is_set():
            transports[1].stats()
            transports[1].native.engine.busy()  # type: ignore[union-attr]

    try:
        assert all(t.datapath == "native" for t in transports)
        for r, (t, handler) in enumerate(zip(transports, (on_rank0, on_rank1), strict=True)):
            t.add_job(
                JOB, r, {1 - r: transports[1 - r].address}, on_data=lambda *a: None, on_data_fields=handler
            )
        callers = [threading.Thread(target=call_in, daemon=True) for _ in range(2)]
        for c in callers:
            c.start()
        header = bytearray(32)
        payload = np.arange(64, dtype=np.float32).tobytes()
        for i in range(count):
            pack_data_header(header, 0, int(DType.FP32), JOB, i, 0, 0, 0, 0, 64)
            transports[0].send_packed(transports[1].address, JOB, header, payload)
        echoed.wait(30.0)
        stop.set()
        for c in callers:
            c.join(5.0)
        assert sorted(received) == list(range(len(received)))
        return len(received)
    finally:
        for t in transports:
            t.close()


def test_handlers_that_send_while_another_thread_calls_in_do_not_deadlock() -> None:
    """Lock order between the GIL and the engine's mutex (host replication's pattern).

    A DATA handler runs on the engine's thread and sends while other Python threads call into
    the same engine. Before the fix a thread could wait for the GIL while holding the engine's
    mutex and another hold the GIL while waiting for the mutex: the process froze (the engine
    stopped acknowledging; in CI, a 3-rank host-replication job timed out). Run in a child
    process so that a freeze fails the test instead of hanging it.
    """
    (arrived,) = run_ranks(_echo_under_contention, 1, timeout=90)
    assert arrived == 3000
