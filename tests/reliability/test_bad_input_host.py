"""Bad input into the host agent's transport socket while a ring all-reduce runs.

Two ranks (transport + ring all-reduce, in-process on loopback) reduce a series of
buckets while a third socket fires seeded random and mutated Checkmate datagrams at
both ranks' data ports: the transport must count every malformed one, handle every
datagram without an error, and every all-reduce result must stay bit-equal to the
ring-order reference (``reference_allreduce``).
"""

from __future__ import annotations

import collections
import random
import socket
import struct
import threading
import time

import pytest
import torch

from checkmate.auth import datagram_job, needs_tag
from checkmate.wire import CHECKMATE_UDP_PORT, CheckmateHeader, DType, Flags, MessageType
from hosts import native
from hosts.ring_allreduce import RingAllReduce
from hosts.ring_config import ReduceOp, RingConfig, reference_allreduce
from hosts.transport import Transport, TransportConfig
from tests.reliability.fuzz_frames import decodes, mutate_datagram, tally
from tests.reliability.record import Recorder

JOB = 41
RANKS = (("127.0.0.110", CHECKMATE_UDP_PORT), ("127.0.0.111", CHECKMATE_UDP_PORT))
FUZZER = "127.0.0.112"
BUCKET_ELEMENTS = (3, 1000, 6000)


def _base(rng: random.Random) -> bytes:
    """What a rank may receive: DATA from either rank, ACK/NACK with ranges, repair requests and answers."""
    kind = rng.randrange(5)
    iteration = rng.randrange(12)
    rank = rng.randrange(2)
    if kind <= 1:
        count = rng.choice([1, 5, 100])
        header = CheckmateHeader(
            MessageType.DATA,
            JOB,
            iteration,
            rng.randrange(3),
            rank,
            rng.randrange(3000),
            count,
            rng.randrange(64),
            DType.FP32,
            Flags(rng.choice([0, 1, 4, 5])),
            0,
        )
        return header.pack() + rng.randbytes(4 * count)
    if kind == 2:
        ranges = sorted(rng.sample(range(0, 200), 4))
        header = CheckmateHeader(
            rng.choice([MessageType.ACK, MessageType.NACK]),
            JOB,
            0,
            0,
            rank,
            1024,
            2,
            rng.randrange(100),
            DType.NONE,
        )
        return header.pack() + struct.pack("!IIII", *ranges)
    if kind == 3:
        header = CheckmateHeader(
            MessageType.REPAIR_REQUEST,
            JOB,
            iteration,
            rng.randrange(3),
            0,
            rng.randrange(100),
            4,
            7,
            DType.NONE,
        )
        return header.pack() + struct.pack("!II", 10, 3)
    header = CheckmateHeader(MessageType.REPAIR_DATA, JOB, iteration, 0, rank, 0, 2, 7, DType.FP32)
    return header.pack() + bytes(8)


