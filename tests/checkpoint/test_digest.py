"""The one optimizer-state digest: a ``step`` difference changes it, a layout-only difference does not."""

from __future__ import annotations

import torch

from checkmate.checkpoint.digest import optimizer_digest, parameters_digest, state_digests


def _adam_state(step: object) -> dict[str, dict[str, object]]:
    return {
        "w": {"step": step, "exp_avg": torch.tensor([[1.0, 2.0], [3.0, 4.0]])},
        "b": {"step": step, "exp_avg": torch.tensor([0.5, -0.5])},
    }


def test_a_step_difference_changes_the_digest() -> None:
    assert optimizer_digest(_adam_state(torch.tensor(5.0))) != optimizer_digest(
        _adam_state(torch.tensor(6.0))
    )
    one_param_ahead = _adam_state(torch.tensor(5.0))
    one_param_ahead["b"]["step"] = torch.tensor(6.0)
    assert optimizer_digest(one_param_ahead) != optimizer_digest(_adam_state(torch.tensor(5.0)))


def test_a_layout_only_difference_does_not() -> None:
    reference = optimizer_digest(_adam_state(torch.tensor(5.0)))
    # the step counter in other forms: a number, another dtype, a 1-element tensor
    for step in (5, 5.0, torch.tensor(5.0, dtype=torch.float64), torch.tensor(5), torch.tensor([5.0])):
        assert optimizer_digest(_adam_state(step)) == reference, step
    # the moments in another memory layout (non-contiguous view), and the mappings in another order
    state = _adam_state(torch.tensor(5.0))
    state["w"]["exp_avg"] = torch.tensor([[1.0, 3.0], [2.0, 4.0]]).t()
    assert not state["w"]["exp_avg"].is_contiguous()  # type: ignore[union-attr]
    reordered = {"b": dict(reversed(list(state["b"].items()))), "w": state["w"]}
    assert optimizer_digest(reordered) == reference


def test_every_bit_of_a_moment_counts() -> None:
    reference = optimizer_digest(_adam_state(torch.tensor(5.0)))
    state = _adam_state(torch.tensor(5.0))
    moment = state["b"]["exp_avg"]
    assert isinstance(moment, torch.Tensor)
    state["b"]["exp_avg"] = torch.nextafter(moment, torch.tensor(1.0))
    assert optimizer_digest(state) != reference
    state = _adam_state(torch.tensor(5.0))
    state["b"]["exp_avg"] = moment.to(torch.float64)  # same values, another dtype: another state
    assert optimizer_digest(state) != reference
    state = _adam_state(torch.tensor(5.0))
    state["b"]["exp_avg_sq"] = torch.zeros(2)
    assert optimizer_digest(state) != reference


def test_a_real_optimizer_and_its_restored_copy_agree() -> None:
    """AdamW keeps ``step`` as a float32 tensor; the same state with ``step`` as a number digests the same."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    live = {names[id(p)]: dict(s) for p, s in optimizer.state.items()}
    as_numbers = {n: {k: (v.item() if k == "step" else v) for k, v in s.items()} for n, s in live.items()}
    assert all(isinstance(s["step"], torch.Tensor) for s in live.values())
    assert optimizer_digest(as_numbers) == optimizer_digest(live)
    params = dict(model.named_parameters())
    assert state_digests(params, live) == (parameters_digest(params), optimizer_digest(live))


def test_parameter_digests_see_every_bit() -> None:
    a = {"w": torch.tensor([1.0, 2.0])}
    b = {"w": torch.tensor([1.0, torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)).item()])}
    assert parameters_digest(a) == parameters_digest({"w": torch.tensor([1.0, 2.0])})
    assert parameters_digest(a) == parameters_digest([("w", torch.tensor([1.0, 2.0]))])
    assert parameters_digest(a) != parameters_digest(b)
    assert parameters_digest(a) != parameters_digest({"v": torch.tensor([1.0, 2.0])})
