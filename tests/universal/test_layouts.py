"""Every rank of every layout loads exactly its pieces, and merging the ranks gives the atoms back.

Layouts: TP 1/2/4 (fused QKV and gate/up split per part, padded vocabulary),
PP 1/2 (layer renaming), DP with plain replicas, ZeRO-1/2/3 flat partitions
(padded, parameters cut mid-row), FSDP dim-0 chunks (uneven), and mixtures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkmate.universal.box_reader import BoxReader
from checkmate.universal.convert import records_of_rank
from checkmate.universal.extract import AtomMerger
from checkmate.universal.geometry import numel
from checkmate.universal.layout import Layout, rank_holdings
from checkmate.universal.load import checkpoint_shapes, load_rank
from checkmate.universal.tiny import tiny_spec

from .helpers import CONFIG, random_atoms, write_atoms

torch.set_num_threads(1)

LAYOUTS = [
    "tp=1",
    "tp=2",
    "tp=4",
    "tp=2,dp=2",
    "tp=1,dp=3",
    "pp=2",
    "tp=2,pp=2,dp=2",
    "dp=3,zero=1",
    "dp=4,zero=2,align=4",
    "tp=2,dp=3,zero=3",
    "tp=2,pp=2,dp=2,zero=3",
    "dp=2,fsdp=1",
    "dp=3,fsdp=1",
    "tp=2,dp=3,fsdp=1",
]


@pytest.fixture(scope="module")
def atoms() -> dict[str, dict[str, torch.Tensor]]:
    return random_atoms()


@pytest.mark.parametrize("zero_style", [False, True], ids=["whole-shards", "flat-shards"])
@pytest.mark.parametrize("text", LAYOUTS)
def test_every_rank_reads_its_pieces_and_the_merge_gives_the_atoms_back(
    tmp_path: Path, atoms: dict[str, dict[str, torch.Tensor]], text: str, zero_style: bool
) -> None:
    reader = write_atoms(tmp_path / "u", atoms, zero_style=zero_style)
    layout = Layout.parse(text)
    spec = tiny_spec(CONFIG)
    shapes = checkpoint_shapes(reader)
    merger = AtomMerger(shapes, spec)
    for rank in range(layout.world_size):
        holdings = rank_holdings(layout, spec, shapes, rank)
        boxes = BoxReader(reader)
        state = load_rank(reader, layout, rank, spec, boxes)
        held = sum(numel(p.logical) for t in holdings.tensors.values() for p in t.pieces)
        flat_held = sum(numel(p.logical) for p in holdings.state_flat.pieces) if holdings.state_flat else 0
        # param + exp_avg + exp_avg_sq: each element of the rank's pieces once, plus one step per parameter
        if layout.zero == 3:
            expected = 3 * flat_held
        elif layout.zero:
            expected = held + 2 * flat_held
        else:
            expected = 3 * held
        assert boxes.elements_read == expected + len(holdings.tensors), f"rank {rank} read other bytes"
        merger.add_all(records_of_rank(holdings, state))
    merged = merger.atoms()
    for name, states in atoms.items():
        for key, value in states.items():
            assert torch.equal(merged[name][key], value), f"{text}: {name}::{key}"


def test_tp_rank_holds_its_part_of_each_fused_sub_parameter(tmp_path: Path) -> None:
    atoms = random_atoms(1)
    reader = write_atoms(tmp_path / "u", atoms)
    d, f = CONFIG.dim, CONFIG.ffn
    for rank in range(2):
        state = load_rank(reader, Layout(tp=2), rank)
        qkv = atoms["layers.1.attn.qkv.weight"]["exp_avg"]
        half = d // 2
        want = torch.cat([qkv[i * d + rank * half : i * d + (rank + 1) * half] for i in range(3)])
        assert torch.equal(state.states["layers.1.attn.qkv.weight"]["exp_avg"], want)
        gate_up = atoms["layers.0.mlp.gate_up.weight"]["param"]
        half_f = f // 2
        want = torch.cat([gate_up[i * f + rank * half_f : i * f + (rank + 1) * half_f] for i in range(2)])
        assert torch.equal(state.params["layers.0.mlp.gate_up.weight"], want)
        down = atoms["layers.0.mlp.down.weight"]["param"]
        assert torch.equal(
            state.params["layers.0.mlp.down.weight"], down[:, rank * half_f : (rank + 1) * half_f]
        )


def test_vocabulary_is_padded_with_zero_rows_and_trimmed_back(tmp_path: Path) -> None:
    atoms = random_atoms(2)
    reader = write_atoms(tmp_path / "u", atoms)
    assert CONFIG.vocab == 49
    embed = atoms["embed.weight"]["param"]
    last = load_rank(reader, Layout(tp=2), 1).params["embed.weight"]
    assert last.shape == (25, CONFIG.dim)  # 49 padded to 50, 25 rows per rank
    assert torch.equal(last[:24], embed[25:])
    assert torch.equal(last[24], torch.zeros(CONFIG.dim))


def test_pipeline_stage_renames_layers(tmp_path: Path) -> None:
    atoms = random_atoms(3)
    reader = write_atoms(tmp_path / "u", atoms)
    first, last = (load_rank(reader, Layout(pp=2), r) for r in range(2))
    assert "embed.weight" in first.params and "head.weight" not in first.params
    assert "head.weight" in last.params and "embed.weight" not in last.params
    assert torch.equal(last.params["layers.0.attn.out.weight"], atoms["layers.1.attn.out.weight"]["param"])
    assert torch.equal(first.params["layers.0.attn.out.weight"], atoms["layers.0.attn.out.weight"]["param"])


def test_zero_partitions_are_padded_to_equal_sizes(tmp_path: Path) -> None:
    reader = write_atoms(tmp_path / "u", random_atoms(4))
    total = sum(t.numel() for t in (reader.parameter(n) for n in reader.parameters))
    sizes = [load_rank(reader, Layout(dp=4, zero=3, align=8), r).param_flat.numel() for r in range(4)]
    assert len(set(sizes)) == 1 and sizes[0] * 4 >= total and sizes[0] * 4 - total < 32
    last = load_rank(reader, Layout(dp=4, zero=3, align=8), 3).param_flat
    padding = sizes[0] * 4 - total
    if padding:
        assert torch.equal(last[-padding:], torch.zeros(padding))
