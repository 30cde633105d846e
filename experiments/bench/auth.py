"""What authentication costs per iteration of the demo model (TinyLM), and what a data MAC would.

    .venv/bin/python -m experiments.bench.auth [--iterations 20] [--world 3] [--json results/auth_bench.json]

1. **Counts per iteration, measured.** A ``--world``-rank ring all-reduce (the real
   :class:`~hosts.ring_allreduce.RingAllReduce` over the real transport, one thread
   per rank on loopback) reduces TinyLM's gradient buckets (DDP's bucket cap of the
   demo, 0.1 MB) for ``--iterations`` iterations; the transports' counters give the
   ACK, NACK and DATA datagrams per iteration. The control channel sends one commit
   to each shadow per iteration and gets one certified back (the demo has 2 shadows).
2. **Cost per operation, measured.** Tagging and checking an ACK (the MAC of
   :class:`checkmate.auth.DatagramAuth`), writing plus reading a commit frame (with
   its gradient tags) through a socket pair with the control MAC against the same
   bytes without it, rank 0 tagging every reduced bucket of an iteration and the
   shadows checking them (:class:`checkmate.auth.GradientDigests`), and, once per
   connection, the control handshake (the shadow's hello, the client's proof).
3. **The iteration**: TinyLM's forward, backward and AdamW step for the demo's
   per-rank batch (48 / 3 ranks, context 64) on one thread, measured here
   (``compute_only``: a lower bound of a real iteration, which also communicates, so
   its fraction is an upper bound); that plus the ring's time per iteration measured
   in step 1 (``compute_plus_ring_here``); and Checkmate's mean iteration of TinyLM
   in ``make bench`` (``results/bench.json``, 3 workers and 2 shadows in Mininet)
   when that file is present.

It prints the figures and writes them as JSON. The per-packet MAC that gradient DATA
does *not* carry is costed the same way (sender tags, shadow checks every datagram),
which is the figure docs/security.md's decision rests on.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from checkmate.auth import DatagramAuth, GradientDigests
from checkmate.control import Commit, decode_message, encode_message, recv_message, send_message
from checkmate.control_frame import ControlAuth, bind, process_auth
from checkmate.tensors import tensor_payload
from checkmate.wire import CheckmateHeader, DType, MessageType
from experiments.tiny_lm import ModelConfig, TinyLM
from hosts.ring_allreduce import RingAllReduce
from hosts.ring_config import ReduceOp, RingConfig
from hosts.transport import Transport, TransportConfig, pack_ranges

OUT = "results/auth_bench.json"
SECRET = bytes(range(32))
BUCKET_CAP_BYTES = int(0.1 * 1024 * 1024)
"""The demo's DDP bucket cap (train_lm --bucket-cap-mb 0.1)."""


