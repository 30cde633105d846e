"""Benchmark (not a test): Checkmate ring all-reduce and DDP step time vs gloo, on loopback or a network.

    .venv/bin/python -m hosts.benchmark [--worlds 2 3 4] [--mib 16] [--reps 5] [--steps 10]
    .venv/bin/python -m hosts.benchmark --network topologies/single.json   (root)

Each world size N runs in its own processes (one per rank, ``torch.set_num_threads(1)``) and
measures, per rank, the same four things: gloo all-reduce, Checkmate ring all-reduce
(:class:`hosts.ring_allreduce.RingAllReduce` on :class:`hosts.transport.Transport`), and the
step time of an MLP under DDP with gloo and with the Checkmate comm hook
(:func:`hosts.ddp.enable_checkmate`). It reports bus bandwidth (``2(N-1)/N * bytes / time``,
the NCCL convention, median over the repetitions) and the median DDP step time, writes JSON
and prints a table.

Loopback (the default): ranks are local processes bound to 127.0.0.(10+r) on the Checkmate UDP
port; gloo rendezvous through a file.

``--network TOPOLOGY``: the topology is brought up in Mininet on the embedded switch target
(:class:`topologies.bench_network.BenchNetwork`: its switches renamed, its own run directory,
so it runs beside other networks) and rank r runs in worker host r+1 of the topology (h1..hN
for ``single.json``), bound to that host's IP on the Checkmate UDP port; gloo's rendezvous
and traffic go through the same network (``MASTER_ADDR`` = the first worker's IP). No job is
registered at the switch: the ring's tagged all-gather packets (REPLICATE set) are forwarded
like any other, nothing is copied to a shadow, so this measures the transport itself (the
"ideal transport" case of ``make bench``). The network is always taken down at the end, also on
an error or Ctrl-C; the switch's drop counters are reported. Writes
results/hosts_bench_network.json by default.
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
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

LOOPBACK_OUT = "results/hosts_bench.json"
NETWORK_OUT = "results/hosts_bench_network.json"
MASTER_PORT_BASE = 29600
"""gloo's rendezvous port in network mode: this plus the world size (a fresh port per run)."""
IDEAL_NOTE = (
    "no job is registered at the switch: the ring's tagged all-gather packets are forwarded, "
    "nothing is copied to a shadow (the ideal-transport case)"
)


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
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hosts.ddp import CheckmateConfig, enable_checkmate
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
    transport = Transport(TransportConfig(bind=addresses[rank], peer_timeout=30.0))
    ring = RingAllReduce(
        transport, RingConfig(job_id=4242, rank=rank, workers=addresses, timeout=collective_timeout)
    )
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
        config = CheckmateConfig(
            job_id=1,
            rank=rank,
            world_size=world,
            bind=addresses[rank],
            workers=addresses,
            timeout=collective_timeout,
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

    result["gloo_step_s"] = step_times(False)
    result["checkmate_step_s"] = step_times(True)
    dist.barrier()
    dist.destroy_process_group()
    return result


def summarize(world: int, mib: int, r0: dict[str, Any]) -> dict[str, Any]:
    """One table row from rank 0's measurements."""
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


# ---- emulated network -------------------------------------------------------------------------
def _rank_from_spec(path: pathlib.Path) -> int:
    """``--rank-spec``: run one rank inside an emulated host, as the spec file says; write its result."""
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


def run_network(
    topology: pathlib.Path,
    worlds: Sequence[int],
    mib: int,
    reps: int,
    steps: int,
    timeout: float,
    work_dir: pathlib.Path | None = None,
) -> dict[str, Any]:
    """Every world size through the emulated network: rows, errors, the switch's drop counters."""
    from checkmate.network import Network
    from checkmate.wire import CHECKMATE_UDP_PORT
    from experiments.bench.network import DEFAULT_WORK_DIR, BenchNetwork, HostCommandError

    available = Network.load(topology).hosts_with_role("worker")
    if max(worlds) > len(available) or min(worlds) < 2:
        raise ValueError(f"--worlds {list(worlds)}: {topology} has {len(available)} workers (need 2..that)")
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    hosts_used: dict[str, list[str]] = {}
    net = BenchNetwork(topology, work_dir or DEFAULT_WORK_DIR)
    try:
        print(f"bringing up {topology} on the embedded switch target ...", file=sys.stderr)  # noqa: T201
        net.up()
        workers = net.workers
        for world in worlds:
            hosts = workers[:world]
            addresses = [(net.address(h), CHECKMATE_UDP_PORT) for h in hosts]
            folder = net.work / f"world{world}"
            folder.mkdir(parents=True, exist_ok=True)
            commands = {}
            for rank, host in enumerate(hosts):
                spec = {
                    "rank": rank,
                    "init_method": f"tcp://{addresses[0][0]}:{MASTER_PORT_BASE + world}",
                    "workers": addresses,
                    "mib": mib,
                    "reps": reps,
                    "steps": steps,
                    "timeout": timeout,
                    "result": str(folder / f"rank{rank}.json"),
                }
                (folder / f"rank{rank}.spec.json").write_text(json.dumps(spec))
                (folder / f"rank{rank}.json").unlink(missing_ok=True)
                commands[host] = [
                    sys.executable,
                    "-m",
                    "hosts.benchmark",
                    "--rank-spec",
                    str(folder / f"rank{rank}.spec.json"),
                ]
            print(f"N={world}: ranks in {', '.join(hosts)} ...", file=sys.stderr)  # noqa: T201
            hosts_used[str(world)] = hosts
            try:
                net.run_on_hosts(commands, folder / "output", timeout)
                r0 = json.loads((folder / "rank0.json").read_text())
            except (HostCommandError, OSError, json.JSONDecodeError) as exc:
                errors[str(world)] = str(exc)[:4000]
                print(f"N={world} failed: {str(exc)[:1500]}", file=sys.stderr)  # noqa: T201
                continue
            rows.append(summarize(world, mib, r0))
    finally:
        drops = net.close()
    return {
        "rows": rows,
        "errors": errors,
        "hosts": hosts_used,
        "switch_drops": drops,
        "switches": [new for _, new in net.config.rename_switches],
    }


# ---- the command ------------------------------------------------------------------------------
def format_table(rows: Sequence[dict[str, Any]]) -> str:
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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--mib", type=int, default=16, help="all-reduce size in MiB (fp32)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--network",
        type=pathlib.Path,
        metavar="TOPOLOGY",
        help="run the ranks in the worker hosts of this topology (e.g. topologies/single.json), "
        "brought up on the embedded switch target (root); default: loopback",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one world size may take")
    parser.add_argument("--work-dir", type=pathlib.Path, help="network mode: its run directory and files")
    parser.add_argument("--out", help=f"JSON output (default {LOOPBACK_OUT}, with --network {NETWORK_OUT})")
    parser.add_argument("--rank-spec", type=pathlib.Path, help=argparse.SUPPRESS)  # one rank in a host
    args = parser.parse_args(argv)
    # The transports authenticate their control datagrams: the benchmark's ranks share a fresh secret.
    os.environ.setdefault("CHECKMATE_JOB_SECRET", secrets.token_hex(32))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.rank_spec is not None:
        return _rank_from_spec(args.rank_spec)
    load_before = [round(x, 2) for x in os.getloadavg()]
    document: dict[str, Any] = {
        "mode": "network" if args.network else "loopback",
        "machine_cores": os.cpu_count(),
        "settings": {"mib": args.mib, "reps": args.reps, "steps": args.steps, "worlds": args.worlds},
        "load_average_at_start": load_before,
    }
    if args.network is None:
        document["rows"] = [run(w, args.mib, args.reps, args.steps, args.timeout) for w in args.worlds]
    else:
        if os.geteuid() != 0:
            print("hosts.benchmark --network needs root (network namespaces, a software switch)")  # noqa: T201
            return 1

        def on_term(signum: int, frame: FrameType | None) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, on_term)
        try:
            found = run_network(
                args.network, args.worlds, args.mib, args.reps, args.steps, args.timeout, args.work_dir
            )
        except KeyboardInterrupt:
            print("interrupted: the ranks stopped, the network taken down")  # noqa: T201
            return 130
        except ValueError as exc:
            print(f"hosts.benchmark: {exc}")  # noqa: T201
            return 2
        document.update(found, topology=str(args.network), target="embedded", note=IDEAL_NOTE)
    document["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    path = pathlib.Path(args.out or (NETWORK_OUT if args.network else LOOPBACK_OUT))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    report = [format_table(document["rows"])]
    if args.network:
        report.append(
            f"network: {args.network} on the embedded switch ({', '.join(document['switches'])}); "
            f"{IDEAL_NOTE}"
        )
        drops = {f"{s}:{k}": v for s, d in document["switch_drops"].items() for k, v in d.items()}
        report.append(f"switch drops: {json.dumps(drops) if drops else 'none'}")
        for world, error in document["errors"].items():
            report.append(f"N={world} failed: {error[:500]}")
    report.append(f"load average: start {load_before}, end {document['load_average_at_end']}")
    report.append(f"wrote {path}")
    print("\n".join(report))  # noqa: T201 - a benchmark script reports on stdout
    return 1 if document.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
