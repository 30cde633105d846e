"""The shadow's optimizer step: the workers' update, replayed on the shadow's shard.

A shadow owns whole parameters. For each certified iteration it is given the
fully reduced gradient of every parameter it owns and the iteration's commit
record (learning rate per group, clipping coefficient, skip flag), and applies
exactly what the workers did: multiply by the clipping coefficient as
``torch.nn.utils.clip_grad_norm_`` does, set each group's learning rate, then
``step()`` of the same ``torch.optim`` class with the same hyperparameters
(foreach/fused choices included). The class is the workers' own, imported by
module and qualified name (:mod:`checkmate.optimizers`): any ``torch.optim``
optimizer without a closure, or a user's importable class. torch.optim steps
each parameter on its own (foreach and fused kernels included), so on the same
CPU type the shard's weights and optimizer state equal the workers' bit for bit.

Exactly as the workers: parameters whose gradient was None at the workers' step
(unused in forward, ``set_to_none``) get no gradient and are skipped by
torch.optim; gradient multiplications between the all-reduce and the step
(``GradScaler.unscale_``'s inverse scale, ``clip_grad_norm_``'s coefficient) are
replayed in the order the workers made them, with the same factor dtype.
Parameters in no param group are held but never stepped.

A param group holds what the workers' group holds, whatever the keys: the
constructor's hyperparameters (validated as the constructor validates them) and any
other key a scheduler or the user put there (OneCycleLR's ``max_lr``/``base_momentum``,
a framework's ``name``); ``step()`` reads the same group the workers' step read.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from checkmate.optimizers import OptimizerReplayError, optimizer_class
from shadow.adam_apply import MIN_PER_THREAD, AdamApply, covers, foreach_matches, verified

logger = logging.getLogger(__name__)

SUPPORTED_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    name: getattr(torch.optim, name)
    for name in (
        "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop",
    )
    if hasattr(torch.optim, name)
}  # fmt: skip
"""The torch.optim classes tested bit for bit (tests/shadow/test_optimizer_apply.py); any other
class importable on the shadow is replayed too (:func:`checkmate.optimizers.optimizer_class`)."""


class OptimizerSpecError(ValueError):
    """An optimizer the shadow cannot replay, or hyperparameters it does not accept."""


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer class name and its param groups: hyperparameters plus parameter names."""

    kind: str
    param_groups: Sequence[Mapping[str, Any]]
    """Each group: the hyperparameters of ``optimizer.param_groups[i]`` and ``"params"``,
    the fully-qualified names of its parameters."""
    module: str | None = None
    qualname: str | None = None
    """Where the class lives (None: ``kind`` in torch.optim, as before they travelled)."""

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> OptimizerSpec:
        """Describe a live optimizer; ``names`` maps id(parameter) to its name."""
        groups = []
        for group in optimizer.param_groups:
            hyper = {k: _plain(v) for k, v in group.items() if k != "params"}
            hyper["params"] = [names[id(p)] for p in group["params"]]
            groups.append(hyper)
        kind = type(optimizer)
        return cls(kind.__name__, groups, kind.__module__, kind.__qualname__)

    @classmethod
    def from_json(cls, description: Mapping[str, Any]) -> OptimizerSpec:
        """From a JobStart's (or a checkpoint's) optimizer description."""
        return cls(
            description["kind"],
            description["param_groups"],
            description.get("module"),
            description.get("qualname"),
        )

    def class_fields(self) -> dict[str, Any]:
        """``kind`` (and ``module``/``qualname`` when known) for a description of this optimizer."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.module is not None and self.qualname is not None:
            out.update(module=self.module, qualname=self.qualname)
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
    return value


def _like(current: Any, value: Any) -> Any:
    """``value`` (as it travelled: tensors as numbers, tuples as lists) in the type of ``current``."""
    if isinstance(current, torch.Tensor) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(value, dtype=current.dtype)
    if isinstance(current, tuple) and isinstance(value, (list, tuple)):
        if len(current) == len(value):
            return tuple(_like(c, v) for c, v in zip(current, value, strict=True))
        return tuple(value)
    return value


@dataclass(frozen=True)
class StepRecord:
    """What the shadow needs of an iteration besides the gradients."""

    iteration: int
    learning_rates: Sequence[float]
    """Learning rate of each param group, in group order, as the workers used it."""
    clip_coefficient: float | None = None
    """The clamped float32 coefficient clip_grad_norm_ multiplied the gradients by, if any."""
    skip_step: bool = False
    """The loss scaler found inf/nan: the workers skipped ``step()``."""
    hyperparameters: Sequence[Mapping[str, Any]] = field(default_factory=tuple)
    """Other per-group hyperparameters that changed this iteration (e.g. momentum)."""
    no_grad: frozenset[str] = frozenset()
    """Parameters whose gradient was None at the workers' step: torch.optim skipped them."""
    gradient_scaling: Sequence[GradientScaling] = ()
    """In-place multiplications of the gradients, in order; when given, ``clip_coefficient`` is ignored."""


