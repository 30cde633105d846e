"""Capacity planning's inputs: the switch targets' limits, the measured rates, the fixed sizes.

Each figure says where it comes from (the ``sources`` of a plan): the optimizer-apply
rate from ``shadow_bench.json`` (``make bench-shadow``), the replicating
switch's frame rate from ``make bench-switch``'s files, the table sizes of
p4src/shared/defines.p4 (tests/controller/test_capacity.py keeps them equal), the
frame overhead from the wire format. The measured files are package data
(``controller/measured/``: copies of what the benchmarks wrote in ``results/``, which is
their output only); a flag names another file. :mod:`controller.capacity` plans with them;
:mod:`controller.capacity_cli` is ``checkmate-ctl plan``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from checkmate.network import MAX_MULTICAST_GROUP_ID
from checkmate.wire import HEADER_BYTES, IPV4_HEADER_BYTES, UDP_HEADER_BYTES

logger = logging.getLogger(__name__)

MEASURED = Path(str(files("controller"))) / "measured"
"""The measured figures the planner uses by default (package data; refresh by copying from results/)."""
DEFAULT_SHADOW_BENCH = MEASURED / "shadow_bench.json"
DEFAULT_SWITCH_BENCH = MEASURED / "switch_bench.json"
DEFAULT_BMV2_BENCH_DIR = MEASURED / "switch_bench_targets"

ETHERNET_HEADER_BYTES = 14
FRAME_OVERHEAD_BYTES = ETHERNET_HEADER_BYTES + IPV4_HEADER_BYTES + UDP_HEADER_BYTES + HEADER_BYTES
"""Bytes of a data frame that are not gradient elements (Ethernet, IPv4, UDP, Checkmate)."""

# p4src/shared/defines.p4 (tests/controller/test_capacity.py checks these against the file)
REPLICATION_TABLE_SIZE = 4096
SHADOW_DESTINATION_TABLE_SIZE = 1024
JOB_TABLE_SIZE = 255
MAX_SHARD_KEYS = 1 << 16
SHADOW_HORIZON_ITERATIONS = 8
"""``ShadowConfig.horizon``: iterations a shadow buffers ahead of the last applied one."""
DDP_DEFAULT_BUCKET_MB = 25.0

GRAD_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

PARAMETER_GATHERS = {"ddp": 0, "fsdp2": 2, "zero1": 1, "zero2": 1}
"""Parameter all-gathers per iteration (untagged, through the same switch): FSDP2 gathers each module
before its forward and again before its backward (``reshard_after_forward=True``, the default; the root
module, kept gathered after its forward, only once: an upper bound); ZeRO-1/2 gather the updated
parameter shards after the step (torch's ZeroRedundancyOptimizer by one broadcast per rank, the same
bytes); DDP none."""
REDUCES_BY_ALL_REDUCE = {"ddp": True, "fsdp2": False, "zero1": True, "zero2": False}
"""Whether the job's own gradient collective is an all-reduce (DDP, ZeRO-1) or a reduce-scatter (FSDP2,
ZeRO-2); protected, both run Checkmate's ring all-reduce, whose fully reduced chunks are tagged."""

OPTIMIZER_STATE_BYTES = {
    "sgd": 0,
    "sgd-momentum": 4,
    "adam": 8,
    "adamw": 8,
    "adam-amsgrad": 12,
    "adagrad": 4,
    "rmsprop": 4,
    "adamax": 8,
    "nadam": 8,
    "radam": 8,
}
"""fp32 optimizer state per parameter: momentum buffer, exp_avg(+exp_avg_sq, +max_exp_avg_sq), ..."""

OPTIMIZER_BENCH_KIND = {
    "sgd": "SGD",
    "sgd-momentum": "SGD",
    "adam": "Adam",
    "adamw": "AdamW",
    "adam-amsgrad": "Adam",
    "adagrad": "Adagrad",
    "rmsprop": "RMSprop",
    "adamax": "Adamax",
    "nadam": "NAdam",
    "radam": "RAdam",
}
"""Which ``kind`` of results/shadow_bench.json gives each optimizer's apply rate (SGD there has momentum)."""


class PlanError(ValueError):
    """A request the planner cannot answer or no deployment satisfies; the message names the limit."""


@dataclass(frozen=True)
class SwitchTarget:
    """What one replicating switch holds and moves, with where each figure comes from."""

    name: str
    multicast_groups: int
    replication_nodes: int | None
    """Replication-engine (L1) nodes; each Checkmate group has two."""
    replication_entries: int
    shadow_rewrites: int
    jobs: int
    bandwidth_gbps: float | None
    """Switching capacity (hardware targets)."""
    frames_per_second: float | None
    """Measured lossless frame rate into the switch with 2-way replication (software targets)."""
    sources: dict[str, str] = field(default_factory=dict)


