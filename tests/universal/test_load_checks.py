"""The universal loader applies the one loader's optimizer checks (checkmate.checkpoint.load).

Kind, number of param groups and which parameters each group holds are
checked by :func:`checkmate.checkpoint.load.optimizer_groups` for a DDP
restore and for every parallel layout alike, before any tensor is copied.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkmate.checkpoint import CheckpointError
from checkmate.universal.layout import Layout
from checkmate.universal.load import load_module
from checkmate.universal.tiny import TinyLM

from .helpers import CONFIG, random_atoms, write_atoms

torch.set_num_threads(1)


def _model() -> TinyLM:
    return TinyLM(CONFIG, CONFIG.vocab, CONFIG.layers)


def test_a_loaded_layout_gets_the_saved_hyperparameters(tmp_path: Path) -> None:
    reader = write_atoms(tmp_path, random_atoms())
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.5, betas=(0.1, 0.2))
    assert load_module(reader, model, optimizer, Layout(), 0) == 7
    assert optimizer.param_groups[0]["lr"] == 0.01
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
            "the state holds Adam state, the optimizer is SGD",
        ),
        (
            lambda m: torch.optim.Adam(
                [
                    {"params": [m.head.weight]},
                    {"params": [p for n, p in m.named_parameters() if n != "head.weight"]},
                ]
            ),
            "the state has 1 param groups, the optimizer 2",
        ),
        (
            lambda m: torch.optim.Adam([p for n, p in m.named_parameters() if n != "head.weight"]),
            "param group 0 holds other parameters than the state's",
        ),
    ],
    ids=["kind", "group-count", "group-members"],
)
def test_an_optimizer_that_does_not_fit_is_refused_before_anything_is_copied(
    tmp_path: Path, make: object, message: str
) -> None:
    reader = write_atoms(tmp_path, random_atoms())
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = make(model)  # type: ignore[operator]
    with pytest.raises(CheckpointError, match=message):
        load_module(reader, model, optimizer, Layout(), 0)
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.detach(), before[name]), f"{name} was copied before the check"
    assert not optimizer.state
