"""A large bucket through the transport to a receiver starved of CPU: every element arrives, bit-exact.

The receiver runs in its own process, which the test stops (SIGSTOP) for most of the
time, as a loaded machine deschedules it; meanwhile its socket buffer fills and the
sender's retransmission timer runs. This is the large-state workload's failure (a 21.7M
parameter model, 8 MB buckets, on 2 loaded cores: the all-reduce timed out with
datagrams missing), reduced to the transport.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

from checkmate.wire import CHECKMATE_UDP_PORT, MAX_PAYLOAD_BYTES, CheckmateHeader, DType, MessageType
from hosts.faults import FaultConfig
from hosts.transport import PeerTimeoutError, Transport, TransportConfig
from tests.hosts.datapaths import datapath_params

JOB = 78
SENDER = ("127.0.0.10", CHECKMATE_UDP_PORT)
RECEIVER = ("127.0.0.11", CHECKMATE_UDP_PORT)
PER = MAX_PAYLOAD_BYTES // 4
BUCKET_MB = 24
"""Three 8 MB buckets' worth of elements (the large-state workload's bucket size)."""

_CTX = mp.get_context("spawn")


def _receiver(count: int, recv_drop: float, datapath: str, ready: Any, out: Any) -> None:
    """Child: receive ``count`` datagrams into one array; report its digest and the transport's stats."""
    array = np.zeros(count * PER, dtype=np.float32)
    seen = np.zeros(count, dtype=np.int32)
    done = threading.Event()

    def on_data(header: CheckmateHeader, payload: Any, addr: tuple[str, int]) -> None:
        i = header.element_offset // PER
        array[header.element_offset : header.element_offset + header.element_count] = np.frombuffer(
            payload, dtype="<f4"
        )
        seen[i] += 1
        if seen.all():
            done.set()

    faults = FaultConfig(seed=5, recv_drop=recv_drop)
    with Transport(TransportConfig(bind=RECEIVER, faults=faults, datapath=datapath)) as transport:
        transport.add_job(JOB, 1, {0: SENDER}, on_data=on_data)
        ready.set()
        finished = done.wait(120.0)
        time.sleep(0.5)  # late duplicates are counted, not delivered
        out.put(
            {
                "finished": finished,
                "sha256": hashlib.sha256(array.tobytes()).hexdigest(),
                "deliveries": seen.tolist(),
                "stats": transport.stats(),
            }
        )


def _starve(pid: int, stop: threading.Event, stopped_s: float, running_s: float) -> None:
    """Keep ``pid`` stopped ``stopped_s`` out of every ``stopped_s + running_s`` seconds until ``stop``."""
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            stop.wait(stopped_s)
            os.kill(pid, signal.SIGCONT)
            stop.wait(running_s)
    except ProcessLookupError:
        return
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("datapath", datapath_params)
@pytest.mark.parametrize("recv_drop", [0.0, 0.02], ids=["starved", "starved-loss2"])
def test_large_bucket_reaches_a_starved_receiver_bit_exact(recv_drop: float, datapath: str) -> None:
    count = BUCKET_MB * (1 << 20) // MAX_PAYLOAD_BYTES
    data = np.random.default_rng(7).standard_normal(count * PER, dtype=np.float32)
    ready, out = _CTX.Event(), _CTX.Queue()
    child = _CTX.Process(target=_receiver, args=(count, recv_drop, datapath, ready, out), daemon=True)
    child.start()
    stop = threading.Event()
    failures: list[PeerTimeoutError] = []
    try:
        assert ready.wait(60.0), "the receiver did not start"
        starver = threading.Thread(target=_starve, args=(child.pid, stop, 0.4, 0.1), daemon=True)
        with Transport(TransportConfig(bind=SENDER, datapath=datapath)) as sender:
            sender.add_job(JOB, 0, {1: RECEIVER}, on_data=lambda h, p, s: None, on_failure=failures.append)
            starver.start()
            start = time.monotonic()
            for i in range(count):
                header = CheckmateHeader(
                    msg_type=MessageType.DATA,
                    job_id=JOB,
                    iteration=0,
                    bucket_id=4,
                    sender_rank=0,
                    element_offset=i * PER,
                    element_count=PER,
                    sequence=0,
                    dtype=DType.FP32,
                )
                sender.send(RECEIVER, header, data[i * PER : (i + 1) * PER].data.cast("B"))
            idle = sender.wait_idle(90.0)
            elapsed = time.monotonic() - start
            stop.set()
            starver.join(timeout=5.0)
            sent = sender.stats()
        assert not failures, f"the sender gave the starved receiver up: {failures[0]}"
        assert idle, f"not everything was acknowledged after {elapsed:.1f}s: {sent}"
        try:
            got = out.get(timeout=60.0)
        except queue.Empty:
            raise AssertionError("the receiver reported nothing") from None
    finally:
        stop.set()
        if child.pid is not None and child.is_alive():
            os.kill(child.pid, signal.SIGCONT)
        child.join(timeout=10.0)
        if child.is_alive():
            child.kill()
            child.join(timeout=5.0)
    assert got["finished"], f"datagrams missing: {sum(1 for d in got['deliveries'] if d == 0)} of {count}"
    assert set(got["deliveries"]) == {1}, "a datagram was delivered twice"
    assert got["sha256"] == hashlib.sha256(data.tobytes()).hexdigest(), "the bucket arrived with wrong bytes"
    assert got["stats"]["data_received"] == count
    if recv_drop:  # losses were repaired, not avoided
        assert sum(v for k, v in sent.items() if k.startswith("retransmit.")) > 0
