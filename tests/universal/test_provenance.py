"""Checkpoints record how they were made, and a disagreeing import or load is refused (issue 30, part 2).

DCP records neither the TP degree that saved it nor the spec: ``import dcp``
without ``--tp`` used to import with degree 1 (exit 0, a TP=2 qkv interleaved).
Now a DCP folder carries ``checkmate-layout.json`` when written through us
(``convert --to dcp``, ``record_dcp_layout``), its record wins and a
contradicting ``--tp`` / ``--spec`` is refused; without a record ``--tp`` is
required, and a fused-looking parameter under ``--tp`` > 1 needs ``parts``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkmate.checkpoint import CheckpointReader
from checkmate.checkpoint.cli import main
from checkmate.universal import Layout, LayoutError, ReshapeRule, ReshapeSpec, load_module
from checkmate.universal.tiny import TinyLM, tiny_spec

from .helpers import CONFIG, assert_atoms_equal, random_atoms, write_atoms

torch.set_num_threads(1)


@pytest.fixture()
def exported(tmp_path: Path) -> tuple[Path, dict]:
    atoms = random_atoms(4)
    reader = write_atoms(tmp_path / "u", atoms)
    assert main(["convert", str(tmp_path / "u"), "--to", "dcp", "-o", str(tmp_path / "dcp")]) == 0
    assert reader.step == 7
    return tmp_path / "dcp", atoms


def test_a_recorded_dcp_imports_without_flags_and_records_its_provenance(
    exported: tuple[Path, dict], tmp_path: Path
) -> None:
    dcp_dir, atoms = exported
    record = json.loads((dcp_dir / "checkmate-layout.json").read_text())
    assert (record["tp"], record["spec_sha256"]) == (1, tiny_spec(CONFIG).to_hash())
    assert main(["import", "dcp", str(dcp_dir), "-o", str(tmp_path / "back")]) == 0
    back = CheckpointReader(tmp_path / "back")
    assert_atoms_equal(back, atoms)
    universal = back.global_state["extra"]["universal"]
    assert universal["tp"] == 1 and universal["spec_sha256"] == tiny_spec(CONFIG).to_hash()
    assert universal["source_layout"] == "dcp,tp=1,pp=1,dp=1"


def test_an_import_whose_tp_or_spec_disagrees_with_the_record_is_refused(
    exported: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dcp_dir, _ = exported
    assert main(["import", "dcp", str(dcp_dir), "-o", str(tmp_path / "o"), "--tp", "2"]) == 1
    assert "--tp 2, but the job that saved it recorded tp=1" in capsys.readouterr().err
    other = tiny_spec(CONFIG).to_json()
    other["rules"] = other["rules"][:2]
    (tmp_path / "spec.json").write_text(json.dumps(other))
    assert (
        main(
            ["import", "dcp", str(dcp_dir), "-o", str(tmp_path / "o"), "--spec", str(tmp_path / "spec.json")]
        )
        == 1
    )
    assert "is not the one the job saved with" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_unrecorded_dcp_needs_the_degree_and_a_fused_rule(
    exported: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dcp_dir, atoms = exported
    (dcp_dir / "checkmate-layout.json").unlink()
    assert main(["import", "dcp", str(dcp_dir), "-o", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "does not record the TP degree that saved it" in err and "pass --tp N" in err
    assert main(["import", "dcp", str(dcp_dir), "-o", str(tmp_path / "o"), "--tp", "2"]) == 1
    assert "layers.0.attn.qkv.bias: looks fused ('qkv')" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main(["import", "dcp", str(dcp_dir), "-o", str(tmp_path / "o"), "--tp", "1"]) == 0
    assert_atoms_equal(CheckpointReader(tmp_path / "o"), atoms)


def test_a_load_whose_head_size_disagrees_with_the_saved_spec_is_refused(tmp_path: Path) -> None:
    reader = write_atoms(tmp_path, random_atoms())
    spec = tiny_spec(CONFIG)
    wrong = ReshapeSpec(
        tuple(
            ReshapeRule(r.pattern, r.cat_dim, r.parts, r.vocab, r.average, 8 if r.head_dim else None)
            for r in spec.rules
        ),
        first_stage=spec.first_stage,
    )
    model = TinyLM(CONFIG, CONFIG.vocab, CONFIG.layers)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(LayoutError, match=r"head_dim=4\), the target spec has .*head_dim=8.*fix: head_dim=4"):
        load_module(reader, model, None, Layout(), 0, wrong)
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
