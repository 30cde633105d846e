"""Benchmark (not a test): optimizer-apply throughput of a shadow, in parameters per second.

    python -m shadow.benchmark [--params 4000000] [--kind Adam] [--iterations 20] [--json out.json]
    python -m shadow.benchmark --fingerprint [--json results/fingerprint_bench.json]

Prints one line per optimizer and writes JSON. The end-to-end lag (commit
arrival to applied) is in every shadow's status (``apply.last_commit_to_apply_seconds``).

``--fingerprint`` measures the divergence check (:mod:`checkmate.fingerprint`) for the
demo model (TinyLM with AdamW, topologies/examples/train_lm.py's defaults): the time to
fingerprint every parameter and its optimizer state (what rank 0 adds to a fingerprinted
step, and at most what a shadow adds for its share), the fingerprint's size on the
control channel, and both against one training iteration of the same model on this
machine (forward, backward, clip, step of one rank's share of the global batch).
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


def measure_fingerprint(repeats: int = 50) -> dict[str, Any]:
    """Fingerprint cost vs one TinyLM training iteration (see the module docstring)."""
    from checkmate.fingerprint import fingerprint
    from topologies.examples.tiny_lm import ModelConfig, TinyLM, loss_of
    from topologies.examples.train_lm import TrainConfig

    config = TrainConfig()
    torch.manual_seed(config.seed)
    model = TinyLM(config.model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.peak_lr, weight_decay=config.weight_decay, foreach=False
    )
    batch = config.global_batch // 2  # one rank's share in the 2-worker demo
    context = ModelConfig().context
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, config.model.vocab, (batch, context), generator=generator)
    targets = torch.randint(0, config.model.vocab, (batch, context), generator=generator)

    def step() -> None:
        optimizer.zero_grad()
        loss_of(model, inputs, targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_norm)
        optimizer.step()

    for _ in range(3):
        step()  # warm-up; creates the optimizer state
    started = time.perf_counter()
    for _ in range(10):
        step()
    iteration_seconds = (time.perf_counter() - started) / 10
    fingerprint(model.named_parameters(), optimizer.state)  # warm-up
    started = time.perf_counter()
    for _ in range(repeats):
        document = fingerprint(model.named_parameters(), optimizer.state)
    fingerprint_seconds = (time.perf_counter() - started) / repeats
    numel = sum(p.numel() for p in model.parameters())
    state_numel = sum(
        v.numel() for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    json_bytes = len(json.dumps(document, separators=(",", ":")).encode())
    return {
        "model": "TinyLM (train_lm defaults) + AdamW",
        "parameters": numel,
        "tensors": len(document),
        "state_elements": state_numel,
        "iteration_seconds": iteration_seconds,
        "fingerprint_seconds": fingerprint_seconds,
        "fingerprint_fraction_of_iteration": fingerprint_seconds / iteration_seconds,
        "fingerprint_json_bytes": json_bytes,
        "gradient_bytes_per_iteration": numel * 4,
        "fingerprint_fraction_of_gradient_bytes": json_bytes / (numel * 4),
        "threads": torch.get_num_threads(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=4_000_000)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--kinds", default="SGD,Adam,AdamW")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--fingerprint", action="store_true", help="measure the divergence check instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.fingerprint:
        figures = measure_fingerprint()
        print(
            f"{figures['model']}: {figures['parameters']} parameters in {figures['tensors']} tensors; "
            f"iteration {figures['iteration_seconds'] * 1e3:.1f} ms; fingerprint "
            f"{figures['fingerprint_seconds'] * 1e3:.2f} ms "
            f"({100 * figures['fingerprint_fraction_of_iteration']:.1f} % of an iteration), "
            f"{figures['fingerprint_json_bytes']} bytes "
            f"({100 * figures['fingerprint_fraction_of_gradient_bytes']:.2f} % of the gradient bytes)"
        )
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(figures, handle, indent=1)
        return 0
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
