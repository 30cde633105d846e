"""The live model is the description (issue 30, deliverables 1 and 2).

Real 2-rank gloo jobs (forked, one thread each) save and load through the
public API with no ``Layout``, rank or shapes where the tensors can say them:

* a TP=2 model on a mesh whose dimensions are *not* named ``tp`` saves, and the
  universal atoms equal the whole parameters element for element; a rule whose
  ``cat_dim`` contradicts a placement is refused there too (it was checked only
  for a mesh dimension named ``"tp"``);
* a ``Layout`` that contradicts the live DTensors (TP=2 model, ``Layout(dp=2)``)
  is refused naming the parameter, for save and for load (it was silently
  shuffled);
* a fused-looking parameter (``qkv``) under TP without ``parts`` is refused with
  the fix in the message (it was stored rank-interleaved);
* an FSDP2 module describes itself (``fsdp=1``), and ``global.json`` records
  how the checkpoint was made: degrees, mesh dimensions, the spec and its hash.

And without ranks: a spec with ``head_dim`` refuses a TP degree that splits
heads (``plan --layout tp=8`` of a 4-head model said it fits).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkmate import checkpoint as fmt
from checkmate.checkpoint import CheckpointReader
from checkmate.checkpoint.cli import main
from checkmate.universal.layout import Layout, rank_holdings
from checkmate.universal.load import checkpoint_shapes, load_module
from checkmate.universal.runs import write_initial
from checkmate.universal.save import save_universal
from checkmate.universal.spec import LayoutError, ReshapeRule, ReshapeSpec
from checkmate.universal.tiny import TinyLM, logical_shapes, tiny_spec

from .helpers import CONFIG, random_atoms, write_atoms

torch.set_num_threads(1)


def _tp_model(names: tuple[str, str], plan_parts: bool = True) -> TinyLM:
    """TinyLM under TP=2 on a (1, 2) mesh named ``names`` (qkv/gate_up column-, out/down row-parallel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = TinyLM(CONFIG, 50, CONFIG.layers)  # vocabulary padded to 50 for TP=2
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=names)
    plan: dict[str, Any] = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(CONFIG.layers):
        plan.update(
            {
                f"layers.{i}.attn.qkv": ColwiseParallel(),
                f"layers.{i}.attn.out": RowwiseParallel(),
                f"layers.{i}.mlp.gate_up": ColwiseParallel(),
                f"layers.{i}.mlp.down": RowwiseParallel(),
            }
        )
    parallelize_module(model, mesh[names[1]], plan)
    return model


def _expect(error: type[BaseException], match: str, call: Any) -> None:
    with pytest.raises(error, match=match):
        call()


def _ranks(rank: int, folder: str) -> None:
    torch.set_num_threads(1)
    root = Path(folder)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{root / 'store'}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        spec, shapes = tiny_spec(CONFIG), logical_shapes(CONFIG)
        initial = fmt.CheckpointReader(root / "initial")
        model = _tp_model(("data", "model"))
        optimizer = torch.optim.Adam(model.parameters())
        assert load_module(initial, model, optimizer) == 0  # no layout, no rank: the DTensors say them
        vocab = {n: s for n, s in shapes.items() if n in ("embed.weight", "head.weight")}
        save_universal(root / "saved", 1, model, None, spec=spec, shapes={**shapes, **vocab})

        # a Layout contradicting the live DTensors, for save and load
        _expect(
            LayoutError,
            r"the live tensor says TP degree 2 \(mesh \{'model': 2\}\), the layout tp=1",
            lambda: save_universal(root / "never", 1, model, None, Layout(dp=2), spec, shapes),
        )
        _expect(
            LayoutError,
            r"the live tensor says TP degree 2",
            lambda: load_module(initial, model, None, Layout(dp=2), rank),
        )
        # a rule whose cat_dim contradicts the placement, on a mesh not named "tp"
        wrong = ReshapeSpec(
            tuple(
                ReshapeRule(r.pattern, 0, r.parts, r.vocab, r.average, r.head_dim)
                if "out" in r.pattern
                else r
                for r in spec.rules
            ),
            first_stage=spec.first_stage,
        )
        _expect(
            LayoutError,
            r"layers\.0\.attn\.out\.weight: tensor parallelism shards dim 1 \(Shard\(1\) on mesh "
            r"\{'model': 2\}\) but rule\(.*cat_dim=0.*fix the spec",
            lambda: save_universal(root / "never", 1, model, None, spec=wrong, shapes=shapes),
        )
        # a fused-looking parameter without parts
        unfused = ReshapeSpec(
            tuple(ReshapeRule(r.pattern, r.cat_dim, None, r.vocab, r.average) for r in spec.rules),
            first_stage=spec.first_stage,
        )
        _expect(
            LayoutError,
            r"layers\.0\.attn\.qkv\.bias: looks fused \('qkv'\) and tensor parallelism \(degree 2\) splits "
            r"dim 0, but rule\(.*\) has no 'parts'.*Fix: give its rule the sub-parameter sizes",
            lambda: save_universal(root / "never", 1, model, None, spec=unfused, shapes=shapes),
        )
        _expect(
            LayoutError,
            r"embed\.weight: .*pads the vocabulary.*pass shapes=",
            lambda: save_universal(root / "never", 1, model, None, spec=spec),
        )

        # FSDP2 describes itself
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        sharded = TinyLM(CONFIG, CONFIG.vocab, CONFIG.layers)
        dp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("replicas",))
        for block in sharded.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(sharded, mesh=dp_mesh)
        adam = torch.optim.Adam(sharded.parameters())
        load_module(fmt.CheckpointReader(root / "moments"), sharded, adam)
        _expect(
            LayoutError,
            r"the live tensor says FSDP2-sharded, the layout has no fsdp=1",
            lambda: load_module(fmt.CheckpointReader(root / "moments"), sharded, adam, Layout(dp=2), rank),
        )
        save_universal(root / "fsdp", 3, sharded, adam, spec=spec, shapes=shapes)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("live")
    write_initial(root / "initial", CONFIG)
    atoms = random_atoms(3)
    write_atoms(root / "moments", atoms, step=3)
    context = mp.start_processes(_ranks, args=(str(root),), nprocs=2, join=False, start_method="fork")
    while not context.join(timeout=120):
        pass
    os.environ.pop("MASTER_ADDR", None)
    return root, atoms


