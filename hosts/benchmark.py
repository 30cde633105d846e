"""Benchmark (not a test): Checkmate ring all-reduce and DDP step time vs gloo, on loopback.

    .venv/bin/python -m hosts.benchmark [--worlds 2 3 4] [--mib 16] [--reps 7] [--warmup 6] [--steps 10]

Each world size N runs in its own processes (one per rank, ``torch.set_num_threads(1)``) and
measures, per rank: gloo's all-reduce and Checkmate's ring all-reduce
(:class:`hosts.ring_allreduce.RingAllReduce` on :class:`hosts.transport.Transport`) of the same
tensor on each of the transport's data paths (``--datapath native|python|both``; both by
default), *interleaved* (gloo, native ring, python ring, gloo, ...: load from other processes
on the machine falls on all alike), each with its wall time and the process's CPU time (all threads); then
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
DATAPATHS = ("native", "python")
"""The transport's data paths (:class:`hosts.transport.TransportConfig` ``datapath``), measured in turn."""
DEFAULT_WARMUP = 6
"""Untimed repetitions before the timed ones: ``RingConfig.keep_iterations`` (4) + 2, so every timed
all-reduce of the ring writes into a reused result buffer (steady state, as in training)."""


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
    datapaths: Sequence[str] = DATAPATHS,
    warmup: int = 0,
) -> dict[str, Any]:
    """One rank's measurements; every rank of the world calls it at once (``workers[r]`` is rank r's).

    One transport per data path in ``datapaths`` (the first on ``workers[r]``, the next on the
    following ports); each repetition runs gloo, then the ring on each data path in turn. The
    first ``warmup`` repetitions are not timed: after ``RingConfig.keep_iterations`` of them the
    ring reuses released result buffers, as it does in training where the buckets repeat every
    iteration (a fresh 16 MiB result faults in ~4,000 pages; gloo reduces in place).
    """
    import torch
    import torch.distributed as dist

    from hosts.ring_allreduce import RingAllReduce
    from hosts.ring_config import ReduceOp, RingConfig
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
    result: dict[str, Any] = {"bind": list(addresses[rank]), "warmup": warmup}

    # all-reduce, interleaved: gloo, ring (each data path), gloo, ring, ... (separate job ids;
    # DDP below makes its own)
    rings = []
    for k, datapath in enumerate(datapaths):
        bound = tuple((ip, port + k) for ip, port in addresses)
        transport = Transport(TransportConfig(bind=bound[rank], peer_timeout=30.0, datapath=datapath))
        if transport.datapath != datapath:
            raise RuntimeError(f"the {datapath} data path is not available here")
        ring = RingAllReduce(
            transport, RingConfig(job_id=4242 + k, rank=rank, workers=bound, timeout=collective_timeout)
        )
        rings.append((datapath, transport, ring))
    timings: dict[str, list[float]] = {"gloo_s": [], "gloo_cpu_s": []}
    for datapath in datapaths:
        timings[f"{datapath}_s"], timings[f"{datapath}_cpu_s"] = [], []
    ring_drops = dict.fromkeys(datapaths, 0)
    for i in range(warmup + reps):
        timed = i >= warmup
        y = x.clone()
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        dist.all_reduce(y)
        if timed:
            timings["gloo_s"].append(time.perf_counter() - t0)
            timings["gloo_cpu_s"].append(time.process_time() - c0)
        for datapath, _, ring in rings:
            dist.barrier()
            before = udp_rcvbuf_errors()
            c0, t0 = time.process_time(), time.perf_counter()
            ring.allreduce(i, 0, x, ReduceOp.SUM)
            if not timed:
                continue
            timings[f"{datapath}_s"].append(time.perf_counter() - t0)
            timings[f"{datapath}_cpu_s"].append(time.process_time() - c0)
            after = udp_rcvbuf_errors()
            if before is not None and after is not None:
                ring_drops[datapath] += after - before
    result["gloo_allreduce_s"] = timings["gloo_s"]
    result["gloo_allreduce_cpu_s"] = timings["gloo_cpu_s"]
    result["datapaths"] = list(datapaths)
    for k, (datapath, transport, _ring) in enumerate(rings):
        prefix = "ring" if k == 0 else f"ring_{datapath}"  # "ring_*": the first (the default) path
        for name in (prefix, f"ring_{datapath}"):
            result[f"{name}_allreduce_s"] = timings[f"{datapath}_s"]
            result[f"{name}_allreduce_cpu_s"] = timings[f"{datapath}_cpu_s"]
            result[f"udp_rcvbuf_errors_during_{name}"] = ring_drops[datapath]
        transport.wait_idle(10.0)
        result[f"{prefix}_transport"] = result[f"ring_{datapath}_transport"] = transport.stats()
    dist.barrier()
    for _, transport, ring in rings:
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
    for datapath in r0.get("datapaths", []):
        dstats = r0[f"ring_{datapath}_transport"]
        row[f"{datapath}_busbw_MBps"] = busbw(r0[f"ring_{datapath}_allreduce_s"])
        row[f"{datapath}_ratio"] = row[f"{datapath}_busbw_MBps"] / gloo
        row[f"{datapath}_cpu_ms"] = 1e3 * statistics.median(r0[f"ring_{datapath}_allreduce_cpu_s"])
        row[f"{datapath}_retransmits"] = sum(v for k, v in dstats.items() if k.startswith("retransmit."))
        row[f"{datapath}_udp_rcvbuf_errors"] = r0.get(f"udp_rcvbuf_errors_during_ring_{datapath}")
    if r0.get("datapaths"):
        row["checkmate_datapath"] = r0["datapaths"][0]
    if "gloo_step_s" in r0:
        row["gloo_step_ms"] = 1e3 * statistics.median(r0["gloo_step_s"])
        row["checkmate_step_ms"] = 1e3 * statistics.median(r0["checkmate_step_s"])
    return row


