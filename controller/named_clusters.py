"""The named cluster configurations of the comparison, each input cited, derived, measured or assumed.

``checkmate-testbed`` (the Checkmate paper's testbed) and ``llama3-405b`` (Meta's Llama 3
training cluster): :data:`CONFIGS` in the order the docs show them, :func:`named` to
build one. Checkmate's shadow lag is ``make bench``'s when results/bench.json has it
(:func:`measured_lag`).
"""

from __future__ import annotations

import json
from pathlib import Path

from controller.cluster_inputs import DEFAULT_BENCH, ClusterConfig, CompareError, Source

LLAMA3 = "The Llama 3 Herd of Models (Llama Team, AI @ Meta, 2024)"
CHECKMATE_PAPER = (
    "Checkmate: Zero Performance Overhead Model Checkpointing via Network Gradient Replication "
    "(Bhardwaj, Wang, Carin, Belay, Ghobadi; NSDI '26; arXiv:2507.13522)"
)


def measured_lag(bench: Path | None = None) -> tuple[float, Source]:
    """Checkmate's mean shadow lag from make bench (results/bench.json), or 1.0 assumed without it."""
    path = DEFAULT_BENCH if bench is None else bench
    try:
        systems = json.loads(path.read_text())["systems"]
        lag = float(next(s for s in systems if s["name"] == "checkmate")["shadow_lag_iterations"]["mean"])
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return 1.0, Source("assumed", f"1 iteration ({path.name} has no Checkmate shadow lag to read)")
    return lag, Source(
        "measured",
        f"{path.name}: Checkmate's mean shadow lag after a step (make bench, the emulated network)",
    )


CHECKPOINT_STATE = Source(
    "assumed",
    "12 bytes per parameter: fp32 weights and AdamW's two fp32 moments "
    "(capacity_inputs.OPTIMIZER_STATE_BYTES); bf16 copies and data-loader state not counted",
)
DESIGN_ZERO = Source(
    "assumed",
    f"0: the design's claim ({CHECKMATE_PAPER}: per-iteration checkpoints at throughput comparable to a "
    "no-checkpoint baseline); this machine's software host agent measured 0.72-0.88x its ideal "
    "(docs/benchmarks.md)",
)


def _shared_sources(lag_source: Source) -> dict[str, Source]:
    """The sources both named configurations share (their values are the same too)."""
    return {
        "checkpoint_bytes_per_param": CHECKPOINT_STATE,
        "restart_s": Source("assumed", "10 minutes from a failure to training again, for every system"),
        "grad_dtype": Source("assumed", "gradients reduced in fp32"),
        "checkmate_overhead": DESIGN_ZERO,
        "checkmate_lag_iterations": lag_source,
    }


def _llama3_iteration_s() -> float:
    return 6 * 405e9 * 16e6 / (16384 * 400e12)


def _llama3() -> ClusterConfig:
    lag, lag_source = measured_lag()
    return ClusterConfig(
        name="llama3-405b",
        description="Llama 3 405B pre-training on Meta's 16K-H100 RoCE cluster, checkpoints to Tectonic",
        gpus=16384,
        gpu_memory_gib=80.0,
        nic_gbps=400.0,
        model_params=405e9,
        checkpoint_bytes_per_param=12.0,
        iteration_time_s=_llama3_iteration_s(),
        dp=128,
        model_parallel=128,
        storage="Tectonic (Meta's distributed file system)",
        storage_write_gbytes_per_s=2000.0,
        checkpoint_writers=16384,
        writer_gbytes_per_s=50.0,
        snapshot_gbytes_per_s=25.0,
        failures=419,
        failure_window_days=54,
        restart_s=600.0,
        switch="tofino2",
        shadow_link_gbps=400.0,
        grad_dtype="fp32",
        checkmate_overhead=0.0,
        checkmate_lag_iterations=lag,
        sources={
            **_shared_sources(lag_source),
            "gpus": Source("cited", f"{LLAMA3}, §3.3.1 and Table 4: up to 16K H100 GPUs (16,384 in Table 4)"),
            "gpu_memory_gib": Source("cited", f"{LLAMA3}, §3.3.1: H100 with 80 GB HBM3"),
            "nic_gbps": Source(
                "cited",
                f"{LLAMA3}, §3.3.1: RoCE and InfiniBand clusters, both 400 Gbps interconnects between GPUs",
            ),
            "model_params": Source("cited", f"{LLAMA3}: the 405B flagship model"),
            "iteration_time_s": Source(
                "derived",
                "6 x 405e9 parameters x 16M tokens per step / (16,384 GPUs x 400 TFLOP/s): tokens per "
                f"batch and TFLOPs/GPU from {LLAMA3}, Table 4 (16,384 GPUs, TP 8, PP 16, DP 128); "
                "the 6N FLOP rule is ours",
            ),
            "dp": Source("cited", f"{LLAMA3}, Table 4: DP 128 at 16,384 GPUs"),
            "model_parallel": Source("cited", f"{LLAMA3}, Table 4: TP 8 x PP 16 (CP 1) at 16,384 GPUs"),
            "storage": Source("cited", f"{LLAMA3}, §3.3.1: checkpoints and data on Tectonic"),
            "storage_write_gbytes_per_s": Source(
                "cited",
                f"{LLAMA3}, §3.3.1: Tectonic sustains 2 TB/s (7 TB/s peak) from 7,500 SSD servers; a shared "
                "file system, so the whole figure for one job's checkpoint is an upper bound",
            ),
            "checkpoint_writers": Source(
                "assumed", "every GPU writes an equal share (a sharded save deduplicating replicated state)"
            ),
            "writer_gbytes_per_s": Source("assumed", "one GPU's 400 Gb/s NIC (50 GB/s) carries its share"),
            "snapshot_gbytes_per_s": Source(
                "assumed",
                "25 GB/s device-to-host per GPU (PCIe Gen5 x16 is 64 GB/s per direction nominal; "
                "8 GPUs share a host)",
            ),
            "failures": Source("cited", f"{LLAMA3}, §3.3.4: 419 unexpected interruptions (466 in all)"),
            "failure_window_days": Source("cited", f"{LLAMA3}, §3.3.4: a 54-day snapshot of pre-training"),
            "switch": Source(
                "assumed",
                "a Tofino 2 leaf replicating (the cited cluster uses Arista 7800 and Minipack2 switches, "
                "which do not run P4)",
            ),
            "shadow_link_gbps": Source("assumed", "shadow hosts on 400 Gb/s links, as the GPUs"),
        },
    )


