"""Every optimizer the shadow replays also restores: from the shadow's memory and from its checkpoint.

The shadow is seeded like rank 0 seeds it (a job_start with the optimizer's state),
replays three steps, and its state goes (a) through a restore answer and
:func:`checkmate.checkpoint.shadow_memory.merge_shards`, (b) through a checkpoint on disk, into a fresh
worker optimizer with :func:`hosts.recovery.load_state`. Both restored workers then
train on next to the uninterrupted one and end bit for bit equal to it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkmate import checkpoint as fmt
from checkmate.checkpoint.shadow_memory import merge_shards
from checkmate.checkpoint.source import RestoredState
from checkmate.control import JobStart, ParamSpec
from checkmate.optimizers import describe, pin_implementation
from hosts.recovery import from_snapshots, load_state
from shadow.node_state import make_optimizer
from shadow.optimizer_apply import OptimizerSpec, StepRecord
from tests.shadow.test_optimizer_apply import OPTIMIZERS, model

torch.set_num_threads(1)


def _groups(net: nn.Module) -> list[dict[str, Any]]:
    params = dict(net.named_parameters())
    return [
        {"params": [params["0.weight"], params["0.bias"]]},
        {"params": [params["2.weight"], params["2.bias"]], "lr": 3e-3},
    ]


def _train(
    net: nn.Module, optimizer: torch.optim.Optimizer, seed: int, steps: int
) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    gradients = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        gradients.append({n: p.grad.detach().clone() for n, p in net.named_parameters()})  # type: ignore[union-attr]
        optimizer.step()
    return gradients


def _job_start(net: nn.Module, optimizer: torch.optim.Optimizer, iteration: int, state_of: Any) -> JobStart:
    """What rank 0 (or a shadow's restore answer) sends: parameters, tensor state, scalar state."""
    names = {id(p): n for n, p in net.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, p in net.named_parameters():
        tensors[f"param/{name}"] = p.detach().clone()
        for key, value in state_of(p).items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{name}/{key}"] = value.detach().clone()
            else:
                scalars.setdefault(name, {})[key] = value
    spec = OptimizerSpec.from_optimizer(optimizer, names)
    return JobStart(
        job_id=1,
        world_size=1,
        workers=[],
        parameters=[ParamSpec(n, tuple(p.shape), "float32") for n, p in net.named_parameters()],
        optimizer={**describe(optimizer), "param_groups": list(spec.param_groups)},
        start_iteration=iteration,
        tensors=tensors,
        optimizer_scalars=scalars,
        extra={"shadow": "s0"},
    )


def _assert_equal(a: nn.Module, oa: torch.optim.Optimizer, b: nn.Module, ob: torch.optim.Optimizer) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        sa, sb = oa.state.get(pa, {}), ob.state.get(pb, {})
        assert sa.keys() == sb.keys(), (name, sa.keys(), sb.keys())
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), (name, key)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_every_optimizer_restores_bit_identically_from_memory_and_disk(kind: str, tmp_path: Path) -> None:
    worker = model()
    optimizer = OPTIMIZERS[kind](_groups(worker))
    pin_implementation(optimizer)
    start = _job_start(
        worker, optimizer, 0, lambda p: optimizer.state.get(p, {})
    )  # e.g. Adagrad's initial sum
    shadow = make_optimizer(start.optimizer, start, {n for n, _ in worker.named_parameters()})
    for iteration, gradients in enumerate(_train(worker, optimizer, seed=5, steps=3)):
        shadow.apply(StepRecord(iteration, [g["lr"] for g in optimizer.param_groups]), gradients)

    # (a) the shadow's memory, as a restore answer
    params = dict(worker.named_parameters())
    answer = _job_start(worker, optimizer, 3, lambda p: {})  # the model's shape and groups
    answer.tensors = {}
    for name in params:
        answer.tensors[f"param/{name}"] = shadow.parameters[name].clone()
        for key, value in shadow.optimizer_state(name).items():
            if isinstance(value, torch.Tensor):
                answer.tensors[f"state/{name}/{key}"] = value.clone()
            else:
                answer.optimizer_scalars.setdefault(name, {})[key] = value
    merged = merge_shards([answer])
    from_memory = RestoredState(
        iteration=merged["iteration"],
        source="shadow-memory",
        parameters=merged["parameters"],
        optimizer_state=merged["optimizer_state"],
        optimizer_kind=merged["optimizer"]["kind"],
    )
    # (b) the shadow's checkpoint on disk
    fmt.write_global(
        tmp_path, 2, fmt.parameters_of(shadow.parameters.items()), answer.optimizer, {"optimizer_step": 3}
    )
    fmt.write_shard(tmp_path, 2, 0, 1, fmt.capture_states(shadow.parameters.items(), shadow.optimizer))
    from_disk = from_snapshots(tmp_path)

    for restored in (from_memory, from_disk):
        fresh = model()
        fresh_optimizer = OPTIMIZERS[kind](_groups(fresh))
        pin_implementation(fresh_optimizer)
        for group, live in zip(fresh_optimizer.param_groups, optimizer.param_groups, strict=True):
            group["lr"] = live["lr"]  # the scheduler's job (the job state) is not part of this test
        load_state(fresh, fresh_optimizer, restored)
        _assert_equal(worker, optimizer, fresh, fresh_optimizer)
        reference = model()
        reference.load_state_dict(worker.state_dict())
        reference_optimizer = OPTIMIZERS[kind](_groups(reference))
        reference_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        _train(reference, reference_optimizer, seed=9, steps=3)
        _train(fresh, fresh_optimizer, seed=9, steps=3)
        _assert_equal(reference, reference_optimizer, fresh, fresh_optimizer)
