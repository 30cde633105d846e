"""Loading a universal checkpoint into any layout, each rank reading only its pieces.

* :func:`load_rank` — one rank of a :class:`~checkmate.universal.layout.Layout`:
  its TP-local / FSDP-chunk tensors, or ZeRO flat partitions, for the
  parameters and every optimizer state (reshaped exactly like the parameter).
* :func:`module_holdings` — what a live module's parameters hold, read from
  the module itself: a DTensor (TP ``Shard``/``Replicate``, FSDP2 ``Shard(0)``,
  uneven shards) by its placements, a plain tensor by the layout.
* :func:`load_module` — fill a live module's parameters (plain or DTensor) and
  its optimizer's state in place.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from checkmate.checkpoint import PARAM_STATE, CheckpointReader
from checkmate.checkpoint.load import optimizer_groups
from checkmate.universal.box_reader import BoxReader
from checkmate.universal.geometry import numel, restrict, slices
from checkmate.universal.layout import (
    FlatPartition,
    Layout,
    LocalTensor,
    check_heads,
    rank_holdings,
    stage_names,
    storage_pieces,
)
from checkmate.universal.live import LiveLayout, LiveParameter, describe_module, with_live_rules
from checkmate.universal.spec import (
    LayoutError,
    ReshapeSpec,
    check_compatible,
    check_fused,
    spec_of_checkpoint,
)

logger = logging.getLogger(__name__)


def checkpoint_shapes(reader: CheckpointReader) -> dict[str, tuple[int, ...]]:
    return {n: tuple(m["shape"]) for n, m in reader.parameters.items()}


def resolve_spec(reader: CheckpointReader, spec: ReshapeSpec | None) -> ReshapeSpec:
    """The target spec (checked against the saved one), or the checkpoint's own spec."""
    saved = spec_of_checkpoint(reader.global_state)
    if spec is None:
        return saved if saved is not None else ReshapeSpec()
    if saved is not None:
        check_compatible(saved, spec, sorted(reader.parameters))
    return spec


def _fill(
    reader: BoxReader, local: LocalTensor, state: str, like: torch.Tensor | None = None
) -> torch.Tensor:
    """``local``'s tensor of ``state``: its pieces read from the checkpoint, padding zero."""
    out: torch.Tensor | None = None
    for piece in local.pieces:
        value = reader.read(local.name, state, piece.logical)
        if out is None:
            out = torch.zeros(local.shape, dtype=like.dtype if like is not None else value.dtype)
        out[slices(piece.local)] = value
    if out is None:
        out = torch.zeros(local.shape, dtype=like.dtype if like is not None else torch.float32)
    return out


def _fill_flat(reader: BoxReader, partition: FlatPartition, state: str, names: Sequence[str]) -> torch.Tensor:
    out = torch.zeros(partition.numel)
    for piece in partition.pieces:
        if piece.name not in names:
            continue
        value = reader.read(piece.name, state, piece.logical).reshape(-1)
        out[piece.offset : piece.offset + numel(piece.logical)] = value
    return out


@dataclass
class RankState:
    """One rank's share of a checkpoint in a layout (local names)."""

    params: dict[str, torch.Tensor] = field(default_factory=dict)
    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """local name -> optimizer state -> tensor (not for flat-partitioned states)."""
    scalars: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    param_flat: torch.Tensor | None = None
    state_flat: dict[str, torch.Tensor] = field(default_factory=dict)


def _is_scalar(reader: CheckpointReader, name: str, state: str) -> bool:
    return reader.slices[(name, state)][0].scalar


def load_rank(
    reader: CheckpointReader,
    layout: Layout,
    rank: int,
    spec: ReshapeSpec | None = None,
    box_reader: BoxReader | None = None,
) -> RankState:
    """Rank ``rank``'s tensors of ``layout``, reading only the elements it holds."""
    spec = resolve_spec(reader, spec)
    reader.check_optimizer_states()
    holdings = rank_holdings(layout, spec, checkpoint_shapes(reader), rank)
    boxes = box_reader or BoxReader(reader)
    out = RankState()
    for local, tensor in holdings.tensors.items():
        name = tensor.name
        if holdings.param_flat is None:
            out.params[local] = _fill(boxes, tensor, PARAM_STATE)
        for state in reader.states_of(name):
            if state == PARAM_STATE:
                continue
            if _is_scalar(reader, name, state):
                out.scalars.setdefault(local, {})[state] = boxes.read(name, state)
            elif holdings.state_flat is None:
                out.states.setdefault(local, {})[state] = _fill(boxes, tensor, state)
    names = [t.name for t in holdings.tensors.values()]
    if holdings.param_flat is not None:
        out.param_flat = _fill_flat(boxes, holdings.param_flat, PARAM_STATE, names)
    if holdings.state_flat is not None:
        states = sorted({s for n in names for s in reader.states_of(n) if s != PARAM_STATE})
        for state in states:
            if not all(_is_scalar(reader, n, state) for n in names if state in reader.states_of(n)):
                out.state_flat[state] = _fill_flat(boxes, holdings.state_flat, state, names)
    return out


