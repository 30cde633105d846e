"""checkmate-ckpt plan / convert --to ranks / reshard --layout / import, and bad input:
a layout that cannot hold the checkpoint is refused naming the parameter and the rule, before
anything is written; an interrupted conversion or save leaves nothing that reads as complete."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from checkmate import checkpoint as fmt
from checkmate.checkpoint import CheckpointReader
from checkmate.checkpoint.cli import main
from checkmate.universal import convert
from checkmate.universal.layout import Layout, rank_holdings
from checkmate.universal.load import checkpoint_shapes, load_module
from checkmate.universal.save import save_universal
from checkmate.universal.spec import LayoutError, ReshapeSpec
from checkmate.universal.tiny import TinyLM, logical_shapes, tiny_spec

from .helpers import CONFIG, assert_atoms_equal, random_atoms, write_atoms

torch.set_num_threads(1)


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    atoms = random_atoms(9)
    write_atoms(tmp_path / "u", atoms, shards=3)
    return tmp_path / "u", atoms


def test_plan_shows_each_ranks_share(saved: tuple[Path, dict], capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = saved
    assert main(["plan", str(root), "--layout", "tp=2,pp=2,dp=2,zero=1", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert len(document["ranks"]) == 8
    assert document["ranks"][5]["coords"] == {"pp": 1, "dp": 0, "tp": 1}
    assert all(r["flat_state_elements"] for r in document["ranks"])


def test_convert_to_rank_files_and_import_them_back(saved: tuple[Path, dict], tmp_path: Path) -> None:
    root, atoms = saved
    assert (
        main(
            ["convert", str(root), "--to", "ranks", "--layout", "tp=2,dp=2,zero=3", "-o", str(tmp_path / "r")]
        )
        == 0
    )
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["layout.json"] + [
        f"rank-{r:05d}.{ext}" for r in range(4) for ext in ("json", "safetensors")
    ]
    assert main(["import", "ranks", str(tmp_path / "r"), "-o", str(tmp_path / "back"), "--shards", "2"]) == 0
    back = CheckpointReader(tmp_path / "back")
    assert_atoms_equal(back, atoms)
    assert back.global_state["extra"]["universal"]["source_layout"] == "tp=2,pp=1,dp=2,zero=3"
    assert main(["verify", str(tmp_path / "back")]) == 0


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (
            "tp=3",
            "layers.0.attn.out.weight: TP degree 3 does not divide its dim 1 (size 16) "
            r"(rule(pattern 'layers\.\d+\.attn\.out\.weight', cat_dim=1, head_dim=4))",
        ),
        ("pp=3", "pipeline: 3 stages do not divide the 2 layers"),
        ("tp=2,zero=5", "zero must be 0, 1, 2 or 3"),
        ("tp=two", "tp needs an integer"),
    ],
)
def test_a_layout_that_cannot_hold_the_checkpoint_is_refused_before_writing(
    saved: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str, message: str
) -> None:
    root, _ = saved
    out = tmp_path / "never"
    assert main(["reshard", str(root), "--layout", layout, "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert message in err, err
    assert not out.exists() and not list(tmp_path.glob(".never*"))


def test_a_spec_without_the_saved_sub_parameter_rule_is_refused(
    saved: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = saved
    document = tiny_spec(CONFIG).to_json()
    for rule in document["rules"]:
        rule.pop("parts", None)  # forgot the fused QKV / gate-up parts
    (tmp_path / "spec.json").write_text(json.dumps(document))
    args = ["convert", str(root), "--to", "ranks", "--layout", "tp=2", "--spec", str(tmp_path / "spec.json")]
    assert main([*args, "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "layers.0.attn.qkv.bias: saved with sub-parameter rule" in err and "parts=[16, 16, 16]" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"rules": [{"pattern": "a", "parts": [2, 2]}]}, "parts and vocab need a cat_dim"),
        ({"rules": [{"pattern": "(", "cat_dim": 0}]}, "is not a regex"),
        ({"rules": [{"pattern": "a", "cat_dim": 0, "colour": 1}]}, "unknown keys"),
        ({"rules": [{"pattern": "a", "cat_dim": 0, "parts": [0]}]}, "parts must list positive sizes"),
        ({"rules": [], "layer_pattern": "layers"}, "needs one group"),
        ([1, 2], "expected an object"),
    ],
)
def test_bad_spec_files_are_refused(tmp_path: Path, document: object, message: str) -> None:
    (tmp_path / "spec.json").write_text(json.dumps(document))
    with pytest.raises(LayoutError, match=message):
        ReshapeSpec.load(tmp_path / "spec.json")


def test_a_vocabulary_smaller_than_the_saved_one_is_refused(saved: tuple[Path, dict]) -> None:
    root, _ = saved
    reader = CheckpointReader(root)
    with pytest.raises(LayoutError, match=r"embed\.weight: .*48 rows, smaller than the saved 49"):
        rank_holdings(
            Layout(), tiny_spec(CONFIG), checkpoint_shapes(reader), 0, {"embed.weight": (48, CONFIG.dim)}
        )
    model = TinyLM(CONFIG, 48, CONFIG.layers)
    with pytest.raises(LayoutError, match="smaller than the saved 49"):
        load_module(reader, model, None, Layout(), 0)


def test_a_larger_padded_vocabulary_loads_with_zero_rows(saved: tuple[Path, dict]) -> None:
    root, atoms = saved
    model = TinyLM(CONFIG, 64, CONFIG.layers)
    optimizer = torch.optim.Adam(model.parameters())
    load_module(CheckpointReader(root), model, optimizer, Layout(), 0)
    assert torch.equal(model.head.weight.detach()[:49], atoms["head.weight"]["param"])
    assert torch.equal(model.head.weight.detach()[49:], torch.zeros(15, CONFIG.dim))
    assert torch.equal(optimizer.state[model.head.weight]["exp_avg"][:49], atoms["head.weight"]["exp_avg"])


def test_an_interrupted_conversion_leaves_the_source_intact_and_no_output(
    saved: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, atoms = saved
    calls = []

    def failing(folder: Path, rank: int, records: list) -> Path:
        calls.append(rank)
        if rank == 2:
            raise OSError("disk full")
        return original(folder, rank, records)

    original = convert.write_rank_file
    monkeypatch.setattr(convert, "write_rank_file", failing)
    with pytest.raises(OSError, match="disk full"):
        convert.to_rank_files(CheckpointReader(root), tmp_path / "out", Layout(tp=2, dp=2))
    assert calls == [0, 1, 2]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))
    assert_atoms_equal(CheckpointReader(root), atoms)


def test_rank_files_without_their_layout_file_are_refused(saved: tuple[Path, dict], tmp_path: Path) -> None:
    root, _ = saved
    convert.to_rank_files(CheckpointReader(root), tmp_path / "r", Layout(dp=2))
    (tmp_path / "r" / "layout.json").unlink()
    with pytest.raises(LayoutError, match="no layout.json; the rank files are incomplete"):
        convert.from_rank_files(tmp_path / "r", tmp_path / "u2")
    assert not (tmp_path / "u2").exists()


def test_rank_files_missing_a_rank_are_refused_naming_it(saved: tuple[Path, dict], tmp_path: Path) -> None:
    root, _ = saved
    convert.to_rank_files(CheckpointReader(root), tmp_path / "r", Layout(tp=2))
    (tmp_path / "r" / "rank-00001.json").unlink()
    with pytest.raises(LayoutError, match="rank 1's manifest rank-00001.json is missing"):
        convert.from_rank_files(tmp_path / "r", tmp_path / "u2")


def test_a_save_interrupted_before_global_json_is_not_a_complete_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        model = TinyLM(CONFIG, CONFIG.vocab, CONFIG.layers)
        spec, shapes = tiny_spec(CONFIG), logical_shapes(CONFIG)
        save_universal(tmp_path / "u", 1, model, None, Layout(), spec, shapes)

        def crash(*args: object, **kwargs: object) -> None:
            raise OSError("killed")

        monkeypatch.setattr(fmt, "write_global", crash)
        with pytest.raises(OSError, match="killed"):
            save_universal(tmp_path / "u", 2, model, None, Layout(), spec, shapes)
    finally:
        dist.destroy_process_group()
    assert fmt.complete_steps(tmp_path / "u") == [1]
    assert fmt.read_latest(tmp_path / "u") == 1
    assert CheckpointReader(tmp_path / "u").step == 1


def test_job_state_travels_through_rank_files(saved: tuple[Path, dict], tmp_path: Path) -> None:
    from checkmate.job_state import JobState

    root, atoms = saved
    reader = CheckpointReader(root)
    job_state = JobState(
        {
            "buffers": {"rope.cache": {"__tensor__": "b0"}},
            "stateful": {"scheduler": {"last_epoch": 7}},
            "param_groups": [],
        },
        {"b0": torch.arange(6.0)},
    )
    parameters = {n: (m["shape"], m["dtype"]) for n, m in reader.parameters.items()}
    g = reader.global_state
    fmt.write_global(root, reader.step, parameters, g["optimizer"], g["extra"], job_state=job_state)
    convert.to_rank_files(CheckpointReader(root), tmp_path / "r", Layout(tp=2))
    convert.from_rank_files(tmp_path / "r", tmp_path / "back")
    back = CheckpointReader(tmp_path / "back")
    assert back.job_state() is not None and back.job_state().equals(job_state)
    assert_atoms_equal(back, atoms)


def test_a_tp_sharded_dtensor_whose_rule_disagrees_is_refused_naming_it(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        model = TinyLM(CONFIG, CONFIG.vocab, CONFIG.layers)
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"layers.0.mlp.down": ColwiseParallel()})  # shards dim 0
        spec, shapes = tiny_spec(CONFIG), logical_shapes(CONFIG)
        with pytest.raises(
            LayoutError, match=r"layers\.0\.mlp\.down\.weight: tensor parallelism shards dim 0"
        ):
            save_universal(tmp_path / "u", 1, model, None, Layout(), spec, shapes)
    finally:
        dist.destroy_process_group()
    assert fmt.complete_steps(tmp_path / "u") == []
