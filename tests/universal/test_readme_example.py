"""README.md and docs/checkpoint-format.md open with the universal-checkpoint example, and it runs.

The example (examples/universal_checkpoint.py) trains a user's own small GPT
(fused QKV) under TP=2 on 2 CPU ranks, saves a universal checkpoint with public
names only, resumes it under FSDP2 on 2 ranks and asserts the losses continue.
Both documents hold its code verbatim (after the marker comment), so the
documents cannot drift from what runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "universal_checkpoint.py"
MARKER = "<!-- example: examples/universal_checkpoint.py -->"


def example_code() -> str:
    """The example file without its module docstring."""
    text = EXAMPLE.read_text()
    return text[text.index('"""', 3) + 3 :].strip() + "\n"


def documented_code(document: Path) -> str:
    text = document.read_text()
    after = text[text.index(MARKER) + len(MARKER) :]
    start = after.index("```python\n") + len("```python\n")
    return after[start : after.index("```\n", start)].strip() + "\n"


@pytest.mark.parametrize("document", ["README.md", "docs/checkpoint-format.md"])
def test_the_documents_hold_the_example_verbatim(document: str) -> None:
    assert documented_code(REPO / document) == example_code()


def test_the_checkpoint_format_document_opens_with_the_example() -> None:
    text = (REPO / "docs" / "checkpoint-format.md").read_text()
    assert text.index(MARKER) < text.index("\n## ")


@pytest.mark.slow  # two 2-rank gloo jobs: ~10 s of CPU, 40-90 s wall on 2 shared cores
def test_the_example_runs_and_resumes_with_the_same_losses(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    tp, fsdp2 = (json.loads((tmp_path / f"{p}.json").read_text()) for p in ("tp", "fsdp2"))
    assert set(fsdp2) == {"4", "5"}
    for step in ("4", "5"):
        assert abs(tp[step] - fsdp2[step]) < 1e-5, (step, tp[step], fsdp2[step])
    saved = json.loads((tmp_path / "ckpt" / "step-00000003" / "global.json").read_text())
    universal = saved["extra"]["universal"]
    assert (universal["tp"], universal["mesh"], universal["source_layout"]) == (
        2,
        {"model": 2},
        "tp=2,pp=1,dp=1",
    )
    assert "step 5: TP=2 loss" in result.stdout
