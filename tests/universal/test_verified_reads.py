"""Every read is verified and every load is all-or-nothing (issue 30, deliverable 3).

* a sharded (TP=2) read of a tensor with a flipped byte raises, naming the file
  and the tensor; large tensors carry one checksum per chunk of rows, so a rank
  verifies what it reads without reading the other ranks' rows;
* a parameter whose Adam ``exp_avg_sq`` is missing is refused by ``verify``
  and by every loader (today: ``verify`` ok, the first ``optimizer.step()``
  raises ``KeyError``);
* a load that fails on a bad byte or a short file leaves the module and the
  optimizer exactly as they were;
* ``checkmate-ckpt import dcp`` of a broken DCP folder prints one line (torch's
  ``CheckpointException`` derives from ``BaseException``).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkmate import checkpoint as fmt
from checkmate.checkpoint import CheckpointError, CheckpointReader
from checkmate.checkpoint import format as format_module
from checkmate.checkpoint.cli import main
from checkmate.checkpoint.load import load_into
from checkmate.universal.box_reader import BoxReader
from checkmate.universal.layout import Layout
from checkmate.universal.load import load_module, load_rank
from checkmate.universal.tiny import TinyLM

from .helpers import CONFIG, random_atoms, write_atoms

torch.set_num_threads(1)


def tensor_location(step_dir: Path, key: str) -> tuple[Path, int, int]:
    """(data file, byte offset, byte length) of the tensor stored under ``key`` in a step."""
    for path in sorted(step_dir.glob("shard-*.safetensors")):
        data = path.read_bytes()
        (header_len,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_len])
        if key in header:
            start, end = header[key]["data_offsets"]
            return path, 8 + header_len + start, end - start
    raise KeyError(key)


def flip_byte(step_dir: Path, key: str, at: float = 0.5) -> None:
    path, offset, length = tensor_location(step_dir, key)
    data = bytearray(path.read_bytes())
    data[offset + int(length * at)] ^= 0x40
    path.write_bytes(bytes(data))


def _model() -> TinyLM:
    return TinyLM(CONFIG, CONFIG.vocab, CONFIG.layers)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_untouched(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.detach(), before[name]), f"{name} was overwritten by a failed load"


def test_a_tp2_rank_read_of_a_flipped_byte_is_refused(tmp_path: Path) -> None:
    reader = write_atoms(tmp_path, random_atoms())
    flip_byte(reader.directory, "layers.1.attn.out.weight::exp_avg")
    reader = CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.out\.weight::exp_avg fails its checksum"):
        load_rank(reader, Layout(tp=2), 1)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        BoxReader(reader).read("layers.1.attn.out.weight", "exp_avg", ((0, 3), (0, 8)))


def test_chunk_checksums_verify_a_rank_share_without_reading_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(format_module, "CHUNK_BYTES", 64)  # 16-float chunks: a row of 16 per chunk
    atoms = random_atoms()
    reader = write_atoms(tmp_path, atoms)
    name = "layers.0.mlp.gate_up.weight"  # (48, 16), TP splits dim 0 per part [24, 24]
    (entry,) = [e for m in reader.manifests for e in m["entries"] if e["key"] == f"{name}::param"]
    assert entry["chunk_rows"] == 1 and len(entry["chunk_sha256"]) == 48
    flip_byte(reader.directory, f"{name}::param", at=0.99)  # in the last row: TP rank 1's (up half)
    reader = CheckpointReader(tmp_path)
    boxes = BoxReader(reader)
    rank0 = boxes.read(name, "param", ((0, 12), (0, 16)))
    assert torch.equal(rank0, atoms[name]["param"][0:12])
    assert reader.elements_fetched == 12 * 16, "rank 0 read more than its rows"
    with pytest.raises(CheckpointError, match=r"gate_up\.weight::param \(rows 47\.\.48\) fails its checksum"):
        boxes.read(name, "param", ((36, 48), (0, 16)))
    assert main(["verify", str(tmp_path)]) == 1


def test_a_zero_style_flat_range_read_is_verified(tmp_path: Path) -> None:
    reader = write_atoms(tmp_path, random_atoms(), zero_style=True, shards=2)
    key = "layers.0.attn.qkv.weight::exp_avg_sq"
    path, offset, length = tensor_location(reader.directory, key)
    flip_byte(reader.directory, key, at=0.9)
    reader = CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="fails its checksum"):
        reader.read("layers.0.attn.qkv.weight", "exp_avg_sq", 200, 300)


def _without(atoms: dict[str, dict[str, torch.Tensor]], name: str, state: str) -> dict:
    return {n: {k: v for k, v in s.items() if not (n == name and k == state)} for n, s in atoms.items()}


def test_a_missing_exp_avg_sq_is_refused_by_verify_and_every_loader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reader = write_atoms(tmp_path, _without(random_atoms(), "layers.0.mlp.down.weight", "exp_avg_sq"))
    assert main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "layers.0.mlp.down.weight: optimizer state ['exp_avg_sq'] missing" in err
    assert "Adam needs ['exp_avg', 'exp_avg_sq', 'step']" in err
    model = _model()
    before = _snapshot(model)
    optimizer = torch.optim.Adam(model.parameters())
    with pytest.raises(
        CheckpointError, match=r"layers\.0\.mlp\.down\.weight: optimizer state \['exp_avg_sq'\]"
    ):
        load_module(reader, model, optimizer, Layout(), 0)
    named = dict(model.named_parameters())
    ordered = torch.optim.Adam([named[n] for n in sorted(named)])  # load_into: the saved group's order
    with pytest.raises(
        CheckpointError, match=r"layers\.0\.mlp\.down\.weight: optimizer state \['exp_avg_sq'\]"
    ):
        load_into(reader, model, ordered)
    _assert_untouched(model, before)
    assert not optimizer.state
    load_module(reader, model, None, Layout(), 0)  # the weights alone are whole and load


def test_a_parameter_never_stepped_loads_without_state(tmp_path: Path) -> None:
    atoms = random_atoms()
    atoms["norm.weight"] = {"param": atoms["norm.weight"]["param"]}  # an unused parameter: no state at all
    reader = write_atoms(tmp_path, atoms)
    assert main(["verify", str(tmp_path)]) == 0
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    load_module(reader, model, optimizer, Layout(), 0)
    assert model.norm.weight not in optimizer.state


@pytest.mark.parametrize("damage", ["flipped byte", "truncated file"])
def test_a_failed_load_overwrites_nothing(tmp_path: Path, damage: str) -> None:
    reader = write_atoms(tmp_path, random_atoms(), shards=2)
    names = sorted(reader.parameters)  # a load reads embed.weight (shard 0) first
    if damage == "flipped byte":
        flip_byte(reader.directory, f"{names[-1]}::exp_avg")
    else:  # shard 1 (names[1::2]) cut short: its file cannot be opened
        path, offset, _ = tensor_location(reader.directory, f"{names[1]}::param")
        os.truncate(path, offset + 4)
    reader = CheckpointReader(tmp_path)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters())
    before = _snapshot(model)
    with pytest.raises(CheckpointError):
        load_module(reader, model, optimizer, Layout(), 0)
    _assert_untouched(model, before)
    assert not optimizer.state


def test_import_dcp_of_a_damaged_folder_prints_one_line(tmp_path: Path) -> None:
    from checkmate.checkpoint.export import export_dcp

    reader = write_atoms(tmp_path / "u", random_atoms())
    dcp_dir = export_dcp(reader, tmp_path / "dcp")
    (data,) = sorted(dcp_dir.glob("*.distcp"))
    os.truncate(data, data.stat().st_size // 3)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "checkmate.checkpoint.cli",
            "import",
            "dcp",
            str(dcp_dir),
            "-o",
            str(tmp_path / "o"),
            "--tp",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"checkmate-ckpt: {dcp_dir}: not a readable DCP checkpoint (rank 0: ")
    assert not (tmp_path / "o").exists()
    assert fmt.complete_steps(tmp_path / "u") == [7]
