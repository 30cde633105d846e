"""Benchmark (not a test): where the native ring's CPU goes per all-reduce, next to gloo's, on loopback.

    .venv/bin/python -m experiments.bench.transport_profile --world 2 [--mib 16] [--warmup 6] [--reps 30]
        [--only native|gloo] [--tool perf|strace] [--ab OLD_BUILD.so]

One process per rank (ranks on 127.0.0.(10+r)), gloo and the native ring interleaved as in
:mod:`hosts.benchmark`, after ``--warmup`` untimed repetitions. Around each all-reduce, per rank:
wall time, ``getrusage`` user and system time, minor faults, voluntary and involuntary context
switches, and the CPU time of each thread by name (``/proc/self/task/*/schedstat``); over the
timed loop, the transport's and the ring's counters per all-reduce. ``--ab`` loads another build
of ``hosts/native/datapath.c`` compiled as module ``_datapath_old`` (``PyInit__datapath`` and the
module name renamed in the source, setup.py's flags) and measures its ring too,
in the same processes on other ports (``old``). ``--tool`` attaches ``perf record`` or
``strace -c -f`` to rank 0 for the timed loop only (``--tool-out``). Prints JSON (docs/benchmarks.md,
"The native data path", third round).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import pathlib
import resource
import secrets
import signal
import statistics
import subprocess
import tempfile
import time
from typing import Any


def thread_ns() -> dict[str, int]:
    """CPU nanoseconds of this process's threads, summed by thread name."""
    out: dict[str, int] = {}
    task = pathlib.Path("/proc/self/task")
    for tid in os.listdir(task):
        try:
            comm = (task / tid / "comm").read_text().strip()
            ns = int((task / tid / "schedstat").read_text().split()[0])
        except OSError:
            continue
        out[comm] = out.get(comm, 0) + ns
    return out