def test_a_tp_model_on_any_mesh_names_saves_without_layout_or_rank(two_rank_run: tuple[Path, dict]) -> None:
    root, _ = two_rank_run
    initial, saved = CheckpointReader(root / "initial"), CheckpointReader(root / "saved")
    assert set(saved.parameters) == set(initial.parameters)
    for name in initial.parameters:
        assert torch.equal(saved.parameter(name), initial.parameter(name)), name
    universal = saved.global_state["extra"]["universal"]
    assert universal["source_layout"] == "tp=2,pp=1,dp=1"
    assert (universal["tp"], universal["dp"], universal["fsdp"]) == (2, 1, False)
    assert universal["mesh"] == {"model": 2}
    assert universal["spec_sha256"] == tiny_spec(CONFIG).to_hash()
    assert not (root / "never").exists() or fmt.complete_steps(root / "never") == []


def test_fsdp2_describes_itself_and_is_recorded(two_rank_run: tuple[Path, dict]) -> None:
    root, atoms = two_rank_run
    saved = CheckpointReader(root / "fsdp")
    universal = saved.global_state["extra"]["universal"]
    assert universal["source_layout"] == "tp=1,pp=1,dp=2,fsdp=1"
    assert universal["mesh"] == {"replicas": 2}
    for name, states in atoms.items():
        for state, value in states.items():
            assert torch.equal(saved.parameter(name, state), value), f"{name}::{state}"


def test_plan_refuses_a_tp_degree_that_splits_attention_heads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_atoms(tmp_path, random_atoms())
    assert main(["plan", str(tmp_path), "--layout", "tp=4"]) == 0
    capsys.readouterr()
    assert main(["plan", str(tmp_path), "--layout", "tp=8"]) == 1
    err = capsys.readouterr().err
    assert "TP degree 8 does not divide its 4 heads of 4" in err, err
    assert "head_dim=4" in err


def test_a_fused_looking_rule_without_parts_is_refused_for_a_tp_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reader = write_atoms(tmp_path, random_atoms())
    document = json.loads((reader.directory / "global.json").read_text())
    for rule in document["extra"]["universal"]["spec"]["rules"]:
        rule.pop("parts", None)  # a checkpoint whose writer forgot the fused parts
    (reader.directory / "global.json").write_text(json.dumps(document))
    assert main(["plan", str(tmp_path), "--layout", "tp=2"]) == 1
    err = capsys.readouterr().err
    assert "layers.0.attn.qkv.bias: looks fused ('qkv') and tensor parallelism (degree 2) splits dim 0" in err
    assert "Fix: give its rule the sub-parameter sizes" in err
    assert main(["plan", str(tmp_path), "--layout", "dp=2"]) == 0  # TP=1 splits nothing: no interleaving
    one_matrix = ReshapeSpec((ReshapeRule(r"layers\.\d+\.attn\.qkv\.(weight|bias)", 0, (48,)),))
    shapes = checkpoint_shapes(CheckpointReader(tmp_path))
    assert rank_holdings(Layout(tp=2), one_matrix, shapes, 1).tensors  # "parts": [<size>]: one matrix
