"""Benchmark (not a test): optimizer-apply throughput of a shadow, in parameters per second.

    python -m shadow.benchmark [--params 4000000] [--kind Adam] [--iterations 20] [--json out.json]

Prints one line per optimizer and writes JSON. The end-to-end lag (commit
arrival to applied) is in every shadow's status (``apply.last_commit_to_apply_seconds``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from shadow.optimizer_apply import OptimizerSpec, ShadowOptimizer, StepRecord

logger = logging.getLogger(__name__)


def measure(kind: str, numel: int, iterations: int, tensors: int = 16) -> dict[str, Any]:
    names = [f"p{i}" for i in range(tensors)]
    per = numel // tensors
    initial = {n: torch.randn(per) for n in names}
    hyper: dict[str, object] = {"lr": 1e-3} if kind != "SGD" else {"lr": 0.1, "momentum": 0.9}
    spec = OptimizerSpec(kind, [{**hyper, "params": names}])
    optimizer = ShadowOptimizer(initial, spec, set(names))
    gradients = {n: torch.randn(per) for n in names}
    optimizer.apply(StepRecord(0, [1e-3], clip_coefficient=0.5), gradients)  # warm-up (lazy state)
    started = time.perf_counter()
    for t in range(1, iterations + 1):
        optimizer.apply(StepRecord(t, [1e-3], clip_coefficient=0.5), gradients)
    seconds = (time.perf_counter() - started) / iterations
    return {
        "kind": kind,
        "parameters": per * tensors,
        "seconds_per_iteration": seconds,
        "parameters_per_second": per * tensors / seconds,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=4_000_000)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--kinds", default="SGD,Adam,AdamW")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = [measure(kind, args.params, args.iterations) for kind in args.kinds.split(",")]
    for r in results:
        print(
            f"{r['kind']:6s} {r['parameters']:>10d} params  {r['seconds_per_iteration'] * 1e3:8.1f} ms/it  "
            f"{r['parameters_per_second'] / 1e6:8.1f} M params/s"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
