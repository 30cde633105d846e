"""Job commands that read or change only the registry: ``job list`` and ``job remove --forget``;
what ``job list`` and ``job show`` say of a TP job's lanes (:func:`lane_summary`, :func:`lane_line`).

Neither connects to a switch, so both work when the network is down (after
``checkmate-net down``, or with a switch gone for good):

* ``job list [--json]`` lists every registered job with what it holds (slot, groups and
  rids per switch) from the registry alone.
* ``job remove ID --forget`` deletes the job from the registry and its secret from the
  state directory, and touches no switch. The next reconcile (every ``checkmate-ctl``
  command that writes, ``checkmate-ctl reconcile``, ``checkmate-net up``) then treats what
  the job left on a live switch as stale and deletes it, and installs it nowhere again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

from checkmate.job import JobSpec
from controller.errors import ControllerError
from controller.job_secrets import JobSecrets
from controller.jobs import lane_job_ids
from controller.registry import JobRecord, Registry

logger = logging.getLogger(__name__)


def lane_summary(spec: JobSpec, registered: Collection[int]) -> dict[str, Any] | None:
    """A lane of a TP job: its TP degree and index, every lane's job id and which are registered
    (what ``job show`` and ``job list`` say of it); None for a job without tensor parallelism."""
    if spec.tp_degree == 1:
        return None
    ids = lane_job_ids(spec)
    return {
        "tp_degree": spec.tp_degree,
        "tp_index": spec.tp_index,
        "lane_job_ids": ids,
        "missing_lanes": [t for t, job_id in enumerate(ids) if job_id not in registered],
    }


def lane_line(spec: JobSpec, registered: Collection[int]) -> str:
    """One line on a lane of a TP job (empty for a job without tensor parallelism)."""
    lanes = lane_summary(spec, registered)
    if lanes is None:
        return ""
    ids = lanes["lane_job_ids"]
    missing = lanes["missing_lanes"]
    return (
        f"lane {spec.tp_index} of a TP={spec.tp_degree} job (lanes: jobs {', '.join(map(str, ids))}"
        + (f"; lane(s) {missing} not registered" if missing else "")
        + ")"
    )


def sizing_line(spec: JobSpec) -> str:
    """One line on a job's sizing fields (``job add --parallelism/--model-params/...``)."""
    parts = [spec.parallelism]
    if spec.model_params is not None:
        parts.append(
            f"{spec.model_params:,} parameters, {spec.optimizer}, {spec.grad_dtype or 'fp32'} gradients, "
            f"{spec.shadow_memory_gib:g} GiB per shadow"
        )
    return "sized: " + ", ".join(parts)


def record_summary(record: JobRecord, registered: Collection[int] = ()) -> dict[str, Any]:
    """What ``job list --json`` prints for one job."""
    switches = sorted({s for (s, _, _) in record.groups} | {s for (s, _) in record.rids})
    out = {
        "job": record.spec.to_json(),
        "slot": record.slot,
        "per_switch": {
            s: {
                "multicast_groups": sum(1 for (sw, _, _) in record.groups if sw == s),
                "rids": sum(1 for (sw, _) in record.rids if sw == s),
            }
            for s in switches
        },
    }
    lanes = lane_summary(record.spec, registered)
    if lanes is not None:
        out["lanes"] = lanes
    return out


def list_jobs(state_dir: Path, as_json: bool) -> str:
    with Registry(state_dir) as registry:
        records = registry.jobs()
    if as_json:
        ids = {r.spec.job_id for r in records}
        return json.dumps({"jobs": [record_summary(r, ids) for r in records]}, indent=2)
    if not records:
        return f"no jobs registered (registry: {state_dir})"
    lines = []
    for record in records:
        spec = record.spec
        shards = ", ".join(f"{k}->{s}" for k, s in sorted(spec.shard_to_shadow.items()))
        lines.append(
            f"job {spec.job_id}  slot {record.slot}  workers {','.join(spec.workers)}  "
            f"shadows {','.join(spec.shadows)}  shards {shards}"
        )
        if spec.tp_degree > 1:
            lines.append("  " + lane_line(spec, {r.spec.job_id for r in records}))
        if spec.sizing_fields():
            lines.append("  " + sizing_line(spec))
    groups = sum(len(r.groups) for r in records)
    rids = sum(len(r.rids) for r in records)
    lines.append(f"{len(records)} job(s) registered: {groups} multicast group(s), {rids} shadow rewrite(s)")
    return "\n".join(lines)


def forget_job(state_dir: Path, job_id: int) -> JobRecord:
    """Delete ``job_id`` from the registry (and its secret); no switch is contacted."""
    with Registry(state_dir) as registry, registry.lock():
        record = registry.job(job_id)
        if record is None:
            raise ControllerError(f"job {job_id} is not registered (registry: {state_dir})")
        registry.remove_job(job_id)
    JobSecrets(state_dir).remove(job_id)
    logger.info("job %d forgotten (registry only)", job_id)
    return record
