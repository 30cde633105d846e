"""Bad input into a shadow node's data port: fuzzed datagrams, then a correct iteration, applied bit-exactly.

A ShadowNode runs in-process on loopback and joins a job through its control
channel as in tests/shadow/test_node.py. Thousands of seeded random and mutated
datagrams go to its UDP data port; the node must count every one it received,
count the malformed ones (``checkmate.wire.decode`` refuses them) as
``malformed``, place nothing of the iteration it later certifies, and then apply
and certify a correct iteration bit-exactly.

Mutations that happen to produce a *well-formed* DATA or REPAIR_DATA datagram of
the job's iteration 0 (the one certified afterwards) are not sent: they are
valid input carrying other values, which no receiver can tell from the real
thing (copies travel with UDP checksum 0). Their number is reported.
"""

from __future__ import annotations

import collections
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from checkmate import wire
from checkmate.auth import needs_tag
from checkmate.control import Certified, Commit
from checkmate.wire import CheckmateHeader, DType, Flags, MessageType
from shadow.node import ShadowConfig, ShadowNode
from shadow.repair import RepairPolicy
from tests.reliability.fuzz_frames import decodes, mutate_datagram, tally
from tests.reliability.record import Recorder
from tests.shadow.test_node import GRAD, JOB, datagram, join, reference, wait_for

HOST = "127.0.0.70"
WORKER_HOST = "127.0.0.60"
"""The host of worker 0 in the job the fuzzed shadow serves (tests.shadow.test_node.join)."""
COMPARED = (
    "the drops counted as malformed and as unauthenticated against the counts expected from the bytes "
    "sent; then each parameter after a genuine iteration against torch.optim.SGD's"
)
BATCH = 200


@pytest.fixture
def shadow_node(tmp_path: Path) -> Iterator[ShadowNode]:
    torch.set_num_threads(1)
    node = ShadowNode(
        ShadowConfig(
            name="s0",
            control_bind=(HOST, 0),
            data_bind=(HOST, 0),
            status_file=tmp_path / "status.json",
            horizon=4,
            repair=RepairPolicy(grace=0.01, timeout=0.05, max_attempts=6),
        )
    ).start()
    yield node
    node.close()


def _base(rng: random.Random) -> bytes:
    """A well-formed datagram a shadow may see: copies of several iterations and buckets, control traffic."""
    kind = rng.randrange(6)
    iteration = rng.choice([0, 0, 1, 2, 3, 7, 100])
    if kind <= 2:
        offset = rng.choice([0, 4, 8, 10])
        values = GRAD[offset : offset + rng.randint(1, 12 - offset)] if offset < 12 else GRAD[:1]
        return datagram(iteration, offset, values.contiguous(), bucket_id=rng.choice([0, 0, 1]))
    if kind == 3:
        values = GRAD[:4].to(torch.bfloat16)
        return datagram(
            iteration, 0, values, dtype=DType.BF16, msg_type=MessageType.REPAIR_DATA, flags=Flags.LAST
        )
    msg = rng.choice([MessageType.ACK, MessageType.NACK, MessageType.REPAIR_REQUEST])
    return CheckmateHeader(msg, JOB, iteration, 0, 1, 0, 4, rng.randrange(100), DType.NONE).pack()