def _dtensor_pieces(
    name: str, spec: ReshapeSpec, logical: Sequence[int], parameter: Any, live: LiveParameter
) -> LocalTensor:
    """What a DTensor holds, from its own placements; its rule must agree with them."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    rule = spec.check_rule(name, logical)
    if live.tp_mesh and live.tp_dim is not None and live.tp_dim != rule.cat_dim:
        raise LayoutError(
            f"{name}: tensor parallelism shards dim {live.tp_dim} (Shard({live.tp_dim}) on mesh "
            f"{dict(live.tp_mesh)}) but {rule.describe()}; fix the spec: a rule for {name} with "
            f'"cat_dim": {live.tp_dim}'
        )
    check_fused(name, rule, live.tp_degree, live.tp_dim)
    stored = tuple(parameter.shape)
    if rule.cat_dim is not None:
        check_heads(name, rule, live.tp_degree, logical[rule.cat_dim])
    pieces = storage_pieces(name, rule, logical, stored, live.tp_degree)
    placements = parameter.placements
    local_shape, offset = compute_local_shape_and_global_offset(stored, parameter.device_mesh, placements)
    window = tuple((o, o + n) for o, n in zip(offset, local_shape, strict=True))
    return LocalTensor(name, tuple(local_shape), restrict(pieces, window))


def module_holdings(
    module: nn.Module,
    spec: ReshapeSpec,
    layout: Layout | None,
    rank: int | None,
    shapes: Mapping[str, Sequence[int]],
    live: LiveLayout | None = None,
) -> dict[str, LocalTensor]:
    """Local parameter name -> what it holds, for a live module of ``layout`` on ``rank``.

    DTensors describe themselves (placements, uneven shards); plain tensors are
    taken to be laid out as ``layout`` says (a stage's TP-local tensor, FSDP chunk).
    A tied alias (the spec's ties) the module holds as its own tensor is filled
    from (and saved into) the canonical atom; a module that ties two names the
    checkpoint holds as two atoms is refused naming them.
    """
    from torch.distributed.tensor import DTensor

    live = live or describe_module(module, layout, rank)
    layout, rank = live.layout, live.rank
    named = dict(module.named_parameters())
    shapes = spec.with_aliases(shapes)
    stage = stage_names(spec, sorted(shapes), layout.pp)[layout.coords(rank)[0]]
    untied = {
        stage[local] for local in named if local in stage and spec.canonical(stage[local]) != stage[local]
    }
    first_name: dict[int, str] = {}
    for local, parameter in module.named_parameters(remove_duplicate=False):
        canonical = first_name.setdefault(id(parameter), local)
        alias, target = stage.get(local, local), stage.get(canonical, canonical)
        if canonical != local and spec.canonical(target) == alias:
            raise LayoutError(
                f"{local} and {canonical} are one tensor the module registers first under the spec's alias "
                f"name {target!r}; register {alias!r} first or swap the tie"
            )
        if canonical != local and spec.canonical(alias) != target and alias in shapes:
            raise LayoutError(
                f"{local} shares its tensor with {canonical} but the checkpoint holds {alias!r} as an atom "
                f"of its own (ties: {dict(spec.ties)}); load it into a module that does not tie them"
            )
    stored_shapes: dict[str, tuple[int, ...]] = {}
    holdings = rank_holdings(layout, spec, shapes, rank, None, untied)
    if set(named) != set(holdings.tensors):
        missing = sorted(set(holdings.tensors) - set(named))
        extra = sorted(set(named) - set(holdings.tensors))
        raise LayoutError(
            f"the module does not fit the checkpoint: missing {missing[:5]}, unknown {extra[:5]}"
        )
    for local, parameter in named.items():
        name = holdings.local_names[local]
        if isinstance(parameter, DTensor):
            stored_shapes[name] = tuple(parameter.shape)
        else:
            rule = spec.rule(name)
            stored = list(parameter.shape)
            if rule.cat_dim is not None and not layout.fsdp:
                stored[rule.cat_dim] *= layout.tp
            stored_shapes[name] = tuple(stored)
    holdings = rank_holdings(layout, spec, shapes, rank, stored_shapes, untied)
    out: dict[str, LocalTensor] = {}
    for local, parameter in named.items():
        name = holdings.local_names[local]
        if isinstance(parameter, DTensor):
            out[local] = _dtensor_pieces(name, spec, shapes[name], parameter, live.parameters[local])
        else:
            out[local] = holdings.tensors[local]
        if tuple(_local(parameter).shape) != out[local].shape:
            raise LayoutError(
                f"{name}: the module holds {tuple(_local(parameter).shape)} locally, the layout "
                f"{layout.describe()} says {out[local].shape}"
            )
    return out


def stage_local_names(
    spec: ReshapeSpec, shapes: Mapping[str, Sequence[int]], layout: Layout, rank: int
) -> dict[str, str]:
    """Local name -> global name of every parameter (tied aliases too) of ``rank``'s stage."""
    return stage_names(spec, sorted(spec.with_aliases(shapes)), layout.pp)[layout.coords(rank)[0]]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(parameter: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(parameter, DTensor):
        return DTensor.from_local(
            local,
            parameter.device_mesh,
            parameter.placements,
            run_check=False,
            shape=parameter.shape,
            stride=parameter.stride(),
        )
    return local


def load_module(
    reader: CheckpointReader,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    layout: Layout | None = None,
    rank: int | None = None,
    spec: ReshapeSpec | None = None,
    box_reader: BoxReader | None = None,
) -> int:
    """Fill ``module`` (and ``optimizer``) in place; returns the step. All or nothing.

    The module describes its own layout (DTensor placements, FSDP2; see
    :mod:`.live`); ``layout`` is needed only for what tensors cannot say
    (pipeline stages, plain TP-local tensors) and must agree with them. ``rank``
    defaults to this process's rank. Everything is read and checked (checksums,
    optimizer state complete, names, shapes, groups) before anything is copied.
    """
    live = describe_module(module, layout, rank)
    layout, rank = live.layout, live.rank
    spec = with_live_rules(resolve_spec(reader, spec), live)
    shapes = checkpoint_shapes(reader)
    holdings = module_holdings(module, spec, layout, rank, shapes, live)
    boxes = box_reader or BoxReader(reader)
    named = dict(module.named_parameters())
    local_names = {
        local: spec.canonical(name) for local, name in stage_local_names(spec, shapes, layout, rank).items()
    }
    groups: list[dict[str, Any]] = []
    if optimizer is not None:  # the one loader's checks (kind, groups, their parameters), before any copy
        saved = reader.global_state.get("optimizer")
        groups = optimizer_groups(
            saved if isinstance(saved, dict) else {},
            None,
            optimizer,
            {id(p): local_names[n] for n, p in named.items()},
            held=set(local_names.values()),
            ordered=False,  # state is placed by name below
        )
    if optimizer is not None:
        reader.check_optimizer_states()
    # read and verify everything first: a bad byte or a short file leaves module and optimizer untouched
    values = {
        local: _fill(boxes, tensor, PARAM_STATE, like=_local(named[local]))
        for local, tensor in holdings.items()
    }
    loaded: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
    if optimizer is not None:
        by_id = {id(p): local for local, p in named.items()}
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                held = by_id.get(id(parameter))
                if held is None:
                    raise LayoutError("the optimizer holds a parameter the module does not")
                tensor = holdings[held]
                state: dict[str, torch.Tensor] = {}
                for key in reader.states_of(tensor.name):
                    if key == PARAM_STATE:
                        continue
                    if _is_scalar(reader, tensor.name, key):
                        state[key] = boxes.read(tensor.name, key).clone()
                    else:
                        state[key] = _like(parameter, _fill(boxes, tensor, key, like=_local(parameter)))
                if state:
                    loaded.append((parameter, state))
    with torch.no_grad():
        for local, value in values.items():
            _local(named[local]).copy_(value)
    if optimizer is None:
        return reader.step
    for parameter, state in loaded:
        optimizer.state[parameter] = state
    for live_group, group in zip(optimizer.param_groups, groups, strict=True):
        live_group.update({k: v for k, v in group.items() if k != "params"})
    return reader.step


def optimizer_meta(optimizer: torch.optim.Optimizer, name_of: Mapping[int, str]) -> dict[str, Any]:
    """``{"kind", "param_groups"}`` with checkpoint names, for ``global.json``."""
    groups = []
    for group in optimizer.param_groups:
        hyper = {
            k: v
            for k, v in group.items()
            if k != "params" and isinstance(v, (int, float, bool, str, tuple, list, type(None)))
        }
        names = [name_of[id(p)] for p in group["params"]]
        groups.append({**hyper, "params": [n for i, n in enumerate(names) if n not in names[:i]]})
    return {"kind": type(optimizer).__name__, "param_groups": groups}
