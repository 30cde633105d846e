"""``checkmate-ctl job add``: the job (or a TP job's lanes) from the options, registered with its secrets.

:func:`job_specs` builds the job's :class:`~checkmate.job.JobSpec` (one per lane) from ``job add``'s options
or ``--spec`` file, each checked against its shadows' memory; :func:`add_jobs` registers
them at the switches, all lanes or none, each with its own secret.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from checkmate.job import JobSpec, JobSpecError
from checkmate.network import NetworkError
from controller.capacity_job import check_shadow_memory, shadow_shares
from controller.controller import Controller
from controller.errors import ControllerError
from controller.job_secrets import JobSecrets
from controller.jobs import check_lanes, lane_job_ids, split_lanes


def job_specs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[JobSpec]:
    """The job(s) ``job add`` registers: one, or one per lane of a TP job (controller.jobs.split_lanes);
    each checked against its shadows' memory when sized (controller.capacity_job)."""
    specs = _lanes(args, parser)
    for spec in specs:
        check_shadow_memory(spec)
    return specs


def _lanes(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[JobSpec]:
    if args.tp_index is not None and args.tp_degree is None:
        parser.error("job add: --tp-index needs --tp-degree")
    if args.spec is not None and args.tp_degree is not None:
        parser.error('job add: with --spec, give "tp_degree" and "tp_index" in the spec file')
    spec = _job_spec(args, parser)
    if args.tp_degree is None:
        return [spec]
    if args.tp_index is not None:
        if not 0 <= args.tp_index < args.tp_degree:
            raise JobSpecError(f"--tp-index {args.tp_index} is outside 0..{args.tp_degree - 1} (--tp-degree)")
        return [dataclasses.replace(spec, tp_degree=args.tp_degree, tp_index=args.tp_index)]
    # split_lanes deals the ring fields; every lane carries the job's sizing (each holds 1/T of it)
    return [dataclasses.replace(lane, **spec.sizing_fields()) for lane in split_lanes(spec, args.tp_degree)]


def _sizing(args: argparse.Namespace) -> dict[str, Any]:
    """``job add``'s sizing options as JobSpec fields (those given)."""
    given = {
        "parallelism": args.parallelism,
        "model_params": args.model_params,
        "optimizer": args.optimizer,
        "grad_dtype": args.grad_dtype,
        "shadow_memory_gib": args.shadow_memory_gib,
    }
    return {name: value for name, value in given.items() if value is not None}


def _job_spec(args: argparse.Namespace, parser: argparse.ArgumentParser) -> JobSpec:
    inline = [args.job_id, args.workers, args.shadows]
    if args.spec is not None:
        if any(v is not None for v in inline) or args.shard or args.shadow_port is not None:
            parser.error("job add: give either --spec or --job-id/--workers/--shadows, not both")
        if _sizing(args):
            parser.error(
                "job add: with --spec, give the sizing fields (parallelism, model_params, optimizer, "
                "grad_dtype, shadow_memory_gib) in the spec file"
            )
        try:
            return JobSpec.loads(args.spec.read_text())
        except OSError as exc:
            raise JobSpecError(f"cannot read {args.spec}: {exc.strerror}") from None
    if any(v is None for v in inline):
        parser.error("job add: --job-id, --workers and --shadows are required (or --spec FILE)")
    shards: dict[int, str] = {}
    for key, shadow in args.shard:
        if key in shards:
            raise JobSpecError(f"shard {key} is given twice")
        shards[key] = shadow
    kwargs: dict[str, Any] = {} if args.shadow_port is None else {"shadow_port": args.shadow_port}
    kwargs.update(_sizing(args))
    return JobSpec(args.job_id, tuple(args.workers), tuple(args.shadows), shards, **kwargs)


def add_jobs(ctl: Controller, state_dir: Path, specs: list[JobSpec], secret_file: Path | None) -> None:
    """Register ``specs`` (a job, or a TP job's lanes: all or none), each with its own secret."""
    secrets = JobSecrets(state_dir)
    if secret_file is not None:
        secrets.create(0, secret_file)  # refuse a bad secret before touching the switches
        secrets.remove(0)
    check_lanes(specs, [r.spec for r in ctl.jobs()])
    derive = len(specs) > 1  # several lanes from one secret file: one derived secret per lane
    if secret_file is not None and not derive and specs[0].tp_degree > 1:
        secrets.check_distinct(specs[0].job_id, secret_file, lane_job_ids(specs[0]))
    added: list[int] = []
    try:
        for spec in specs:
            record = ctl.add_job(spec)
            added.append(spec.job_id)
            path = secrets.create(spec.job_id, secret_file, derive_lane=derive)
            lane = f" (lane {spec.tp_index} of TP={spec.tp_degree})" if spec.tp_degree > 1 else ""
            print(
                f"job {spec.job_id}{lane} added: slot {record.slot}, {len(record.groups)} multicast "
                f"group(s), {len(record.rids)} shadow rewrite(s); secret kept in {path} (mode 0600)"
            )
            for share in shadow_shares(spec):
                print(
                    f"  shadow {share.shadow}: {share.parameters:,} parameters, "
                    f"{share.state_bytes / 2**30:,.1f} of {share.memory_bytes / 2**30:,.1f} GiB "
                    f"({spec.parallelism})"
                )
    except (ControllerError, NetworkError) as exc:
        for job_id in reversed(added):  # a TP job's lanes go in together or not at all
            ctl.remove_job(job_id)
            secrets.remove(job_id)
        if added:
            raise ControllerError(f"{exc} (lanes {added} added before it were removed again)") from exc
        raise
