"""Host-side replication (no switch): the chunk owners send the shadows their reduced chunks themselves.

In ``host`` mode (``CheckmateConfig.replication``, ``RingConfig.host_replica``)
no datagram between workers carries REPLICATE, and every reduced element
reaches the shadow owning its shard key exactly once, bit for bit equal to the
ring's result, formatted like the switch's copy (a DATA datagram with
REPLICATE cleared).
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest
import torch

from checkmate.wire import CHECKMATE_UDP_PORT, MAX_PAYLOAD_BYTES, CheckmateHeader, Flags, MessageType, decode
from hosts.ddp import CheckmateConfig, CheckmateConfigError
from hosts.faults import FaultConfig
from hosts.ring_allreduce import RingAllReduce
from hosts.ring_config import ReduceOp, RingConfig, reference_allreduce
from hosts.transport import Addr, Transport, TransportConfig
from tests.hosts.datapaths import datapath_params
from tests.hosts.harness import run_ranks, worker_addr

JOB = 9
SHADOWS = (("127.0.0.50", CHECKMATE_UDP_PORT), ("127.0.0.51", CHECKMATE_UDP_PORT))
SIZES = (1, 1000, 2 * (MAX_PAYLOAD_BYTES // 4) + 7, 30_000)
ITERATIONS = 2


def _inputs(rank: int, iteration: int, bucket: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * iteration + 100 * bucket + rank)
    return torch.randn(n, generator=g)


def _shard_key(bucket: int) -> int:
    return bucket % len(SHADOWS)


def _replica(shard_key: int) -> Addr | None:
    return SHADOWS[shard_key]


def _rank(rank: int, world: int, datapath: str) -> dict[str, object]:
    transport = Transport(
        TransportConfig(bind=worker_addr(rank), peer_timeout=5.0, faults=FaultConfig(), datapath=datapath)
    )
    assert transport.datapath == datapath
    sent_flags: list[int] = []
    transport.tap = lambda header, peer, retransmit: sent_flags.append(int(header.flags))
    engine = RingAllReduce(
        transport,
        RingConfig(
            job_id=JOB,
            rank=rank,
            workers=tuple(worker_addr(r) for r in range(world)),
            shard_key_for_bucket=_shard_key,
            timeout=20.0,
            host_replica=_replica,
        ),
    )
    for iteration in range(ITERATIONS):
        futures = [
            engine.allreduce_async(iteration, b, _inputs(rank, iteration, b, n), ReduceOp.AVG)
            for b, n in enumerate(SIZES)
        ]
        for future in futures:
            future.wait()
    stats = engine.stats()
    transport.wait_idle(5.0)
    tags = len(engine.tag_log)
    engine.close()
    transport.close()
    return {"flags": sent_flags, "stats": stats, "tags": tags}


class _Collector:
    """A UDP socket at a shadow's data address that keeps every datagram it receives."""

    def __init__(self, address: Addr) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind(address)
        self.sock.settimeout(0.2)
        self.datagrams: list[tuple[CheckmateHeader, bytes, Addr]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, addr = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            header, payload = decode(data)
            self.datagrams.append((header, bytes(payload), addr))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.mark.parametrize("datapath", datapath_params)
def test_shadow_receives_every_reduced_element_once_bit_exact(datapath: str) -> None:
    """On both data paths: the native engine sends the copies itself (``ring_replica``)."""
    world = 3
    collectors = [_Collector(a) for a in SHADOWS]
    try:
        results = run_ranks(_rank, world, datapath, timeout=60)
    finally:
        for c in collectors:
            c.close()
    # nothing between workers is tagged: the switch would copy nothing
    for r in results:
        assert r["flags"], "the rank sent nothing"
        assert all(not f & Flags.REPLICATE for f in r["flags"])
    assert sum(r["stats"].get("host_copies", 0) for r in results) == sum(r["tags"] for r in results)
    for iteration in range(ITERATIONS):
        for bucket, n in enumerate(SIZES):
            expected = reference_allreduce(
                [_inputs(r, iteration, bucket, n) for r in range(world)], ReduceOp.AVG
            )
            got = torch.full((n,), float("nan"))
            times = torch.zeros(n, dtype=torch.int32)
            shadow = collectors[_shard_key(bucket)]
            for header, payload, addr in shadow.datagrams:
                if (header.iteration, header.bucket_id) != (iteration, bucket):
                    continue
                assert header.msg_type is MessageType.DATA
                assert not header.flags & Flags.REPLICATE
                assert header.job_id == JOB and header.shard_key == _shard_key(bucket)
                assert addr == worker_addr(header.sender_rank)
                lo, hi = header.element_offset, header.element_offset + header.element_count
                got[lo:hi] = torch.frombuffer(bytearray(payload), dtype=torch.float32)
                times[lo:hi] += 1
            assert torch.equal(times, torch.ones(n, dtype=torch.int32)), f"bucket {bucket}: not once each"
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), f"bucket {bucket} differs"
            # the other shadow got nothing of this bucket
            other = collectors[1 - _shard_key(bucket)]
            assert not any((h.iteration, h.bucket_id) == (iteration, bucket) for h, _, _ in other.datagrams)


def test_replication_mode_from_env_and_shadow_data_address(tmp_path: Path) -> None:
    job_file = tmp_path / "job.json"
    job_file.write_text(
        json.dumps(
            {
                "job": {
                    "job_id": 3,
                    "workers": ["h1", "h2"],
                    "shadows": ["sh1", "sh2"],
                    "shard_to_shadow": {"0": "sh2", "1": "sh1"},
                    "shadow_port": 5000,
                },
                "worker_addresses": ["10.0.0.1", "10.0.0.2"],
                "shadow_control": {"sh1": "10.0.9.1:48880", "sh2": "10.0.9.2:48880"},
            }
        )
    )
    env = {"RANK": "0", "WORLD_SIZE": "2", "CHECKMATE_JOB_FILE": str(job_file)}
    assert CheckmateConfig.from_env(env).replication == "switch"
    config = CheckmateConfig.from_env({**env, "CHECKMATE_REPLICATION": "host"})
    assert config.replication == "host"
    assert config.shadow_data_address(0) == ("10.0.9.2", 5000)
    assert config.shadow_data_address(1) == ("10.0.9.1", 5000)
    assert config.shadow_data_address(7) is None
    with pytest.raises(CheckmateConfigError, match="CHECKMATE_REPLICATION"):
        CheckmateConfig.from_env({**env, "CHECKMATE_REPLICATION": "both"})
    # without a job file: shard key k -> the k-th shadow listed, the default UDP port
    plain = CheckmateConfig.from_env(
        {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "CHECKMATE_SHADOWS": "a=127.0.0.60:1,b=127.0.0.61:2",
        }
    )
    assert plain.shadow_data_address(1) == ("127.0.0.61", CHECKMATE_UDP_PORT)
    assert plain.unnamed_shadows == frozenset()  # named: rank 0 checks each hello's name
    mixed = CheckmateConfig.from_env(
        {
            "RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "CHECKMATE_SHADOWS": "127.0.0.60:1,b=127.0.0.61:2",
        }
    )
    assert list(mixed.shadow_control) == ["shadow0", "b"] and mixed.unnamed_shadows == {"shadow0"}