# ---- loopback ---------------------------------------------------------------------------------
def _rank_main(
    rank: int,
    world: int,
    store: str,
    mib: int,
    reps: int,
    steps: int,
    timeout: float,
    datapaths: Sequence[str],
    warmup: int,
    out: Any,
) -> None:
    from checkmate.wire import CHECKMATE_UDP_PORT

    workers = [(f"127.0.0.{10 + r}", CHECKMATE_UDP_PORT) for r in range(world)]
    result = rank_benchmark(rank, f"file://{store}", workers, mib, reps, steps, timeout, datapaths, warmup)
    out.put((rank, result))


def run(
    world: int,
    mib: int,
    reps: int,
    steps: int,
    timeout: float = 600.0,
    datapaths: Sequence[str] = DATAPATHS,
    warmup: int = 0,
) -> dict[str, Any]:
    """One world size on loopback: its table row."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, world, f"{tmp}/store", mib, reps, steps, timeout, tuple(datapaths), warmup, out),
            )
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
        tuple(spec.get("datapaths", DATAPATHS[:1])),
        spec.get("warmup", 0),
    )
    out = pathlib.Path(spec["result"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)
    return 0


# ---- the command ------------------------------------------------------------------------------
def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Busbw (MB/s) and CPU ms per all-reduce of gloo and each data path; the DDP step times."""
    datapaths = [d for d in DATAPATHS if rows and f"{d}_busbw_MBps" in rows[0]]
    names = datapaths or ["ckm"]
    header = ["N", "MiB", "gloo MB/s"]
    header += [f"{d} MB/s" for d in names] + [f"{d} ratio" for d in names]
    header += ["gloo CPU ms"] + [f"{d} CPU ms" for d in names]
    header += ["gloo step ms", "ckm step ms", "rexmit", "rcvbuf drops"]
    widths = [max(len(h), 6) for h in header]
    lines = [" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True))]
    for r in rows:
        keys = [f"{d}_" for d in datapaths] if datapaths else ["checkmate_"]
        cells = [str(r["world_size"]), str(r["bytes"] >> 20), f"{r['gloo_busbw_MBps']:.1f}"]
        cells += [f"{r[k + 'busbw_MBps']:.1f}" for k in keys]
        cells += [f"{r[k + 'ratio']:.2f}" if k != "checkmate_" else f"{r['ratio']:.2f}" for k in keys]
        cells += [f"{r['gloo_cpu_ms']:.1f}"] + [f"{r[k + 'cpu_ms']:.1f}" for k in keys]
        if "gloo_step_ms" in r:
            cells += [f"{r['gloo_step_ms']:.1f}", f"{r['checkmate_step_ms']:.1f}"]
        else:
            cells += ["-", "-"]
        drops = r.get("udp_rcvbuf_errors_during_ring")
        cells += [str(r["ring_retransmits"]), "-" if drops is None else str(drops)]
        lines.append(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every transport benchmark takes (loopback here, the emulated network elsewhere)."""
    parser.add_argument("--worlds", type=_world, nargs="+", default=[2, 3, 4])
    parser.add_argument("--mib", type=_positive, default=16, help="all-reduce size in MiB (fp32)")
    parser.add_argument(
        "--reps", type=_positive, default=7, help="interleaved repetitions of each all-reduce"
    )
    parser.add_argument(
        "--warmup",
        type=_non_negative,
        default=DEFAULT_WARMUP,
        help="untimed interleaved repetitions first (the ring's result buffers are reused from the 6th on)",
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
        "settings": {
            "mib": args.mib,
            "reps": args.reps,
            "warmup": args.warmup,
            "steps": args.steps,
            "worlds": args.worlds,
        },
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
    parser.add_argument(
        "--datapath",
        choices=[*DATAPATHS, "both"],
        default="both",
        help="the transport's data path(s) measured beside gloo (both: native and python, interleaved)",
    )
    args = parser.parse_args(argv)
    datapaths = DATAPATHS if args.datapath == "both" else (args.datapath,)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.rank_spec is not None:  # the secret comes from the launching benchmark's environment
        if not any(os.environ.get(v) for v in ("CHECKMATE_JOB_SECRET", "CHECKMATE_JOB_SECRET_FILE")):
            os.environ["CHECKMATE_JOB_SECRET"] = secrets.token_hex(32)  # a lone rank: its own
        return rank_from_spec(args.rank_spec)
    document = start_document("loopback", args)
    document["datapaths"] = list(datapaths)
    document["rows"] = [
        run(w, args.mib, args.reps, args.steps, args.timeout, datapaths, args.warmup) for w in args.worlds
    ]
    finish_document(document, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
