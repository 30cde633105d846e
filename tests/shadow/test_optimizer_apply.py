"""A shadow replaying the workers' steps ends bit-for-bit where the workers end."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from checkmate.optimizers import pin_implementation
from shadow.optimizer_apply import (
    GradientScaling,
    OptimizerSpec,
    OptimizerSpecError,
    ShadowOptimizer,
    StepRecord,
)

torch.set_num_threads(1)

OPTIMIZERS: dict[str, Callable[[list[dict]], torch.optim.Optimizer]] = {
    "sgd-momentum-nesterov-wd": lambda g: torch.optim.SGD(
        g, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
    "sgd-dampening": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.8, dampening=0.1),
    "adam": lambda g: torch.optim.Adam(g, lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=1e-4),
    "adam-amsgrad": lambda g: torch.optim.Adam(g, lr=1e-2, amsgrad=True),
    "adamw": lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.05),
    "adamw-amsgrad": lambda g: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.05, amsgrad=True),
    "sgd-maximize": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, maximize=True),
    "adam-maximize": lambda g: torch.optim.Adam(g, lr=1e-2, maximize=True),
    "adamax-wd-maximize": lambda g: torch.optim.Adamax(g, lr=1e-2, weight_decay=1e-3, maximize=True),
    "nadam-decoupled": lambda g: torch.optim.NAdam(
        g, lr=1e-2, weight_decay=1e-3, momentum_decay=5e-3, decoupled_weight_decay=True
    ),
    "nadam-maximize": lambda g: torch.optim.NAdam(g, lr=1e-2, weight_decay=1e-3, maximize=True),
    "radam-decoupled": lambda g: torch.optim.RAdam(
        g, lr=1e-2, weight_decay=1e-3, decoupled_weight_decay=True
    ),
    "radam-maximize": lambda g: torch.optim.RAdam(g, lr=1e-2, maximize=True),
    "rmsprop-centered-momentum": lambda g: torch.optim.RMSprop(
        g, lr=1e-2, alpha=0.9, momentum=0.5, centered=True, weight_decay=1e-3
    ),
    "rmsprop-maximize": lambda g: torch.optim.RMSprop(g, lr=1e-2, maximize=True),
    "adagrad-decay": lambda g: torch.optim.Adagrad(
        g, lr=0.05, lr_decay=1e-2, weight_decay=1e-3, initial_accumulator_value=0.1
    ),
    "adagrad-maximize": lambda g: torch.optim.Adagrad(g, lr=0.05, maximize=True),
    "adadelta-wd": lambda g: torch.optim.Adadelta(g, lr=0.5, rho=0.8, weight_decay=1e-3, maximize=True),
    "asgd-early-averaging": lambda g: torch.optim.ASGD(
        g, lr=1e-2, lambd=1e-3, alpha=0.7, t0=2, weight_decay=1e-3
    ),
    "asgd-maximize": lambda g: torch.optim.ASGD(g, lr=1e-2, maximize=True),
    "rprop-etas": lambda g: torch.optim.Rprop(g, lr=1e-2, etas=(0.4, 1.3), step_sizes=(1e-5, 1.0)),
    "rprop-maximize": lambda g: torch.optim.Rprop(g, lr=1e-2, maximize=True),
    "sgd-foreach": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True, foreach=True),
    "adam-foreach-amsgrad": lambda g: torch.optim.Adam(g, lr=1e-2, amsgrad=True, foreach=True),
    "rmsprop-foreach": lambda g: torch.optim.RMSprop(g, lr=1e-2, momentum=0.5, centered=True, foreach=True),
    "asgd-foreach": lambda g: torch.optim.ASGD(g, lr=1e-2, t0=2, foreach=True),
    "rprop-foreach": lambda g: torch.optim.Rprop(g, lr=1e-2, foreach=True),
    "nadam-foreach": lambda g: torch.optim.NAdam(g, lr=1e-2, foreach=True),
    "radam-foreach": lambda g: torch.optim.RAdam(g, lr=1e-2, foreach=True),
    "adamax-foreach": lambda g: torch.optim.Adamax(g, lr=1e-2, foreach=True),
    "adadelta-foreach": lambda g: torch.optim.Adadelta(g, lr=0.5, foreach=True),
    "adagrad-foreach": lambda g: torch.optim.Adagrad(g, lr=0.05, foreach=True),
    "adam-fused": lambda g: torch.optim.Adam(g, lr=1e-2, fused=True),
    "adamw-fused-amsgrad": lambda g: torch.optim.AdamW(g, lr=1e-2, amsgrad=True, fused=True),
    "sgd-fused-momentum": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, fused=True),
    "adagrad-fused": lambda g: torch.optim.Adagrad(g, lr=0.05, fused=True),
}


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_two_shards_equal_the_workers_bit_for_bit(kind: str) -> None:
    worker = model()
    names = {id(p): n for n, p in worker.named_parameters()}
    params = dict(worker.named_parameters())
    groups = [
        {"params": [params["0.weight"], params["0.bias"]]},
        {"params": [params["2.weight"], params["2.bias"]], "lr": 3e-3},
    ]
    optimizer = OPTIMIZERS[kind](groups)
    pin_implementation(optimizer)  # what enable_checkmate does: foreach explicit on both sides
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    spec = OptimizerSpec.from_optimizer(optimizer, names)
    initial = {n: p.detach().clone() for n, p in worker.named_parameters()}
    shards = [
        ShadowOptimizer(initial, spec, {"0.weight", "2.bias"}),
        ShadowOptimizer(initial, spec, {"0.bias", "2.weight"}),
    ]
    generator = torch.Generator().manual_seed(2)
    for iteration in range(6):
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(worker(x), y).backward()
        gradients = {n: p.grad.detach().clone() for n, p in worker.named_parameters()}  # type: ignore[union-attr]
        total = torch.nn.utils.clip_grad_norm_(worker.parameters(), max_norm=0.5)
        coefficient = torch.clamp(0.5 / (total + 1e-6), max=1.0).item()
        skip = iteration == 3  # a loss scaler that found inf: nobody steps
        learning_rates = [g["lr"] for g in optimizer.param_groups]
        if not skip:
            optimizer.step()
        scheduler.step()
        record = StepRecord(iteration, learning_rates, coefficient, skip)
        for shard in shards:
            shard.apply(record, {n: gradients[n].clone() for n in shard.parameters})
    for shard in shards:
        for name, value in shard.parameters.items():
            assert torch.equal(value, params[name].detach()), name
            expected = optimizer.state[params[name]]
            got = shard.optimizer_state(name)
            assert expected.keys() == got.keys()
            for key in expected:
                assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(expected[key])), (name, key)


def test_unsupported_or_inconsistent_specs_are_refused() -> None:
    worker = model()
    initial = {n: p.detach() for n, p in worker.named_parameters()}
    spec = OptimizerSpec("LBFGS", [{"params": list(initial), "lr": 0.1}])
    with pytest.raises(OptimizerSpecError, match="needs a closure"):
        ShadowOptimizer(initial, spec, {"0.bias"})
    spec = OptimizerSpec("Nope", [{"params": list(initial), "lr": 0.1}])
    with pytest.raises(OptimizerSpecError, match="not a torch.optim optimizer"):
        ShadowOptimizer(initial, spec, {"0.bias"})
    spec = OptimizerSpec("X", [{"params": list(initial), "lr": 0.1}], "no_such_module_here", "X")
    with pytest.raises(OptimizerSpecError, match="cannot import module 'no_such_module_here'"):
        ShadowOptimizer(initial, spec, {"0.bias"})
    with pytest.raises(OptimizerSpecError, match="not in the model"):
        ShadowOptimizer(initial, OptimizerSpec("SGD", [{"params": ["x"], "lr": 0.1}]), {"x"})
    held = ShadowOptimizer(initial, OptimizerSpec("SGD", [{"params": ["0.bias"], "lr": 0.1}]), {"0.weight"})
    assert held.unoptimized == {"0.weight"}  # in no param group: held, never stepped
    with pytest.raises(OptimizerSpecError, match="learning rate -1.0 is invalid"):
        ShadowOptimizer(initial, OptimizerSpec("SGD", [{"params": ["0.bias"], "lr": -1.0}]), {"0.bias"})
    with pytest.raises(OptimizerSpecError, match="rejects"):
        ShadowOptimizer(
            initial, OptimizerSpec("Adam", [{"params": ["0.bias"], "betas": [2.0, 0.9]}]), {"0.bias"}
        )
    shard = ShadowOptimizer(initial, OptimizerSpec("SGD", [{"params": ["0.bias"], "lr": 0.1}]), {"0.bias"})
    with pytest.raises(KeyError, match="no gradient"):
        shard.apply(StepRecord(0, [0.1]), {})
    with pytest.raises(ValueError, match="learning rates"):
        shard.apply(StepRecord(0, [0.1, 0.2]), {"0.bias": torch.zeros(32)})


class SignSGD(torch.optim.Optimizer):
    """A user's own optimizer, importable by module and name: the shadow replays it."""

    def __init__(self, params: object, lr: float = 0.01, decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "decay": decay})  # type: ignore[arg-type]

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["count"] = state.get("count", 0) + 1  # non-tensor state
                p.mul_(1 - group["decay"]).add_(torch.sign(p.grad), alpha=-group["lr"])


