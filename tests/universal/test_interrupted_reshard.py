"""A reshard killed mid-way (SIGKILL, no clean-up runs) leaves the source intact and nothing
that reads as a complete checkpoint.

The reshard runs as ``checkmate-ckpt`` in a child process whose writer pauses after its
first file (a hook installed before ``main`` runs, signalling through a marker file); the
test kills the child there, then checks with ``checkmate-ckpt verify`` and the readers:
the source verifies, the half-written target is refused.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkmate import checkpoint as fmt
from checkmate.checkpoint import CheckpointError, CheckpointReader
from checkmate.checkpoint.cli import main
from checkmate.universal import convert

from .helpers import assert_atoms_equal, random_atoms, write_atoms

torch.set_num_threads(1)

# the child: pause for the kill after the first shard / rank file is written
CHILD = """
import sys, time
from pathlib import Path
from checkmate.checkpoint import export, storage
from checkmate.checkpoint.cli import main
from checkmate.universal import convert
marker = Path(sys.argv[1])
def pausing(original):
    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        marker.write_text("written one")
        time.sleep(60)
        return result
    return wrapped
export.storage.write_shard = pausing(storage.write_shard)
convert.write_rank_file = pausing(convert.write_rank_file)
sys.exit(main(sys.argv[2:]))
"""


def _kill_mid_way(tmp_path: Path, args: list[str]) -> None:
    marker = tmp_path / "marker"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(marker), *args],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert child.poll() is None, f"the reshard ended (rc {child.returncode}) before it was killed"
            assert time.monotonic() < deadline, "the reshard wrote nothing in 60 s"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)


@pytest.fixture()
def source(tmp_path: Path) -> tuple[Path, dict]:
    atoms = random_atoms(3)
    write_atoms(tmp_path / "src", atoms, shards=2)
    return tmp_path / "src", atoms


def test_a_killed_reshard_to_more_shards_leaves_an_incomplete_step(
    source: tuple[Path, dict], tmp_path: Path
) -> None:
    root, atoms = source
    target = tmp_path / "three"
    _kill_mid_way(tmp_path, ["reshard", str(root), "--shards", "3", "-o", str(target)])
    step = fmt.step_dir(target, 7)
    assert (step / "global.json").exists()  # the writer got this far: one shard of three
    assert fmt.complete_steps(target) == []
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        CheckpointReader(target)
    with pytest.raises(CheckpointError):
        CheckpointReader(target, 7)
    assert main(["verify", str(target)]) == 1
    assert main(["verify", str(root)]) == 0
    assert_atoms_equal(CheckpointReader(root), atoms)


def test_a_killed_reshard_to_a_layout_leaves_only_a_hidden_partial_folder(
    source: tuple[Path, dict], tmp_path: Path
) -> None:
    root, atoms = source
    target = tmp_path / "tp2"
    _kill_mid_way(tmp_path, ["reshard", str(root), "--layout", "tp=2,dp=2", "-o", str(target)])
    assert not target.exists()
    (partial,) = tmp_path.glob(".tp2.partial-*")  # no clean-up ran: the staging folder stays, hidden
    assert (partial / "rank-00000.json").exists() and not (partial / "layout.json").exists()
    with pytest.raises(CheckpointError, match="no layout.json; the rank files are incomplete"):
        convert.from_rank_files(partial, tmp_path / "back")
    assert main(["import", "ranks", str(partial), "-o", str(tmp_path / "back")]) == 1
    assert not (tmp_path / "back").exists()
    assert main(["verify", str(root)]) == 0
    assert_atoms_equal(CheckpointReader(root), atoms)
    # the same reshard, run again to the end, gives the target
    assert main(["reshard", str(root), "--layout", "tp=2,dp=2", "-o", str(target)]) == 0
    assert (target / "layout.json").exists()
