"""Saving a live parallel job (any layout) as one universal checkpoint.

Every rank turns what it holds into records (:mod:`.extract`) and writes them
to a staging folder of rank files; after a barrier, rank k merges the
parameters assigned to it (balanced by size) from every rank file and writes
universal shard k of W; rank 0 writes ``global.json`` (with the reshape spec
and the source layout under ``extra["universal"]``), moves ``latest`` and
removes the staging folder. A crash at any point leaves an incomplete step
that readers ignore (no ``global.json`` or not all W manifests), never a half
checkpoint that reads as complete.

Replicas are written once: plain data-parallel copies by DP index 0 and
TP-replicated parameters by TP index 0, unless their rule says ``average``
(then every copy is written and the merge averages them).
"""

from __future__ import annotations

import datetime
import logging
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checkmate import checkpoint as fmt
from checkmate.checkpoint import PARAM_STATE
from checkmate.job_state import JobState
from checkmate.universal.extract import AtomMerger, Record, records_of_tensor
from checkmate.universal.geometry import numel, whole
from checkmate.universal.layout import Layout, LocalTensor
from checkmate.universal.live import LiveLayout, describe_module, with_live_rules
from checkmate.universal.load import _local, module_holdings, optimizer_meta, stage_local_names
from checkmate.universal.rank_files import read_rank_records, write_rank_file
from checkmate.universal.spec import LayoutError, ReshapeSpec

logger = logging.getLogger(__name__)


def module_records(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    holdings: Mapping[str, LocalTensor],
    layout: Layout,
    rank: int,
    spec: ReshapeSpec,
) -> list[Record]:
    """This rank's records of every parameter and optimizer state (replicas only once)."""
    _, dp_index, tp_index = layout.coords(rank)
    records: list[Record] = []
    for local, parameter in module.named_parameters():
        tensor = holdings[local]
        rule = spec.rule(tensor.name)
        replicated_dp = not (layout.fsdp or layout.zero) and dp_index > 0
        replicated_tp = (rule.cat_dim is None or layout.tp == 1) and tp_index > 0
        if (replicated_dp or replicated_tp) and not rule.average:
            continue
        records += records_of_tensor(tensor, PARAM_STATE, _local(parameter))
        if optimizer is not None:
            for key, value in optimizer.state.get(parameter, {}).items():
                if isinstance(value, torch.Tensor):
                    records += records_of_tensor(tensor, key, _local(value))
    return records


def assign_owners(shapes: Mapping[str, Sequence[int]], writers: int) -> list[list[str]]:
    """Whole parameters to ``writers`` shard writers, largest first onto the least loaded."""
    loads = [0] * writers
    owners: list[list[str]] = [[] for _ in range(writers)]
    for name in sorted(shapes, key=lambda n: (-numel(whole(shapes[n])), n)):
        target = loads.index(min(loads))
        owners[target].append(name)
        loads[target] += numel(whole(shapes[name]))
    return owners


def save_universal(
    root: Path,
    step: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    layout: Layout | None = None,
    spec: ReshapeSpec | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    extra: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    job_state: JobState | None = None,
) -> Path:
    """Collective: every rank calls it; returns the step's folder.

    The module describes its own layout (DTensor placements, FSDP2 modules,
    :mod:`.live`); ``layout`` is needed only for what tensors cannot say
    (pipeline stages, plain TP-local tensors) and must agree with them.
    ``spec``: the rules tensors cannot say (fused ``parts``, ``head_dim``,
    ``vocab`` padding, ties). ``shapes``: every parameter's logical
    (universal) shape by checkpoint name; by default each tensor's whole
    shape (required for vocabulary-padded parameters and pipeline stages).
    ``job_state`` (rank 0's: buffers, scheduler, ...) goes into global.json as is.
    """
    live = describe_module(module, layout)
    layout, rank = live.layout, live.rank
    spec = with_live_rules(spec or ReshapeSpec(), live)
    if shapes is None:
        shapes = _gathered_shapes(live_shapes(module, live, spec))
    holdings = module_holdings(module, spec, layout, rank, shapes, live)
    records = module_records(module, optimizer, holdings, layout, rank, spec)
    local_names = stage_local_names(spec, shapes, layout, rank)
    name_of = {id(p): spec.canonical(local_names[n]) for n, p in module.named_parameters()}
    meta = optimizer_meta(optimizer, name_of) if optimizer is not None else {}
    return save_records(
        root, step, records, meta, layout, spec, shapes, extra, timeout, job_state, mesh=live.mesh
    )


