"""Tied parameters (the tiny LM's head shares the input embedding's tensor).

The checkpoint holds one atom (``embed.weight``) and records the alias in its
spec (``ties``); a tied module loads it once, an untied module or a pipeline
stage that holds the head on its own gets it filled from that atom; under TP
the vocabulary-parallel embedding and the column-parallel head split the one
tensor alike (both dim 0), and a tie whose rules split it two ways is refused
naming both parameters and rules.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from checkmate.checkpoint import CheckpointReader
from checkmate.checkpoint.load import load_into
from checkmate.universal.layout import Layout, rank_holdings
from checkmate.universal.load import checkpoint_shapes, load_module, load_rank
from checkmate.universal.runs import RunJob, run_layout, write_initial
from checkmate.universal.spec import LayoutError, ReshapeRule, ReshapeSpec
from checkmate.universal.tiny import TinyConfig, TinyLM, tiny_spec

from .helpers import random_atoms, write_atoms

torch.set_num_threads(1)
TIED = TinyConfig(tied=True)


def _train(root: Path, layout: str, steps: int) -> dict[int, float]:
    write_initial(root / "init", TIED)
    job = RunJob(layout, str(root / "init"), 0, steps, save_root=str(root / "ckpt"), save_steps=[steps])
    job.config = dataclasses.asdict(TIED)
    return run_layout(job, timeout=120)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> CheckpointReader:
    root = tmp_path_factory.mktemp("tied")
    _train(root, "tp=1", 2)
    return CheckpointReader(root / "ckpt", 2)


def test_a_tied_model_saves_one_atom_and_records_the_alias(trained: CheckpointReader) -> None:
    assert "head.weight" not in trained.parameters
    assert trained.parameters["embed.weight"]["shape"] == [TIED.vocab, TIED.dim]
    assert trained.global_state["extra"]["universal"]["spec"]["ties"] == {"head.weight": "embed.weight"}
    assert trained.states_of("embed.weight") == ["exp_avg", "exp_avg_sq", "param", "step"]
    # the one loader restores the tied model as is (named_parameters holds the tensor once)
    model = TinyLM(TIED, TIED.vocab, TIED.layers)
    load_into(trained, model)
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.head.weight.detach(), trained.parameter("embed.weight"))


def test_an_untied_model_gets_both_filled_from_the_one_atom(trained: CheckpointReader) -> None:
    untied = TinyLM(dataclasses.replace(TIED, tied=False), TIED.vocab, TIED.layers)
    assert untied.head.weight is not untied.embed.weight
    optimizer = torch.optim.Adam(untied.parameters(), lr=1e-2)
    assert load_module(trained, untied, optimizer, Layout(), 0, tiny_spec(TIED)) == 2
    atom = trained.parameter("embed.weight")
    for parameter in (untied.embed.weight, untied.head.weight):
        assert torch.equal(parameter.detach(), atom)
        assert torch.equal(
            optimizer.state[parameter]["exp_avg"], trained.parameter("embed.weight", "exp_avg")
        )


def test_pipeline_stages_each_hold_their_copy_of_the_tied_tensor(trained: CheckpointReader) -> None:
    layout, spec, atom = Layout(pp=2), tiny_spec(TIED), trained.parameter("embed.weight", "exp_avg")
    first, last = load_rank(trained, layout, 0, spec), load_rank(trained, layout, 1, spec)
    assert "head.weight" not in first.params and "embed.weight" not in last.params
    assert torch.equal(first.states["embed.weight"]["exp_avg"], atom)
    assert torch.equal(last.states["head.weight"]["exp_avg"], atom)
    assert (
        rank_holdings(layout, spec, checkpoint_shapes(trained), 1).tensors["head.weight"].name
        == "embed.weight"
    )


def test_a_tie_its_rules_split_two_ways_is_refused_under_tp_naming_both(trained: CheckpointReader) -> None:
    rules = tuple(
        ReshapeRule(r"head\.weight", cat_dim=1) if r.pattern == r"head\.weight" else r
        for r in tiny_spec(TIED).rules
    )
    spec = dataclasses.replace(tiny_spec(TIED), rules=rules)
    shapes = checkpoint_shapes(trained)
    rank_holdings(Layout(tp=1), spec, shapes, 0)  # one rank holds the whole tensor: no split to disagree on
    with pytest.raises(
        LayoutError, match=r"head\.weight: tied to embed\.weight.*cat_dim=1.*cat_dim=0, vocab"
    ):
        load_rank(trained, Layout(tp=2), 0, spec)


def test_a_module_tie_the_spec_does_not_know_is_refused_naming_it(
    trained: CheckpointReader, tmp_path: Path
) -> None:
    untied_checkpoint = write_atoms(tmp_path, random_atoms())  # saved without ties: two atoms
    with pytest.raises(LayoutError, match=r"head\.weight shares its tensor with embed\.weight but the check"):
        load_module(untied_checkpoint, TinyLM(TIED, TIED.vocab, TIED.layers), None, Layout(), 0)
    # saved once without a recorded tie (a DDP job's checkpoint of a tied model): loads as it is
    atoms = {n: v for n, v in random_atoms().items() if n != "head.weight"}
    once = write_atoms(tmp_path / "once", atoms)
    tied = TinyLM(TIED, TIED.vocab, TIED.layers)
    load_module(once, tied, None, Layout(), 0)
    assert tied.head.weight is tied.embed.weight
    assert torch.equal(tied.head.weight.detach(), atoms["embed.weight"]["param"])
    untie = ReshapeSpec(tiny_spec(TIED).rules, first_stage=(r"embed\.weight",))
    with pytest.raises(LayoutError, match=r"saved with tied parameters \{'head\.weight': 'embed\.weight'\}"):
        load_module(trained, TinyLM(TIED, TIED.vocab, TIED.layers), None, Layout(), 0, untie)
    with pytest.raises(LayoutError, match="ties"):
        ReshapeSpec(ties=(("a", "b"), ("b", "c")))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["tp=1,dp=2", "dp=2,fsdp=1", "tp=2,dp=1"])
def test_a_tied_tp_by_dp_run_resumes_in_another_layout(
    tmp_path_factory: pytest.TempPathFactory, target: str
) -> None:
    root = tmp_path_factory.getbasetemp() / "tied-tp2dp2"
    if not (root / "losses.json").exists():
        root.mkdir(exist_ok=True)
        write_initial(root / "init", TIED)
        job = RunJob("tp=2,dp=2", str(root / "init"), 0, 4, save_root=str(root / "ckpt"), save_steps=[2])
        job.config = dataclasses.asdict(TIED)
        losses = run_layout(job, timeout=180)
        (root / "losses.json").write_text(repr(losses))
    source_losses = eval((root / "losses.json").read_text())  # noqa: S307 (our own repr of a dict of floats)
    resave = tmp_path_factory.mktemp("resave")
    job = RunJob(target, str(root / "ckpt"), 2, 4, resave_root=str(resave))
    job.config = dataclasses.asdict(TIED)
    losses = run_layout(job, timeout=180)
    saved, again = CheckpointReader(root / "ckpt", 2), CheckpointReader(resave, 2)
    assert saved.parameters == again.parameters and "head.weight" not in again.parameters
    for name in saved.parameters:
        for state in saved.states_of(name):
            assert torch.equal(saved.parameter(name, state), again.parameter(name, state)), f"{name}::{state}"
    for step in (3, 4):
        assert losses[step] == pytest.approx(source_losses[step], abs=1e-4)


def test_rank_files_of_a_tied_checkpoint_merge_back_into_one_atom(
    trained: CheckpointReader, tmp_path: Path
) -> None:
    from checkmate.universal import convert

    folder, _ = convert.to_rank_files(trained, tmp_path / "ranks", Layout(tp=2, pp=2))
    back = CheckpointReader(convert.from_rank_files(folder, tmp_path / "back").parent)
    assert back.parameters == trained.parameters and "head.weight" not in back.parameters
    for state in trained.states_of("embed.weight"):
        assert torch.equal(back.parameter("embed.weight", state), trained.parameter("embed.weight", state))
