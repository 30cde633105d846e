"""The one loader: a checkpoint's state into a live model and optimizer, or one rank's slice.

* :func:`load_state` copies a :class:`~checkmate.checkpoint.source.RestoredState`
  (from any state source: a snapshot directory, the shadows' memory) into a
  model (parameters, persistent buffers), its optimizer (per-parameter state,
  param-group hyperparameters) and the job's stateful objects.
* :func:`load_into` is :func:`load_state` of a checkpoint on disk (any number of
  data-parallel workers each call it; every worker gets the same state).
* :func:`zero1_slice` gives one rank of a ZeRO-1-style partition its slice of
  the flattened parameters and optimizer states, reading only those bytes.
* :func:`data_position` is where the workers resume reading data after the
  checkpoint's step (a shadow snapshot's ``extra["data_position"]``).

All are strict, whichever source the state came from: the model's parameter
names must equal the state's and shapes must match; the optimizer must be of the
state's kind, with as many param groups, each holding the same parameters in the
same order; buffers must match the job state's; every tensor read from disk is
checked against its checksum. A state that does not fit raises CheckpointError
naming what does not fit, before the optimizer is touched.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from checkmate.checkpoint.format import CheckpointError
from checkmate.checkpoint.optim_states import missing_optimizer_states
from checkmate.checkpoint.reader import CheckpointReader
from checkmate.checkpoint.source import RestoredState, state_of_reader
from checkmate.job_state import JobState, JobStateError, load_stateful, persistent_buffers

logger = logging.getLogger(__name__)


def _unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(model, nn.parallel.DistributedDataParallel) and inner is not None else model


def _check_names(what: str, have: Sequence[str], names: Sequence[str]) -> None:
    missing = sorted(set(names) - set(have))
    extra = sorted(set(have) - set(names))
    if missing or extra:
        raise CheckpointError(
            f"{what} does not fit this model: missing {missing[:5]}, not in the model {extra[:5]}"
            + (" (lists cut at 5)" if max(len(missing), len(extra)) > 5 else "")
        )


def load_into(
    reader: CheckpointReader, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Copy the checkpoint into ``model`` (and ``optimizer``); returns the checkpoint's step."""
    load_state(model, optimizer, state_of_reader(reader))
    return reader.step


def load_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: RestoredState,
    stateful: Mapping[str, Any] | None = None,
) -> None:
    """Copy ``state`` into the model (parameters, persistent buffers), optimizer and stateful objects.

    ``model`` may be wrapped in DistributedDataParallel. Names, shapes, the optimizer's
    kind and its param groups are checked before anything is copied; buffers and
    stateful objects as they are loaded. CheckpointError saying what does not fit.
    """
    module = _unwrap(model)
    named = dict(module.named_parameters())
    what = f"the state after iteration {state.iteration} ({state.source})"
    _check_names(what, list(state.parameters), list(named))
    for name, parameter in named.items():
        value = state.parameters[name]
        if tuple(value.shape) != tuple(parameter.shape):
            raise CheckpointError(f"{name}: state shape {tuple(value.shape)}, model {tuple(parameter.shape)}")
    groups = None
    if optimizer is not None:
        name_of = {id(p): n for n, p in named.items()}
        groups = optimizer_groups(state.optimizer or {}, state.optimizer_kind, optimizer, name_of)
        problems = missing_optimizer_states(
            {"kind": state.optimizer_kind, **(state.optimizer or {})},
            {n: list(state.optimizer_state.get(n) or {}) for n in named},
        )
        if problems:
            raise CheckpointError(f"{what}: incomplete optimizer state: " + "; ".join(problems[:3]))
    with torch.no_grad():
        for name, parameter in named.items():
            parameter.copy_(state.parameters[name].to(parameter.dtype))
    if optimizer is not None and groups is not None:
        per_index: dict[int, dict[str, Any]] = {}
        index = 0
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                entry = state.optimizer_state.get(name_of[id(parameter)])
                if entry:
                    per_index[index] = {
                        k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()
                    }
                index += 1
        optimizer.load_state_dict({"state": per_index, "param_groups": groups})
    _load_job_state(module, optimizer, state.job_state, dict(stateful or {}))


