"""The live model is the description: layout, rank and shapes read from DTensors and FSDP2.

A job that shards its parameters with torch's own tools already says how each
parameter is split: a DTensor has a device mesh and placements, FSDP2 records
which mesh dimension is its data-parallel shard. :func:`describe_module` reads
that, so saving and loading need no hand-written layout:

* **TP**: a parameter's model-parallel placements — a plain DTensor's own, or
  for an FSDP2-managed parameter the placements of the DTensor it was before
  ``fully_shard`` (FSDP's ``_unsharded_dtensor_spec``). No mesh dimension
  *name* is assumed: which dimension is FSDP's comes from FSDP2 itself, every
  other one is tensor parallelism. ``Shard(d)`` means TP splits dim ``d``
  (the rule's ``cat_dim`` must say ``d``), ``Replicate`` that it does not.
* **FSDP**: the parameter belongs to an FSDP2 module (``fully_shard``); the
  degree is its data-parallel mesh's size, the shard dim must be 0.
* **rank numbering**: a :class:`~checkmate.universal.layout.Layout` numbers
  ranks dp-major (``rank = dp_index * tp + tp_index``, what
  ``init_device_mesh(..., (dp, tp), ...)`` gives, whatever the names). A
  DTensor whose mesh coordinate disagrees is refused naming the parameter.

Given a :class:`Layout` as well, every parameter's own description must agree
with it (TP degree, FSDP or not, FSDP degree), else :class:`LayoutError` names
the parameter, what the tensor says and what the layout says.

Fused parameters cannot describe themselves (a DTensor of a QKV weight looks
like any other): :func:`checkmate.universal.spec.check_fused` refuses a fused-looking name (qkv,
gate_up, w13, ...) that TP splits under a rule without ``parts``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checkmate.universal.layout import Layout
from checkmate.universal.spec import FUSED_NAME, REPLICATED, LayoutError, ReshapeRule, ReshapeSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LiveParameter:
    """What a live parameter says about its own sharding."""

    name: str
    global_shape: tuple[int, ...]
    """The whole stored tensor (all TP and FSDP ranks together; vocabulary padding included)."""
    tp_degree: int = 1
    tp_dim: int | None = None
    """The tensor dimension tensor parallelism splits (None: replicated or no TP)."""
    tp_index: int = 0
    tp_mesh: tuple[tuple[str, int], ...] = ()
    fsdp_degree: int = 1
    fsdp_index: int = 0
    dtensor: bool = False
    fsdp: bool = False
    """Managed by FSDP2 (``fully_shard``)."""
    fsdp_mesh: tuple[tuple[str, int], ...] = ()


@dataclass
class LiveLayout:
    """The layout a live module's parameters describe, and each parameter's own account."""

    layout: Layout
    rank: int
    parameters: dict[str, LiveParameter] = field(default_factory=dict)
    mesh: dict[str, int] = field(default_factory=dict)
    """Every model-parallel and FSDP mesh dimension seen: name (or ``dim<i>``) -> size."""


def _fsdp_params(module: nn.Module) -> dict[int, Any]:
    """id(sharded parameter) -> its FSDP2 ``FSDPParam``, for every ``fully_shard`` module."""
    from torch.distributed.fsdp import FSDPModule

    out: dict[int, Any] = {}
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            group = sub._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                out[id(fsdp_param.sharded_param)] = fsdp_param
    return out


def _mesh_names(mesh: Any) -> tuple[str, ...]:
    names = mesh.mesh_dim_names
    return tuple(names) if names else tuple(f"dim{i}" for i in range(mesh.ndim))


def _model_parallel(name: str, mesh: Any, placements: Sequence[Any]) -> tuple[int, int | None, int, tuple]:
    """(degree, split dim, this rank's index, mesh) of the model-parallel part of a DTensor's placements."""
    from torch.distributed.tensor import Replicate, Shard

    if mesh.ndim != 1:
        raise LayoutError(
            f"{name}: tensor parallelism over a {mesh.ndim}-D mesh {_mesh_names(mesh)} ({list(placements)}); "
            f"a layout here has one TP dimension (put EP/CP outside the saved model or flatten the mesh)"
        )
    (placement,) = placements
    if type(placement) is Shard:
        split: int | None = placement.dim
    elif isinstance(placement, Replicate):
        split = None
    else:
        raise LayoutError(
            f"{name}: placement {placement} on mesh {_mesh_names(mesh)} is neither Shard nor Replicate; "
            f"save after the optimizer step (no Partial) with a plain Shard(d) or Replicate"
        )
    index = mesh.get_local_rank(0)
    return mesh.size(), split, index, ((_mesh_names(mesh)[0], mesh.size()),)


def describe_parameter(name: str, parameter: torch.Tensor, fsdp_param: Any | None) -> LiveParameter:
    """One parameter's own account of its sharding."""
    from torch.distributed.tensor import DTensor

    tp_degree, tp_dim, tp_index, tp_mesh = 1, None, 0, ()
    fsdp_degree, fsdp_index = 1, 0
    if fsdp_param is not None:
        placement = fsdp_param.fsdp_placement
        if placement.dim != 0:
            raise LayoutError(
                f"{name}: FSDP2 shards dim {placement.dim}; a layout here has FSDP shard dim 0 "
                f"(fully_shard's default shard_placement_fn)"
            )
        dp_mesh = fsdp_param.mesh_info.mesh
        if dp_mesh.ndim != 1:
            raise LayoutError(f"{name}: FSDP2 over a {dp_mesh.ndim}-D mesh (HSDP) is not a layout here")
        fsdp_degree, fsdp_index = dp_mesh.size(), dp_mesh.get_local_rank(0)
        spec = fsdp_param._unsharded_dtensor_spec
        if spec is not None:
            tp_degree, tp_dim, tp_index, tp_mesh = _model_parallel(name, spec.mesh, spec.placements)
            shape = tuple(spec.shape)
        else:
            shape = tuple(parameter.shape)
        return LiveParameter(
            name,
            shape,
            tp_degree,
            tp_dim,
            tp_index,
            tp_mesh,
            fsdp_degree,
            fsdp_index,
            dtensor=True,
            fsdp=True,
            fsdp_mesh=((_mesh_names(dp_mesh)[0], fsdp_degree),),
        )
    if isinstance(parameter, DTensor):
        tp_degree, tp_dim, tp_index, tp_mesh = _model_parallel(
            name, parameter.device_mesh, parameter.placements
        )
        return LiveParameter(name, tuple(parameter.shape), tp_degree, tp_dim, tp_index, tp_mesh, dtensor=True)
    return LiveParameter(name, tuple(parameter.shape))


def describe_module(module: nn.Module, layout: Layout | None = None, rank: int | None = None) -> LiveLayout:
    """The layout ``module``'s parameters describe on this rank; ``layout``, when given, must agree.

    Without DTensors the module is plain: replicated over every rank (DDP)
    unless ``layout`` says otherwise (pipeline stages, TP-local plain tensors).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
    fsdp = _fsdp_params(module)
    parameters = {
        name: describe_parameter(name, parameter, fsdp.get(id(parameter)))
        for name, parameter in module.named_parameters()
    }
    live = [p for p in parameters.values() if p.dtensor]
    tp = max((p.tp_degree for p in live), default=1)
    fsdp_degree = max((p.fsdp_degree for p in live if p.fsdp), default=1)
    for item in live:
        if item.tp_mesh and item.tp_degree != tp:
            raise LayoutError(f"{item.name}: TP degree {item.tp_degree}, other parameters have {tp}")
        if item.fsdp and item.fsdp_degree != fsdp_degree:
            raise LayoutError(
                f"{item.name}: FSDP degree {item.fsdp_degree}, other parameters have {fsdp_degree}"
            )
    if layout is None:
        if not live:
            layout = Layout(dp=world)
        else:
            if world % tp:
                raise LayoutError(f"the model's TP degree {tp} does not divide the {world} ranks")
            layout = Layout(tp=tp, dp=world // tp, fsdp=any(p.fsdp for p in live))
    _, dp_index, tp_index = layout.coords(rank)
    for item in live:
        said = []
        if item.tp_mesh and item.tp_degree != layout.tp:
            said.append(f"TP degree {item.tp_degree} (mesh {dict(item.tp_mesh)}), the layout tp={layout.tp}")
        if item.fsdp != layout.fsdp:
            said.append(
                "FSDP2-sharded, the layout has no fsdp=1"
                if item.fsdp
                else "not FSDP2-sharded, the layout has fsdp=1"
            )
        elif layout.fsdp and item.fsdp_degree != layout.dp:
            said.append(f"FSDP degree {item.fsdp_degree}, the layout dp={layout.dp}")
        if not said and item.tp_mesh and item.tp_index != tp_index:
            said.append(
                f"TP index {item.tp_index} on rank {rank}, where layout {layout.describe()} numbers ranks "
                f"dp-major (TP index {tp_index}): build the mesh as init_device_mesh(..., (dp, tp))"
            )
        if not said and layout.fsdp and item.fsdp_index != dp_index:
            said.append(f"FSDP index {item.fsdp_index} on rank {rank}, the layout's dp index {dp_index}")
        if said:
            raise LayoutError(
                f"{item.name}: the live tensor says {'; '.join(said)}. Omit the layout argument (the "
                f"module describes itself) or give the one it was built with"
            )
    mesh: dict[str, int] = {}
    for item in live:
        mesh.update(dict(item.fsdp_mesh))
        mesh.update(dict(item.tp_mesh))
    return LiveLayout(layout, rank, parameters, mesh)


def with_live_rules(spec: ReshapeSpec, live: LiveLayout) -> ReshapeSpec:
    """``spec`` plus a rule for every TP-split parameter no rule names: its ``cat_dim`` from the placement.

    What a DTensor says needs no rule; what it cannot say (fused ``parts``,
    ``head_dim``, ``vocab`` padding, ``average``) does, and a fused-looking
    name gets no derived rule (it is refused where it is split).
    """
    derived = [
        ReshapeRule(re.escape(name), cat_dim=item.tp_dim)
        for name, item in sorted(live.parameters.items())
        if item.tp_dim is not None
        and item.tp_degree > 1
        and spec.rule(name) is REPLICATED
        and not FUSED_NAME.search(name)
    ]
    if not derived:
        return spec
    return ReshapeSpec(spec.rules + tuple(derived), spec.layer_pattern, spec.first_stage, spec.ties)
