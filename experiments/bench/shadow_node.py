"""Benchmark (not a test): a shadow node's CPU per applied iteration, copies to certified state.

    python -m experiments.bench.shadow_node [--workload tinylm|large-state] [--iterations 30]
        [--json out.json]

One :class:`~shadow.node.ShadowNode` owns every bucket of the model; a hand-driven rank 0
sends it the job start, the bucket layout and, per iteration, the commit record (with
its gradient tags and, every iteration as CPU workers do by default, its fingerprint)
over the real control channel, and the copies are handed to the node's datagram
handler (:meth:`~shadow.node_receive.Receiver.on_datagram`) in the order the switch
sends them, before the commit as in a run. Rank 0's side (the reference step and
fingerprint, the tags, building datagrams) runs on this process's main thread and is
measured with ``time.thread_time`` and taken out: what remains is the shadow's CPU
(receive handling, placement, the gradient check, the optimizer step, the fingerprint,
the control handler), as process CPU time per iteration, user and system together. The
socket receive itself (one ``recvfrom_into`` per datagram) is not in it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from checkmate.auth import GradientDigests, secret_from_env
from checkmate.control import (
    BucketLayout,
    BucketSpec,
    Commit,
    JobStart,
    ParamSlice,
    ParamSpec,
    recv_message,
    send_message,
)
from checkmate.fingerprint import fingerprint
from checkmate.tensors import tensor_payload
from checkmate.wire import MAX_PAYLOAD_BYTES, CheckmateHeader, DType, MessageType
from shadow.node import ShadowConfig, ShadowNode
from shadow.optimizer_apply import OptimizerSpec, ShadowOptimizer, StepRecord

logger = logging.getLogger(__name__)

JOB = 77
WORKER = ("127.0.0.1", 9)


@dataclass(frozen=True)
class Workload:
    name: str
    shapes: dict[str, tuple[int, ...]]
    bucket_bytes: int


def workload(name: str) -> Workload:
    """TinyLM as ``make bench`` trains it, or its large-state variant (width 768, 3 layers)."""
    from experiments.tiny_lm import ModelConfig, TinyLM

    if name == "tinylm":
        config, bucket = ModelConfig(), 25 << 20
    elif name == "large-state":
        config, bucket = ModelConfig(width=768, layers=3, heads=12), 8 << 20
    else:
        raise ValueError(f"unknown workload {name!r}")
    torch.manual_seed(0)
    model = TinyLM(config)
    return Workload(name, {n: tuple(p.shape) for n, p in model.named_parameters()}, bucket)


def _buckets(load: Workload) -> list[BucketSpec]:
    """DDP-like buckets (reverse parameter order, about ``bucket_bytes`` each), all shard key 0."""
    buckets: list[BucketSpec] = []
    pieces: list[ParamSlice] = []
    size = 0
    for name in reversed(list(load.shapes)):
        numel = torch.Size(load.shapes[name]).numel()
        pieces.append(ParamSlice(name, size, numel))
        size += numel
        if size * 4 >= load.bucket_bytes:
            buckets.append(BucketSpec(len(buckets), "float32", size, 0, tuple(pieces)))
            pieces, size = [], 0
    if pieces:
        buckets.append(BucketSpec(len(buckets), "float32", size, 0, tuple(pieces)))
    return buckets


def _datagrams(iteration: int, buckets: list[BucketSpec], grads: dict[int, torch.Tensor]) -> list[bytes]:
    per = MAX_PAYLOAD_BYTES // 4
    out = []
    for bucket in buckets:
        data = grads[bucket.bucket_id]
        for offset in range(0, bucket.num_elements, per):
            values = data[offset : offset + per]
            header = CheckmateHeader(
                MessageType.DATA, JOB, iteration, bucket.bucket_id, 1, offset, values.numel(), 0, DType.FP32,
                shard_key=0,
            )  # fmt: skip
            out.append(bytes(header.pack()) + bytes(tensor_payload(values)))
    return out


def _cpu_seconds() -> float:
    return time.process_time()


def measure(name: str, iterations: int, apply_threads: int | None = None) -> dict[str, Any]:
    """The shadow's CPU per iteration for ``name`` (see the module docstring)."""
    load = workload(name)
    buckets = _buckets(load)
    generator = torch.Generator().manual_seed(1)
    initial = {n: torch.randn(s, generator=generator) for n, s in load.shapes.items()}
    names = list(load.shapes)
    hyper = {"lr": 1e-3, "weight_decay": 0.1, "foreach": False}
    optimizer = {"kind": "AdamW", "param_groups": [{**hyper, "params": names}]}
    grads = {b.bucket_id: torch.randn(b.num_elements, generator=generator) / 100 for b in buckets}
    gradients = {
        piece.name: grads[b.bucket_id][piece.offset : piece.offset + piece.numel].view(
            load.shapes[piece.name]
        )
        for b in buckets
        for piece in b.params
    }
    reference = ShadowOptimizer(initial, OptimizerSpec("AdamW", [{**hyper, "params": names}]), set(names))
    secret = secret_from_env()
    tags = GradientDigests(secret, JOB)
    config: dict[str, Any] = {}
    if apply_threads is not None:
        config["apply_threads"] = apply_threads
    node = ShadowNode(
        ShadowConfig(
            name="s0", control_bind=("127.0.0.1", 0), data_bind=("127.0.0.1", 0), shard_keys=(0,), **config
        )
    ).start()
    conn = socket.create_connection(node.control_address, timeout=5)
    threading.Thread(target=_drain, args=(conn,), daemon=True).start()
    try:
        send_message(
            conn,
            JobStart(
                job_id=JOB,
                world_size=2,
                workers=[WORKER, ("127.0.0.1", 10)],
                parameters=[ParamSpec(n, s, "float32") for n, s in load.shapes.items()],
                optimizer=optimizer,
                start_iteration=0,
                tensors={f"param/{n}": t for n, t in initial.items()},
                extra={"fingerprint_every": 1},
            ),
            timeout=30,
        )
        send_message(conn, BucketLayout(JOB, 0, buckets), timeout=30)
        deadline = time.monotonic() + 120
        while node.status()["state"] != "running" and time.monotonic() < deadline:
            time.sleep(0.05)
        rank0 = 0.0  # this thread's CPU on rank 0's side
        warmup = 2
        cpu_start = wall_start = 0.0
        for t in range(warmup + iterations):
            if t == warmup:
                cpu_start, wall_start, rank0 = _cpu_seconds(), time.perf_counter(), 0.0
            began = time.thread_time()
            reference.apply(StepRecord(t, [1e-3]), gradients)
            document = fingerprint(reference.parameters.items(), reference.optimizer.state)
            for b in buckets:
                tags.record(t, b.bucket_id, tensor_payload(grads[b.bucket_id]))
            packets = _datagrams(t, buckets, grads)
            rank0 += time.thread_time() - began
            for packet in packets:
                node.on_datagram(memoryview(packet), WORKER)
            began = time.thread_time()
            send_message(
                conn,
                Commit(
                    JOB, t, [1e-3], optimizer_step=t + 1, fingerprint=document, gradient_digests=tags.take(t)
                ),
                timeout=30,
            )
            rank0 += time.thread_time() - began
            if not node.wait_applied(t, timeout=120):
                raise RuntimeError(f"iteration {t} not applied: {node.status()}")
        cpu = _cpu_seconds() - cpu_start - rank0
        wall = time.perf_counter() - wall_start
        status = node.status()
    finally:
        conn.close()
        node.close()
    if status.get("divergences") or status.get("apply", {}).get("divergences"):
        raise RuntimeError(f"the bench's shadow diverged: {status}")
    numel = sum(torch.Size(s).numel() for s in load.shapes.values())
    return {
        "workload": name,
        "parameters": numel,
        "tensors": len(load.shapes),
        "buckets": len(buckets),
        "datagrams_per_iteration": len(packets),
        "iterations": iterations,
        "shadow_cpu_ms_per_iteration": 1e3 * cpu / iterations,
        "wall_ms_per_iteration": 1e3 * wall / iterations,
        "apply_threads": apply_threads,
        "cores": len(os.sched_getaffinity(0)),
    }


def _drain(conn: socket.socket) -> None:
    """Read (and ignore) what the shadow says to rank 0 (certificates), so it never blocks."""
    while True:
        try:
            recv_message(conn, timeout=300)
        except (OSError, ValueError):
            return


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="tinylm,large-state")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--apply-threads", type=int, default=None, help="default: the shadow's own default")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("CHECKMATE_JOB_SECRET", os.urandom(32).hex())  # a bench job's own secret
    rows = []
    for name in args.workload.split(","):
        row = measure(name, args.iterations, args.apply_threads)
        rows.append(row)
        print(
            f"{row['workload']:12s} {row['parameters']:>10d} params "
            f"{row['datagrams_per_iteration']:>6d} datagrams: shadow CPU "
            f"{row['shadow_cpu_ms_per_iteration']:8.2f} ms/it, wall {row['wall_ms_per_iteration']:8.2f} ms/it"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