def _tables_source() -> str:
    return "p4src/shared/defines.p4 (tables as committed)"


def _best_lossless_rate(paths: list[Path], target: str) -> tuple[float, str] | None:
    """Highest lossless 2-way 9014-byte frames/s into ``target`` over the benchmark files."""
    best: tuple[float, str] | None = None
    for path in paths:
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for row in document.get("summary", []) if isinstance(document, dict) else []:
            if (
                isinstance(row, dict)
                and row.get("target") == target
                and row.get("scenario") == "2-way"
                and row.get("frame_bytes") == 9014
                and row.get("mode") == "lossless"
                and isinstance(row.get("in_pps"), (int, float))
            ):
                rate = float(row["in_pps"])
                if best is None or rate > best[0]:
                    best = (rate, repo_relative(path))
    return best


def switch_target(
    name: str, max_groups: int | None = None, bandwidth_gbps: float | None = None
) -> SwitchTarget:
    """The limits of ``name`` (bmv2, embedded, tofino, tofino2), optionally overridden."""
    tables = {
        "replication_entries": REPLICATION_TABLE_SIZE,
        "shadow_rewrites": SHADOW_DESTINATION_TABLE_SIZE,
        "jobs": JOB_TABLE_SIZE,
    }
    sources = {"tables": _tables_source()}
    if name in ("bmv2", "embedded"):
        groups, nodes = 4096, 4096
        sources["multicast_groups"] = "BMv2's default limits: 4096 groups, 4096 L1 nodes (docs/controller.md)"
        if name == "bmv2":
            files = sorted(DEFAULT_BMV2_BENCH_DIR.glob("*bmv2*.json"))
        else:
            files = [DEFAULT_SWITCH_BENCH, *sorted(DEFAULT_BMV2_BENCH_DIR.glob("*embedded*.json"))]
        measured = _best_lossless_rate(files, name)
        rate = measured[0] if measured else None
        sources["frames_per_second"] = (
            f"highest lossless 2-way 9014 B rate in {measured[1]} (make bench-switch)"
            if measured
            else "no switch benchmark file found: frame rate not checked"
        )
        bandwidth = bandwidth_gbps
    elif name in ("tofino", "tofino2"):
        groups, nodes = MAX_MULTICAST_GROUP_ID, None
        sources["multicast_groups"] = (
            "the controller's group ids 1..32767 (the chip's own group and node counts are not "
            "claimed: docs/tofino.md; give the SDE's figure with --max-groups)"
        )
        rate = None
        bandwidth = (
            bandwidth_gbps if bandwidth_gbps is not None else (6400.0 if name == "tofino" else 12800.0)
        )
        sources["bandwidth_gbps"] = (
            "vendor's published switching capacity (6.4 / 12.8 Tb/s), not measured here"
        )
    else:
        raise PlanError(f"unknown switch target {name!r}: bmv2, embedded, tofino or tofino2")
    if max_groups is not None:
        groups = min(groups, max_groups)
        sources["multicast_groups"] = f"--max-groups {max_groups}"
    if bandwidth_gbps is not None:
        sources["bandwidth_gbps"] = f"--switch-gbps {bandwidth_gbps:g}"
    return SwitchTarget(
        name, groups, nodes, frames_per_second=rate, bandwidth_gbps=bandwidth, sources=sources, **tables
    )


def apply_rate(optimizer: str, path: Path = DEFAULT_SHADOW_BENCH) -> float:
    """Parameters per second one shadow core applies for ``optimizer``, from ``make bench-shadow``."""
    kind = OPTIMIZER_BENCH_KIND[optimizer]
    try:
        rows = json.loads(path.read_text())
    except OSError as exc:
        raise PlanError(
            f"cannot read the shadow benchmark {path} ({exc.strerror}): run make bench-shadow first"
        ) from None
    except ValueError as exc:
        raise PlanError(f"{path} is not JSON ({exc}): run make bench-shadow again") from None
    rates = [
        float(row["parameters_per_second"])
        for row in (rows if isinstance(rows, list) else [])
        if isinstance(row, dict)
        and row.get("kind") == kind
        and isinstance(row.get("parameters_per_second"), (int, float))
    ]
    if not rates or rates[0] <= 0:
        raise PlanError(
            f"{path} has no apply rate for {kind} (optimizer {optimizer}): "
            f"run python -m experiments.bench.shadow --kinds {kind} --json {path}"
        )
    return rates[0]


def repo_relative(path: Path) -> str:
    """``path`` as a plan's sources name it: ``controller/measured/...`` for the packaged figures."""
    try:
        return str(Path("controller", "measured", path.resolve().relative_to(MEASURED.resolve())))
    except ValueError:
        return str(path)
