"""train_lm's CheckFreq-style baseline: the snapshot is a copy taken at the step, persisted atomically."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import torch

from examples.train_lm import BaselineCheckpointer, JsonLog


def test_checkfreq_persists_the_state_of_the_step_not_later_updates(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    log = JsonLog(tmp_path / "rank0.jsonl")
    checkpointer = BaselineCheckpointer("checkfreq", 2, tmp_path / "ckpt", module, optimizer, 0, log)
    release = threading.Event()
    original = checkpointer._write

    def slow_write(state: dict[str, Any], iteration: int, started: float) -> None:
        release.wait(timeout=30)  # the persist runs while training changes the live tensors
        original(state, iteration, started)

    checkpointer._write = slow_write  # type: ignore[method-assign]
    checkpointer.after_step(0)  # k = 2: no checkpoint after iteration 0
    assert checkpointer._persist is None
    checkpointer.after_step(1)
    expected_weight = module.weight.detach().clone()
    expected_moment = optimizer.state[module.weight]["exp_avg"].clone()
    with torch.no_grad():
        module.weight.add_(1.0)  # the next iteration's update, in place
        optimizer.state[module.weight]["exp_avg"].add_(1.0)
    release.set()
    checkpointer.close()
    log.close()
    saved = torch.load(tmp_path / "ckpt" / "checkpoint.pt")
    assert saved["iteration"] == 1
    assert torch.equal(saved["model"]["weight"], expected_weight)
    assert torch.equal(saved["optimizer"]["state"][0]["exp_avg"], expected_moment)
    assert not (tmp_path / "ckpt" / "checkpoint.pt.tmp").exists()
    records = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [(r["event"], r["kind"], r["iteration"]) for r in records] == [("checkpoint", "checkfreq", 1)]
    assert records[0]["durable"] >= records[0]["started"]
