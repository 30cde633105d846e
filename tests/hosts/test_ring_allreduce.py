"""Ring all-reduce: equal to gloo (2 ranks), to the documented ring-order sum (3-4 ranks), tags, bad input."""

from __future__ import annotations

import functools
import socket
import struct
import sys
import tempfile
import time

import pytest
import torch

from checkmate.auth import DatagramAuth, secret_from_env
from checkmate.wire import (
    CHECKMATE_UDP_PORT,
    MAX_PAYLOAD_BYTES,
    CheckmateHeader,
    DType,
    Flags,
    MessageType,
    decode,
    encode,
)
from hosts.faults import FaultConfig
from hosts.ring_allreduce import RingAllReduce, TagRecord
from hosts.ring_config import CollectiveTimeoutError, ReduceOp, RingConfig, reference_allreduce, slot_grid
from hosts.transport import PeerTimeoutError, Transport, TransportConfig
from tests.hosts.datapaths import datapath_params
from tests.hosts.harness import run_ranks, worker_addr

JOB = 5
SIZES = (0, 1, 3, 1000, 2 * (MAX_PAYLOAD_BYTES // 4) + 7, 60_000)


@pytest.fixture(autouse=True, params=datapath_params)
def datapath(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on each data path: in this process through this module's TransportConfig,
    in the ranks' processes through the ``datapath`` argument."""
    monkeypatch.setattr(
        sys.modules[__name__], "TransportConfig", functools.partial(TransportConfig, datapath=request.param)
    )
    return str(request.param)


def _inputs(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(n, generator=g).to(dtype)


def _engine(rank: int, world: int, faults: FaultConfig, datapath: str, **kw: float) -> RingAllReduce:
    transport = Transport(
        TransportConfig(bind=worker_addr(rank), faults=faults, peer_timeout=5.0, datapath=datapath)
    )
    assert transport.datapath == datapath
    config = RingConfig(
        job_id=JOB,
        rank=rank,
        workers=tuple(worker_addr(r) for r in range(world)),
        shard_key_for_bucket=lambda b: b % 3,
        **kw,  # type: ignore[arg-type]
    )
    return RingAllReduce(transport, config)


def _ring_vs_gloo(rank: int, world: int, store: str, faults: FaultConfig, datapath: str) -> dict[str, object]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    engine = _engine(rank, world, faults, datapath, timeout=20.0)
    mismatches = []
    bucket = 0
    for iteration, op in enumerate((ReduceOp.SUM, ReduceOp.AVG)):
        futures = []
        for n in SIZES:
            x = _inputs(rank, n, torch.float32, seed=n + iteration)
            futures.append((n, engine.allreduce_async(iteration, bucket, x, op), x))
            bucket += 1
        for n, fut, x in futures:
            ours = fut.wait()
            theirs = x / world if op is ReduceOp.AVG else x.clone()
            dist.all_reduce(theirs)
            if not torch.equal(ours.view(torch.int32), theirs.view(torch.int32)):
                mismatches.append((op.value, n))
    engine.transport.wait_idle(5.0)  # the last all-gather sends are acknowledged (or resent) by now
    stats = engine.transport.stats()
    tags = list(engine.tag_log)
    dist.barrier()
    engine.close()
    engine.transport.close()
    dist.destroy_process_group()
    return {"mismatches": mismatches, "stats": stats, "tags": tags}


@pytest.mark.parametrize("loss", [0.0, 0.05], ids=["clean", "loss5"])
def test_two_ranks_bit_identical_to_gloo(loss: float, datapath: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        faults = FaultConfig(seed=11, send_drop=loss, reorder=loss)
        results = run_ranks(_ring_vs_gloo, 2, f"{tmp}/store", faults, datapath, timeout=60)
    for r in results:
        assert r["mismatches"] == []
    if loss:  # either rank's losses (which datagrams a seeded fault hits depends on timing)
        assert sum(v for r in results for k, v in r["stats"].items() if k.startswith("retransmit.")) > 0
    _check_tags_cover_once([r["tags"] for r in results], expected_buckets=2 * len(SIZES))


def _check_tags_cover_once(tag_logs: list[list[TagRecord]], expected_buckets: int) -> None:
    """Across all ranks, the tagged ranges of each (iteration, bucket) tile the bucket exactly once."""
    by_bucket: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for log in tag_logs:
        for t in log:
            by_bucket.setdefault((t.iteration, t.bucket_id), []).append((t.element_offset, t.element_count))
            assert t.shard_key == t.bucket_id % 3
    nonempty = {k for k, v in by_bucket.items() if v}
    assert len(nonempty) <= expected_buckets
    for key, ranges in by_bucket.items():
        ranges.sort()
        position = 0
        for offset, count in ranges:
            assert offset == position, f"{key}: gap or overlap at {position}"
            position += count


def _ring_vs_reference(rank: int, world: int, faults: FaultConfig, datapath: str) -> dict[str, object]:
    engine = _engine(rank, world, faults, datapath, timeout=20.0)
    bad = []
    sizes = {}
    futures = []
    bucket = 0
    for iteration, (op, dtype) in enumerate(
        [(ReduceOp.SUM, torch.float32), (ReduceOp.AVG, torch.float32), (ReduceOp.SUM, torch.bfloat16)]
    ):
        for n in (world - 1, 5000, 2 * MAX_PAYLOAD_BYTES + 13):
            x = _inputs(rank, n, dtype, seed=bucket)
            futures.append(
                (iteration, bucket, n, op, dtype, engine.allreduce_async(iteration, bucket, x, op))
            )
            sizes[(iteration, bucket)] = n
            bucket += 1
    for iteration, b, n, op, dtype, fut in futures:
        ours = fut.wait()
        expected = reference_allreduce([_inputs(r, n, dtype, seed=b) for r in range(world)], op)
        if not torch.equal(ours.view(torch.int16), expected.view(torch.int16)):
            bad.append((iteration, b, n))
    engine.transport.wait_idle(5.0)
    time.sleep(0.2)  # let the peers' last ACKs arrive before closing
    tags = list(engine.tag_log)
    stats = engine.transport.stats()
    engine.close()
    engine.transport.close()
    return {"bad": bad, "tags": tags, "sizes": sizes, "stats": stats}


@pytest.mark.parametrize(
    ("world", "faults"),
    [(3, FaultConfig()), (4, FaultConfig(seed=5, send_drop=0.01, duplicate=0.02, reorder=0.05))],
    ids=["3-ranks", "4-ranks-faults"],
)
def test_more_ranks_equal_ring_order_reference(world: int, faults: FaultConfig, datapath: str) -> None:
    results = run_ranks(_ring_vs_reference, world, faults, datapath, timeout=60)
    for r in results:
        assert r["bad"] == []
    _check_tags_cover_once([r["tags"] for r in results], expected_buckets=9)
    # every element of every bucket is covered (not only non-overlapping)
    covered: dict[tuple[int, int], int] = {}
    for r in results:
        for t in r["tags"]:
            covered[(t.iteration, t.bucket_id)] = covered.get((t.iteration, t.bucket_id), 0) + t.element_count
    for key, n in results[0]["sizes"].items():
        assert covered.get(key, 0) == n, key


def test_only_the_owner_tags_and_tags_are_the_all_gather_first_send(datapath: str) -> None:
    # 3 ranks: bucket of 3 chunks; rank c-1 owns chunk c.
    grid = slot_grid(30, 3, 10)
    assert grid.bounds == (0, 10, 20, 30)
    results = run_ranks(_ring_vs_reference, 3, FaultConfig(), datapath, timeout=60)
    for rank, r in enumerate(results):
        for t in r["tags"]:
            n = r["sizes"][(t.iteration, t.bucket_id)]
            owned = (rank + 1) % 3
            assert owned * n // 3 <= t.element_offset < (owned + 1) * n // 3


def _lonely(rank_count: int, peer_timeout: float, timeout: float) -> RingAllReduce:
    transport = Transport(TransportConfig(bind=worker_addr(0), peer_timeout=peer_timeout))
    config = RingConfig(
        job_id=JOB, rank=0, workers=tuple(worker_addr(r) for r in range(rank_count)), timeout=timeout
    )
    return RingAllReduce(transport, config)


def test_dead_peer_fails_with_peer_timeout_naming_it() -> None:
    engine = _lonely(2, peer_timeout=0.5, timeout=30.0)
    start = time.monotonic()
    fut = engine.allreduce_async(0, 0, torch.ones(10_000))
    with pytest.raises(PeerTimeoutError, match=r"rank 1 at 127\.0\.0\.11:48879"):
        fut.wait()
    assert time.monotonic() - start < 3.0
    with pytest.raises(PeerTimeoutError):  # the engine stays failed
        engine.allreduce_async(0, 1, torch.ones(4)).wait()
    engine.close()
    engine.transport.close()


def test_silent_predecessor_fails_with_collective_timeout() -> None:
    engine = _lonely(3, peer_timeout=30.0, timeout=0.6)
    # rank 1 (next) is alive and acknowledges; rank 2 (prev) never sends: play rank 1 with a transport.
    rank1 = Transport(TransportConfig(bind=worker_addr(1)))
    rank1.add_job(JOB, 1, {0: worker_addr(0)}, on_data=lambda h, p, a: None)
    start = time.monotonic()
    fut = engine.allreduce_async(0, 0, torch.ones(100))
    with pytest.raises(CollectiveTimeoutError, match=r"from rank 2 at 127\.0\.0\.12:48879"):
        fut.wait()
    assert time.monotonic() - start < 2.0
    engine.close()
    engine.transport.close()
    rank1.close()


def _data(seq: int, iteration: int, offset: int, count: int, dtype: DType = DType.FP32) -> bytes:
    header = CheckmateHeader(MessageType.DATA, JOB, iteration, 0, 1, offset, count, seq, dtype=dtype)
    return bytes(
        encode(
            header, struct.pack(f"<{count}f", *([1.5] * count)) if dtype is DType.FP32 else bytes(2 * count)
        )
    )


def test_bad_data_is_counted_never_applied_and_repairs_are_served() -> None:
    engine = _lonely(2, peer_timeout=10.0, timeout=5.0)
    rank1 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rank1.bind(worker_addr(1))
    rank1.settimeout(2.0)
    x = torch.arange(10, dtype=torch.float32)
    fut = engine.allreduce_async(5, 0, x, ReduceOp.SUM)
    # rank 0 sends chunk 0 (elements 0..4) to rank 1; rank 1 would send chunk 1 back, reduced.
    first, _ = rank1.recvfrom(65536)
    assert decode(first)[0].element_offset == 0
    bad = [
        _data(0, 1, 5, 5),  # stale: iteration 1 <= 5 - keep_iterations
        _data(1, 50, 5, 5),  # far future
        _data(2, 5, 3, 5),  # offset not on the slot grid
        _data(3, 5, 5, 5, DType.BF16),  # wrong dtype
        _data(3, 5, 5, 5),  # sequence 3 again: a transport duplicate
    ]
    for datagram in bad:
        rank1.sendto(datagram, worker_addr(0))
    time.sleep(0.2)
    assert not fut.done()
    # now the real data: chunk 1 (elements 5..9) = x[5:] + 1.5 as rank 1's sum; then chunk 0 in all-gather
    rank1.sendto(_data(4, 5, 5, 5), worker_addr(0))
    rank1.sendto(_data(5, 5, 0, 5), worker_addr(0))
    result = fut.wait()
    assert torch.equal(result[5:], x[5:] + 1.5)
    assert torch.equal(result[:5], torch.full((5,), 1.5))
    drops = engine.transport.drops()
    for reason in ("stale_iteration", "future_iteration", "out_of_range", "dtype_mismatch", "duplicate"):
        assert drops.get(reason) == 1, (reason, drops)
    # a tagged all-gather send of the reduced chunk 1 went to rank 1
    tagged = []
    while True:
        try:
            datagram, _ = rank1.recvfrom(65536)
        except TimeoutError:
            break
        header, _ = decode(datagram)
        if header.msg_type is MessageType.DATA and header.flags & Flags.REPLICATE:
            tagged.append(header)
        if tagged:
            break
    assert tagged and tagged[0].element_offset == 5 and tagged[0].element_count == 5

    # the repair service: a shadow asks for elements 2..3 and 7..8
    shadow = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    shadow.bind(("127.0.0.30", CHECKMATE_UDP_PORT))
    shadow.settimeout(2.0)
    auth = DatagramAuth(secret_from_env(), JOB)
    request = CheckmateHeader(MessageType.REPAIR_REQUEST, JOB, 5, 0, 0, 2, 2, 42, dtype=DType.NONE)
    unsigned = encode(request) + struct.pack("!II", 7, 2)
    shadow.sendto(unsigned, worker_addr(0))  # no MAC: dropped, never answered
    shadow.sendto(unsigned + auth.tag([unsigned]), worker_addr(0))
    got = {}
    for _ in range(2):
        opened = auth.open(memoryview(shadow.recvfrom(65536)[0]))
        assert opened is not None  # the answer carries the job's MAC
        header, payload = decode(opened)
        assert header.msg_type is MessageType.REPAIR_DATA and header.sequence == 42
        assert not header.flags & Flags.REPLICATE
        got[header.element_offset] = torch.frombuffer(bytearray(payload), dtype=torch.float32)
    assert torch.equal(got[2], result[2:4]) and torch.equal(got[7], result[7:9])
    missing = CheckmateHeader(MessageType.REPAIR_REQUEST, JOB, 4, 0, 0, 0, 2, 43, dtype=DType.NONE)
    shadow.sendto(encode(missing) + auth.tag([encode(missing)]), worker_addr(0))
    header, _ = decode(shadow.recvfrom(65536)[0])
    assert header.msg_type is MessageType.NACK and header.sequence == 43 and header.iteration == 4
    assert engine.transport.drops().get("unauthenticated") == 1
    shadow.close()
    rank1.close()
    engine.close()
    engine.transport.close()