def _fuzz_shadow(node: ShadowNode, cases: int, seed: int) -> dict[str, object]:
    rank0 = join(node)
    rng = random.Random(seed)
    target = node.data_address
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sender.bind((WORKER_HOST, 0))  # from a job member's host: the fuzz reaches past the source check
    sent = malformed = unauthenticated = withheld = 0
    mutations: collections.Counter[str] = collections.Counter()
    received0 = node.status()["packets_received"]
    try:
        while sent < cases:
            for _ in range(min(BATCH, cases - sent)):
                if rng.random() < 0.05:
                    name, data = "random", rng.randbytes(rng.randrange(200))
                else:
                    name, data = mutate_datagram(_base(rng), rng)
                header = decodes(data)
                if (
                    header is not None
                    and header.job_id == JOB
                    and header.iteration == 0
                    and header.msg_type in (MessageType.DATA, MessageType.REPAIR_DATA)
                ):
                    withheld += 1
                    continue
                if len(data) > 65507:  # the largest UDP payload over IPv4
                    data = data[:65507]
                    header = decodes(data)
                sender.sendto(data, target)
                sent += 1
                # NACK and REPAIR_DATA are checked for the job's MAC before they are parsed
                unauthenticated += needs_tag(data)
                malformed += header is None and not needs_tag(data)
                mutations[name.split("+")[0]] += 1

            # pace: every datagram is received before the next batch (no silent socket-buffer loss)
            def caught_up(expected: int = sent) -> bool:
                return bool(node.status()["packets_received"] - received0 == expected)

            assert wait_for(caught_up, timeout=20), (node.status()["packets_received"] - received0, sent)
        status = node.status()
        assert status["packets_received"] - received0 == sent
        counted = (status["drops"].get("malformed", 0), status["drops"].get("unauthenticated", 0))
        differed = int(counted[0] != malformed) + int(counted[1] != unauthenticated)
        assert differed == 0, (counted, malformed, unauthenticated)
        assert node.applied_iteration == -1 and status["certified_iteration"] == -1
        drops = dict(status["drops"])

        # a correct iteration afterwards: applied and certified bit-exactly
        sender.sendto(datagram(0, 8, GRAD[8:]), target)
        sender.sendto(datagram(0, 0, GRAD[:8]), target)
        rank0.send(Commit(JOB, 0, [0.1]))
        assert node.wait_applied(0, 10), node.status()
        want = reference(1)
        got = node.parameters()
        assert set(got) == {"w", "b"}
        differed += sum(not torch.equal(got[n].view(torch.int32), want[n].view(torch.int32)) for n in want)
        assert differed == 0, "the state after the fuzz differs from torch.optim.SGD's"
        assert wait_for(lambda: node.status()["certified_iteration"] == 0)
        assert wait_for(lambda: any(isinstance(m, Certified) and m.iteration == 0 for m in rank0.received))
    finally:
        sender.close()
        rank0.close()
    return {
        "sent": sent,
        "malformed": malformed,
        "unauthenticated": unauthenticated,
        "comparisons": 2 + len(want),
        "differed": differed,
        "withheld": withheld,
        "drops": drops,
        "mutations": mutations,
    }


def _held(r: dict[str, object]) -> str:
    drops = r["drops"]
    assert isinstance(drops, dict)
    return (
        f"{r['sent']} datagrams received and counted, {r['malformed']} malformed (counted as malformed), "
        f"{r['unauthenticated']} NACK/REPAIR_DATA without the job's MAC (counted as unauthenticated), "
        f"the rest dropped by reason ({tally(drops)}) or held for uncommitted iterations; the node kept "
        f"running, then applied and certified iteration 0 bit-equal to torch.optim.SGD "
        f"({r['withheld']} mutations that were well-formed copies of iteration 0 were not sent)"
    )


def test_fuzzed_datagrams_into_the_shadow(shadow_node: ShadowNode, reliability: Recorder) -> None:
    result = _fuzz_shadow(shadow_node, 4000, seed=30)
    assert int(result["malformed"]) > 1000  # type: ignore[call-overload]
    reliability.record(
        area="bad input",
        case="fuzzed datagrams into the data port "
        "(random bytes, bit flips, truncation, extension, field values)",
        target="shadow node",
        trials=int(result["sent"]),  # type: ignore[call-overload]
        compared=COMPARED,
        comparisons=int(result["comparisons"]),  # type: ignore[call-overload]
        differed=int(result["differed"]),  # type: ignore[call-overload]
        held=_held(result),
    )


@pytest.mark.soak
def test_fuzzed_datagrams_into_the_shadow_soak(shadow_node: ShadowNode, reliability: Recorder) -> None:
    result = _fuzz_shadow(shadow_node, 100_000, seed=31)
    reliability.record(
        area="bad input",
        case="fuzzed datagrams into the data port, 100k cases",
        target="shadow node",
        trials=int(result["sent"]),  # type: ignore[call-overload]
        compared=COMPARED,
        comparisons=int(result["comparisons"]),  # type: ignore[call-overload]
        differed=int(result["differed"]),  # type: ignore[call-overload]
        held=_held(result),
    )


def test_every_wire_rejection_is_a_wire_format_error() -> None:
    """``decode`` raises WireFormatError and nothing else on any mutation (what receive loops rely on)."""
    rng = random.Random(32)
    refused = 0
    start = time.monotonic()
    for _ in range(20_000):
        _, data = mutate_datagram(_base(rng), rng)
        try:
            wire.decode(data)
        except wire.WireFormatError:
            refused += 1
    assert refused > 5000 and time.monotonic() - start < 30
