"""Benchmark (not a test): Checkmate ring all-reduce and DDP step time vs gloo on loopback.

    .venv/bin/python -m hosts.benchmark [--worlds 2 4] [--mib 16] [--reps 5] [--steps 10]

Each world size runs in its own processes (one per rank, ``torch.set_num_threads(1)``),
ranks bound to 127.0.0.(10+r):48879. Reports bus bandwidth
(``2(N-1)/N * bytes / time``, the NCCL convention) and mean DDP step time for an MLP,
writes JSON to results/hosts_bench.json and prints a table. On an emulated network,
run the same worker function with CHECKMATE_BIND / MASTER_ADDR pointing into it.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import pathlib
import queue
import statistics
import tempfile
import time
from typing import Any

logger = logging.getLogger(__name__)


def _rank_main(rank: int, world: int, store: str, mib: int, reps: int, steps: int, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hosts.ddp import enable_checkmate
    from hosts.ring_allreduce import ReduceOp, RingAllReduce, RingConfig
    from hosts.transport import Transport, TransportConfig

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    n = mib * (1 << 20) // 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    result: dict[str, Any] = {}

    # all-reduce: gloo
    times = []
    for _ in range(reps):
        y = x.clone()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(y)
        times.append(time.perf_counter() - t0)
    result["gloo_allreduce_s"] = times

    # all-reduce: Checkmate ring (a separate job id; the DDP agent below makes its own transport)
    workers = tuple((f"127.0.0.{10 + r}", 48879) for r in range(world))
    transport = Transport(TransportConfig(bind=workers[rank], peer_timeout=30.0))
    ring = RingAllReduce(transport, RingConfig(job_id=4242, rank=rank, workers=workers, timeout=120.0))
    times = []
    for i in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        ring.allreduce(i, 0, x, ReduceOp.SUM)
        times.append(time.perf_counter() - t0)
    result["ring_allreduce_s"] = times
    result["ring_transport"] = transport.stats()
    transport.wait_idle(10.0)
    dist.barrier()
    ring.close()
    transport.close()

    # DDP step time
    def step_times(checkmate: bool) -> list[float]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(1024, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 1024),
            torch.nn.Linear(1024, 10),
        )
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        agent = enable_checkmate(ddp, opt) if checkmate else None
        g = torch.Generator().manual_seed(rank)
        out_times = []
        for _ in range(steps + 1):
            data = torch.randn(32, 1024, generator=g)
            target = torch.randint(0, 10, (32,), generator=g)
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(ddp(data), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out_times.append(time.perf_counter() - t0)
        if agent is not None:
            agent.close()
        return out_times[1:]  # the first step builds buckets

    result["gloo_step_s"] = step_times(False)
    result["checkmate_step_s"] = step_times(True)
    dist.barrier()
    dist.destroy_process_group()
    out.put((rank, result))


def run(world: int, mib: int, reps: int, steps: int, timeout: float = 600.0) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, f"{tmp}/store", mib, reps, steps, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in range(world):
                rank, value = out.get(timeout=timeout)
                results[rank] = value
        except queue.Empty:
            raise TimeoutError(f"benchmark with {world} ranks did not finish in {timeout}s") from None
        finally:
            for p in procs:
                p.join(timeout=10)
    r0 = results[0]
    nbytes = mib * (1 << 20)
    factor = 2 * (world - 1) / world

    def busbw(times: list[float]) -> float:
        return factor * nbytes / statistics.median(times) / 1e6

    return {
        "world_size": world,
        "bytes": nbytes,
        "gloo_busbw_MBps": busbw(r0["gloo_allreduce_s"]),
        "checkmate_busbw_MBps": busbw(r0["ring_allreduce_s"]),
        "gloo_step_ms": 1e3 * statistics.median(r0["gloo_step_s"]),
        "checkmate_step_ms": 1e3 * statistics.median(r0["checkmate_step_s"]),
        "ring_retransmits": sum(v for k, v in r0["ring_transport"].items() if k.startswith("retransmit.")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--mib", type=int, default=16, help="all-reduce size in MiB (fp32)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="results/hosts_bench.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = [run(w, args.mib, args.reps, args.steps) for w in args.worlds]
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine_cores": os.cpu_count(), "rows": rows}, indent=2) + "\n")
    header = " ".join(
        f"{h:>{w}}"
        for h, w in (
            ("N", 2),
            ("MiB", 4),
            ("gloo MB/s", 10),
            ("ckm MB/s", 9),
            ("gloo step ms", 13),
            ("ckm step ms", 12),
            ("rexmit", 6),
        )
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"{r['world_size']:>2} {r['bytes'] >> 20:>4} {r['gloo_busbw_MBps']:>10.1f} "
            f"{r['checkmate_busbw_MBps']:>9.1f} {r['gloo_step_ms']:>13.1f} {r['checkmate_step_ms']:>12.1f} "
            f"{r['ring_retransmits']:>6}"
        )
    print("\n".join(lines))  # noqa: T201 - a benchmark script reports on stdout
    print(f"wrote {path}")  # noqa: T201
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