class Fuzzer(threading.Thread):
    """Sends mutated datagrams to both ranks until stopped (or ``limit`` are sent)."""

    def __init__(self, seed: int, limit: int) -> None:
        super().__init__(daemon=True)
        self.rng = random.Random(seed)
        self.limit = limit
        self.stop = threading.Event()
        self.sent = [0, 0]
        self.malformed = [0, 0]
        self.unauthenticated = [0, 0]
        self.mutations: collections.Counter[str] = collections.Counter()

    def run(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((FUZZER, 0))
        sock.setblocking(False)
        try:
            while not self.stop.is_set() and sum(self.sent) < self.limit:
                for _ in range(50):
                    name, data = mutate_datagram(_base(self.rng), self.rng)
                    data = data[:65507]
                    rank = self.rng.randrange(2)
                    try:
                        sock.sendto(data, RANKS[rank])
                    except BlockingIOError:
                        continue
                    self.sent[rank] += 1
                    # ACK, NACK and repair datagrams are checked for the job's MAC before they are parsed
                    self.unauthenticated[rank] += needs_tag(data) and datagram_job(data) == JOB
                    self.malformed[rank] += decodes(data) is None and not needs_tag(data)
                    self.mutations[name.split("+")[0]] += 1
                    # drain whatever the ranks answered (NACKs, repair data)
                while True:
                    try:
                        sock.recv(65536)
                    except BlockingIOError:
                        break
                time.sleep(0.002)
        finally:
            sock.close()


def _fuzz_during_allreduce(iterations: int, limit: int, seed: int, datapath: str) -> dict[str, object]:
    torch.set_num_threads(1)
    engines = [
        RingAllReduce(
            Transport(TransportConfig(bind=RANKS[r], peer_timeout=20.0, datapath=datapath)),
            RingConfig(job_id=JOB, rank=r, workers=RANKS, shard_key_for_bucket=lambda b: b % 2, timeout=60.0),
        )
        for r in range(2)
    ]
    fuzzer = Fuzzer(seed, limit)
    gen = torch.Generator().manual_seed(seed)
    checked = differed = 0
    try:
        fuzzer.start()
        iteration = 0
        # keep reducing until the fuzzer has sent its quota: every datagram lands while the ring runs
        while iteration < iterations or (fuzzer.is_alive() and iteration < 100 * iterations):
            futures = []
            for bucket, n in enumerate(BUCKET_ELEMENTS):
                inputs = [torch.randn(n, generator=gen) for _ in range(2)]
                op = ReduceOp.AVG if iteration % 2 else ReduceOp.SUM
                futures.append(
                    (
                        [
                            e.allreduce_async(iteration, bucket, x.clone(), op)
                            for e, x in zip(engines, inputs, strict=True)
                        ],
                        reference_allreduce(inputs, op),
                    )
                )
            for pending, want in futures:
                for fut in pending:
                    got = fut.wait()
                    differed += not torch.equal(got.view(torch.int32), want.view(torch.int32))
                    checked += 1
            iteration += 1
        assert sum(fuzzer.sent) == limit, "the fuzzer did not finish while the ring ran"
        fuzzer.stop.set()
        fuzzer.join(10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if all(
                e.transport.drops().get("malformed", 0) == fuzzer.malformed[r] for r, e in enumerate(engines)
            ):
                break
            time.sleep(0.05)
        stats = [e.transport.stats() for e in engines]
        drops: collections.Counter[str] = collections.Counter()
        repairs: collections.Counter[str] = collections.Counter()
        for r, e in enumerate(engines):
            counted = e.transport.drops()
            differed += int(counted.get("malformed", 0) != fuzzer.malformed[r])
            differed += int(counted.get("unauthenticated", 0) != fuzzer.unauthenticated[r])
            assert differed == 0, (r, counted, fuzzer.malformed[r], fuzzer.unauthenticated[r])
            assert stats[r].get("handler_error", 0) == 0 and stats[r].get("recv_error", 0) == 0, stats[r]
            drops.update(e.transport.drops())
            repairs.update({k: v for k, v in e.stats().items() if k.startswith("repair_")})
    finally:
        fuzzer.stop.set()
        for e in engines:
            e.close()
            e.transport.close()
    return {
        "sent": sum(fuzzer.sent),
        "malformed": sum(fuzzer.malformed),
        "checked": checked,
        "comparisons": checked + 4,
        "differed": differed,
        "unauthenticated": sum(fuzzer.unauthenticated),
        "drops": dict(drops),
        "repairs": dict(repairs),
        "mutations": fuzzer.mutations,
        "iterations": iteration,
    }


def _held(r: dict[str, object]) -> str:
    drops, repairs = r["drops"], r["repairs"]
    assert isinstance(drops, dict) and isinstance(repairs, dict)
    return (
        f"{r['sent']} datagrams fired at both ranks during {r['iterations']} iterations of ring all-reduce "
        f"({len(BUCKET_ELEMENTS)} buckets each); {r['malformed']} malformed, each counted as malformed; "
        f"{r['unauthenticated']} ACK/NACK/repair datagrams without the job's MAC, each counted as "
        "unauthenticated; "
        f"the rest dropped by reason ({tally(drops)}) or answered as repair requests "
        f"({tally(repairs)}); no handler error; all {r['checked']} all-reduce "
        "results bit-equal to the ring-order reference"
    )


@pytest.mark.parametrize("datapath", ["native", "python"])
def test_fuzzed_datagrams_into_the_host_agent_during_allreduce(reliability: Recorder, datapath: str) -> None:
    if datapath == "native" and not native.available():
        pytest.skip("hosts.native._datapath is not built")
    result = _fuzz_during_allreduce(iterations=12, limit=4000, seed=40, datapath=datapath)
    assert int(result["malformed"]) > 1000  # type: ignore[call-overload]
    reliability.record(
        area="bad input",
        case=f"fuzzed datagrams into the transport socket while a ring all-reduce runs ({datapath} path)",
        target="host agent",
        trials=int(result["sent"]),  # type: ignore[call-overload]
        compared="every all-reduce result bit for bit against the ring-order reference; per rank, the "
        "drops counted as malformed and as unauthenticated against the counts expected from the bytes sent",
        comparisons=int(result["comparisons"]),  # type: ignore[call-overload]
        differed=int(result["differed"]),  # type: ignore[call-overload]
        held=_held(result),
    )


@pytest.mark.soak
def test_fuzzed_datagrams_into_the_host_agent_soak(reliability: Recorder) -> None:
    result = _fuzz_during_allreduce(iterations=200, limit=100_000, seed=41, datapath="native")
    reliability.record(
        area="bad input",
        case="fuzzed datagrams into the transport socket during ring all-reduce, 100k cases",
        target="host agent",
        trials=int(result["sent"]),  # type: ignore[call-overload]
        compared="every all-reduce result bit for bit against the ring-order reference; per rank, the "
        "drops counted as malformed and as unauthenticated against the counts expected from the bytes sent",
        comparisons=int(result["comparisons"]),  # type: ignore[call-overload]
        differed=int(result["differed"]),  # type: ignore[call-overload]
        held=_held(result),
    )
