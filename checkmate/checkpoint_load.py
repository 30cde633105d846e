"""Loading a universal checkpoint into any layout.

* :func:`load_into` restores a whole model and its optimizer (any number of
  data-parallel workers each call it; every worker gets the same state).
* :func:`zero1_slice` gives one rank of a ZeRO-1-style partition its slice of
  the flattened parameters and optimizer states, reading only those bytes.
* :func:`data_position` is where the workers resume reading data after the
  checkpoint's step (a shadow snapshot's ``extra["data_position"]``).

Both are strict: the model's parameter names must equal the checkpoint's,
shapes must match, and every tensor read is checked against its checksum.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from checkmate.checkpoint_format import PARAM_STATE, CheckpointError, CheckpointReader

logger = logging.getLogger(__name__)


def _check_names(reader: CheckpointReader, names: Sequence[str]) -> None:
    missing = sorted(set(names) - set(reader.parameters))
    extra = sorted(set(reader.parameters) - set(names))
    if missing or extra:
        raise CheckpointError(
            f"step {reader.step} does not fit this model: missing {missing[:5]}, not in the model {extra[:5]}"
            + (" (lists cut at 5)" if max(len(missing), len(extra)) > 5 else "")
        )


def load_into(
    reader: CheckpointReader, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Copy the checkpoint into ``model`` (and ``optimizer``); returns the checkpoint's step."""
    named = dict(model.named_parameters())
    _check_names(reader, list(named))
    for name, parameter in named.items():
        value = reader.parameter(name)
        if tuple(value.shape) != tuple(parameter.shape):
            raise CheckpointError(
                f"{name}: checkpoint shape {tuple(value.shape)}, model {tuple(parameter.shape)}"
            )
        with torch.no_grad():
            parameter.copy_(value.to(parameter.dtype))
    if optimizer is not None:
        _load_optimizer(reader, named, optimizer)
    return reader.step


def _load_optimizer(
    reader: CheckpointReader, named: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer
) -> None:
    spec = reader.global_state.get("optimizer", {})
    kind = spec.get("kind")
    if kind and kind != type(optimizer).__name__:
        raise CheckpointError(f"checkpoint holds {kind} state, the optimizer is {type(optimizer).__name__}")
    name_of = {id(p): n for n, p in named.items()}
    saved_groups = spec.get("param_groups", [])
    if saved_groups and len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint has {len(saved_groups)} param groups, the optimizer {len(optimizer.param_groups)}"
        )
    state: dict[int, dict[str, torch.Tensor]] = {}
    groups = []
    index = 0
    for group_index, group in enumerate(optimizer.param_groups):
        indices = []
        for parameter in group["params"]:
            name = name_of[id(parameter)]
            states = {s: reader.parameter(name, s) for s in reader.states_of(name) if s != PARAM_STATE}
            if states:
                state[index] = states
            indices.append(index)
            index += 1
        hyper = {k: v for k, v in group.items() if k != "params"}
        if saved_groups:
            saved = {
                k: (tuple(v) if isinstance(v, list) else v) for k, v in saved_groups[group_index].items()
            }
            names = saved.pop("params", None)
            if names is not None and [name_of[id(p)] for p in group["params"]] != list(names):
                raise CheckpointError(
                    f"param group {group_index} holds other parameters than the checkpoint's"
                )
            hyper.update({k: v for k, v in saved.items() if k in hyper})
        groups.append({**hyper, "params": indices})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def data_position(reader: CheckpointReader) -> Any:
    """The workers' data position after the checkpoint's step, or None when it holds none.

    Shadow snapshots keep what rank 0 set with ``CheckmateAgent.set_data_position``
    for that step (a JSON value) in ``global.json``'s ``extra``.
    """
    extra = reader.global_state.get("extra")
    return extra.get("data_position") if isinstance(extra, dict) else None


@dataclass(frozen=True)
class Zero1Slice:
    """Elements [start, end) of the flat concatenation of all parameters (in ``order``)."""

    rank: int
    world_size: int
    start: int
    end: int
    order: tuple[str, ...]
    states: dict[str, torch.Tensor]
    """state name -> flat tensor of this rank's elements (``param`` and every optimizer state)."""


def zero1_bounds(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s even share of ``total`` elements (the first ``total % world`` ranks get one more)."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def zero1_slice(
    reader: CheckpointReader, rank: int, world_size: int, order: Sequence[str] | None = None
) -> Zero1Slice:
    """Load only rank ``rank``'s slice of every flattened state; 0-d states (``step``) are skipped."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    names = tuple(order) if order is not None else tuple(sorted(reader.parameters))
    _check_names(reader, names)
    sizes = []
    for name in names:
        numel = 1
        for dim in reader.parameters[name]["shape"]:
            numel *= dim
        sizes.append(numel)
    start, end = zero1_bounds(sum(sizes), rank, world_size)
    pieces: dict[str, list[torch.Tensor]] = {}
    cursor = 0
    for name, numel in zip(names, sizes, strict=True):
        lo, hi = max(start, cursor), min(end, cursor + numel)
        if lo < hi:
            for state in reader.states_of(name):
                if reader.slices[(name, state)][0].scalar:
                    continue
                pieces.setdefault(state, []).append(reader.read(name, state, lo - cursor, hi - cursor))
        cursor += numel
    states = {s: torch.cat(p) for s, p in pieces.items()}
    return Zero1Slice(rank, world_size, start, end, names, states)
