"""The shadow's faster Adam/AdamW steps (threads, blocks, torch's foreach) equal torch.optim's bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from shadow import adam_apply
from shadow.adam_apply import AdamApply, covers, foreach_matches, verified
from shadow.optimizer_apply import OptimizerSpec, ShadowOptimizer, StepRecord

torch.set_num_threads(1)

KINDS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05),
    "adam-l2": lambda p: torch.optim.Adam(p, lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=3e-3),
    "adam-decoupled": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32 if t.element_size() == 4 else torch.int64)


def assert_same(torch_opt: torch.optim.Optimizer, theirs: list[torch.Tensor], mine_opt: torch.optim.Optimizer,
                mine: list[torch.Tensor]) -> None:  # fmt: skip
    for a, b in zip(theirs, mine, strict=True):
        assert torch.equal(bits(a), bits(b))
        sa, sb = torch_opt.state[a], mine_opt.state[b]
        assert list(sa) == list(sb)
        for key in sa:
            assert torch.equal(bits(sa[key]), bits(sb[key])), key


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("threads", [1, 3])
def test_blocked_steps_equal_torch_single_tensor_steps_bit_for_bit(
    kind: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adam_apply, "BLOCK", 192)  # many blocks, boundaries inside every tensor
    monkeypatch.setattr(adam_apply, "MIN_PER_THREAD", 64)
    generator = torch.Generator().manual_seed(7)
    shapes = [(37, 29), (1000,), (1,), (192,), (193,), (5, 7, 11)]
    start = [torch.randn(s, generator=generator) for s in shapes]
    theirs = [p.clone().requires_grad_() for p in start]
    mine = [p.clone().requires_grad_() for p in start]
    torch_opt, mine_opt = KINDS[kind](theirs), KINDS[kind](mine)
    assert covers(mine_opt, mine_opt.param_groups[0])
    runner = AdamApply(threads)
    try:
        for step in range(4):
            for i, (a, b) in enumerate(zip(theirs, mine, strict=True)):
                grad = torch.randn(a.shape, generator=generator)
                skipped = step == 2 and i == 1  # a parameter without a gradient keeps its state and step
                a.grad = None if skipped else grad.clone()
                b.grad = None if skipped else grad.clone()
            torch_opt.step()
            with torch.no_grad():
                assert runner.step(mine_opt, mine_opt.param_groups) == []
    finally:
        runner.close()
    assert_same(torch_opt, theirs, mine_opt, mine)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_probes_accept_torchs_own_adam_here(kind: str) -> None:
    opt = KINDS[kind]([torch.zeros(3, requires_grad=True)])
    assert verified(opt, opt.param_groups[0], torch.float32)
    assert foreach_matches(opt, opt.param_groups[0], torch.float32)


def test_what_the_blocked_path_does_not_cover_goes_to_torch() -> None:
    def group(opt: torch.optim.Optimizer) -> dict:
        return opt.param_groups[0]

    p = [torch.zeros(3, requires_grad=True)]
    assert not covers(torch.optim.Adam(p, amsgrad=True), group(torch.optim.Adam(p, amsgrad=True)))
    assert not covers(torch.optim.Adam(p, maximize=True), group(torch.optim.Adam(p, maximize=True)))
    assert not covers(torch.optim.Adam(p, foreach=True), group(torch.optim.Adam(p, foreach=True)))
    assert not covers(torch.optim.SGD(p, lr=0.1), group(torch.optim.SGD(p, lr=0.1)))
    sgd = torch.optim.SGD(p, lr=0.1)
    assert not covers(sgd, {**group(torch.optim.Adam(p)), "params": p})  # another class, same keys


@pytest.mark.parametrize("threads", [1, 2])
def test_a_large_shard_on_threads_equals_the_workers_adamw_bit_for_bit(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over 2M parameters: the shadow's thread pool (threads=2) or torch's foreach step (threads=1)."""
    blocked_steps: list[int] = []
    step_of = AdamApply.step

    def counted(self: AdamApply, *args: object) -> list[torch.Tensor]:
        blocked_steps.append(self.threads)
        return step_of(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(AdamApply, "step", counted)
    generator = torch.Generator().manual_seed(3)
    shapes = {"emb": (1024, 1100), "w": (1000, 1001), "b": (1001,), "idle": (7,)}
    initial = {n: torch.randn(s, generator=generator) for n, s in shapes.items()}
    hyper = {"lr": 1e-3, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8, "foreach": False}
    shard = ShadowOptimizer(
        initial, OptimizerSpec("AdamW", [{**hyper, "params": list(shapes)}]), set(shapes), threads
    )
    workers = {n: t.clone().requires_grad_() for n, t in initial.items()}
    reference = torch.optim.AdamW(list(workers.values()), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    try:
        for step in range(3):
            grads = {n: torch.randn(s, generator=generator) for n, s in shapes.items()}
            for n, p in workers.items():
                p.grad = None if n == "idle" else grads[n].clone()
            reference.step()
            shard.apply(StepRecord(step, [1e-3], no_grad=frozenset({"idle"})), grads)
    finally:
        shard.close()
    # the probe's 3 steps x 2 thread counts, then the 3 steps themselves
    assert blocked_steps == ([1, 1, 1, 2, 2, 2] + [2, 2, 2] if threads == 2 else [])
    for n, p in workers.items():
        assert torch.equal(bits(p), bits(shard.parameters[n])), n
        state = reference.state.get(p, {})
        mine = shard.optimizer_state(n)
        assert list(state) == list(mine), n
        for key in state:
            assert torch.equal(bits(state[key]), bits(mine[key])), (n, key)
