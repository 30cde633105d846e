"""Direct receive on the native data path (hosts/native/datapath.c, ``direct_read``).

After the final of one of its own chunk's slots, a rank reads the predecessor's next message with
the payload iovecs pointing at the following slots' places in the result. These tests check that
this happens (the engine's ``native.direct_datagrams``), that results stay bit-identical to the
reference, and that a stranger's datagrams shaped like the expected finals, sent to a rank while
it all-reduces, are dropped as before and never change the result.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

import pytest
import torch

from checkmate.wire import HEADER_BYTES, MAX_PAYLOAD_BYTES, pack_data_header
from hosts.ring_allreduce import RingAllReduce
from hosts.ring_config import ReduceOp, RingConfig, reference_allreduce, slot_grid
from hosts.transport import Transport, TransportConfig
from tests.hosts.datapaths import NATIVE_BUILT

pytestmark = pytest.mark.skipif(not NATIVE_BUILT, reason="hosts.native._datapath is not built")

JOB = 93
N = 1_000_003
"""Elements per all-reduce: each rank's own chunk is ~224 slots (fp32, 2 ranks)."""


def _rings(base: int) -> list[RingAllReduce]:
    transports = [
        Transport(TransportConfig(bind=(f"127.0.0.{base + r}", 0), datapath="native", peer_timeout=20.0))
        for r in range(2)
    ]
    workers = tuple(t.address for t in transports)
    return [
        RingAllReduce(t, RingConfig(job_id=JOB, rank=r, workers=workers, timeout=30.0))
        for r, t in enumerate(transports)
    ]


def _close(rings: Sequence[RingAllReduce]) -> None:
    for ring in rings:
        ring.close()
    for ring in rings:
        ring.transport.close()


def _inputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=g) * 3 for _ in range(2)]


def _allreduce(
    rings: Sequence[RingAllReduce], iteration: int, xs: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    futures = [r.allreduce_async(iteration, 0, x, ReduceOp.SUM) for r, x in zip(rings, xs, strict=True)]
    return [f.wait() for f in futures]


def test_own_chunk_finals_are_received_in_place_bit_exact() -> None:
    rings = _rings(base=130)
    try:
        for iteration in range(4):
            xs = _inputs(iteration)
            want = reference_allreduce(xs, ReduceOp.SUM)
            for out in _allreduce(rings, iteration, xs):
                assert torch.equal(out.view(torch.int32), want.view(torch.int32)), iteration
        direct = [r.transport.stats().get("native.direct_datagrams", 0) for r in rings]
        assert all(d > 0 for d in direct), direct
    finally:
        _close(rings)


def test_strangers_shaped_like_the_expected_finals_never_change_the_result() -> None:
    """A third socket floods rank 0 with DATA that claims to be rank 1's finals of rank 0's own
    chunk (right job, iteration, bucket, offsets, counts and sizes; garbage payload) while the
    ranks all-reduce: whichever of them the engine reads in place lands only in slots not yet
    final, is dropped (unknown rank: wrong source address), and the result is bit-exact."""
    rings = _rings(base=140)
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stranger.bind(("127.0.0.149", 0))
    target = rings[0].transport.address
    grid = slot_grid(N, 2, MAX_PAYLOAD_BYTES // 4)
    own = grid.chunk_slots[0]
    garbage = bytes(range(256)) * (MAX_PAYLOAD_BYTES // 256 + 1)
    try:
        for iteration in range(4):
            forged = []
            for slot in own:
                header = bytearray(HEADER_BYTES)
                # flags 0, fp32, this job, iteration, bucket 0, "from rank 1", shard 0, the slot
                pack_data_header(header, 0, 1, JOB, iteration, 0, 1, 0, grid.offsets[slot], grid.counts[slot])
                forged.append(bytes(header) + garbage[: 4 * grid.counts[slot]])
            stop = threading.Event()

            def flood(datagrams: list[bytes] = forged, done: threading.Event = stop) -> None:
                while not done.is_set():
                    for data in datagrams:
                        stranger.sendto(data, target)
                    time.sleep(0.001)

            thread = threading.Thread(target=flood, daemon=True)
            thread.start()
            try:
                xs = _inputs(100 + iteration)
                want = reference_allreduce(xs, ReduceOp.SUM)
                outs = _allreduce(rings, iteration, xs)
            finally:
                stop.set()
                thread.join(5.0)
            for out in outs:
                assert torch.equal(out.view(torch.int32), want.view(torch.int32)), iteration
        stats = rings[0].transport.stats()
        assert stats.get("drop.unknown_rank", 0) > 0, stats
        assert stats.get("native.direct_datagrams", 0) > 0, stats
    finally:
        stranger.close()
        _close(rings)
