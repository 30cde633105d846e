"""Benchmark (not a test): Checkmate's ring all-reduce next to gloo's through the emulated network.

    .venv/bin/python -m experiments.bench.transport [TOPOLOGY] [--worlds 2 3 4] [--mib 16] [--reps 7]

(root; TOPOLOGY defaults to topologies/single.json.) The measurements are
:func:`hosts.benchmark.rank_benchmark`'s (interleaved gloo and ring all-reduces, wall and CPU
time, DDP step times); here the topology is brought up in Mininet on the embedded switch target
(:class:`experiments.bench.network.BenchNetwork`: its switches renamed, its own run directory,
so it runs beside other networks) and rank r runs in worker host r+1 of the topology (h1..hN
for ``single.json``), as ``python -m hosts.benchmark --rank-spec FILE``, bound to that host's IP
on the Checkmate UDP port; gloo's rendezvous and traffic go through the same network
(``MASTER_ADDR`` = the first worker's IP). No job is registered at the switch: the ring's
tagged all-gather packets (REPLICATE set) are forwarded like any other, nothing is copied to a
shadow, so this measures the transport itself (the "ideal transport" case of ``make bench``).
The network is always taken down at the end, also on an error or Ctrl-C; the switch's drop
counters are reported. Writes results/hosts_bench_network.json by default.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

from hosts.benchmark import add_arguments, finish_document, start_document, summarize

logger = logging.getLogger(__name__)

NETWORK_OUT = "results/hosts_bench_network.json"
DEFAULT_TOPOLOGY = pathlib.Path("topologies/single.json")
MASTER_PORT_BASE = 29600
"""gloo's rendezvous port: this plus the world size (a fresh port per run)."""
IDEAL_NOTE = (
    "no job is registered at the switch: the ring's tagged all-gather packets are forwarded, "
    "nothing is copied to a shadow (the ideal-transport case)"
)


def run_network(
    topology: pathlib.Path,
    worlds: Sequence[int],
    mib: int,
    reps: int,
    steps: int,
    timeout: float,
    work_dir: pathlib.Path | None = None,
    prefix: Sequence[str] = (),
    warmup: int = 0,
) -> dict[str, Any]:
    """Every world size through the emulated network: rows, errors, the switch's drop counters.

    ``prefix``: an argv prefix for every rank (``make bench`` pins them to its worker CPUs).
    """
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
                    "warmup": warmup,
                    "steps": steps,
                    "timeout": timeout,
                    "result": str(folder / f"rank{rank}.json"),
                }
                (folder / f"rank{rank}.spec.json").write_text(json.dumps(spec))
                (folder / f"rank{rank}.json").unlink(missing_ok=True)
                commands[host] = [
                    *prefix,
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "topology", type=pathlib.Path, nargs="?", default=DEFAULT_TOPOLOGY, help="network description (JSON)"
    )
    add_arguments(parser)
    parser.add_argument("--work-dir", type=pathlib.Path, help="its run directory and files")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(NETWORK_OUT), help="JSON output")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if os.geteuid() != 0:
        print("experiments.bench.transport needs root (network namespaces, a software switch)")  # noqa: T201
        return 1
    if not args.topology.is_file():
        print(f"experiments.bench.transport: no topology file {args.topology}")  # noqa: T201
        return 2
    document = start_document("network", args)

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        found = run_network(
            args.topology,
            args.worlds,
            args.mib,
            args.reps,
            args.steps,
            args.timeout,
            args.work_dir,
            warmup=args.warmup,
        )
    except KeyboardInterrupt:
        print("interrupted: the ranks stopped, the network taken down")  # noqa: T201
        return 130
    except ValueError as exc:
        print(f"experiments.bench.transport: {exc}")  # noqa: T201
        return 2
    document.update(found, topology=str(args.topology), target="embedded", note=IDEAL_NOTE)
    drops = {f"{s}:{k}": v for s, d in document["switch_drops"].items() for k, v in d.items()}
    notes = [
        f"network: {args.topology} on the embedded switch ({', '.join(document['switches'])}); {IDEAL_NOTE}",
        f"switch drops: {json.dumps(drops) if drops else 'none'}",
        *(f"N={world} failed: {error[:500]}" for world, error in document["errors"].items()),
    ]
    finish_document(document, args.out, notes)
    return 1 if document.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
