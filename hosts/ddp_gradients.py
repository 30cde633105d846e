"""The gradients' path between the all-reduce and the optimizer step, as the shadows must replay it.

Two interceptions, installed in torch while any agent lives (:func:`install` /
:func:`uninstall`, under ``_AGENTS_LOCK``, which guards the agent registry and the patched
torch attributes): ``clip_grad_norm_``'s clamped coefficient and ``GradScaler``'s inverse
scale are recorded for the commit, in order, and a ``GradScaler.update`` after an
all-reduce without an optimizer step commits that iteration as skipped. The recorders run
on the thread that calls clipping / unscaling / ``update`` (the training loop).

:class:`GradientGuard` is the agents' component that owns those records (the DDP agent's and
the FSDP2 agent's): it registers itself with the interceptions (:meth:`GradientGuard.attach`),
keeps the multiplications and the parameters without a gradient until the commit takes them
(:meth:`~GradientGuard.take_scaling`, :meth:`~GradientGuard.take_no_grad`) and, in the step
pre-hook (training thread, no lock), refuses what the shadows cannot follow: a closure, a
param group added, a model parameter replaced (:class:`CheckmateStateError`). A GradScaler
``update`` is handed to the callback its agent gave (the commits' skipped step).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from checkmate.control import dtype_name


class CheckmateStateError(RuntimeError):
    """The model or optimizer changed in a way the shadows cannot follow (raised where it happens)."""


# ---- gradient transformations: clipping and GradScaler's unscaling -----------------------
# torch's clip_grad_norm_ looks its helper _clip_grads_with_norm_ up in its module's globals at
# each call, so replacing that helper sees every clip_grad_norm_ call however the script
# imported the function (``from torch.nn.utils import clip_grad_norm_`` before enable included).
# GradScaler.unscale_ (and step's implicit unscale) multiply the gradients through the class's
# _unscale_grads_, replaced at class level for every scaler instance. Both record the factor they
# multiplied by for the commit; the shadows repeat the multiplications in the same order.
_ORIGINAL_CLIP = torch.nn.utils.clip_grad.clip_grad_norm_
_ORIGINAL_CLIP_WITH_NORM = torch.nn.utils.clip_grad._clip_grads_with_norm_
_ORIGINAL_UNSCALE = torch.amp.grad_scaler.GradScaler._unscale_grads_
_AGENTS: list[GradientGuard] = []
_AGENTS_LOCK = threading.Lock()


def _live_agents() -> list[GradientGuard]:
    with _AGENTS_LOCK:
        return list(_AGENTS)


@torch.no_grad()
def _recording_clip_grads_with_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    """torch's ``_clip_grads_with_norm_``, recording the clamped coefficient it multiplied by."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    _ORIGINAL_CLIP_WITH_NORM(params, max_norm, total_norm, foreach)
    if any(p.grad is not None for p in params):
        coefficient = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)  # as torch computes it
        ids = frozenset(id(p) for p in params if p.grad is not None)
        for agent in _live_agents():
            agent.record_scaling("clip", coefficient, ids)


def _recording_unscale_grads_(
    scaler: torch.amp.GradScaler,
    optimizer: torch.optim.Optimizer,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    allow_fp16: bool,
) -> dict[torch.device, torch.Tensor]:
    """GradScaler's ``_unscale_grads_``, recording the inverse scale it multiplied the gradients by."""
    result = _ORIGINAL_UNSCALE(scaler, optimizer, inv_scale, found_inf, allow_fp16)
    if float(inv_scale) != 1.0:  # 1.0: the inf check without unscaling (x * 1 == x)
        for agent in _live_agents():
            if agent.guards(optimizer):
                agent.record_scaling("unscale", inv_scale, None)
    return result


def _install_patches() -> None:
    """Route clipping and unscaling through the recorders (lock held by the caller)."""
    torch.nn.utils.clip_grad._clip_grads_with_norm_ = _recording_clip_grads_with_norm_
    torch.nn.utils.clip_grads_with_norm_ = _recording_clip_grads_with_norm_
    torch.amp.grad_scaler.GradScaler._unscale_grads_ = _recording_unscale_grads_  # type: ignore[method-assign,assignment]