def _testbed() -> ClusterConfig:
    lag, lag_source = measured_lag()
    unknown = "not in the paper's abstract or introduction, read here: a stand-in, not the testbed's figure"
    return ClusterConfig(
        name="checkmate-testbed",
        description=(
            f"a stand-in for the published testbed ({CHECKMATE_PAPER}): every figure assumed, "
            "none of the testbed's figures could be read here (its abstract and introduction were)"
        ),
        gpus=8,
        gpu_memory_gib=40.0,
        nic_gbps=100.0,
        model_params=1.5e9,
        checkpoint_bytes_per_param=12.0,
        iteration_time_s=0.5,
        dp=8,
        model_parallel=1,
        storage="each server's local NVMe SSD",
        storage_write_gbytes_per_s=16.0,
        checkpoint_writers=8,
        writer_gbytes_per_s=2.0,
        snapshot_gbytes_per_s=12.0,
        failures=419 * 8 / 16384,
        failure_window_days=54,
        restart_s=600.0,
        switch="tofino",
        shadow_link_gbps=100.0,
        grad_dtype="fp32",
        checkmate_overhead=0.0,
        checkmate_lag_iterations=lag,
        sources={
            **_shared_sources(lag_source),
            "gpus": Source("assumed", f"8 GPUs, one per server ({unknown})"),
            "gpu_memory_gib": Source("assumed", f"A100 40 GB ({unknown})"),
            "nic_gbps": Source("assumed", f"100 Gb/s NICs ({unknown})"),
            "model_params": Source("assumed", f"a GPT-2 XL sized model, 1.5B parameters ({unknown})"),
            "iteration_time_s": Source("assumed", f"0.5 s per iteration ({unknown})"),
            "dp": Source("assumed", "pure data parallelism over the 8 GPUs"),
            "model_parallel": Source("assumed", "no model parallelism"),
            "storage": Source(
                "assumed",
                "local NVMe SSDs (where the testbed wrote is not in the parts of the paper read here)",
            ),
            "storage_write_gbytes_per_s": Source("assumed", "8 local NVMe SSDs at 2 GB/s each"),
            "checkpoint_writers": Source("assumed", "each server writes an equal share to its own SSD"),
            "writer_gbytes_per_s": Source("assumed", "2 GB/s sequential write of one NVMe SSD"),
            "snapshot_gbytes_per_s": Source(
                "assumed", "12 GB/s device-to-host (PCIe Gen4 x16, 32 GB/s nominal)"
            ),
            "failures": Source(
                "derived",
                f"{LLAMA3}'s 419 interruptions per 16,384 GPUs in 54 days, scaled to 8 GPUs (an assumption "
                "that failures scale with GPUs)",
            ),
            "failure_window_days": Source(
                "cited", f"{LLAMA3}, §3.3.4: 54 days (the window of the rate above)"
            ),
            "switch": Source("assumed", f"a Tofino switch replicates ({unknown} which model)"),
            "shadow_link_gbps": Source("assumed", "shadow hosts on 100 Gb/s links, as the GPUs"),
        },
    )


CONFIGS = {"checkmate-testbed": _testbed, "llama3-405b": _llama3}
"""The named cluster configurations, in the order the docs show them."""


def named(name: str) -> ClusterConfig:
    try:
        return CONFIGS[name]()
    except KeyError:
        raise CompareError(f"unknown cluster configuration {name!r}; known: {', '.join(CONFIGS)}") from None