def ru() -> tuple[float, float, int, int, int]:
    """user s, system s, minor faults, voluntary and involuntary context switches of the process."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return (r.ru_utime, r.ru_stime, r.ru_minflt, r.ru_nvcsw, r.ru_nivcsw)


def rank_main(rank: int, world: int, store: str, args: argparse.Namespace, out: Any) -> None:
    """One rank: the measurements, put on ``out`` as (rank, summary)."""
    import torch
    import torch.distributed as dist

    from hosts.ring_allreduce import RingAllReduce
    from hosts.ring_config import ReduceOp, RingConfig
    from hosts.transport import Transport, TransportConfig

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    workers = tuple((f"127.0.0.{10 + r}", 47000) for r in range(world))
    transport = Transport(TransportConfig(bind=workers[rank], peer_timeout=30.0, datapath="native"))
    ring = RingAllReduce(transport, RingConfig(job_id=4242, rank=rank, workers=workers, timeout=120))
    rings = {"native": ring}
    if args.ab:
        import importlib.machinery
        import importlib.util

        import hosts.native as hn

        loader = importlib.machinery.ExtensionFileLoader("_datapath_old", args.ab)
        spec = importlib.util.spec_from_loader("_datapath_old", loader)
        assert spec is not None
        oldmod = importlib.util.module_from_spec(spec)
        loader.exec_module(oldmod)
        orig = hn.load
        hn.load = lambda: oldmod
        try:
            w2 = tuple((ip, port + 100) for ip, port in workers)
            t2 = Transport(TransportConfig(bind=w2[rank], peer_timeout=30.0, datapath="native"))
        finally:
            hn.load = orig
        rings["old"] = RingAllReduce(t2, RingConfig(job_id=4243, rank=rank, workers=w2, timeout=120))
    n = args.mib * (1 << 20) // 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    systems = ["gloo", *rings] if args.only is None else [args.only]
    its = dict.fromkeys(rings, 0)

    def one(system: str) -> tuple[float, tuple[float, float, int, int, int], dict[str, int]]:
        if system == "gloo":
            y = x.clone()
            dist.barrier()
            t = (time.perf_counter(), ru(), thread_ns())
            dist.all_reduce(y)
        else:
            dist.barrier()
            t = (time.perf_counter(), ru(), thread_ns())
            rings[system].allreduce(its[system], 0, x, ReduceOp.SUM)
            its[system] += 1
        return t

    for _ in range(args.warmup):
        for s in ["gloo", *rings]:
            one(s)
    tool = None
    if rank == 0 and args.tool:
        pid = str(os.getpid())
        if args.tool == "perf":
            tool = subprocess.Popen(
                ["perf", "record", "-e", "cpu-clock", "-F", "2000", "-g", "-p", pid, "-o", args.tool_out],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        else:
            tool = subprocess.Popen(
                ["strace", "-c", "-f", "-p", pid, "-o", args.tool_out], stderr=subprocess.DEVNULL
            )
        time.sleep(1.5)
    dist.barrier()
    acc: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    st0 = transport.stats()
    rs0 = ring.stats()
    for _ in range(args.reps):
        for s in systems:
            w0, r0, th0 = one(s)
            w1, r1, th1 = time.perf_counter(), ru(), thread_ns()
            acc[s].append(
                {
                    "wall": w1 - w0,
                    "user": r1[0] - r0[0],
                    "sys": r1[1] - r0[1],
                    "minflt": r1[2] - r0[2],
                    "nvcsw": r1[3] - r0[3],
                    "nivcsw": r1[4] - r0[4],
                    "threads": {k: (th1.get(k, 0) - th0.get(k, 0)) / 1e6 for k in th1},
                }
            )
    st1 = transport.stats()
    rs1 = ring.stats()
    if tool is not None:
        tool.send_signal(signal.SIGINT)
        tool.wait(timeout=60)
    dist.barrier()
    summary: dict[str, Any] = {}
    nb = args.mib * (1 << 20)
    for s, rows in acc.items():

        def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
            return statistics.median(r[key] for r in rows)

        def mean(key: str, rows: list[dict[str, Any]] = rows) -> float:
            return statistics.fmean(r[key] for r in rows)

        names = sorted({k for r in rows for k in r["threads"]})
        summary[s] = {
            "busbw_MBps": 2 * (world - 1) / world * nb / med("wall") / 1e6,
            "wall_ms_median": 1e3 * med("wall"),
            "cpu_ms_median": 1e3 * statistics.median(r["user"] + r["sys"] for r in rows),
            "user_ms_mean": 1e3 * mean("user"),
            "sys_ms_mean": 1e3 * mean("sys"),
            "minflt_mean": mean("minflt"),
            "nvcsw_mean": mean("nvcsw"),
            "nivcsw_mean": mean("nivcsw"),
            "threads_ms_mean": {
                k: round(statistics.fmean(r["threads"].get(k, 0.0) for r in rows), 3) for k in names
            },
        }
    reps = args.reps
    summary["native_counters_per_op"] = {
        k: round((st1.get(k, 0) - st0.get(k, 0)) / reps, 1)
        for k in st1
        if isinstance(st1.get(k), int) and st1.get(k, 0) != st0.get(k, 0)
    }
    summary["ring_counters_per_op"] = {
        k: round((rs1.get(k, 0) - rs0.get(k, 0)) / reps, 1) for k in rs1 if rs1.get(k, 0) != rs0.get(k, 0)
    }
    for r in rings.values():
        r.close()
        r.transport.close()
    dist.destroy_process_group()
    out.put((rank, summary))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--only", choices=["gloo", "native"])
    p.add_argument("--tool", choices=["perf", "strace"])
    p.add_argument("--tool-out", default="transport_profile.out", help="perf.data or strace summary")
    p.add_argument("--ab", help="an old build of the extension (module _datapath_old): measured as 'old'")
    args = p.parse_args()
    os.environ.setdefault("CHECKMATE_JOB_SECRET", secrets.token_hex(32))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=rank_main, args=(r, args.world, f"{tmp}/s", args, q))
            for r in range(args.world)
        ]
        for pr in procs:
            pr.start()
        res = dict(q.get(timeout=600) for _ in procs)
        for pr in procs:
            pr.join(30)
    document = {"load": os.getloadavg(), "args": vars(args), "rank0": res[0], "rank1": res[1], "all": res}
    print(json.dumps(document, indent=1))  # noqa: T201 - a benchmark script reports on stdout
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
