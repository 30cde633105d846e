"""Which optimizers a shadow can replay, and how the workers describe theirs.

Shared by the host agent (``hosts.ddp``: describe the workers' optimizer, refuse
at ``enable_checkmate`` what the shadows cannot reproduce) and the shadow
(``shadow.optimizer_apply``: import the same class and build it on its shard).

A shadow replays the workers' *own* optimizer class: the description carries
its module and qualified name (``{"kind": "RMSprop", "module": "torch.optim.rmsprop",
"qualname": "RMSprop", "param_groups": [...]}``), and the shadow imports it.
Every ``torch.optim`` optimizer that takes no closure and dense gradients works
(SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta, ASGD,
Rprop; others such as Muon are replayed as any importable class, untested); so
does a user's class importable on the shadow (not one defined in ``__main__`` or
inside a function) whose state is element-wise (each state tensor shaped like
its parameter, or 0-d: :func:`non_elementwise_state` checks it after the first
step). Adafactor is refused: its factored state does not fit the layout-free
checkpoint. On CPU the replay is bit-exact when both sides run the same
implementation, so :func:`pin_implementation` makes
``foreach`` explicit in every param group before the first step (torch would
otherwise choose per call from the devices it sees). ``fused=True`` is replayed
on CPU (torch's fused CPU kernels work per parameter, so a shard steps exactly
like the whole model) and refused for parameters on another device, whose fused
kernels a CPU shadow does not have. ``differentiable=True`` and
``capturable=True`` are refused.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

NEEDS_CLOSURE = frozenset({"torch.optim.lbfgs.LBFGS"})
"""torch.optim classes whose ``step`` needs a closure (it re-evaluates the loss: the
shadow has no model or data to evaluate)."""
SPARSE_ONLY = frozenset({"torch.optim.sparse_adam.SparseAdam"})
"""torch.optim classes that take only sparse gradients (DDP's buckets are dense)."""
NOT_ELEMENTWISE = frozenset({"torch.optim.Adafactor", "torch.optim._adafactor.Adafactor"})
"""torch.optim classes whose per-parameter state is not shaped like the parameter (Adafactor's
factored ``row_var``/``col_var``): the layout-free checkpoint stores optimizer state element by
element (docs/checkpoint-format.md), so a checkpoint of them could not be restored."""

SHARDED_STATE = frozenset({"torch.distributed.optim.zero_redundancy_optimizer.ZeroRedundancyOptimizer"})
"""Optimizers that keep each rank's share of the state on that rank only (ZeRO-1): rank 0 holds
neither the full state the shadows start from nor what its fingerprint must cover, so such a job
is refused (on every rank, before any collective) rather than left unprotected or hanging."""


class OptimizerReplayError(ValueError):
    """An optimizer (or an option of it) the shadows cannot reproduce exactly."""


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def optimizer_class(description: Mapping[str, Any]) -> type[torch.optim.Optimizer]:
    """The optimizer class a description names: its ``module`` + ``qualname``, or ``kind`` in torch.optim.

    Raises :class:`OptimizerReplayError` naming what cannot be imported or used.
    """
    module_name = description.get("module")
    qualname = description.get("qualname")
    kind = description.get("kind")
    if module_name is None or qualname is None:  # a description from before module/qualname travelled
        if not isinstance(kind, str) or not isinstance(getattr(torch.optim, kind, None), type):
            raise OptimizerReplayError(f"optimizer {kind!r} is not a torch.optim optimizer")
        found: Any = getattr(torch.optim, kind)
    else:
        if not isinstance(module_name, str) or not isinstance(qualname, str):
            raise OptimizerReplayError(
                f"optimizer module {module_name!r} / qualname {qualname!r} are not names"
            )
        try:
            found = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - any import failure is reported with its cause
            raise OptimizerReplayError(
                f"optimizer {module_name}.{qualname}: cannot import module {module_name!r} "
                f"on the shadow: {exc}"
            ) from None
        for part in qualname.split("."):
            found = getattr(found, part, None)
            if found is None:
                raise OptimizerReplayError(f"optimizer {module_name}.{qualname}: {part!r} not found")
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise OptimizerReplayError(
            f"{module_name or 'torch.optim'}.{qualname or kind} is not an optimizer class"
        )
    check_class(found)
    return found


def check_class(cls: type[torch.optim.Optimizer]) -> None:
    """Refuse a class the shadow cannot step: one that needs a closure or sparse gradients."""
    name = qualified_name(cls)
    if name in NEEDS_CLOSURE or _step_needs_closure(cls):
        raise OptimizerReplayError(
            f"optimizer {name}: its step() needs a closure (it re-evaluates the loss), which a shadow "
            "cannot run"
        )
    if name in SHARDED_STATE:
        inner = getattr(cls, "__name__", name)
        raise OptimizerReplayError(
            f"optimizer {name} (ZeRO-1) keeps each rank's share of the optimizer state on that rank "
            "only: rank 0 cannot send the shadows the full state or its fingerprint, so Checkmate does "
            f"not protect a {inner} job. Use the optimizer it wraps directly under DDP (the shadows "
            "hold the full optimizer state for the job, in the network, so the workers need not), "
            "or shard with FSDP2 and hosts.enable_checkmate_fsdp (docs/backend.md)"
        )
    if name in SPARSE_ONLY:
        raise OptimizerReplayError(
            f"optimizer {name} takes sparse gradients; DDP's gradient buckets are dense"
        )


def _step_needs_closure(cls: type[torch.optim.Optimizer]) -> bool:
    try:
        parameters = inspect.signature(cls.step).parameters
    except (TypeError, ValueError):
        return False
    closure = parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def check_importable(cls: type[torch.optim.Optimizer]) -> None:
    """Refuse a class a shadow could not import by its module and qualified name."""
    name = qualified_name(cls)
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise OptimizerReplayError(
            f"optimizer {name} is defined in the training script itself (or inside a function): a shadow "
            "imports the workers' optimizer class by module and name; move it into an importable module"
        )
    try:
        module = importlib.import_module(cls.__module__)
    except Exception as exc:  # noqa: BLE001 - reported with its cause
        raise OptimizerReplayError(f"optimizer {name}: its module cannot be imported: {exc}") from None
    found: Any = module
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    if found is not cls:
        raise OptimizerReplayError(f"optimizer {name}: importing it by name gives another object ({found!r})")


def _default_foreach(params: list[torch.Tensor], differentiable: bool) -> bool:
    """What torch would choose for ``foreach=None`` with these parameters."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach

        return bool(_default_to_fused_or_foreach(params, differentiable, use_fused=False)[1])
    except (ImportError, TypeError):  # pragma: no cover - older/newer torch without the helper
        return bool(params) and all(p.device.type == "cuda" for p in params)


def pin_implementation(optimizer: torch.optim.Optimizer) -> None:
    """Make ``foreach`` explicit in every param group that has the option (None -> torch's choice).

    Also refuses the options a shadow cannot reproduce (:func:`check_options`).
    """
    check_options(optimizer)
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = _default_foreach(list(group["params"]), bool(group.get("differentiable")))


def check_options(optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`OptimizerReplayError` for an option no shadow reproduces, naming it."""
    name = qualified_name(type(optimizer))
    for index, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            raise OptimizerReplayError(
                f"optimizer {name}, param group {index}: differentiable=True (autograd through the step) "
                "is not replayed by the shadows"
            )
        if group.get("capturable"):
            raise OptimizerReplayError(
                f"optimizer {name}, param group {index}: capturable=True (CUDA-graph state on the device) "
                "is not replayed by the shadows; leave it off"
            )
        if group.get("fused"):
            devices = sorted({p.device.type for p in group["params"]} - {"cpu"})
            if devices:
                raise OptimizerReplayError(
                    f"optimizer {name}, param group {index}: fused=True on {', '.join(devices)} parameters: "
                    "the shadows' CPU kernels would not match bit for bit; use foreach or the for-loop"
                )
        for key, value in group.items():
            if key != "params" and callable(value):
                raise OptimizerReplayError(
                    f"optimizer {name}, param group {index}: hyperparameter {key!r} is a function "
                    f"({value!r}); only plain values travel to the shadows"
                )


def check_checkpointable(cls: type[torch.optim.Optimizer]) -> None:
    """Refuse a class whose state the layout-free checkpoint cannot hold."""
    name = qualified_name(cls)
    if name in NOT_ELEMENTWISE:
        raise OptimizerReplayError(
            f"optimizer {name}: its state is factored (not shaped like each parameter); Checkmate's "
            "checkpoint stores optimizer state element by element, so it could not be restored"
        )


def non_elementwise_state(optimizer: torch.optim.Optimizer) -> str | None:
    """``"<class> state '<key>' of a <shape> parameter has shape <shape>"`` for the first state tensor
    that is neither 0-d nor shaped like its parameter, or None."""
    for parameter, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() != parameter.numel():
                return (
                    f"{qualified_name(type(optimizer))} state {key!r} of a {list(parameter.shape)} "
                    f"parameter has shape {list(value.shape)}"
                )
    return None


def check_replayable(optimizer: torch.optim.Optimizer) -> None:
    """Everything :func:`enable_checkmate` checks about the optimizer (raises, naming the cause)."""
    check_class(type(optimizer))
    check_checkpointable(type(optimizer))
    check_importable(type(optimizer))
    check_options(optimizer)


def describe(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"kind", "module", "qualname"}`` of the optimizer's class (param groups are added by the caller)."""
    cls = type(optimizer)
    return {"kind": cls.__name__, "module": cls.__module__, "qualname": cls.__qualname__}