def _remove_patches() -> None:
    torch.nn.utils.clip_grad._clip_grads_with_norm_ = _ORIGINAL_CLIP_WITH_NORM
    torch.nn.utils.clip_grads_with_norm_ = _ORIGINAL_CLIP_WITH_NORM
    torch.amp.grad_scaler.GradScaler._unscale_grads_ = _ORIGINAL_UNSCALE  # type: ignore[method-assign]


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` itself (kept for scripts written against earlier versions).

    Since clipping is recorded inside torch's helper, ``torch.nn.utils.clip_grad_norm_``
    is recorded however it was imported; this name only calls it.
    """
    return _ORIGINAL_CLIP(parameters, max_norm, norm_type, error_if_nonfinite, foreach)


_ORIGINAL_SCALER_UPDATE = torch.amp.grad_scaler.GradScaler.update


def _update_and_commit_skips(scaler: torch.amp.GradScaler, new_scale: Any = None) -> None:
    """GradScaler.update, then: an iteration all-reduced without an optimizer step was skipped."""
    _ORIGINAL_SCALER_UPDATE(scaler, new_scale)
    for agent in _live_agents():
        agent.scaler_updated()


def install(agent: GradientGuard) -> None:
    """Register a live agent; the first one routes clipping, unscaling and scaler updates through here."""
    with _AGENTS_LOCK:
        _AGENTS.append(agent)
        _install_patches()
        torch.amp.grad_scaler.GradScaler.update = _update_and_commit_skips  # type: ignore[method-assign,assignment]


def uninstall(agent: GradientGuard) -> None:
    """Forget an agent; the last one gives torch its own clipping, unscaling and update back."""
    with _AGENTS_LOCK:
        if agent in _AGENTS:
            _AGENTS.remove(agent)
        if not _AGENTS:
            _remove_patches()
            torch.amp.grad_scaler.GradScaler.update = _ORIGINAL_SCALER_UPDATE  # type: ignore[method-assign]


class GradientGuard:
    """One agent's gradient records (multiplications, parameters without a gradient) and step checks.

    Owns its records and the optimizer's step pre-hook; training thread, no lock of its own
    (the interceptions' registry is under ``_AGENTS_LOCK``).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        rank: int,
        on_scaler_update: Callable[[], None],
    ) -> None:
        """``module``: the model whose parameters the shadows hold (DDP's ``.module``, the FSDP2
        model); ``on_scaler_update``: what a GradScaler ``update`` does for this agent."""
        self._module = module
        self._optimizer = optimizer
        self._rank = rank
        self._on_scaler_update = on_scaler_update
        self._names: dict[int, str] = {id(p): n for n, p in module.named_parameters()}
        self._param_ids = frozenset(self._names)
        self._scaling: list[tuple[str, float, torch.dtype, frozenset[int] | None]] = []
        """Gradient multiplications (unscale, clip) since the last commit, in order."""
        self._no_grad: list[str] = []
        """Rank 0: the optimizer's parameters without a gradient at this iteration's step."""
        self._structure: tuple[Any, ...] = self._structure_now()
        self._pre_step_handle: Any = None
        self._refusing_add_param_group = False

    @property
    def names(self) -> Mapping[int, str]:
        """Parameter ``id`` -> its name in the model, as at enable."""
        return self._names

    def guards(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` is this agent's."""
        return optimizer is self._optimizer

    # ---- life: the step pre-hook, add_param_group and the interceptions ----------------------
    def attach(self, refuse_add_param_group: bool = True) -> None:
        """Note the structure the shadows are told, hook the step, intercept; ``refuse_add_param_group``:
        ``optimizer.add_param_group`` raises at once (else the step's check finds the new group)."""
        self._structure = self._structure_now()
        self._pre_step_handle = self._optimizer.register_step_pre_hook(self._before_step)
        if refuse_add_param_group:
            self._guard_add_param_group()
            self._refusing_add_param_group = True
        install(self)

    def detach(self) -> None:
        """Undo :meth:`attach` (the optimizer's own add_param_group again; torch's own helpers once
        no agent is left)."""
        if self._pre_step_handle is not None:
            self._pre_step_handle.remove()
            self._pre_step_handle = None
        if self._refusing_add_param_group:
            vars(self._optimizer).pop("add_param_group", None)  # the class's method again
            self._refusing_add_param_group = False
        uninstall(self)

    # ---- what the interceptions call -------------------------------------------------------
    def record_scaling(self, by: str, factor: torch.Tensor, parameter_ids: frozenset[int] | None) -> None:
        """A multiplication of (some of) this job's gradients since the last commit, in order."""
        if parameter_ids is not None:
            parameter_ids = parameter_ids & self._param_ids
            if not parameter_ids:
                return
            if parameter_ids >= self._param_ids:
                parameter_ids = None
        self._scaling.append((by, float(factor.detach().to("cpu")), factor.dtype, parameter_ids))

    def scaler_updated(self) -> None:
        """A GradScaler's ``update()`` ran: the agent's callback (a skipped step, if one was reduced)."""
        self._on_scaler_update()

    # ---- what the commit takes -------------------------------------------------------------
    def take_no_grad(self) -> list[str]:
        """Rank 0: the parameters without a gradient at the last step (the record is emptied)."""
        no_grad, self._no_grad = self._no_grad, []
        return no_grad

    def take_scaling(self) -> tuple[float | None, list[dict[str, Any]]]:
        """This iteration's gradient multiplications as (legacy clip_coefficient, gradient_scaling)."""
        records, self._scaling = self._scaling, []
        if not records:
            return None, []
        if (
            len(records) == 1
            and records[0][0] == "clip"
            and records[0][2] is torch.float32
            and records[0][3] is None
        ):
            return records[0][1], []  # the common case reads as before
        out = []
        for by, factor, dtype, ids in records:
            entry: dict[str, Any] = {"by": by, "factor": factor, "dtype": dtype_name(dtype)}
            if ids is not None:
                entry["params"] = sorted(self._names[i] for i in ids)
            out.append(entry)
        return None, out

    # ---- the step pre-hook's checks ----------------------------------------------------------
    def _structure_now(self) -> tuple[Any, ...]:
        """What the shadows were told at enable: param groups' members, the model's parameters."""
        groups = tuple(tuple(id(p) for p in g["params"]) for g in self._optimizer.param_groups)
        params = tuple((n, id(p), tuple(p.shape), p.dtype) for n, p in self._module.named_parameters())
        return groups, params

    def _structure_error(self) -> str | None:
        groups, params = self._structure_now()
        old_groups, old_params = self._structure
        kind = type(self._optimizer).__name__
        if len(groups) != len(old_groups):
            return (
                f"{kind} now has {len(groups)} param groups, {len(old_groups)} when checkmate was enabled "
                "(add_param_group after enable_checkmate)"
            )
        for index, (now, before) in enumerate(zip(groups, old_groups, strict=True)):
            if now != before:
                return f"{kind} param group {index} holds other parameters than when checkmate was enabled"
        if params != old_params:
            before_map = {n: (i, s, d) for n, i, s, d in old_params}
            after_map = {n: (i, s, d) for n, i, s, d in params}
            for name in sorted(set(before_map) | set(after_map)):
                if name not in after_map:
                    return f"model parameter {name!r} is gone"
                if name not in before_map:
                    return f"model parameter {name!r} is new"
                if before_map[name] != after_map[name]:
                    (_, s0, d0), (_, s1, d1) = before_map[name], after_map[name]
                    return f"model parameter {name!r} was replaced ({list(s0)} {d0} -> {list(s1)} {d1})"
        return None

    def _guard_add_param_group(self) -> None:
        optimizer = self._optimizer

        def add_param_group(param_group: dict[str, Any]) -> None:
            raise CheckmateStateError(
                f"checkmate: {type(optimizer).__name__}.add_param_group after enable_checkmate: the shadows "
                "replay the param groups they were given at enable; add every group before enabling "
                "(the last certified checkpoint is intact)"
            )

        optimizer.add_param_group = add_param_group  # type: ignore[method-assign]

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step pre-hook: refuse what the shadows cannot follow; note parameters without a gradient."""
        # torch passes step's positional arguments with the optimizer itself first
        if any(a is not None for a in args[1:]) or kwargs.get("closure") is not None:
            raise CheckmateStateError(
                f"checkmate: {type(optimizer).__name__}.step was given a closure: the shadows cannot "
                "re-evaluate the loss; call step() without one (the last certified checkpoint is intact)"
            )
        problem = self._structure_error()
        if problem is not None:
            raise CheckmateStateError(
                f"checkmate: {problem}; the shadows cannot follow a changed model or optimizer mid-run: "
                "restart the job from its last certified checkpoint (which is intact)"
            )
        if self._rank == 0:
            self._no_grad = [
                self._names[id(p)]
                for g in optimizer.param_groups
                for p in g["params"]
                if p.grad is None and id(p) in self._names
            ]
