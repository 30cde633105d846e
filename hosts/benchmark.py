"""Benchmark (not a test): Checkmate ring all-reduce and DDP step time vs gloo, on loopback.

    .venv/bin/python -m hosts.benchmark [--worlds 2 3 4] [--mib 16] [--reps 7] [--steps 10]

Each world size N runs in its own processes (one per rank, ``torch.set_num_threads(1)``) and
measures, per rank: gloo's all-reduce and Checkmate's ring all-reduce
(:class:`hosts.ring_allreduce.RingAllReduce` on :class:`hosts.transport.Transport`) of the same
tensor, *interleaved* (gloo, ring, gloo, ring, ...: load from other processes on the machine
falls on both alike), each with its wall time and the process's CPU time (all threads); then
the step time of an MLP under DDP with gloo and with the Checkmate comm hook
(:func:`hosts.ddp.enable_checkmate`; ``--steps 0`` skips it). It reports bus bandwidth
(``2(N-1)/N * bytes / time``, the NCCL convention, median over the repetitions), the median
CPU milliseconds per all-reduce, the transport's retransmissions and GSO writes, the kernel's
``UdpRcvbufErrors`` during the ring's repetitions, and the load average; writes JSON and prints
a table. Ranks are bound to 127.0.0.(10+r) on the Checkmate UDP port; gloo rendezvous through
a file.

The same measurement through the emulated network (ranks in Mininet hosts, every packet
through the software switch) is :mod:`experiments.bench.transport`; it runs each rank as
``python -m hosts.benchmark --rank-spec FILE`` inside a host.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import os
import pathlib
import queue
import secrets
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

LOOPBACK_OUT = "results/hosts_bench.json"


def udp_rcvbuf_errors() -> int | None:
    """The kernel's UdpRcvbufErrors counter of this network namespace (datagrams dropped at full buffers)."""
    try:
        lines = pathlib.Path("/proc/net/snmp").read_text().splitlines()
    except OSError:
        return None
    rows = [line.split() for line in lines if line.startswith("Udp:")]
    if len(rows) < 2 or "RcvbufErrors" not in rows[0]:
        return None
    return int(rows[1][rows[0].index("RcvbufErrors")])


def rank_benchmark(
    rank: int,
    init_method: str,
    workers: Sequence[tuple[str, int]],
    mib: int,
    reps: int,
    steps: int,
    timeout: float,
) -> dict[str, Any]:
    """One rank's measurements; every rank of the world calls it at once (``workers[r]`` is rank r's)."""
    import torch
    import torch.distributed as dist

    from hosts.ring_allreduce import ReduceOp, RingAllReduce, RingConfig
    from hosts.transport import Transport, TransportConfig

    torch.set_num_threads(1)
    world = len(workers)
    addresses = tuple((str(ip), int(port)) for ip, port in workers)
    collective_timeout = min(timeout, 120.0)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=collective_timeout),
    )
    n = mib * (1 << 20) // 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    result: dict[str, Any] = {"bind": list(addresses[rank])}

    # all-reduce, interleaved: gloo, ring, gloo, ring, ... (a separate job id; DDP below makes its own)
    transport = Transport(TransportConfig(bind=addresses[rank], peer_timeout=30.0))
    ring = RingAllReduce(
        transport, RingConfig(job_id=4242, rank=rank, workers=addresses, timeout=collective_timeout)
    )
    timings: dict[str, list[float]] = {k: [] for k in ("gloo_s", "gloo_cpu_s", "ring_s", "ring_cpu_s")}
    ring_drops = 0
    for i in range(reps):
        y = x.clone()
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        dist.all_reduce(y)
        timings["gloo_s"].append(time.perf_counter() - t0)
        timings["gloo_cpu_s"].append(time.process_time() - c0)
        dist.barrier()
        before = udp_rcvbuf_errors()
        c0, t0 = time.process_time(), time.perf_counter()
        ring.allreduce(i, 0, x, ReduceOp.SUM)
        timings["ring_s"].append(time.perf_counter() - t0)
        timings["ring_cpu_s"].append(time.process_time() - c0)
        after = udp_rcvbuf_errors()
        if before is not None and after is not None:
            ring_drops += after - before
    result["gloo_allreduce_s"] = timings["gloo_s"]
    result["gloo_allreduce_cpu_s"] = timings["gloo_cpu_s"]
    result["ring_allreduce_s"] = timings["ring_s"]
    result["ring_allreduce_cpu_s"] = timings["ring_cpu_s"]
    result["udp_rcvbuf_errors_during_ring"] = ring_drops
    transport.wait_idle(10.0)
    result["ring_transport"] = transport.stats()
    dist.barrier()
    ring.close()
    transport.close()

    if steps > 0:
        result["gloo_step_s"] = _step_times(
            rank, world, addresses, steps, collective_timeout, checkmate=False
        )
        result["checkmate_step_s"] = _step_times(
            rank, world, addresses, steps, collective_timeout, checkmate=True
        )
    dist.barrier()
    dist.destroy_process_group()
    return result


