"""Loss across a layout change (the Universal Checkpointing paper's figure), on CPU.

``python -m checkmate.universal.reshard_demo [--steps 60 --switch 30 --out results]``
trains the tiny transformer with TP=2 x DP=2 (4 ranks) for ``--steps``
iterations, saving a universal checkpoint at ``--switch``; then resumes that
checkpoint as TP=1 x DP=3, FSDP2 on 2 ranks, TP=2 x DP=1, PP=2, FSDP2 x TP
(2 x 2), ZeRO-1 and ZeRO-3 on 3 ranks and ZeRO-3 x TP (2 x 2), and trains to ``--steps`` on the same global
batches. Writes ``reshard_loss.json`` (every loss, and each resumed run's
largest difference from the source run) and ``reshard_loss.png`` (loss per
step; the difference on a log scale).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from checkmate.universal.runs import RunJob, run_layout, write_initial
from checkmate.universal.tiny import TinyConfig

logger = logging.getLogger(__name__)

SOURCE = "tp=2,dp=2"
TARGETS = (
    "tp=1,dp=3",
    "dp=2,fsdp=1",
    "tp=2,dp=1",
    "pp=2",
    "tp=2,dp=2,fsdp=1",
    "dp=3,zero=1,align=4",
    "dp=3,zero=3,align=4",
    "tp=2,dp=2,zero=3",
)


def measure(steps: int, switch: int, lr: float) -> dict[str, object]:
    config = TinyConfig()
    with tempfile.TemporaryDirectory(prefix="checkmate-reshard-") as scratch:
        root = Path(scratch)
        write_initial(root / "init", config)
        started = time.monotonic()
        source = run_layout(
            RunJob(
                SOURCE, str(root / "init"), 0, steps, save_root=str(root / "ckpt"), save_steps=[switch], lr=lr
            ),
            timeout=600,
        )
        runs: dict[str, dict[int, float]] = {}
        for target in TARGETS:
            runs[target] = run_layout(RunJob(target, str(root / "ckpt"), switch, steps, lr=lr), timeout=600)
        elapsed = time.monotonic() - started
    differences = {target: max(abs(losses[s] - source[s]) for s in losses) for target, losses in runs.items()}
    return {
        "config": config.__dict__,
        "lr": lr,
        "source_layout": SOURCE,
        "switch_step": switch,
        "source": source,
        "resumed": runs,
        "max_abs_loss_difference": differences,
        "seconds": round(elapsed, 1),
        "torch": torch.__version__,
    }


def plot(result: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    source: dict[int, float] = result["source"]  # type: ignore[assignment]
    runs: dict[str, dict[int, float]] = result["resumed"]  # type: ignore[assignment]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
    steps = sorted(source)
    top.plot(steps, [source[s] for s in steps], color="black", linewidth=2.5, label=f"{SOURCE} (source)")
    for target, losses in runs.items():
        keys = sorted(losses)
        top.plot(keys, [losses[k] for k in keys], linestyle="--", marker=".", label=f"resumed as {target}")
        bottom.plot(keys, [max(abs(losses[k] - source[k]), 1e-9) for k in keys], marker=".", label=target)
    for axis in (top, bottom):
        axis.axvline(float(result["switch_step"]), color="grey", linestyle=":")  # type: ignore[arg-type]
    top.set_ylabel("training loss")
    top.set_title("Universal checkpoint at the dotted line, resumed in other layouts", fontsize=10)
    top.legend(fontsize=8)
    bottom.set_yscale("log")
    bottom.set_ylabel("|loss - source loss|\n(0 drawn at 1e-9)")
    bottom.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--switch", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    if not 0 < args.switch < args.steps:
        parser.error("--switch must be between 0 and --steps")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    result = measure(args.steps, args.switch, args.lr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reshard_loss.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "reshard_loss.png")
    differences: dict[str, float] = result["max_abs_loss_difference"]  # type: ignore[assignment]
    for target, difference in differences.items():
        sys.stdout.write(f"{SOURCE} -> {target}: largest |loss difference| {difference:.2e}\n")
    sys.stdout.write(f"wrote {out / 'reshard_loss.json'} and {out / 'reshard_loss.png'}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
