"""A native ring keeps the DATA that arrives while it is being built.

A ring's job and its native ring used to reach the engine in two calls (``add_job``, then
``ring_add``). DATA of the job that arrived between them was accepted, acknowledged and handed to
Python as a plain job's datagram, so the ring never saw it and the op timed out with those slots
missing (seen once in ``test_two_ranks_bit_identical_to_gloo[native-clean]`` on a loaded machine:
a peer sends its first bucket as soon as its own ring exists). The ring is now set up in the same
engine call that adds the job (``NativeDatapath.expect_ring``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from checkmate.tensors import tensor_payload
from checkmate.wire import CheckmateHeader, DType, MessageType
from hosts.ring_allreduce import RingAllReduce
from hosts.ring_config import ReduceOp, RingConfig
from hosts.transport import Transport, TransportConfig
from tests.hosts.datapaths import NATIVE_BUILT

pytestmark = pytest.mark.skipif(not NATIVE_BUILT, reason="hosts.native._datapath is not built")

JOB = 93


def _hold_engine_add_job_until_data(transport: Transport) -> None:
    """Make ``transport``'s engine, once it has learned a job, wait until a DATA datagram was accepted.

    That holds the caller inside the window between the engine's registration and the rest of
    the job's setup until the peer's (retransmitted) datagram has arrived.
    """
    native = transport.native
    assert native is not None
    engine_add_job = native.add_job

    def add_job_then_wait(*args: Any) -> None:
        engine_add_job(*args)
        deadline = time.monotonic() + 5.0
        while transport.stats().get("data_received", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.005)

    native.add_job = add_job_then_wait  # type: ignore[method-assign,assignment]


def test_datagrams_that_arrive_while_the_ring_is_built_reach_it() -> None:
    # initial_rto small: rank 0's first datagram, dropped by rank 1 as an unknown job, comes back soon
    config = {"peer_timeout": 10.0, "datapath": "native", "initial_rto": 0.05, "min_rto": 0.05}
    t0 = Transport(TransportConfig(bind=("127.0.0.60", 0), **config))  # type: ignore[arg-type]
    t1 = Transport(TransportConfig(bind=("127.0.0.61", 0), **config))  # type: ignore[arg-type]
    workers = (t0.address, t1.address)
    rings: list[RingAllReduce] = []
    try:
        rings.append(RingAllReduce(t0, RingConfig(job_id=JOB, rank=0, workers=workers, timeout=10.0)))
        x0 = torch.arange(5000, dtype=torch.float32)
        x1 = torch.full((5000,), 0.5)
        started = rings[0].allreduce_async(0, 0, x0, ReduceOp.SUM)  # rank 0's chunk leaves now

        # Hold rank 1 between the engine learning of the job and the rest of the ring's setup
        # until rank 0's (retransmitted) datagram has been accepted: the window of the old race.
        _hold_engine_add_job_until_data(t1)
        rings.append(RingAllReduce(t1, RingConfig(job_id=JOB, rank=1, workers=workers, timeout=10.0)))
        assert t1.stats().get("data_received", 0) > 0  # the datagram did arrive inside the window
        ours = rings[1].allreduce(0, 0, x1, ReduceOp.SUM)
        theirs = started.wait()
        expected = x0 + x1
        assert torch.equal(ours, expected) and torch.equal(theirs, expected)
    finally:
        for ring in rings:
            ring.close()
        t0.close()
        t1.close()


def test_a_plain_jobs_datagrams_that_arrive_while_it_is_added_are_delivered() -> None:
    """The same window for a job without a ring: the engine knew the job before Python's table did.

    A DATA datagram the engine accepted in between was acknowledged, handed up and dropped for an
    unknown job: the sender never sent it again. Python's table is now filled first.
    """
    config = {"peer_timeout": 10.0, "datapath": "native", "initial_rto": 0.05, "min_rto": 0.05}
    t0 = Transport(TransportConfig(bind=("127.0.0.62", 0), **config))  # type: ignore[arg-type]
    t1 = Transport(TransportConfig(bind=("127.0.0.63", 0), **config))  # type: ignore[arg-type]
    received: list[bytes] = []
    try:
        peers = {0: t0.address, 1: t1.address}
        t0.add_job(JOB + 1, 0, peers, on_data=lambda header, payload, addr: None)
        payload = torch.arange(64, dtype=torch.float32)
        header = CheckmateHeader(MessageType.DATA, JOB + 1, 0, 0, 0, 0, 64, 0, DType.FP32)
        t0.send(t1.address, header, tensor_payload(payload))  # dropped by t1 (unknown job), then resent

        _hold_engine_add_job_until_data(t1)
        t1.add_job(JOB + 1, 1, peers, on_data=lambda header, data, addr: received.append(bytes(data)))
        assert t1.stats().get("data_received", 0) > 0  # it arrived inside the window
        deadline = time.monotonic() + 5.0
        while not received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert received == [bytes(tensor_payload(payload))]
    finally:
        t0.close()
        t1.close()