def _step_times(
    rank: int, world: int, addresses: tuple[tuple[str, int], ...], steps: int, timeout: float, checkmate: bool
) -> list[float]:
    """DDP step times of a 2.1M-parameter MLP, over gloo or with the Checkmate comm hook."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hosts.ddp import CheckmateConfig, enable_checkmate

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.Linear(1024, 10),
    )
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    config = CheckmateConfig(
        job_id=1,
        rank=rank,
        world_size=world,
        bind=addresses[rank],
        workers=addresses,
        timeout=timeout,
        peer_timeout=30.0,
    )
    agent = enable_checkmate(ddp, opt, config) if checkmate else None
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


def summarize(world: int, mib: int, r0: dict[str, Any]) -> dict[str, Any]:
    """One table row from rank 0's measurements."""
    nbytes = mib * (1 << 20)
    factor = 2 * (world - 1) / world

    def busbw(times: list[float]) -> float:
        return factor * nbytes / statistics.median(times) / 1e6

    stats = r0["ring_transport"]
    gloo, ring = busbw(r0["gloo_allreduce_s"]), busbw(r0["ring_allreduce_s"])
    row = {
        "world_size": world,
        "bytes": nbytes,
        "gloo_busbw_MBps": gloo,
        "checkmate_busbw_MBps": ring,
        "ratio": ring / gloo,
        "gloo_cpu_ms": 1e3 * statistics.median(r0["gloo_allreduce_cpu_s"]),
        "checkmate_cpu_ms": 1e3 * statistics.median(r0["ring_allreduce_cpu_s"]),
        "ring_retransmits": sum(v for k, v in stats.items() if k.startswith("retransmit.")),
        "ring_retransmits_by_cause": {k[11:]: v for k, v in stats.items() if k.startswith("retransmit.")},
        "ring_gso_writes": stats.get("gso_writes", 0),
        "ring_datagrams_sent": stats.get("data_sent", 0),
        "udp_rcvbuf_errors_during_ring": r0.get("udp_rcvbuf_errors_during_ring"),
    }
    if "gloo_step_s" in r0:
        row["gloo_step_ms"] = 1e3 * statistics.median(r0["gloo_step_s"])
        row["checkmate_step_ms"] = 1e3 * statistics.median(r0["checkmate_step_s"])
    return row


# ---- loopback ---------------------------------------------------------------------------------
def _rank_main(
    rank: int, world: int, store: str, mib: int, reps: int, steps: int, timeout: float, out: Any
) -> None:
    from checkmate.wire import CHECKMATE_UDP_PORT

    workers = [(f"127.0.0.{10 + r}", CHECKMATE_UDP_PORT) for r in range(world)]
    out.put((rank, rank_benchmark(rank, f"file://{store}", workers, mib, reps, steps, timeout)))