def live_shapes(module: nn.Module, live: LiveLayout, spec: ReshapeSpec) -> dict[str, tuple[int, ...]]:
    """Each parameter's logical shape from the tensor itself (whole DTensor shape, plain x TP degree)."""
    layout = live.layout
    if layout.pp > 1:
        raise LayoutError(
            f"layout {layout.describe()}: a pipeline stage holds only its own layers under local names; "
            f"pass shapes= (every parameter's logical shape by checkpoint name)"
        )
    out: dict[str, tuple[int, ...]] = {}
    for name in dict(module.named_parameters()):
        rule = spec.rule(name)
        item = live.parameters[name]
        if rule.vocab:
            raise LayoutError(
                f"{name}: {rule.describe()} pads the vocabulary, and padded rows cannot be told from the "
                f"tensor; pass shapes={{{name!r}: (<real vocabulary size>, ...)}}"
            )
        shape = list(item.global_shape)
        if not item.dtensor and rule.cat_dim is not None and layout.tp > 1:
            shape[rule.cat_dim] *= layout.tp  # a plain TP-local tensor
        out[name] = tuple(shape)
    return out


def _gathered_shapes(mine: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(mine)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dict(mine))
    out: dict[str, tuple[int, ...]] = {}
    for shapes in everyone:
        for name, shape in shapes.items():
            if out.setdefault(name, tuple(shape)) != tuple(shape):
                raise LayoutError(
                    f"{name}: ranks hold it with different whole shapes {out[name]} and {shape}"
                )
    return out


def save_records(
    root: Path,
    step: int,
    records: Sequence[Record],
    meta: Mapping[str, Any],
    layout: Layout,
    spec: ReshapeSpec,
    shapes: Mapping[str, Sequence[int]],
    extra: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    job_state: JobState | None = None,
    mesh: Mapping[str, int] | None = None,
) -> Path:
    """Collective: each rank passes the records it holds and its optimizer description.

    ``global.json`` records how the checkpoint was made (``extra["universal"]``,
    :func:`provenance`): the layout, its degrees, the mesh dimensions, the spec
    and its SHA-256.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = {
        n: s for n, s in shapes.items() if spec.canonical(n) == n
    }  # a tied alias is its canonical's atom
    if world != layout.world_size:
        raise ValueError(f"layout {layout.describe()} has {layout.world_size} ranks, the job {world}")
    root = Path(root)
    staging = root / f".staging-step-{step:08d}"
    write_rank_file(staging, rank, records)
    metas: list[Any] = [None] * world
    dist.all_gather_object(metas, dict(meta))
    _barrier(timeout)
    owned = assign_owners(shapes, world)[rank]
    merger = AtomMerger({n: shapes[n] for n in owned}, spec)
    for source in range(world):
        merger.add_all(read_rank_records(staging, source, owned))
    atoms = merger.atoms() if owned else {}
    fmt.write_shard(root, step, rank, world, atoms)
    _barrier(timeout)
    if rank == 0:
        universal = provenance(spec, layout.describe(), layout, mesh)
        fmt.write_global(
            root,
            step,
            {n: (list(s), "torch.float32") for n, s in shapes.items()},
            _merge_meta(metas),
            {**dict(extra or {}), "universal": universal},
            job_state=job_state,
        )
        fmt.update_latest(root, step)
        for leftover in root.glob(".staging-step-*"):  # this step's, and any an earlier crash left
            if leftover.name <= staging.name:
                shutil.rmtree(leftover, ignore_errors=True)
    _barrier(timeout)
    return fmt.step_dir(root, step)


def provenance(
    spec: ReshapeSpec, source: str, layout: Layout | None = None, mesh: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """``extra["universal"]``: how a checkpoint was made (checked by loads and imports)."""
    out: dict[str, Any] = {"spec": spec.to_json(), "spec_sha256": spec.to_hash(), "source_layout": source}
    if layout is not None:
        out.update(
            tp=layout.tp,
            pp=layout.pp,
            dp=layout.dp,
            zero=layout.zero,
            fsdp=layout.fsdp,
            rank_order="dp-major: rank = (pp_index * dp + dp_index) * tp + tp_index",
        )
    if mesh:
        out["mesh"] = dict(mesh)
    return out


def _merge_meta(metas: Sequence[Any]) -> dict[str, Any]:
    """One optimizer description from every rank's (pipeline stages hold different parameters)."""
    merged: dict[str, Any] = {}
    for meta in metas:
        if not meta:
            continue
        if not merged:
            merged = {
                "kind": meta["kind"],
                "param_groups": [dict(g, params=[]) for g in meta["param_groups"]],
            }
        for index, group in enumerate(meta["param_groups"]):
            held = merged["param_groups"][index]["params"]
            held.extend(n for n in group["params"] if n not in held)
    return merged


def _barrier(timeout: float) -> None:
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout))
    else:
        dist.barrier()