def optimizer_groups(
    spec: Mapping[str, Any],
    kind: str | None,
    optimizer: torch.optim.Optimizer,
    name_of: Mapping[int, str],
    held: Collection[str] | None = None,
    ordered: bool = True,
) -> list[dict[str, Any]]:
    """The param groups to load (live hyperparameters, the state's where it has them); checks first.

    ``spec``: the state's optimizer description (``kind``, ``param_groups`` with
    parameter names); ``name_of``: id of each live parameter -> its name in the
    state. ``held`` (the names this process holds, e.g. one pipeline stage's):
    each live group must hold its saved group's parameters among ``held``, in the
    same order (any order when not ``ordered``: a loader that places state by
    name); None means every saved parameter. Returns the groups in
    ``load_state_dict`` form (``params`` as indices in live order).
    """
    kind = kind or spec.get("kind")
    if kind and kind != type(optimizer).__name__:
        raise CheckpointError(f"the state holds {kind} state, the optimizer is {type(optimizer).__name__}")
    saved_groups = spec.get("param_groups") or []
    if saved_groups and len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the state has {len(saved_groups)} param groups, the optimizer {len(optimizer.param_groups)}"
        )
    groups = []
    index = 0
    for group_index, group in enumerate(optimizer.param_groups):
        live_names = []
        for parameter in group["params"]:
            if id(parameter) not in name_of:
                raise CheckpointError(f"param group {group_index} holds a parameter the model does not")
            live_names.append(name_of[id(parameter)])
        hyper = {k: v for k, v in group.items() if k != "params"}
        if saved_groups:
            saved = {
                k: (tuple(v) if isinstance(v, list) else v) for k, v in saved_groups[group_index].items()
            }
            names = saved.pop("params", None)
            expected = None if names is None else [n for n in names if held is None or n in held]
            if expected is not None and (
                live_names != expected if ordered else set(live_names) != set(expected)
            ):
                raise CheckpointError(
                    f"param group {group_index} holds other parameters than the state's "
                    f"(first live {live_names[:3]}, saved {expected[:3]})"
                )
            hyper.update({k: v for k, v in saved.items() if k in hyper})
        groups.append({**hyper, "params": list(range(index, index + len(live_names)))})
        index += len(live_names)
    return groups


def _load_job_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    job_state: JobState | None,
    stateful: dict[str, Any],
) -> None:
    buffers = persistent_buffers(module)
    if job_state is None:
        if stateful:
            raise CheckpointError(
                f"the restored state holds no job state (a version-1 checkpoint or an older agent): "
                f"cannot restore stateful object(s) {sorted(stateful)}"
            )
        if buffers:
            logger.warning(
                "the restored state holds no buffers: %s keep their current values", sorted(buffers)
            )
        return
    try:
        saved_buffers = job_state.buffers
        if set(saved_buffers) != set(buffers):
            raise CheckpointError(
                f"the state's buffers {sorted(saved_buffers)[:5]} do not fit the model's "
                f"{sorted(buffers)[:5]}"
            )
        with torch.no_grad():
            for name, buffer in buffers.items():
                value = saved_buffers[name]
                if tuple(value.shape) != tuple(buffer.shape) or value.dtype != buffer.dtype:
                    raise CheckpointError(
                        f"buffer {name}: state {tuple(value.shape)} {value.dtype}, "
                        f"model {tuple(buffer.shape)} {buffer.dtype}"
                    )
                buffer.copy_(value)
        groups = job_state.param_groups
        if groups and optimizer is not None:
            if len(groups) != len(optimizer.param_groups):
                raise CheckpointError(
                    f"the state has {len(groups)} param groups, the optimizer {len(optimizer.param_groups)}"
                )
            for live, hyper in zip(optimizer.param_groups, groups, strict=True):
                for key, value in hyper.items():
                    live[key] = value.clone() if isinstance(value, torch.Tensor) else value
        load_stateful(stateful, job_state)
    except JobStateError as exc:
        raise CheckpointError(str(exc)) from None


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
    _check_names(f"step {reader.step}", list(reader.parameters), names)
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
