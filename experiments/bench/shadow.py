"""Benchmark (not a test): optimizer-apply throughput of a shadow, in parameters per second.

    python -m experiments.bench.shadow [--params 4000000] [--kind Adam] [--iterations 20] [--json out.json]
    python -m experiments.bench.shadow --fingerprint [--json results/fingerprint_bench.json]
    python -m experiments.bench.shadow --disk [--iteration-ms 70] [--json results/shadow_disk_bench.json]
    python -m experiments.bench.shadow --job-state [--json results/job_state_bench.json]

Prints one line per optimizer and writes JSON. The end-to-end lag (commit
arrival to applied) is in every shadow's status (``apply.last_commit_to_apply_seconds``).

``--fingerprint`` measures the divergence check (:mod:`checkmate.fingerprint`) for the
demo model (TinyLM with AdamW, :class:`experiments.tiny_lm.TrainConfig`'s defaults): the time to
fingerprint every parameter and its optimizer state (what rank 0 adds to a fingerprinted
step, and at most what a shadow adds for its share), the fingerprint's size on the
control channel, and both against one training iteration of the same model on this
machine (forward, backward, clip, step of one rank's share of the global batch).

``--disk`` measures the disk tier: how long one shadow takes to persist its shard of a
model trained with Adam (parameter + ``exp_avg`` + ``exp_avg_sq`` in fp32, the universal
format, fsynced: :class:`shadow.snapshots.Snapshotter`'s write) for shards of growing
size, and from that the largest shard it can persist every iteration at a given
iteration time (``--iteration-ms``; default: the demo's measured Checkmate iteration).
A shadow that writes slower than that coalesces (docs/shadow.md, "Disk tier").

``--job-state`` measures what the job state (persistent buffers, stateful objects, param
groups: :mod:`checkmate.job_state`) adds to each commit record, for the demo model with an
LR scheduler and a data cursor as stateful objects, and for a BatchNorm CNN, against the
iteration's gradient bytes.
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


def measure(
    kind: str, numel: int, iterations: int, tensors: int = 16, apply_threads: int = 1, fused: bool = False
) -> dict[str, Any]:
    names = [f"p{i}" for i in range(tensors)]
    per = numel // tensors
    initial = {n: torch.randn(per) for n in names}
    hyper: dict[str, object] = {"lr": 1e-3} if kind != "SGD" else {"lr": 0.1, "momentum": 0.9}
    if fused and kind != "SGD":  # workers that chose torch's fused CPU kernel: the shadow replays it
        hyper["fused"] = True
    spec = OptimizerSpec(kind, [{**hyper, "params": names}])
    optimizer = ShadowOptimizer(initial, spec, set(names), apply_threads)
    gradients = {n: torch.randn(per) for n in names}
    optimizer.apply(StepRecord(0, [1e-3], clip_coefficient=0.5), gradients)  # warm-up (lazy state)
    started, cpu = time.perf_counter(), time.process_time()
    for t in range(1, iterations + 1):
        optimizer.apply(StepRecord(t, [1e-3], clip_coefficient=0.5), gradients)
    seconds = (time.perf_counter() - started) / iterations
    cpu_seconds = (time.process_time() - cpu) / iterations
    optimizer.close()
    return {
        "kind": kind,
        "parameters": per * tensors,
        "seconds_per_iteration": seconds,
        "parameters_per_second": per * tensors / seconds,
        "cpu_seconds_per_iteration": cpu_seconds,
        "parameters_per_cpu_second": per * tensors / cpu_seconds,
        "apply_threads": apply_threads,
        "fused": fused and kind != "SGD",
    }


def measure_fingerprint(repeats: int = 50) -> dict[str, Any]:
    """Fingerprint cost vs one TinyLM training iteration (see the module docstring)."""
    from checkmate.fingerprint import fingerprint
    from experiments.tiny_lm import ModelConfig, TinyLM, TrainConfig, loss_of

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


def measure_disk(sizes: Sequence[int], repeats: int, directory: str | None = None) -> list[dict[str, Any]]:
    """Seconds to write one shard of ``numel`` Adam-trained parameters (3 fp32 states), per size."""
    import tempfile
    from pathlib import Path

    from checkmate import checkpoint as fmt

    rows = []
    for numel in sizes:
        tensors = 8
        per = numel // tensors
        states = {
            f"layer{i}.weight": {
                fmt.PARAM_STATE: torch.randn(per),
                "exp_avg": torch.randn(per),
                "exp_avg_sq": torch.rand(per),
                "step": torch.tensor(5.0),
            }
            for i in range(tensors)
        }
        parameters = {name: ([per], "torch.float32") for name in states}
        optimizer = {"kind": "Adam", "param_groups": [{"lr": 1e-3, "params": list(states)}]}
        seconds = []
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            root = Path(tmp)
            for step in range(repeats + 1):
                started = time.perf_counter()
                fmt.write_global(root, step, parameters, optimizer, {"iteration": step})
                fmt.write_shard(root, step, 0, 1, states)
                fmt.update_latest(root, step)
                fmt.prune(root, 2)
                if step:  # the first write warms the page cache and the allocator
                    seconds.append(time.perf_counter() - started)
        written = per * tensors * 3 * 4
        mean = sum(seconds) / len(seconds)
        rows.append(
            {
                "shard_parameters": per * tensors,
                "bytes_written": written,
                "seconds_per_write": mean,
                "max_seconds_per_write": max(seconds),
                "megabytes_per_second": written / mean / 1e6,
                "writes_per_second": 1.0 / mean,
            }
        )
    return rows


def demo_iteration_ms() -> float | None:
    """The demo's measured Checkmate iteration (results/bench.json), if it is there."""
    from experiments.commands import REPO

    path = REPO / "results" / "bench.json"
    try:
        systems = json.loads(path.read_text())["systems"]
        return float(next(s["mean_iteration_ms"] for s in systems if s["name"] == "checkmate"))
    except (OSError, ValueError, KeyError, StopIteration):
        return None