def run(world: int, mib: int, reps: int, steps: int, timeout: float = 600.0) -> dict[str, Any]:
    """One world size on loopback: its table row."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, f"{tmp}/store", mib, reps, steps, timeout, out))
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
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
    return summarize(world, mib, results[0])


def rank_from_spec(path: pathlib.Path) -> int:
    """``--rank-spec``: run one rank (in an emulated host) as the spec file says; write its result."""
    spec = json.loads(path.read_text())
    result = rank_benchmark(
        spec["rank"],
        spec["init_method"],
        [tuple(w) for w in spec["workers"]],
        spec["mib"],
        spec["reps"],
        spec["steps"],
        spec["timeout"],
    )
    out = pathlib.Path(spec["result"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)
    return 0


# ---- the command ------------------------------------------------------------------------------
def format_table(rows: Sequence[dict[str, Any]]) -> str:
    columns = (
        ("N", 2),
        ("MiB", 4),
        ("gloo MB/s", 10),
        ("ckm MB/s", 9),
        ("ratio", 6),
        ("gloo CPU ms", 12),
        ("ckm CPU ms", 11),
        ("gloo step ms", 13),
        ("ckm step ms", 12),
        ("rexmit", 6),
        ("rcvbuf drops", 12),
    )
    lines = [" ".join(f"{h:>{w}}" for h, w in columns)]
    for r in rows:
        step = (
            f"{r['gloo_step_ms']:>13.1f} {r['checkmate_step_ms']:>12.1f}"
            if "gloo_step_ms" in r
            else f"{'-':>13} {'-':>12}"
        )
        drops = r.get("udp_rcvbuf_errors_during_ring")
        lines.append(
            f"{r['world_size']:>2} {r['bytes'] >> 20:>4} {r['gloo_busbw_MBps']:>10.1f} "
            f"{r['checkmate_busbw_MBps']:>9.1f} {r['ratio']:>6.2f} {r['gloo_cpu_ms']:>12.1f} "
            f"{r['checkmate_cpu_ms']:>11.1f} {step} {r['ring_retransmits']:>6} "
            f"{'-' if drops is None else drops:>12}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every transport benchmark takes (loopback here, the emulated network elsewhere)."""
    parser.add_argument("--worlds", type=_world, nargs="+", default=[2, 3, 4])
    parser.add_argument("--mib", type=_positive, default=16, help="all-reduce size in MiB (fp32)")
    parser.add_argument(
        "--reps", type=_positive, default=7, help="interleaved repetitions of each all-reduce"
    )
    parser.add_argument("--steps", type=_non_negative, default=10, help="DDP steps per system (0: none)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one world size may take")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def _world(text: str) -> int:
    value = int(text)
    if not 2 <= value <= 64:
        raise argparse.ArgumentTypeError(f"world size {text} is outside 2..64")
    return value


def start_document(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """The JSON document's head: mode, machine, settings, the load average now."""
    # The transports authenticate their control datagrams: the benchmark's ranks share a fresh secret.
    os.environ.setdefault("CHECKMATE_JOB_SECRET", secrets.token_hex(32))
    return {
        "mode": mode,
        "machine_cores": os.cpu_count(),
        "settings": {"mib": args.mib, "reps": args.reps, "steps": args.steps, "worlds": args.worlds},
        "interleaved": True,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def finish_document(document: dict[str, Any], path: pathlib.Path, notes: Sequence[str] = ()) -> None:
    """Write the JSON (atomically) and print the table, ``notes`` and the load averages."""
    document["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    tmp.replace(path)
    report = [format_table(document["rows"]), *notes]
    report.append(
        f"load average: start {document['load_average_at_start']}, end {document['load_average_at_end']}"
    )
    report.append(f"wrote {path}")
    print("\n".join(report))  # noqa: T201 - a benchmark script reports on stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(LOOPBACK_OUT), help="JSON output")
    parser.add_argument("--rank-spec", type=pathlib.Path, help=argparse.SUPPRESS)  # one rank in a host
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.rank_spec is not None:  # the secret comes from the launching benchmark's environment
        os.environ.setdefault("CHECKMATE_JOB_SECRET", secrets.token_hex(32))
        return rank_from_spec(args.rank_spec)
    document = start_document("loopback", args)
    document["rows"] = [run(w, args.mib, args.reps, args.steps, args.timeout) for w in args.worlds]
    finish_document(document, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
