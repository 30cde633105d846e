"""DeepSpeed universal export/import (checked with DeepSpeed's own loader where it is installed)
and torch DCP import of real TP and FSDP2 runs."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from checkmate.checkpoint import CheckpointError, CheckpointReader
from checkmate.checkpoint.export import export_deepspeed_universal
from checkmate.universal.interop import import_dcp, import_deepspeed_universal
from checkmate.universal.layout import Layout
from checkmate.universal.load import load_rank
from checkmate.universal.runs import RunJob, run_layout, write_initial
from checkmate.universal.spec import LayoutError
from checkmate.universal.tiny import TinyConfig, tiny_spec

from .helpers import CONFIG, assert_atoms_equal, random_atoms, write_atoms

torch.set_num_threads(1)


def test_deepspeed_export_carries_the_reslicing_keys(tmp_path: Path) -> None:
    reader = write_atoms(tmp_path / "u", random_atoms(5))
    folder = export_deepspeed_universal(reader, tmp_path / "ds")
    qkv = torch.load(folder / "zero" / "layers.0.attn.qkv.weight" / "exp_avg.pt", weights_only=True)
    assert qkv["cat_dim"] == 0 and qkv["param_n_sub_params"] == 3
    embed = torch.load(folder / "zero" / "embed.weight" / "fp32.pt", weights_only=True)
    assert embed["vocab_tensor"] is True and embed["param"].shape == (49, CONFIG.dim)
    down = torch.load(folder / "zero" / "layers.1.mlp.down.weight" / "fp32.pt", weights_only=True)
    assert down["cat_dim"] == 1 and "param_n_sub_params" not in down
    norm = torch.load(folder / "zero" / "norm.weight" / "fp32.pt", weights_only=True)
    assert set(norm) == {"param"}


def test_deepspeed_export_imports_back_with_its_rules(tmp_path: Path) -> None:
    atoms = random_atoms(6)
    reader = write_atoms(tmp_path / "u", atoms)
    folder = export_deepspeed_universal(reader, tmp_path / "ds")
    imported = CheckpointReader(import_deepspeed_universal(folder, tmp_path / "back", num_shards=2).parent)
    assert_atoms_equal(imported, atoms)
    # the rules came back from DeepSpeed's keys: TP=2 slices equal those of the original spec
    for rank in range(2):
        mine, theirs = load_rank(reader, Layout(tp=2), rank), load_rank(imported, Layout(tp=2), rank)
        for name, value in mine.params.items():
            assert torch.equal(theirs.params[name], value), name


def test_deepspeed_import_refuses_a_folder_without_zero(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no zero/ folder"):
        import_deepspeed_universal(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.deepspeed
@pytest.mark.parametrize("tp", [1, 2])
def test_deepspeeds_own_loader_reads_our_export(tmp_path: Path, tp: int) -> None:
    universal_checkpoint = pytest.importorskip("deepspeed.checkpoint.universal_checkpoint")
    reader = write_atoms(tmp_path / "u", random_atoms(7))
    folder = export_deepspeed_universal(reader, tmp_path / "ds")
    for rank in range(tp):
        ours = load_rank(reader, Layout(tp=tp), rank)
        for name, value in ours.params.items():
            # DeepSpeed's loader is a method of a ZeRO parameter with an _hp_mapping; give it one
            parameter = torch.empty(value.shape)
            destination = torch.empty(value.numel())
            parameter._hp_mapping = types.SimpleNamespace(  # type: ignore[attr-defined]
                lp_fragment_address=types.SimpleNamespace(start=0, numel=value.numel()),
                get_hp_fragment=lambda d=destination: d,
                optim_fragment={},
            )
            universal_checkpoint.load_hp_checkpoint_state(parameter, str(folder / "zero" / name), rank, tp)
            assert torch.equal(destination, value.reshape(-1)), f"tp={tp} rank {rank} {name}"
            fragments = parameter._hp_mapping.optim_fragment  # type: ignore[attr-defined]
            for state in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(fragments[state], ours.states[name][state].reshape(-1)), (name, state)


@pytest.mark.parametrize("layout", ["tp=2,dp=1", "dp=2,fsdp=1"])
def test_dcp_checkpoint_of_a_real_run_imports_element_for_element(tmp_path: Path, layout: str) -> None:
    config = TinyConfig()
    write_initial(tmp_path / "init", config)
    run_layout(
        RunJob(
            layout,
            str(tmp_path / "init"),
            0,
            2,
            save_root=str(tmp_path / "universal"),
            dcp_root=str(tmp_path / "dcp"),
            save_steps=[2],
        ),
        timeout=120,
    )
    tp = Layout.parse(layout).tp
    imported = import_dcp(
        tmp_path / "dcp" / "step-2", tmp_path / "imported", tiny_spec(config), tp, config.vocab
    )
    ours, theirs = CheckpointReader(tmp_path / "universal", 2), CheckpointReader(imported.parent)
    assert theirs.step == 2
    assert ours.parameters == theirs.parameters
    for name in ours.parameters:
        for state in ours.states_of(name):
            assert torch.equal(ours.parameter(name, state), theirs.parameter(name, state)), (name, state)


def test_dcp_import_with_a_tp_degree_its_rules_cannot_split_fails_before_writing(tmp_path: Path) -> None:
    from checkmate.checkpoint.export import export_dcp

    reader = write_atoms(tmp_path / "u", random_atoms(8))
    export_dcp(reader, tmp_path / "dcp")
    (tmp_path / "dcp" / "checkmate-layout.json").unlink()  # no record: the degree given is taken as is
    with pytest.raises(LayoutError, match="qkv.*TP degree 5 does not divide"):
        import_dcp(tmp_path / "dcp", tmp_path / "out", tiny_spec(CONFIG), tp=5)
    assert not (tmp_path / "out").exists()


def test_deepspeed_export_refuses_unequal_fused_parts_before_writing(tmp_path: Path) -> None:
    atoms = random_atoms(10)
    reader = write_atoms(tmp_path / "u", atoms)
    spec = tiny_spec(CONFIG).to_json()
    for rule in spec["rules"]:
        if "qkv" in rule["pattern"]:
            rule["parts"] = [16, 8, 24]  # grouped-query attention: q, k, v of different sizes
    reader.global_state["extra"]["universal"]["spec"] = spec
    with pytest.raises(
        LayoutError, match=r"layers\.0\.attn\.qkv\.bias: .*param_n_sub_params needs equal parts"
    ):
        export_deepspeed_universal(reader, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()
