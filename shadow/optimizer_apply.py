"""The shadow's optimizer step: the workers' update, replayed on the shadow's shard.

A shadow owns whole parameters. For each certified iteration it is given the
fully reduced gradient of every parameter it owns and the iteration's commit
record (learning rate per group, clipping coefficient, skip flag), and applies
exactly what the workers did: multiply by the clipping coefficient as
``torch.nn.utils.clip_grad_norm_`` does, set each group's learning rate, then
``step()`` of the same ``torch.optim`` class with the same hyperparameters
(foreach/fused choices included). Element-wise optimizers do not care which
other parameters share the step, so on the same CPU type the shard's weights
and optimizer state equal the workers' bit for bit.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

SUPPORTED_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "SGD": torch.optim.SGD,
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
}


class OptimizerSpecError(ValueError):
    """An optimizer the shadow cannot replay, or hyperparameters it does not accept."""


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer class name and its param groups: hyperparameters plus parameter names."""

    kind: str
    param_groups: Sequence[Mapping[str, Any]]
    """Each group: the hyperparameters of ``optimizer.param_groups[i]`` and ``"params"``,
    the fully-qualified names of its parameters."""

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, names: Mapping[int, str]) -> OptimizerSpec:
        """Describe a live optimizer; ``names`` maps id(parameter) to its name."""
        groups = []
        for group in optimizer.param_groups:
            hyper = {k: _plain(v) for k, v in group.items() if k != "params"}
            hyper["params"] = [names[id(p)] for p in group["params"]]
            groups.append(hyper)
        return cls(type(optimizer).__name__, groups)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return list(value)
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


class ShadowOptimizer:
    """The parameters a shadow owns, and the optimizer that updates them."""

    def __init__(self, initial: Mapping[str, torch.Tensor], spec: OptimizerSpec, owned: set[str]) -> None:
        optimizer_class = SUPPORTED_OPTIMIZERS.get(spec.kind)
        if optimizer_class is None:
            raise OptimizerSpecError(
                f"optimizer {spec.kind!r} is not supported; supported: {sorted(SUPPORTED_OPTIMIZERS)}"
            )
        unknown = sorted(owned - set(initial))
        if unknown:
            raise OptimizerSpecError(f"owned parameters {unknown} are not in the model")
        self.spec = spec
        self.parameters: dict[str, torch.Tensor] = {
            name: initial[name].detach().clone().float() for name in sorted(owned)
        }
        self._group_of: dict[str, int] = {}
        allowed = set(optimizer_class([torch.zeros(1, requires_grad=True)]).defaults) | {"initial_lr"}
        constructor_args = set(inspect.signature(optimizer_class).parameters) - {"self", "params"}
        groups = []
        for index, group in enumerate(spec.param_groups):
            hyper: dict[str, Any] = {
                k: (tuple(v) if isinstance(v, list) else v) for k, v in group.items() if k != "params"
            }
            unexpected = sorted(set(hyper) - allowed)
            if unexpected:
                raise OptimizerSpecError(f"{spec.kind} has no hyperparameter(s) {unexpected}")
            if not isinstance(hyper.get("lr", 0.0), (int, float)) or hyper.get("lr", 0.0) < 0:
                raise OptimizerSpecError(f"param group {index}: learning rate {hyper.get('lr')!r} is invalid")
            try:  # the constructor validates its defaults: validate each group the same way
                optimizer_class(
                    [torch.zeros(1, requires_grad=True)],
                    **{k: v for k, v in hyper.items() if k in constructor_args},
                )
            except (TypeError, ValueError) as exc:
                raise OptimizerSpecError(f"{spec.kind} rejects param group {index}: {exc}") from exc
            params = [self.parameters[n] for n in group["params"] if n in self.parameters]
            for n in group["params"]:
                if n in self.parameters:
                    self._group_of[n] = index
            groups.append({**hyper, "params": params})
        missing = sorted(set(self.parameters) - set(self._group_of))
        if missing:
            raise OptimizerSpecError(f"owned parameters {missing} are in no param group")
        try:
            self.optimizer = optimizer_class(groups)
        except (TypeError, ValueError) as exc:
            raise OptimizerSpecError(f"{spec.kind} rejects the hyperparameters: {exc}") from exc
        self.iteration = -1
        """The last iteration applied (-1: none yet)."""

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
            parameter.grad = gradients[name].view_as(parameter)
        if step.clip_coefficient is not None:
            coefficient = torch.tensor(step.clip_coefficient, dtype=torch.float32)
            for parameter in self.parameters.values():
                assert parameter.grad is not None
                parameter.grad.mul_(coefficient)
        for index, (group, lr) in enumerate(
            zip(self.optimizer.param_groups, step.learning_rates, strict=True)
        ):
            group["lr"] = lr
            if index < len(step.hyperparameters):
                group.update(step.hyperparameters[index])
        if not step.skip_step:
            self.optimizer.step()
        for parameter in self.parameters.values():
            parameter.grad = None
        self.iteration = step.iteration

    def optimizer_state(self, name: str) -> dict[str, torch.Tensor]:
        """The optimizer's per-parameter state (e.g. exp_avg, momentum_buffer, step)."""
        return dict(self.optimizer.state.get(self.parameters[name], {}))