def test_a_users_optimizer_class_and_gradients_skipped_or_scaled_replay_exactly() -> None:
    worker = model()
    names = {id(p): n for n, p in worker.named_parameters()}
    params = dict(worker.named_parameters())
    optimizer = SignSGD(worker.parameters(), lr=0.01, decay=1e-3)
    spec = OptimizerSpec.from_optimizer(optimizer, names)
    assert (spec.module, spec.qualname) == (__name__, "SignSGD")
    initial = {n: p.detach().clone() for n, p in worker.named_parameters()}
    shard = ShadowOptimizer(initial, spec, set(initial))
    generator = torch.Generator().manual_seed(3)
    for iteration in range(4):
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(worker(x), y).backward()
        gradients = {n: p.grad.detach().clone() for n, p in worker.named_parameters()}  # type: ignore[union-attr]
        # the workers: unscale, then clip a subset, and one parameter had no gradient
        for p in worker.parameters():
            p.grad.mul_(torch.tensor(0.25))  # type: ignore[union-attr]
        params["2.bias"].grad.mul_(torch.tensor(0.5))  # type: ignore[union-attr]
        params["0.bias"].grad = None
        optimizer.step()
        record = StepRecord(
            iteration,
            [0.01],
            no_grad=frozenset({"0.bias"}),
            gradient_scaling=(
                GradientScaling("unscale", 0.25),
                GradientScaling("clip", 0.5, params=frozenset({"2.bias"})),
            ),
        )
        shard.apply(record, gradients)
    for name, value in shard.parameters.items():
        assert torch.equal(value, params[name].detach()), name
        assert shard.optimizer_state(name) == dict(optimizer.state[params[name]]), name
    assert shard.optimizer_state("0.bias") == {}  # never had a gradient: never stepped