def measure_job_state() -> dict[str, Any]:
    """Commit bytes the job state adds, against the iteration's gradient bytes (see module docstring)."""
    from checkmate.control import Commit, encode_message
    from checkmate.job_state import capture
    from experiments.tiny_lm import TinyLM, TrainConfig

    class Cursor:
        def __init__(self) -> None:
            self.batch = 1234

        def state_dict(self) -> dict[str, Any]:
            return {"batch": self.batch, "epoch": 3}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.batch = state["batch"]

    def figures(
        model: torch.nn.Module, optimizer: torch.optim.Optimizer, stateful: dict[str, Any]
    ) -> dict[str, Any]:
        plain = sum(len(p) for p in encode_message(Commit(1, 100, [1e-3], optimizer_step=101)))
        state = capture(model, stateful, optimizer)
        full = sum(
            len(p) for p in encode_message(Commit(1, 100, [1e-3], optimizer_step=101, job_state=state))
        )
        gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return {
            "parameters": sum(p.numel() for p in model.parameters()),
            "buffers": len(state.buffers),
            "stateful": sorted(stateful),
            "commit_bytes_without_job_state": plain,
            "commit_bytes_with_job_state": full,
            "job_state_bytes": full - plain,
            "gradient_bytes_per_iteration": gradient_bytes,
            "job_state_fraction_of_gradient_bytes": (full - plain) / gradient_bytes,
        }

    config = TrainConfig()
    torch.manual_seed(config.seed)
    lm = TinyLM(config.model)
    adamw = torch.optim.AdamW(lm.parameters(), lr=config.peak_lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: min(1.0, (step + 1) / 5))
    demo = figures(lm, adamw, {"scheduler": scheduler, "loader": Cursor()})
    demo["model"] = "TinyLM (train_lm defaults) + AdamW, LambdaLR scheduler and a data cursor"
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 3),
        torch.nn.BatchNorm2d(64),
        torch.nn.ReLU(),
        torch.nn.Conv2d(64, 128, 3),
        torch.nn.BatchNorm2d(128),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(128, 10),
    )
    sgd = torch.optim.SGD(cnn.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    bn = figures(cnn, sgd, {"scheduler": torch.optim.lr_scheduler.StepLR(sgd, 10), "scaler": scaler})
    bn["model"] = "a 2-layer BatchNorm CNN + SGD, StepLR and GradScaler"
    return {"demo": demo, "batchnorm_cnn": bn}


def _write_json(path: str | None, figures: Any) -> None:
    """The figures as JSON at ``path`` (nothing when no ``--json`` was given)."""
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(figures, handle, indent=1)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=4_000_000)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--kinds", default="SGD,Adam,AdamW")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--apply-threads", type=int, default=1, help="the shadow's apply threads")
    parser.add_argument("--fused", action="store_true", help="the workers' Adam/AdamW have fused=True")
    parser.add_argument("--json", default=None)
    parser.add_argument("--fingerprint", action="store_true", help="measure the divergence check instead")
    parser.add_argument("--disk", action="store_true", help="measure the disk tier instead")
    parser.add_argument("--disk-sizes", default="1000000,4000000,16000000,32000000")
    parser.add_argument("--disk-repeats", type=int, default=3)
    parser.add_argument("--disk-dir", default=None, help="where to write (default: the temporary directory)")
    parser.add_argument("--iteration-ms", type=float, default=None, help="default: the demo's (results/)")
    parser.add_argument("--job-state", action="store_true", help="measure the job state's commit bytes")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.job_state:
        figures = measure_job_state()
        for row in figures.values():
            print(
                f"{row['model']}: {row['parameters']} parameters, {row['buffers']} buffers, "
                f"stateful {row['stateful']}: job state {row['job_state_bytes']} bytes per commit = "
                f"{100 * row['job_state_fraction_of_gradient_bytes']:.3f} % of the "
                f"{row['gradient_bytes_per_iteration']} gradient bytes of an iteration"
            )
        _write_json(args.json, figures)
        return 0
    if args.disk:
        iteration_ms = args.iteration_ms if args.iteration_ms is not None else demo_iteration_ms()
        rows = measure_disk([int(n) for n in args.disk_sizes.split(",")], args.disk_repeats, args.disk_dir)
        for r in rows:
            print(
                f"shard {r['shard_parameters']:>10d} params ({r['bytes_written'] / 1e6:7.1f} MB): "
                f"{r['seconds_per_write'] * 1e3:8.1f} ms per write "
                f"(max {r['max_seconds_per_write'] * 1e3:.1f}), "
                f"{r['megabytes_per_second']:7.1f} MB/s, {r['writes_per_second']:6.2f} writes/s"
            )
        fits = [
            r for r in rows if iteration_ms is not None and r["max_seconds_per_write"] * 1e3 <= iteration_ms
        ]
        largest = max((r["shard_parameters"] for r in fits), default=None)
        rate = max(r["megabytes_per_second"] for r in rows)
        estimate = int(rate * 1e6 * (iteration_ms or 0) / 1e3 / 12)
        print(
            f"at {iteration_ms} ms per iteration: the largest measured shard persisted every iteration "
            f"is {largest} parameters; at the best rate measured ({rate:.0f} MB/s) about {estimate} "
            "parameters per shadow (Adam: 12 bytes each) fit in one iteration"
        )
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(
                    {
                        "iteration_ms": iteration_ms,
                        "rows": rows,
                        "largest_measured_shard_every_iteration": largest,
                        "estimated_parameters_per_shadow_every_iteration": estimate,
                        "threads": torch.get_num_threads(),
                    },
                    handle,
                    indent=1,
                )
        return 0
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
        _write_json(args.json, figures)
        return 0
    results = [
        measure(kind, args.params, args.iterations, apply_threads=args.apply_threads, fused=args.fused)
        for kind in args.kinds.split(",")
    ]
    for r in results:
        print(
            f"{r['kind']:6s} {r['parameters']:>10d} params  {r['seconds_per_iteration'] * 1e3:8.1f} ms/it  "
            f"{r['parameters_per_second'] / 1e6:8.1f} M params/s, "
            f"{r['parameters_per_cpu_second'] / 1e6:8.1f} M params per CPU-second"
        )
    _write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
