"""The cluster-scale comparison: Checkmate next to periodic checkpointing on named clusters.

``checkmate-ctl plan --compare [NAME ...]`` answers, for each named cluster configuration,
what each checkpointing system costs and what a failure costs with it:

* the per-iteration overhead when checkpointing every ``k`` iterations,
* the checkpoint interval at 5 % overhead (the smallest ``k`` whose overhead is at most 5 %),
* the repeated work per failure at that interval (``k/2 + d`` iterations, ``d`` the delay
  until a checkpoint is durable, plus the restart), at the cluster's failure rate,
* for Checkmate, the shadow cluster the capacity planner (:func:`controller.capacity.plan`)
  sizes from the apply rate measured in ``results/shadow_bench.json``.

The comparison lives in five modules, one concern each:

* :mod:`controller.cluster_inputs`: :class:`ClusterConfig`, :class:`Source` (every input
  ``cited``, ``derived``, ``measured``, ``assumed`` or ``given``), :func:`with_overrides`;
* :mod:`controller.cluster_model`: the model and its arithmetic, :func:`compare`;
* :mod:`controller.named_clusters`: the named, cited configurations (:data:`CONFIGS`, :func:`named`);
* :mod:`controller.cluster_bench_check`: the model against ``make bench``'s measurements;
* :mod:`controller.cluster_render`: the comparison as text and Markdown.

This module is their public face, kept so that ``from controller.cluster_compare import
...`` goes on working (the benchmark's storage host and its ``--storage-cluster`` option
import :data:`CONFIGS`, :func:`named` and :func:`write_seconds` from here); new code imports
from the modules above.
"""

from __future__ import annotations

from controller.cluster_bench_check import DEFAULT_DISK_BENCH, MachineCheck, MachineRow, machine_check
from controller.cluster_inputs import (
    DEFAULT_BENCH,
    INPUT_FIELDS,
    SWITCHES,
    ClusterConfig,
    CompareError,
    Source,
    with_overrides,
)
from controller.cluster_model import (
    MAX_INTERVAL,
    OVERHEAD_BUDGET,
    PEERS,
    SYSTEMS,
    Comparison,
    SystemResult,
    compare,
    durable_delay,
    interval_at,
    overhead,
    snapshot_seconds,
    write_seconds,
)
from controller.cluster_render import machine_markdown, markdown, render_text, storage_sensitivity
from controller.named_clusters import CONFIGS, measured_lag, named

__all__ = [
    "CONFIGS",
    "DEFAULT_BENCH",
    "DEFAULT_DISK_BENCH",
    "INPUT_FIELDS",
    "MAX_INTERVAL",
    "OVERHEAD_BUDGET",
    "PEERS",
    "SWITCHES",
    "SYSTEMS",
    "ClusterConfig",
    "CompareError",
    "Comparison",
    "MachineCheck",
    "MachineRow",
    "Source",
    "SystemResult",
    "compare",
    "durable_delay",
    "interval_at",
    "machine_check",
    "machine_markdown",
    "markdown",
    "measured_lag",
    "named",
    "overhead",
    "render_text",
    "snapshot_seconds",
    "storage_sensitivity",
    "with_overrides",
    "write_seconds",
]