def _per_call(
    fn: Callable[[], object],
    number: int = 2000,
    repeat: int = 7,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median seconds per call of ``fn`` (wall clock; ``time.thread_time``: this thread's CPU)."""
    samples = []
    for _ in range(repeat):
        t0 = clock()
        for _ in range(number):
            fn()
        samples.append((clock() - t0) / number)
    return statistics.median(samples)


def buckets_of(model: torch.nn.Module) -> list[int]:
    """Element counts of DDP-like buckets (reverse parameter order, capped at the demo's size)."""
    sizes, current = [], 0
    for p in reversed(list(model.parameters())):
        current += p.numel()
        if current * 4 >= BUCKET_CAP_BYTES:
            sizes.append(current)
            current = 0
    if current:
        sizes.append(current)
    return sizes


def ring_counts(world: int, iterations: int, buckets: list[int]) -> dict[str, float]:
    """Datagrams per iteration (all ranks together) of a real ring all-reduce of ``buckets``."""
    addresses = tuple((f"127.0.0.{81 + r}", 47100 + r) for r in range(world))
    transports = [Transport(TransportConfig(bind=addresses[r], peer_timeout=30.0)) for r in range(world)]
    rings = [
        RingAllReduce(t, RingConfig(job_id=77, rank=r, workers=addresses, timeout=60.0))
        for r, t in enumerate(transports)
    ]
    # the transports authenticate with the process's secret; give the job one for this run
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            g = torch.Generator().manual_seed(rank)
            tensors = [torch.randn(n, generator=g) for n in buckets]
            for it in range(iterations):
                for b, x in enumerate(tensors):
                    rings[rank].allreduce(it, b, x.clone(), ReduceOp.SUM)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    seconds = time.perf_counter() - t0
    for t in transports:
        t.wait_idle(5.0)
    stats = [t.stats() for t in transports]
    for ring in rings:
        ring.close()
    for t in transports:
        t.close()
    if errors:
        raise RuntimeError(f"ring all-reduce failed: {errors[0]}")

    def total(key: str) -> float:
        return sum(s.get(key, 0) for s in stats) / iterations

    return {
        "data_per_iteration": total("data_sent"),
        "acks_per_iteration": total("acks_sent"),
        "nacks_per_iteration": total("nacks_sent"),
        "unauthenticated_drops": sum(s.get("drop.unauthenticated", 0) for s in stats),
        "ring_seconds_per_iteration": seconds / iterations,
    }


def datagram_costs(payload_bytes: int) -> dict[str, float]:
    auth = DatagramAuth(SECRET, 1)
    ack = CheckmateHeader(MessageType.ACK, 1, 0, 0, 0, 1024, 1, 77, dtype=DType.NONE).pack()
    ranges = pack_ranges([(80, 81)])
    sealed = b"".join(auth.seal((ack, ranges)))
    view = memoryview(sealed)
    data = bytes(32 + payload_bytes)
    key = auth._key  # the same HMAC a per-packet data MAC would compute
    return {
        "ack_seal_s": _per_call(lambda: auth.seal((ack, ranges))),
        "ack_open_s": _per_call(lambda: auth.open(view)),
        "data_mac_s": _per_call(lambda: hmac.digest(key, data, "sha256")),
        "data_bytes": len(data),
    }


def gradient_tag_costs(buckets: list[int]) -> dict[str, float]:
    """Seconds per iteration for rank 0 to tag every reduced bucket and for the shadows to check them."""
    tensors = [torch.randn(n) for n in buckets]
    rank0, shadow = GradientDigests(SECRET, 1), GradientDigests(SECRET, 1)
    state = {"iteration": 0}

    def tag_all() -> None:
        i = state["iteration"] = state["iteration"] + 1
        for b, t in enumerate(tensors):
            rank0.record(i, b, tensor_payload(t))
        state["digests"] = rank0.take(i)  # type: ignore[assignment]

    def check_all() -> None:
        digests = state["digests"]
        for b, t in enumerate(tensors):
            assert shadow.check(digests, b, tensor_payload(t)) is None  # type: ignore[arg-type]

    tag_all()
    return {
        "gradient_tags_s_per_iteration": _per_call(tag_all, number=100),
        "gradient_checks_s_per_iteration": _per_call(check_all, number=100),
        "gradient_tags_cpu_s_per_iteration": _per_call(tag_all, number=100, clock=time.thread_time),
        "gradient_checks_cpu_s_per_iteration": _per_call(check_all, number=100, clock=time.thread_time),
        "gradient_bytes_per_iteration": 4 * sum(buckets),
    }


def handshake_costs() -> dict[str, float]:
    """Seconds per control connection for the hello and the proof (both ends), on a socket pair."""
    server_auth, client_auth = ControlAuth(SECRET), ControlAuth(SECRET)

    def handshake() -> None:
        a, b = socket.socketpair()
        with a, b:
            server = bind(b, server_auth, 1, server=True, name="s0")
            bind(a, client_auth, 1, name="s0")
            server.recv(b, 1.0)  # the proof

    def bare() -> None:
        a, b = socket.socketpair()
        a.close()
        b.close()

    return {
        "handshake_s_per_connection": max(0.0, _per_call(handshake, number=200) - _per_call(bare, number=200))
    }


def control_costs(digests: dict[str, Any] | None = None) -> dict[str, float]:
    """Seconds to write and read one commit frame through a socket pair, with and without the MAC."""
    commit = Commit(
        1,
        12345,
        [0.001],
        clip_coefficient=0.5,
        optimizer_step=12346,
        data_position={"batch": 9},
        gradient_digests=digests,
    )
    a, b = socket.socketpair()
    bind(b, process_auth(), server=True)
    bind(a, process_auth())

    def authenticated() -> None:
        send_message(a, commit, 1.0)
        recv_message(b, 1.0)

    frame = b"".join(bytes(p) for p in encode_message(commit))

    def plain() -> None:  # the same message encoded, written, read and decoded, without guard and tags
        parts = encode_message(commit)
        a.sendall(b"".join(parts))
        got = bytearray()
        while len(got) < len(frame):
            got += b.recv(len(frame) - len(got))
        decode_message(got[16:])

    with a, b:
        return {
            "commit_authenticated_s": _per_call(authenticated, number=500),
            "commit_plain_s": _per_call(plain, number=500),
            "commit_bytes": len(frame),
        }


def iteration_time(world: int, global_batch: int = 48, steps: int = 8) -> dict[str, float]:
    torch.manual_seed(0)
    config = ModelConfig()
    model = TinyLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_rank = global_batch // world
    tokens = torch.randint(0, config.vocab, (per_rank, config.context + 1))
    times, cpu = [], []
    for _ in range(steps + 1):
        t0, c0 = time.perf_counter(), time.thread_time()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, config.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return {
        "compute_s": min(times[1:]),  # the least: a lower bound of the iteration, so a high fraction
        "compute_cpu_s": min(cpu[1:]),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--world", type=int, default=3, help="ranks (the demo has 3)")
    parser.add_argument("--shadows", type=int, default=2, help="shadows (the demo has 2)")
    parser.add_argument("--json", type=Path, default=Path(OUT))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("CHECKMATE_JOB_SECRET", SECRET.hex())

    model = TinyLM(ModelConfig())
    buckets = buckets_of(model)
    counts = ring_counts(args.world, args.iterations, buckets)
    mean_payload = int(
        4 * sum(buckets) * 2 * (args.world - 1) / args.world / max(counts["data_per_iteration"], 1)
    )
    costs = datagram_costs(mean_payload)
    sample = GradientDigests(SECRET, 1)
    for b, n in enumerate(buckets):
        sample.record(0, b, tensor_payload(torch.zeros(n)))
    control = control_costs(sample.take(0))  # a commit as rank 0 sends it, with the buckets' tags
    gradient = gradient_tag_costs(buckets)
    handshake = handshake_costs()
    iteration = iteration_time(args.world)

    acks = counts["acks_per_iteration"] + counts["nacks_per_iteration"]
    datagram_auth = acks * (costs["ack_seal_s"] + costs["ack_open_s"])
    control_auth = 2 * args.shadows * max(0.0, control["commit_authenticated_s"] - control["commit_plain_s"])
    gradient_auth = gradient["gradient_tags_s_per_iteration"] + gradient["gradient_checks_s_per_iteration"]
    per_iteration = datagram_auth + control_auth + gradient_auth
    rank0_gradient = gradient["gradient_tags_s_per_iteration"]
    data_mac = counts["data_per_iteration"] * 2 * costs["data_mac_s"]  # sender tags, receiver checks
    references = {
        "compute_only": iteration["compute_s"],
        "compute_plus_ring_here": iteration["compute_s"] + counts["ring_seconds_per_iteration"],
    }
    bench = Path("results/bench.json")
    if bench.exists():
        try:
            seconds = _checkmate_iteration(json.loads(bench.read_text()))
            if seconds:
                references["make_bench_checkmate_mean"] = seconds
        except (OSError, ValueError):
            pass
    result: dict[str, Any] = {
        "model": {"name": "TinyLM", "parameters": iteration["parameters"], "buckets": buckets},
        "world": args.world,
        "shadows": args.shadows,
        "counts": counts,
        "costs": {**costs, **control, **gradient, **handshake},
        "authentication_s_per_iteration": per_iteration,
        "datagram_auth_s_per_iteration": datagram_auth,
        "control_auth_s_per_iteration": control_auth,
        "gradient_auth_s_per_iteration": gradient_auth,
        "rank0_gradient_tags_s_per_iteration": rank0_gradient,
        "rank0_gradient_tags_fraction_of_iteration": {k: rank0_gradient / v for k, v in references.items()},
        "rank0_gradient_tags_cpu_fraction_of_compute_cpu": gradient["gradient_tags_cpu_s_per_iteration"]
        / iteration["compute_cpu_s"],
        "data_mac_s_per_iteration_not_used": data_mac,
        "iteration_s": references,
        "fraction_of_iteration": {k: per_iteration / v for k, v in references.items()},
        "data_mac_fraction_of_iteration": {k: data_mac / v for k, v in references.items()},
        "target_fraction": 0.01,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    model_line = f"TinyLM: {iteration['parameters']} parameters, {len(buckets)} buckets"
    print(f"{model_line}; {args.world} ranks, {args.shadows} shadows")
    print(
        f"per iteration (all ranks): {counts['data_per_iteration']:.0f} DATA, "
        f"{counts['acks_per_iteration']:.1f} ACK, {counts['nacks_per_iteration']:.2f} NACK datagrams; "
        f"{2 * args.shadows} control frames"
    )
    print(
        f"ACK tag {costs['ack_seal_s'] * 1e6:.2f} us + check {costs['ack_open_s'] * 1e6:.2f} us; "
        "commit frame "
        f"{control['commit_authenticated_s'] * 1e6:.1f} us authenticated vs "
        f"{control['commit_plain_s'] * 1e6:.1f} us plain"
    )
    print(
        f"gradient tags: rank 0 {gradient['gradient_tags_s_per_iteration'] * 1e6:.0f} us "
        f"({gradient['gradient_tags_cpu_s_per_iteration'] * 1e6:.0f} us CPU), shadows' checks "
        f"{gradient['gradient_checks_s_per_iteration'] * 1e6:.0f} us "
        f"({gradient['gradient_checks_cpu_s_per_iteration'] * 1e6:.0f} us CPU) per iteration "
        f"({gradient['gradient_bytes_per_iteration'] / 1e3:.0f} kB); control handshake "
        f"{handshake['handshake_s_per_connection'] * 1e6:.0f} us per connection"
    )
    print(
        f"authentication: {per_iteration * 1e6:.0f} us per iteration "
        f"(datagrams {datagram_auth * 1e6:.0f} us, control {control_auth * 1e6:.0f} us, "
        f"gradient tags and checks {gradient_auth * 1e6:.0f} us)"
    )
    for name, seconds in references.items():
        print(
            f"  iteration ({name}) {seconds * 1e3:.1f} ms: authentication "
            f"{100 * per_iteration / seconds:.3f} %, a per-packet data MAC would add "
            f"{100 * data_mac / seconds:.2f} %"
        )
    print(
        f"rank 0's gradient tags, CPU time: {gradient['gradient_tags_cpu_s_per_iteration'] * 1e6:.0f} us = "
        f"{100 * result['rank0_gradient_tags_cpu_fraction_of_compute_cpu']:.2f} % of TinyLM's compute step "
        f"({iteration['compute_cpu_s'] * 1e3:.1f} ms CPU)"
    )
    print(f"wrote {args.json}")
    return 0


def _checkmate_iteration(doc: Any) -> float | None:
    """Checkmate's mean iteration (seconds) of TinyLM in results/bench.json (make bench), if there."""
    for system in doc.get("systems", []) if isinstance(doc, dict) else []:
        if system.get("name") == "checkmate" and isinstance(system.get("mean_iteration_ms"), (int, float)):
            return float(system["mean_iteration_ms"]) / 1000.0
    return None


if __name__ == "__main__":
    raise SystemExit(main())
