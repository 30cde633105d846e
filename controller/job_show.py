"""``checkmate-ctl job show``: one job's slot, groups, counters and its shadows' status.

:func:`show_job` prints a job (or returns its JSON document with ``--json``), asking its
shadows for their status on their control port; :func:`print_job_line` is the one line
that names a job, also printed after a move or a resize.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from checkmate.job import JobSpec
from checkmate.network import Network
from checkmate.p4 import names
from controller.controller import Controller
from controller.job_registry_cli import lane_line, lane_summary, sizing_line
from controller.job_secrets import JobSecretError, JobSecrets
from controller.shadow_status import (
    ShadowStatus,
    protection,
    protection_line,
    query_shadows,
    shadow_addresses,
    summary_line,
)

logger = logging.getLogger(__name__)


def print_job_line(record_spec: JobSpec, slot: int) -> None:
    shards = ", ".join(f"{k}->{s}" for k, s in sorted(record_spec.shard_to_shadow.items()))
    print(
        f"job {record_spec.job_id}  slot {slot}  workers {','.join(record_spec.workers)}  "
        f"shadows {','.join(record_spec.shadows)}  shards {shards}"
    )


def show_job(
    ctl: Controller, network: Network, args: argparse.Namespace, job_id: int, state_dir: Path
) -> dict[str, Any]:
    """Print one job (text), or return its JSON document (--json)."""
    status = ctl.job_status(job_id)
    record = status.record
    shadows = None
    if not args.no_shadows:
        overrides = dict(args.shadow_address)
        for name in sorted(set(overrides) - set(record.spec.shadows)):
            logger.warning("--shadow-address %s: job %d has no shadow %s", name, job_id, name)
        addresses = shadow_addresses(record.spec, network, args.shadow_control_port, overrides)
        try:
            secret = JobSecrets(state_dir).read(job_id)
        except JobSecretError as exc:  # e.g. a job added before secrets existed: say so on each line
            shadows = [ShadowStatus(name, "", error=str(exc)) for name in addresses]
        else:
            shadows = query_shadows(addresses, args.shadow_timeout, record.spec.job_id, secret)
    if args.json:
        out = {
            "job": record.spec.to_json(),
            "slot": record.slot,
            "groups": [
                {"switch": s, "next_hop_port": p, "shadow": sh, "group_id": g}
                for (s, p, sh), g in sorted(record.groups.items())
            ],
            "rids": [{"switch": s, "shadow": sh, "rid": r} for (s, sh), r in sorted(record.rids.items())],
            "counters": {
                switch: {name: {"packets": v.packets, "bytes": v.bytes} for name, v in values.items()}
                for switch, values in status.counters.items()
            },
        }
        lanes = lane_summary(record.spec, {r.spec.job_id for r in ctl.jobs()})
        if lanes is not None:
            out["lanes"] = lanes
        if shadows is not None:
            out["shadows"] = {answer.shadow: answer.to_json() for answer in shadows}
            out["protection"] = protection(shadows, record.spec.job_id)
        return out
    print_job_line(record.spec, record.slot)
    if record.spec.tp_degree > 1:
        print("  " + lane_line(record.spec, {r.spec.job_id for r in ctl.jobs()}))
    if record.spec.sizing_fields():
        print("  " + sizing_line(record.spec))
    for (switch, port, shadow), group in sorted(record.groups.items()):
        rid = record.rids[(switch, shadow)]
        print(f"  {switch}: multicast group {group}: next hop port {port} + copy to {shadow} (rid {rid})")
    print("  counters since the job was added (packets / bytes):")
    for switch, values in sorted(status.counters.items()):
        parts = [f"{name} {v.packets} / {v.bytes}" for name, v in values.items()]
        print(f"    {switch}: " + ", ".join(parts))
    copies, rejected = status.total(names.ShadowCopies.NAME), status.total(names.RejectedReplications.NAME)
    print(
        f"  total: {names.ShadowCopies.NAME} {copies.packets} / {copies.bytes}, "
        f"{names.RejectedReplications.NAME} {rejected.packets}"
    )
    if shadows is not None:
        print(f"  shadows (status on their control port, {args.shadow_timeout:g} s timeout):")
        for answer in shadows:
            print(f"    {summary_line(answer, record.spec.job_id)}")
        print(f"  {protection_line(protection(shadows, record.spec.job_id))}")
    return {}
