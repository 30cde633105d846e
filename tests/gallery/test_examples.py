"""The example script topologies/examples/train_ddp.py resumes with hosts.resume, bit-identically.

It never calls ``agent.close()``: its last step's commit still reaches the shadows
(sent at interpreter exit), so a restart resumes right after it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from tests.gallery.test_gallery import ROOT, Job, _shadows

SCRIPT = str(ROOT / "examples" / "train_ddp.py")


def _run(nodes: list, steps: int, save: Path, resume: bool = False) -> list[int]:
    """Run the script; the steps rank 0 printed."""
    argv = ["--steps", str(steps), "--samples", "512", "--save", str(save)] + (["--resume"] if resume else [])
    out = save.with_suffix(".rank{rank}.out")
    assert Job(SCRIPT, argv, nodes, {"GALLERY_STDOUT": str(out)}).wait(180) == [0, 0]
    lines = Path(str(out).format(rank=0)).read_text().splitlines()
    return [int(line.split()[1]) for line in lines if line.startswith("step")]


def test_train_ddp_resumes_after_its_last_step_and_ends_bit_identical() -> None:
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="train-ddp-"))
    nodes = _shadows(tmp / "a")
    try:
        _run(nodes, 11, tmp / "full.pt")
    finally:
        for n in nodes:
            n.close()
    nodes = _shadows(tmp / "b")
    try:
        _run(nodes, 5, tmp / "part.pt")
        for n in nodes:  # the last step's commit arrived although the script never closed its agent
            assert n.wait_applied(4, 20), n.status()
        steps = _run(nodes, 11, tmp / "resumed.pt", resume=True)  # 8 batches per epoch: mid-epoch 0
        assert steps == list(range(6, 12)), f"rank 0 ran steps {steps}, not 6..11 after the restored 5"
        for n in nodes:
            assert n.wait_applied(10, 20), n.status()
    finally:
        for n in nodes:
            n.close()
    full, resumed = torch.load(tmp / "full.pt"), torch.load(tmp / "resumed.pt")
    assert full.keys() == resumed.keys()
    for name in full:
        assert torch.equal(full[name].view(torch.int32), resumed[name].view(torch.int32)), name