@pytest.mark.parametrize("kind", ["SGD", "Adam"])
def test_scheduler_and_user_keys_in_param_groups_travel_and_replay_exactly(kind: str) -> None:
    """OneCycleLR's keys, a group name and a user's nested key: accepted, kept, and the cycled
    momentum (SGD) or betas (Adam, which arrive as a list) replayed bit for bit."""
    worker = model()
    names = {id(p): n for n, p in worker.named_parameters()}
    groups = [
        {"params": list(worker[0].parameters()), "name": "body", "tags": {"depth": [1, 2]}},
        {"params": list(worker[2].parameters()), "name": "head", "lr": 0.02},
    ]
    if kind == "SGD":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(groups, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    spec = OptimizerSpec.from_optimizer(optimizer, names)
    assert {"max_lr", "min_lr", "initial_lr", "name"} <= set(spec.param_groups[0])
    initial = {n: p.detach().clone() for n, p in worker.named_parameters()}
    shard = ShadowOptimizer(initial, spec, set(initial))
    assert [g["name"] for g in shard.optimizer.param_groups] == ["body", "head"]
    assert shard.optimizer.param_groups[0]["tags"] == {"depth": [1, 2]}
    momentum_key = "momentum" if kind == "SGD" else "betas"
    generator = torch.Generator().manual_seed(5)
    for iteration in range(6):
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(worker(x), y).backward()
        gradients = {n: p.grad.detach().clone() for n, p in worker.named_parameters()}  # type: ignore[union-attr]
        # what the commit carries: the lr and the momentum in force at this step, as JSON gives them
        cycled = [{momentum_key: list(g[momentum_key]) if kind == "Adam" else g[momentum_key]}
                  for g in optimizer.param_groups]  # fmt: skip
        record = StepRecord(iteration, [g["lr"] for g in optimizer.param_groups], hyperparameters=cycled)
        optimizer.step()
        scheduler.step()
        shard.apply(record, gradients)
        if kind == "Adam":
            assert isinstance(shard.optimizer.param_groups[0]["betas"], tuple)
    for name, value in shard.parameters.items():
        assert torch.equal(value, dict(worker.named_parameters())[name].detach()), name
