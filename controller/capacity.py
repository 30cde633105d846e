"""Capacity planning: what a job of a given size needs from shadows and switches.

``checkmate-ctl plan --model-params 70e9 --optimizer adamw --iteration-time 10 --dp 128 --tp 8
--link-gbps 400 --switch tofino2`` answers: how many shadow processes (one CPU core each) and
shadow hosts, how much shadow memory, how many bytes each shadow link carries per
iteration, what the replicating switch must hold (multicast groups, replication
entries, shadow rewrites, replication-engine nodes) and copy per second against the
target's limits, and the work repeated after a failure.

Where the figures come from (each result says so in ``sources``):

* the optimizer-apply rate, parameters per second on one core, is read from
  ``results/shadow_bench.json`` (``make bench-shadow``, one thread) at run time; the
  planner never runs torch;
* datagram sizes and counts follow the ring all-reduce's slot grid
  (hosts/ring_allreduce.py: a bucket in ``dp`` chunks, each chunk in datagrams of at
  most ``MAX_PAYLOAD_BYTES``; only the owner's all-gather copy of each slot is tagged);
* table sizes are those of p4src/shared/defines.p4 (a test keeps them equal); BMv2's
  replication-engine limits are BMv2's defaults (docs/controller.md); Tofino's group
  limit is the controller's group-id space, not a claim about the chip (docs/tofino.md);
  switch bandwidth on Tofino is the vendor's published figure; BMv2's and the embedded
  target's frame rates are the lossless 2-way 9014-byte rates of ``make bench-switch``.

The model (docs/capacity.md states it with its limits): one DP ring per TP index, each
reducing ``params / tp`` parameters in buckets of ``--bucket-mb``; a shadow is one
process on one core owning whole buckets (bucket b -> shard b mod K) and may spend
``--shadow-busy`` of an iteration applying the optimizer (the rest is receiving,
reassembly and snapshots); a shadow host has ``--shadow-cores-per-host`` cores,
``--shadow-memory-gib`` of memory and one link of ``--link-gbps``; every worker is
attached to a leaf switch holding ``--workers-per-switch`` workers, which replicates
its workers' tagged datagrams.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from checkmate.network import MAX_MULTICAST_GROUP_ID
from checkmate.p4.program import REPO_ROOT
from checkmate.wire import HEADER_BYTES, IPV4_HEADER_BYTES, MAX_PAYLOAD_BYTES, UDP_HEADER_BYTES

logger = logging.getLogger(__name__)

DEFAULT_SHADOW_BENCH = REPO_ROOT / "results" / "shadow_bench.json"
DEFAULT_SWITCH_BENCH = REPO_ROOT / "results" / "switch_bench.json"
DEFAULT_BMV2_BENCH_DIR = REPO_ROOT / "results" / "switch_bench_targets"

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
                    best = (
                        rate,
                        str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path),
                    )
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
            f"run python -m shadow.benchmark --kinds {kind} --json {path}"
        )
    return rates[0]


@dataclass(frozen=True)
class PlanRequest:
    model_params: float
    optimizer: str
    iteration_time_s: float
    dp: int
    tp: int = 1
    link_gbps: float = 100.0
    switch: str = "tofino"
    grad_dtype: str = "fp32"
    bucket_mb: float = DDP_DEFAULT_BUCKET_MB
    shadow_cores_per_host: int = 32
    shadow_memory_gib: float = 256.0
    shadow_busy: float = 0.5
    workers_per_switch: int = 32
    max_groups: int | None = None
    switch_gbps: float | None = None
    lag_iterations: float = 1.0
    """Iterations after which a step's checkpoint is certified (1 measured by make bench)."""
    compare_every: int | None = None
    shadows_per_ring: int | None = None
    """Use this many shadows per ring (at least the planner's minimum, at most one per bucket)."""
    """A periodic checkpoint every this many iterations, for the repeated-work comparison."""
    shadow_bench: Path = DEFAULT_SHADOW_BENCH

    def validate(self) -> None:
        def positive(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise PlanError(f"{name} must be a positive finite number, got {value!r}")

        positive("--model-params", self.model_params)
        positive("--iteration-time", self.iteration_time_s)
        positive("--link-gbps", self.link_gbps)
        positive("--bucket-mb", self.bucket_mb)
        positive("--shadow-memory-gib", self.shadow_memory_gib)
        if self.model_params < 1:
            raise PlanError(f"--model-params {self.model_params:g}: a model has at least one parameter")
        if self.model_params > 1e15:
            raise PlanError(f"--model-params {self.model_params:g} is not a model size (more than 10^15)")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise PlanError(
                f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZER_STATE_BYTES)}"
            )
        if self.grad_dtype not in GRAD_DTYPE_BYTES:
            raise PlanError(
                f"unknown gradient dtype {self.grad_dtype!r}; known: {', '.join(GRAD_DTYPE_BYTES)}"
            )
        for name, value in (
            ("--dp", self.dp),
            ("--tp", self.tp),
            ("--shadow-cores-per-host", self.shadow_cores_per_host),
            ("--workers-per-switch", self.workers_per_switch),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be an integer >= 1, got {value!r}")
        if self.dp < 2:
            raise PlanError(
                "--dp 1 has no all-reduce: nothing crosses the switch to copy (Checkmate needs dp >= 2)"
            )
        if self.tp > self.model_params:
            raise PlanError(f"--tp {self.tp} splits {self.model_params:g} parameters into empty shards")
        if not 0 < self.shadow_busy <= 1:
            raise PlanError(f"--shadow-busy must be in (0, 1], got {self.shadow_busy!r}")
        if self.lag_iterations < 0 or not math.isfinite(self.lag_iterations):
            raise PlanError(f"--lag must be >= 0, got {self.lag_iterations!r}")
        if self.shadows_per_ring is not None and self.shadows_per_ring < 1:
            raise PlanError(f"--shadows-per-ring must be >= 1, got {self.shadows_per_ring!r}")
        if self.compare_every is not None and self.compare_every < 1:
            raise PlanError(f"--compare-every must be >= 1, got {self.compare_every!r}")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _datagrams(elements: int, dp: int, per_datagram: int) -> int:
    """Tagged datagrams of one bucket: the slot grid of hosts/ring_allreduce.py, counted."""
    total = 0
    for c in range(dp):
        chunk = (c + 1) * elements // dp - c * elements // dp
        total += _ceil_div(chunk, per_datagram)
    return total


def plan(request: PlanRequest) -> dict[str, Any]:
    """The plan as a JSON-able dict; raises PlanError naming the limiting resource."""
    request.validate()
    target = switch_target(request.switch, request.max_groups, request.switch_gbps)
    rate = apply_rate(request.optimizer, request.shadow_bench)
    gpus = request.dp * request.tp
    params = int(request.model_params)
    ring_params = _ceil_div(params, request.tp)
    grad_bytes = GRAD_DTYPE_BYTES[request.grad_dtype]
    per_datagram = MAX_PAYLOAD_BYTES // grad_bytes
    bucket_elements = max(1, int(request.bucket_mb * 1024 * 1024) // grad_bytes)
    buckets = _ceil_div(ring_params, bucket_elements)
    last_bucket = ring_params - (buckets - 1) * bucket_elements
    full_dgrams = _datagrams(bucket_elements, request.dp, per_datagram)
    last_dgrams = _datagrams(last_bucket, request.dp, per_datagram)
    ring_datagrams = (buckets - 1) * full_dgrams + last_dgrams
    ring_copy_bytes = ring_params * grad_bytes + ring_datagrams * FRAME_OVERHEAD_BYTES
    bucket_wire_bytes = bucket_elements * grad_bytes + full_dgrams * FRAME_OVERHEAD_BYTES
    T = request.iteration_time_s
    link_bytes_per_iteration = request.link_gbps * 1e9 / 8 * T

    # --- shadows per ring: CPU, then link, then memory; each owns whole buckets
    budget_s = request.shadow_busy * T
    bucket_apply_s = min(bucket_elements, ring_params) / rate
    if bucket_apply_s > budget_s:
        raise PlanError(
            f"shadow CPU: one bucket of {min(bucket_elements, ring_params):,} parameters takes "
            f"{bucket_apply_s * 1e3:.1f} ms to apply ({request.optimizer}, {rate / 1e6:.1f} M params/s "
            f"per core measured in {_rel(request.shadow_bench)}), more than the {budget_s * 1e3:.1f} ms "
            "a shadow may spend "
            f"per {T * 1e3:g} ms iteration: no number of shadows keeps up; use smaller buckets (--bucket-mb) "
            "or a longer iteration"
        )
    one_bucket_wire = min(bucket_wire_bytes, ring_copy_bytes)
    if one_bucket_wire > link_bytes_per_iteration:
        raise PlanError(
            f"shadow link: one bucket ({one_bucket_wire / 1e6:.1f} MB on the wire) does not cross a "
            f"{request.link_gbps:g} Gb/s link in a {T * 1e3:g} ms iteration: no number of shadows keeps up; "
            "use smaller buckets (--bucket-mb) or faster shadow links"
        )
    state_bytes = OPTIMIZER_STATE_BYTES[request.optimizer]
    memory_per_param = (4 + state_bytes) * 2 + SHADOW_HORIZON_ITERATIONS * grad_bytes
    host_memory = request.shadow_memory_gib * 2**30
    buckets_by_cpu = int(budget_s * rate // bucket_elements) or 1
    buckets_by_memory = int(host_memory // (bucket_elements * memory_per_param))
    if buckets_by_memory < 1:
        raise PlanError(
            f"shadow memory: one bucket needs {bucket_elements * memory_per_param / 2**30:.1f} GiB, "
            f"more than a shadow host's {request.shadow_memory_gib:g} GiB"
        )
    buckets_per_shadow = min(buckets_by_cpu, buckets_by_memory, buckets)
    shadows_per_ring = _ceil_div(buckets, buckets_per_shadow)
    # the link: a shadow's buckets must cross its host's link in one iteration
    while shadows_per_ring < buckets:
        owned = _ceil_div(buckets, shadows_per_ring)
        if owned * bucket_wire_bytes <= link_bytes_per_iteration:
            break
        shadows_per_ring += 1
    if request.shadows_per_ring is not None:
        if request.shadows_per_ring < shadows_per_ring:
            raise PlanError(
                f"--shadows-per-ring {request.shadows_per_ring}: at least {shadows_per_ring} are needed "
                "to keep up (shadow CPU, memory and link)"
            )
        if request.shadows_per_ring > buckets:
            raise PlanError(
                f"--shadows-per-ring {request.shadows_per_ring}: a ring has {buckets} bucket(s), a shadow "
                "owns whole buckets"
            )
        shadows_per_ring = request.shadows_per_ring
    owned = _ceil_div(buckets, shadows_per_ring)
    owned_params = min(owned * bucket_elements, ring_params)
    shadow_bytes_per_iteration = min(owned * bucket_wire_bytes, ring_copy_bytes)
    if shadows_per_ring > MAX_SHARD_KEYS:
        raise PlanError(
            f"shard keys: {shadows_per_ring} shadows per ring, the wire's shard key holds {MAX_SHARD_KEYS}"
        )
    shadows = shadows_per_ring * request.tp
    shadow_memory = owned_params * memory_per_param
    host_limits = {
        "cores": request.shadow_cores_per_host,
        "memory": int(host_memory // shadow_memory),
        "link": int(link_bytes_per_iteration // shadow_bytes_per_iteration),
    }
    limiting_host = min(host_limits, key=lambda k: host_limits[k])
    per_host = max(1, host_limits[limiting_host])
    hosts = _ceil_div(shadows, per_host)

    # --- switch: the busiest leaf
    leaf_workers = min(request.workers_per_switch, gpus)
    leaves = _ceil_div(gpus, leaf_workers)
    rings_on_leaf = min(request.tp, leaf_workers)
    groups = leaf_workers * shadows_per_ring
    entries = leaf_workers * shadows_per_ring
    rewrites = rings_on_leaf * shadows_per_ring
    nodes = 2 * groups
    copy_bytes_leaf = ring_copy_bytes * request.tp * leaf_workers / gpus
    copies_leaf = ring_datagrams * request.tp * leaf_workers / gpus
    # frames into the leaf per iteration: each worker sends 2 (dp-1)/dp of its ring's bytes
    ring_frames_leaf = leaf_workers * 2 * (request.dp - 1) / request.dp * ring_datagrams
    checks = [
        ("multicast groups", groups, target.multicast_groups, target.sources["multicast_groups"]),
        ("replication-engine nodes", nodes, target.replication_nodes, target.sources["multicast_groups"]),
        ("replicate_to_shadow entries", entries, target.replication_entries, target.sources["tables"]),
        ("rewrite_shadow_copy entries (rids)", rewrites, target.shadow_rewrites, target.sources["tables"]),
    ]
    switch_rows = []
    for name, needed, limit, source in checks:
        if limit is None:
            continue
        switch_rows.append(
            {"resource": name, "needed": needed, "limit": limit, "fits": needed <= limit, "source": source}
        )
    copy_gbps = copy_bytes_leaf * 8 / T / 1e9
    if target.bandwidth_gbps is not None:
        switch_rows.append(
            {
                "resource": "replication bandwidth (Gb/s of copies)",
                "needed": round(copy_gbps, 3),
                "limit": target.bandwidth_gbps,
                "fits": copy_gbps <= target.bandwidth_gbps,
                "source": target.sources["bandwidth_gbps"],
            }
        )
    if target.frames_per_second is not None:
        frames_s = (ring_frames_leaf + copies_leaf) / T
        switch_rows.append(
            {
                "resource": "frames per second in (ring traffic + copies)",
                "needed": round(frames_s),
                "limit": round(target.frames_per_second),
                "fits": frames_s <= target.frames_per_second,
                "source": target.sources["frames_per_second"],
            }
        )
    over = [r for r in switch_rows if not r["fits"]]

    repeated = 0.5 + request.lag_iterations
    result: dict[str, Any] = {
        "request": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(request).items()},
        "gpus": gpus,
        "rings": {
            "count": request.tp,
            "parameters_per_ring": ring_params,
            "buckets_per_ring": buckets,
            "bucket_parameters": min(bucket_elements, ring_params),
            "tagged_datagrams_per_ring_per_iteration": ring_datagrams,
            "copied_bytes_per_ring_per_iteration": ring_copy_bytes,
        },
        "shadows": {
            "apply_rate_params_per_s_per_core": rate,
            "processes": shadows,
            "per_ring": shadows_per_ring,
            "buckets_per_shadow": owned,
            "parameters_per_shadow": owned_params,
            "apply_seconds_per_iteration": owned_params / rate,
            "busy_share": owned_params / rate / T,
            "memory_bytes_per_shadow": shadow_memory,
            "memory_bytes_total": shadow_memory * shadows,
            "hosts": hosts,
            "shadows_per_host": per_host,
            "host_limited_by": limiting_host,
            "cores": shadows,
            "link_bytes_per_shadow_per_iteration": shadow_bytes_per_iteration,
            "link_bytes_per_host_per_iteration": shadow_bytes_per_iteration * min(per_host, shadows),
            "link_share_per_host": shadow_bytes_per_iteration
            * min(per_host, shadows)
            / link_bytes_per_iteration,
        },
        "switch": {
            "target": target.name,
            "leaves": leaves,
            "workers_per_leaf": leaf_workers,
            "copies_per_leaf_per_iteration": round(copies_leaf, 1),
            "copy_bytes_per_leaf_per_iteration": round(copy_bytes_leaf),
            "copy_gbps_per_leaf": copy_gbps,
            "resources": switch_rows,
            "fits": not over,
        },
        "repeated_work_per_failure": {
            "iterations": repeated,
            "seconds": repeated * T,
            "gpu_hours": repeated * T * gpus / 3600,
            "periodic": None,
        },
        "sources": {
            "apply_rate": f"{_rel(request.shadow_bench)} (make bench-shadow, one thread), "
            f"{OPTIMIZER_BENCH_KIND[request.optimizer]}",
            "lag_iterations": "--lag; make bench measured a mean lag of 1.0 iteration (results/bench.json)",
            **{f"switch_{k}": v for k, v in target.sources.items()},
        },
    }
    if request.compare_every is not None:
        periodic = request.compare_every / 2 + 1
        result["repeated_work_per_failure"]["periodic"] = {
            "every": request.compare_every,
            "iterations": periodic,
            "gpu_hours": periodic * T * gpus / 3600,
            "checkmate_saves": 1 - repeated / periodic,
        }
    if over:
        worst = over[0]
        raise PlanInfeasible(
            f"switch {target.name}: {worst['resource']}: the busiest leaf needs {worst['needed']:,}, "
            f"the target has {worst['limit']:,} ({worst['source']})",
            result,
        )
    return result


class PlanInfeasible(PlanError):
    """A complete plan that does not fit the switch; ``plan`` holds the figures."""

    def __init__(self, message: str, plan: dict[str, Any]) -> None:
        super().__init__(message)
        self.plan = plan


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def render(result: dict[str, Any]) -> str:
    """The plan as text for a terminal."""
    r, s, sw, rep = (
        result["request"],
        result["shadows"],
        result["switch"],
        result["repeated_work_per_failure"],
    )
    lines = [
        f"{_si(r['model_params'], 'params')} {r['optimizer']}, {result['gpus']} GPUs "
        f"(dp {r['dp']} x tp {r['tp']}), "
        f"{r['iteration_time_s'] * 1e3:g} ms/iteration, {r['grad_dtype']} gradients, "
        f"{r['bucket_mb']:g} MB buckets",
        f"shadows: {s['processes']} processes ({s['per_ring']} per ring), one core each, on {s['hosts']} "
        f"host(s) (room for {s['shadows_per_host']} per host, limited by {s['host_limited_by']})",
        f"  each applies {_si(s['parameters_per_shadow'], 'params')} in "
        f"{s['apply_seconds_per_iteration'] * 1e3:.1f} ms "
        f"per iteration ({s['busy_share']:.0%} busy) at "
        f"{s['apply_rate_params_per_s_per_core'] / 1e6:.1f} M params/s",
        f"  memory {_si(s['memory_bytes_per_shadow'], 'B')} per shadow, "
        f"{_si(s['memory_bytes_total'], 'B')} in all",
        f"  link: {_si(s['link_bytes_per_shadow_per_iteration'], 'B')} per shadow per iteration, "
        f"{s['link_share_per_host']:.0%} of a host's {r['link_gbps']:g} Gb/s link",
        f"switch {sw['target']}: {sw['leaves']} leaves of {sw['workers_per_leaf']} workers; "
        "the busiest copies "
        f"{sw['copies_per_leaf_per_iteration']:,.0f} datagrams "
        f"({_si(sw['copy_bytes_per_leaf_per_iteration'], 'B')}) "
        f"per iteration, {sw['copy_gbps_per_leaf']:.2f} Gb/s",
    ]
    for row in sw["resources"]:
        mark = "ok  " if row["fits"] else "OVER"
        lines.append(f"  {mark} {row['resource']}: {row['needed']:,} of {row['limit']:,}")
    lines.append(
        f"repeated work per failure: {rep['iterations']:g} iterations = {rep['seconds']:.3g} s "
        f"= {rep['gpu_hours']:.3g} GPU-hours"
    )
    if rep["periodic"]:
        p = rep["periodic"]
        lines.append(
            f"  a checkpoint every {p['every']} iterations: {p['iterations']:g} iterations = "
            f"{p['gpu_hours']:.3g} GPU-hours ({p['checkmate_saves']:.0%} saved by Checkmate)"
        )
    lines.append("sources:")
    lines.extend(f"  {k}: {v}" for k, v in result["sources"].items())
    return "\n".join(lines)


def _number(text: str) -> float:
    """A size such as 70e9, 7B, 1.3b, 350M, 137k."""
    suffixes = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    cleaned = text.strip().replace("_", "").replace(",", "")
    factor = 1.0
    if cleaned and cleaned[-1].lower() in suffixes:
        factor = suffixes[cleaned[-1].lower()]
        cleaned = cleaned[:-1]
    try:
        value = float(cleaned) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 70e9, 7B, 350M)") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (shared with controller.cli)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def add_plan_parser(commands: Any) -> None:
    """Register ``plan`` on ``checkmate-ctl``'s sub-command parser."""
    p = commands.add_parser(
        "plan",
        help="capacity plan: shadows, memory, links and switch resources for a job size",
        description="How many shadow CPUs, how much memory, link and switch capacity a job needs "
        "(docs/capacity.md). Needs no network description and touches no switch.",
    )
    p.add_argument("--model-params", type=_number, required=True, help="parameters, e.g. 70e9, 7B, 350M")
    p.add_argument("--optimizer", required=True, choices=sorted(OPTIMIZER_STATE_BYTES), help="optimizer")
    p.add_argument("--iteration-time", type=_number, required=True, help="seconds per training iteration")
    p.add_argument("--dp", type=positive_int, required=True, help="data-parallel degree (workers per ring)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (rings), default 1")
    p.add_argument("--link-gbps", type=_number, default=100.0, help="shadow host link, Gb/s (default 100)")
    p.add_argument("--switch", default="tofino", choices=["bmv2", "embedded", "tofino", "tofino2"])
    p.add_argument("--grad-dtype", default="fp32", choices=sorted(GRAD_DTYPE_BYTES), help="bucket dtype")
    p.add_argument("--bucket-mb", type=_number, default=DDP_DEFAULT_BUCKET_MB, help="DDP bucket_cap_mb (25)")
    p.add_argument(
        "--shadow-cores-per-host", type=positive_int, default=32, help="cores per shadow host (32)"
    )
    p.add_argument("--shadow-memory-gib", type=_number, default=256.0, help="memory per shadow host (256)")
    p.add_argument(
        "--shadow-busy",
        type=float,
        default=0.5,
        help="share of an iteration a shadow may spend applying (0.5)",
    )
    p.add_argument("--workers-per-switch", type=positive_int, default=32, help="workers per leaf switch (32)")
    p.add_argument(
        "--max-groups",
        dest="plan_max_groups",
        type=positive_int,
        default=None,
        help="the switch's group limit",
    )
    p.add_argument("--switch-gbps", type=_number, default=None, help="the switch's capacity, Gb/s")
    p.add_argument("--lag", type=float, default=1.0, help="iterations until a step is certified (1)")
    p.add_argument(
        "--compare-every",
        type=positive_int,
        default=None,
        help="compare with a checkpoint every N iterations",
    )
    p.add_argument(
        "--shadows-per-ring",
        type=positive_int,
        default=None,
        help="use this many shadows per ring (default: fewest)",
    )
    p.add_argument("--shadow-bench", type=Path, default=DEFAULT_SHADOW_BENCH, help="make bench-shadow's JSON")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    return PlanRequest(
        model_params=args.model_params,
        optimizer=args.optimizer,
        iteration_time_s=args.iteration_time,
        dp=args.dp,
        tp=args.tp,
        link_gbps=args.link_gbps,
        switch=args.switch,
        grad_dtype=args.grad_dtype,
        bucket_mb=args.bucket_mb,
        shadow_cores_per_host=args.shadow_cores_per_host,
        shadow_memory_gib=args.shadow_memory_gib,
        shadow_busy=args.shadow_busy,
        workers_per_switch=args.workers_per_switch,
        max_groups=args.plan_max_groups,
        switch_gbps=args.switch_gbps,
        lag_iterations=args.lag,
        compare_every=args.compare_every,
        shadows_per_ring=args.shadows_per_ring,
        shadow_bench=args.shadow_bench,
    )


def run_plan(args: argparse.Namespace, prog: str = "checkmate-ctl") -> int:
    """``checkmate-ctl plan``: print the plan; 1 with the limiting resource when none fits."""
    try:
        result = plan(request_from_args(args))
    except PlanInfeasible as exc:
        if args.json:
            print(json.dumps({**exc.plan, "error": str(exc)}, indent=2))
        else:
            print(render(exc.plan))
        print(f"{prog}: error: cannot fit: {exc}", file=sys.stderr)
        return 1
    except PlanError as exc:
        print(f"{prog}: error: cannot plan: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0
