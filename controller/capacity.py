"""Capacity planning: what a job of a given size needs from shadows and switches (the model).

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
its workers' tagged datagrams. ``--parallelism fsdp2`` makes the buckets the job's
``--fsdp-modules`` (one reduce-scatter each, run on the same ring, the hop to each shard's
owner tagged) and adds its untagged parameter all-gathers to the switch's traffic; the
shadows hold the full state for every parallelism (docs/capacity.md, "Sharded jobs").

Three modules: :mod:`controller.capacity_inputs` (the figures above and where each comes
from), this one (:class:`PlanRequest` and :func:`plan`, the arithmetic), and
:mod:`controller.capacity_cli` (``checkmate-ctl plan``: options, text rendering).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from checkmate.job import PARALLELISMS, UNPROTECTED_PARALLELISMS
from checkmate.wire import MAX_PAYLOAD_BYTES
from controller.capacity_inputs import (
    DDP_DEFAULT_BUCKET_MB,
    DEFAULT_SHADOW_BENCH,
    FRAME_OVERHEAD_BYTES,
    GRAD_DTYPE_BYTES,
    MAX_SHARD_KEYS,
    OPTIMIZER_BENCH_KIND,
    OPTIMIZER_STATE_BYTES,
    PARAMETER_GATHERS,
    REDUCES_BY_ALL_REDUCE,
    SHADOW_HORIZON_ITERATIONS,
    PlanError,
    apply_rate,
    repo_relative,
    switch_target,
)

logger = logging.getLogger(__name__)


PLAN_PARALLELISMS = (*PARALLELISMS, *UNPROTECTED_PARALLELISMS)
"""What ``--parallelism`` takes: the protected ones and those only sized (ZeRO-1/2)."""


def protection(parallelism: str, tp: int) -> str:
    """What protects a job of this parallelism today (the plan's ``protection``; docs/backend.md)."""
    if parallelism == "ddp":
        return "protected: hosts.enable_checkmate (DDP's comm hook tags each bucket's reduced chunks)"
    if parallelism == "fsdp2" and tp == 1:
        return (
            "protected: hosts.c10d_fsdp.enable_checkmate_fsdp on the checkmate backend (each module's "
            "reduce-scatter runs on the ring, the hop to each shard's owner tagged)"
        )
    if parallelism == "fsdp2":
        return (
            f"not protected: FSDP2 with tensor parallelism (--tp {tp}) is not integrated; the figures are "
            "what its lanes would need"
        )
    return (
        f"not protected: {UNPROTECTED_PARALLELISMS[parallelism]} is not integrated (docs/backend.md); "
        "the figures are what it would need with its gradients tagged like "
        + ("DDP's" if REDUCES_BY_ALL_REDUCE[parallelism] else "FSDP2's")
    )


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
    parallelism: str = "ddp"
    """How the job reduces its gradients: ddp, fsdp2, zero1 or zero2 (``PLAN_PARALLELISMS``)."""
    fsdp_modules: int | None = None
    """FSDP2: the ``fully_shard`` modules holding parameters; each reduce-scatters once per iteration."""

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
        if self.parallelism not in PLAN_PARALLELISMS:
            raise PlanError(
                f"unknown --parallelism {self.parallelism!r}; known: {', '.join(PLAN_PARALLELISMS)} "
                "(tensor parallelism is --tp)"
            )
        if self.parallelism == "fsdp2":
            if self.fsdp_modules is None:
                raise PlanError(
                    "--parallelism fsdp2 needs --fsdp-modules: its gradients travel one reduce-scatter "
                    "per fully_shard module, not in --bucket-mb buckets"
                )
            modules = self.fsdp_modules
            if isinstance(modules, bool) or not isinstance(modules, int) or modules < 1:
                raise PlanError(f"--fsdp-modules must be an integer >= 1, got {modules!r}")
            if modules * self.tp > self.model_params:
                raise PlanError(
                    f"--fsdp-modules {modules}: {self.model_params:g} parameters over --tp {self.tp} leave "
                    "modules without parameters"
                )
        elif self.fsdp_modules is not None:
            raise PlanError(f"--fsdp-modules goes with --parallelism fsdp2, not {self.parallelism}")


def shadow_bytes_per_param(optimizer: str, grad_dtype: str) -> int:
    """Shadow memory per parameter: fp32 weights and optimizer state twice (live and the snapshot being
    written) and ``ShadowConfig.horizon`` iterations of gradients at the bucket dtype (docs/capacity.md).

    The same for every parallelism: the shadows hold the full (logical) state whether the workers
    shard it (FSDP2, ZeRO) or not. ``checkmate-ctl job add`` sizes a job's shadows with it too.
    """
    state = OPTIMIZER_STATE_BYTES[optimizer]
    return (4 + state) * 2 + SHADOW_HORIZON_ITERATIONS * GRAD_DTYPE_BYTES[grad_dtype]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _datagrams(elements: int, dp: int, per_datagram: int) -> int:
    """Tagged datagrams of one bucket: the slot grid of hosts/ring_allreduce.py, counted."""
    total = 0
    for c in range(dp):
        chunk = (c + 1) * elements // dp - c * elements // dp
        total += _ceil_div(chunk, per_datagram)
    return total


@dataclass(frozen=True)
class Buckets:
    """A ring's gradient buckets per iteration: ``count`` buckets of ``parameters`` each, of which
    ``wire`` elements cross the ring (FSDP2 pads each module's reduce-scatter input to ``N`` equal
    shards; the shadows keep only the parameters)."""

    count: int
    parameters: int
    wire: int


def ring_buckets(request: PlanRequest, ring_params: int, bucket_elements: int) -> list[Buckets]:
    """The ring's buckets: DDP's (and ZeRO's) ``--bucket-mb`` cut, or one per FSDP2 module.

    FSDP2: the ring's parameters split as evenly as whole elements allow over ``--fsdp-modules``
    (sizes differ by at most one), each padded up to a multiple of ``dp`` (``chunk_cat``'s rank-major
    input, every rank's shard the same size; FSDP2 pads each parameter's dim 0, so real padding is
    up to ``dp - 1`` rows per parameter, which the planner, knowing no shapes, does not add).
    """
    if request.parallelism == "fsdp2":
        assert request.fsdp_modules is not None  # validate()
        modules = request.fsdp_modules
        small, larger = divmod(ring_params, modules)
        grid = [Buckets(larger, small + 1, _ceil_div(small + 1, request.dp) * request.dp)]
        grid.append(Buckets(modules - larger, small, _ceil_div(small, request.dp) * request.dp))
        return [b for b in grid if b.count]
    buckets = _ceil_div(ring_params, bucket_elements)
    last = ring_params - (buckets - 1) * bucket_elements
    grid = [Buckets(buckets - 1, bucket_elements, bucket_elements), Buckets(1, last, last)]
    return [b for b in grid if b.count]


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
    nominal = max(1, int(request.bucket_mb * 1024 * 1024) // grad_bytes)
    grid = ring_buckets(request, ring_params, nominal)
    buckets = sum(b.count for b in grid)
    # the largest bucket (DDP, ZeRO: the nominal --bucket-mb one, even when the ring is smaller)
    largest = Buckets(1, nominal, nominal)
    if request.parallelism == "fsdp2":
        largest = max(grid, key=lambda b: b.wire)
    bucket_elements = largest.parameters
    full_dgrams = _datagrams(largest.wire, request.dp, per_datagram)
    ring_datagrams = sum(b.count * _datagrams(b.wire, request.dp, per_datagram) for b in grid)
    ring_wire_elements = sum(b.count * b.wire for b in grid)
    ring_copy_bytes = ring_wire_elements * grad_bytes + ring_datagrams * FRAME_OVERHEAD_BYTES
    bucket_wire_bytes = largest.wire * grad_bytes + full_dgrams * FRAME_OVERHEAD_BYTES
    T = request.iteration_time_s
    link_bytes_per_iteration = request.link_gbps * 1e9 / 8 * T

    # --- shadows per ring: CPU, then link, then memory; each owns whole buckets
    budget_s = request.shadow_busy * T
    fsdp = request.parallelism == "fsdp2"
    unit = "one bucket (FSDP module)" if fsdp else "one bucket"
    smaller = "more, smaller FSDP modules (--fsdp-modules)" if fsdp else "smaller buckets (--bucket-mb)"
    bucket_apply_s = min(bucket_elements, ring_params) / rate
    if bucket_apply_s > budget_s:
        raise PlanError(
            f"shadow CPU: {unit} of {min(bucket_elements, ring_params):,} parameters takes "
            f"{bucket_apply_s * 1e3:.1f} ms to apply ({request.optimizer}, {rate / 1e6:.1f} M params/s "
            f"per core measured in {repo_relative(request.shadow_bench)}), "
            f"more than the {budget_s * 1e3:.1f} ms a shadow may spend "
            f"per {T * 1e3:g} ms iteration: no number of shadows keeps up; use {smaller} "
            "or a longer iteration"
        )
    one_bucket_wire = min(bucket_wire_bytes, ring_copy_bytes)
    if one_bucket_wire > link_bytes_per_iteration:
        raise PlanError(
            f"shadow link: {unit} ({one_bucket_wire / 1e6:.1f} MB on the wire) does not cross a "
            f"{request.link_gbps:g} Gb/s link in a {T * 1e3:g} ms iteration: no number of shadows keeps up; "
            f"use {smaller} or faster shadow links"
        )
    memory_per_param = shadow_bytes_per_param(request.optimizer, request.grad_dtype)
    host_memory = request.shadow_memory_gib * 2**30
    buckets_by_cpu = int(budget_s * rate // bucket_elements) or 1
    buckets_by_memory = int(host_memory // (bucket_elements * memory_per_param))
    if buckets_by_memory < 1:
        raise PlanError(
            f"shadow memory: {unit} needs {bucket_elements * memory_per_param / 2**30:.1f} GiB, "
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
    # frames into the leaf per iteration: each worker sends 2 (dp-1)/dp of its ring's bytes (the tagged
    # ring all-reduce), and (dp-1)/dp per parameter all-gather (FSDP2: forward and backward; ZeRO: after
    # the step), counted on the same datagram grid
    gathers = PARAMETER_GATHERS[request.parallelism]
    ring_frames_leaf = leaf_workers * (2 + gathers) * (request.dp - 1) / request.dp * ring_datagrams
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
        "protection": protection(request.parallelism, request.tp),
        "gpus": gpus,
        "rings": {
            "count": request.tp,
            "parameters_per_ring": ring_params,
            "buckets_per_ring": buckets,
            "bucket_parameters": min(bucket_elements, ring_params),
            "tagged_datagrams_per_ring_per_iteration": ring_datagrams,
            "copied_bytes_per_ring_per_iteration": ring_copy_bytes,
            "padding_elements_per_ring_per_iteration": ring_wire_elements - ring_params,
            "parameter_all_gathers_per_iteration": gathers,
            "gradient_bytes_sent_per_worker_per_iteration": {
                "tagged": round(2 * (request.dp - 1) / request.dp * ring_wire_elements * grad_bytes),
                "untagged": round(
                    (2 if REDUCES_BY_ALL_REDUCE[request.parallelism] else 1)
                    * (request.dp - 1)
                    / request.dp
                    * ring_wire_elements
                    * grad_bytes
                ),
            },
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
            "apply_rate": f"{repo_relative(request.shadow_bench)} (make bench-shadow, one thread), "
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