@dataclass(frozen=True)
class GradientScaling:
    """One in-place multiplication of gradients the workers made between the all-reduce and the step."""

    by: str
    """``"unscale"`` (GradScaler's inverse scale) or ``"clip"`` (clip_grad_norm_'s clamped coefficient)."""
    factor: float
    dtype: torch.dtype = torch.float32
    """The factor's dtype as the workers multiplied by it (a 0-d tensor of this dtype)."""
    params: frozenset[str] | None = None
    """The parameters it applied to (None: every parameter with a gradient)."""


class ShadowOptimizer:
    """The parameters a shadow owns, and the optimizer that updates them."""

    def __init__(
        self,
        initial: Mapping[str, torch.Tensor],
        spec: OptimizerSpec,
        owned: set[str],
        threads: int = 1,
    ) -> None:
        """``threads``: how many threads step Adam/AdamW groups (:mod:`shadow.adam_apply`; bit for
        bit the same for any count); every other optimizer steps with ``optimizer.step()``."""
        try:
            optimizer_cls = optimizer_class(
                {"kind": spec.kind, "module": spec.module, "qualname": spec.qualname}
            )
        except OptimizerReplayError as exc:
            raise OptimizerSpecError(f"optimizer {spec.kind!r} is not supported: {exc}") from None
        unknown = sorted(owned - set(initial))
        if unknown:
            raise OptimizerSpecError(f"owned parameters {unknown} are not in the model")
        self.spec = spec
        # The workers' dtype (fp32, or bf16/fp16 for a low-precision model): the step is theirs.
        self.parameters: dict[str, torch.Tensor] = {
            name: initial[name].detach().clone() for name in sorted(owned)
        }
        self._group_of: dict[str, int] = {}
        try:
            probe: torch.optim.Optimizer | None = optimizer_cls(
                [torch.zeros(2, 2, requires_grad=True)]  # type: ignore[call-arg]
            )
        except (TypeError, ValueError, RuntimeError):
            probe = None  # a user's class that needs more than params: its groups are not pre-checked
        defaults = dict(probe.defaults) if probe is not None else {}
        constructor_args = set(inspect.signature(optimizer_cls).parameters) - {"self", "params"}
        groups = []
        for index, group in enumerate(spec.param_groups):
            # The constructor's hyperparameters in the types it gives them (betas: a tuple); any other
            # key (a scheduler's, the user's) as it travelled: step() does not read it.
            hyper: dict[str, Any] = {
                k: (_like(defaults[k], v) if k in defaults else v) for k, v in group.items() if k != "params"
            }
            if not isinstance(hyper.get("lr", 0.0), (int, float)) or hyper.get("lr", 0.0) < 0:
                raise OptimizerSpecError(f"param group {index}: learning rate {hyper.get('lr')!r} is invalid")
            try:  # the constructor validates its defaults: validate each group the same way
                if probe is not None:
                    optimizer_cls(
                        [torch.zeros(2, 2, requires_grad=True)],
                        **{k: v for k, v in hyper.items() if k in constructor_args},
                    )
            except (TypeError, ValueError) as exc:
                raise OptimizerSpecError(f"{spec.kind} rejects param group {index}: {exc}") from exc
            params = [self.parameters[n] for n in group["params"] if n in self.parameters]
            for n in group["params"]:
                if n in self.parameters:
                    self._group_of[n] = index
            groups.append({**hyper, "params": params})
        self.unoptimized = frozenset(set(self.parameters) - set(self._group_of))
        """Owned parameters in no param group: the workers never step them (held, never changed)."""
        # The first group's hyperparameters as the constructor's defaults too: some constructors
        # initialise state from their arguments (Adagrad's initial_accumulator_value).
        first = {k: v for k, v in groups[0].items() if k in constructor_args} if groups else {}
        try:
            self.optimizer = optimizer_cls(groups, **first)
        except (TypeError, ValueError) as exc:
            raise OptimizerSpecError(f"{spec.kind} rejects the hyperparameters: {exc}") from exc
        self.iteration = -1
        """The last iteration applied (-1: none yet)."""
        self.threads = max(1, threads)
        self._blocked: AdamApply | None = None
        self._probed: dict[tuple[Any, ...], bool] = {}
        if self.threads > 1 and any(covers(self.optimizer, g) for g in self.optimizer.param_groups):
            self._blocked = AdamApply(self.threads)

    def close(self) -> None:
        """Stop the apply threads (if any)."""
        if self._blocked is not None:
            self._blocked.close()

    def _step(self) -> None:
        """``optimizer.step()``, with the Adam/AdamW groups it covers on :mod:`shadow.adam_apply`."""
        blocked = self._blocked
        groups = self.optimizer.param_groups
        fast = [g for g in groups if covers(self.optimizer, g)]
        work = sum(p.numel() for g in fast for p in g["params"] if p.grad is not None)
        # One thread's worth (or one thread): torch.optim's own step, through its foreach variant
        # where that is bit for bit the same (one Python call per operation, not per tensor).
        if blocked is None or work < 2 * MIN_PER_THREAD:
            self._torch_step([g for g in fast if self._verified(g, foreach=True)])
            return
        fast = [g for g in fast if self._verified(g)]
        if not fast:
            self.optimizer.step()
            return
        with torch.no_grad():
            left = blocked.step(self.optimizer, fast)
        rest = [g for g in groups if not any(g is f for f in fast)]
        if not left and not any(p.grad is not None for g in rest for p in g["params"]):
            return
        # What the blocked path did not take: torch.optim steps it, with the others' gradients hidden.
        keep = {id(p) for p in left}
        hidden = []
        for group in fast:
            for p in group["params"]:
                if p.grad is not None and id(p) not in keep:
                    hidden.append((p, p.grad))
                    p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, grad in hidden:
                p.grad = grad

    def _torch_step(self, foreach: list[dict[str, Any]]) -> None:
        """``optimizer.step()``, the ``foreach`` groups with torch's foreach implementation."""
        saved = [group["foreach"] for group in foreach]
        for group in foreach:
            group["foreach"] = True
        try:
            self.optimizer.step()
        finally:
            for group, value in zip(foreach, saved, strict=True):
                group["foreach"] = value

    def _verified(self, group: Mapping[str, Any], foreach: bool = False) -> bool:
        """The probe of :func:`shadow.adam_apply.verified` for this group's settings (cached)."""
        dtypes = tuple(sorted({str(p.dtype) for p in group["params"]}))
        flags = (
            "foreach",
            "fused",
            "capturable",
            "differentiable",
            "amsgrad",
            "maximize",
            "decoupled_weight_decay",
        )
        key = (foreach, dtypes, group.get("weight_decay") != 0, *(repr(group.get(k)) for k in flags))
        known = self._probed.get(key)
        if known is None:
            probe = foreach_matches if foreach else verified
            known = all(
                probe(self.optimizer, group, p.dtype)
                for p in {str(p.dtype): p for p in group["params"]}.values()
                if p.dtype in (torch.float32, torch.float64)
            )
            self._probed[key] = known
        return known

    def apply(self, step: StepRecord, gradients: Mapping[str, torch.Tensor]) -> None:
        """Apply one iteration. ``gradients`` holds the reduced gradient of every owned parameter."""
        missing = sorted(set(self.parameters) - set(gradients))
        if missing:
            raise KeyError(f"iteration {step.iteration}: no gradient for owned parameters {missing}")
        if len(step.learning_rates) != len(self.optimizer.param_groups):
            raise ValueError(
                f"iteration {step.iteration}: {len(step.learning_rates)} learning rates for "
                f"{len(self.optimizer.param_groups)} param groups"
            )
        for name, parameter in self.parameters.items():
            if name in step.no_grad or name in self.unoptimized:
                parameter.grad = None  # torch.optim skips a parameter without a gradient
            else:
                gradient = gradients[name].view_as(parameter)
                # e.g. a bf16-compressed bucket of an fp32 model: the workers copied it back the same way
                parameter.grad = (
                    gradient if gradient.dtype == parameter.dtype else gradient.to(parameter.dtype)
                )
        scaling = list(step.gradient_scaling)
        if not scaling and step.clip_coefficient is not None:
            scaling = [GradientScaling("clip", step.clip_coefficient)]
        for operation in scaling:
            factor = torch.tensor(operation.factor, dtype=operation.dtype)
            for name, parameter in self.parameters.items():
                if parameter.grad is not None and (operation.params is None or name in operation.params):
                    parameter.grad.mul_(factor)
        for index, (group, lr) in enumerate(
            zip(self.optimizer.param_groups, step.learning_rates, strict=True)
        ):
            group["lr"] = _like(group["lr"], lr)
            if index < len(step.hyperparameters):
                # in the type the group holds (betas cycled by OneCycleLR arrive as a list)
                group.update({k: _like(group.get(k), v) for k, v in step.hyperparameters[index].items()})
        if not step.skip_step:
            self._step()
        for parameter in self.parameters.values():
            parameter.grad = None
        self.iteration = step.iteration

    def optimizer_state(self, name: str) -> dict[str, torch.Tensor]:
        """The optimizer's per-parameter state (e.g. exp_avg, momentum_buffer, step)."""
        return dict(self.optimizer.state.get(self.parameters[name], {}))
