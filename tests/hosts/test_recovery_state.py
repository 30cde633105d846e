"""Restoring a job's state: from a universal checkpoint on disk when no shadow answers, strictly,
bit for bit (no network needed; the shadows' memory path is covered by tests/topologies/test_recovery.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from checkmate import checkpoint as fmt
from checkmate.checkpoint.digest import optimizer_digest, parameters_digest
from checkmate.checkpoint.source import SOURCE_SNAPSHOT
from experiments.tiny_lm import ModelConfig, TinyLM, batch_for, load_corpus, loss_of
from hosts.recovery import ResumeError, load_state, optimizer_states_by_name, restore_latest, resume

CONFIG = ModelConfig(context=16, width=16, heads=2, layers=1)


def _closed_port() -> tuple[str, int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return "127.0.0.1", int(probe.getsockname()[1])


def _model_and_optimizer(seed: int) -> tuple[TinyLM, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = TinyLM(CONFIG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _step(model: TinyLM, optimizer: torch.optim.Optimizer, corpus: torch.Tensor, iteration: int) -> None:
    inputs, targets = batch_for(corpus, 0, iteration, 0, 1, 4, CONFIG.context)
    optimizer.zero_grad()
    loss_of(model, inputs, targets).backward()
    optimizer.step()


def _write_snapshot(root: Path, step: int, model: TinyLM, optimizer: torch.optim.Optimizer) -> None:
    """What two shadows write: the parameters split over two shard files, plus global.json."""
    named = list(model.named_parameters())
    states = fmt.capture_states(named, optimizer)
    spec = {"kind": "AdamW", "param_groups": [{"params": [n for n, _ in named]}]}
    fmt.write_global(root, step, fmt.parameters_of(named), spec, {"optimizer_step": step + 1})
    names = [n for n, _ in named]
    for shard in range(2):
        fmt.write_shard(root, step, shard, 2, {n: states[n] for n in names[shard::2]})


def test_restores_from_the_snapshots_when_no_shadow_answers(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    corpus = load_corpus()
    model, optimizer = _model_and_optimizer(0)
    for iteration in range(3):
        _step(model, optimizer, corpus, iteration)
    _write_snapshot(tmp_path, 1, model, optimizer)  # an older complete step
    _write_snapshot(tmp_path, 2, model, optimizer)
    fmt.write_global(tmp_path, 3, {}, {})  # a partial newer step (no shards): ignored

    state = restore_latest({"sh1": _closed_port()}, tmp_path, timeout=2.0)
    assert state is not None and state.source == SOURCE_SNAPSHOT
    assert state.iteration == 2 and state.next_iteration == 3 and state.optimizer_step == 3

    fresh, fresh_optimizer = _model_and_optimizer(1)  # different initial weights
    load_state(fresh, fresh_optimizer, state)
    assert parameters_digest(fresh.named_parameters()) == parameters_digest(model.named_parameters())
    assert optimizer_digest(optimizer_states_by_name(fresh, fresh_optimizer)) == optimizer_digest(
        optimizer_states_by_name(model, optimizer)
    )
    # ... and training continues exactly as the original does.
    _step(model, optimizer, corpus, 3)
    _step(fresh, fresh_optimizer, corpus, 3)
    assert parameters_digest(fresh.named_parameters()) == parameters_digest(model.named_parameters())


def test_nothing_to_restore_means_starting_from_scratch(tmp_path: Path) -> None:
    assert restore_latest({"sh1": _closed_port()}, tmp_path / "empty", timeout=2.0) is None
    assert restore_latest({}, None) is None


def test_a_state_of_another_model_is_refused(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer(0)
    _write_snapshot(tmp_path, 0, model, optimizer)
    state = restore_latest({}, tmp_path)
    assert state is not None
    state.parameters["extra.weight"] = torch.zeros(2)
    with pytest.raises(ResumeError, match="does not fit this model"):
        load_state(*_model_and_optimizer(0), state)
    del state.parameters["extra.weight"]
    state.parameters["head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ResumeError, match="head.weight: state shape"):
        load_state(*_model_and_optimizer(0), state)


def test_a_damaged_newest_checkpoint_is_an_error_naming_the_file_unless_starting_over(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer(0)
    _write_snapshot(tmp_path, 1, model, optimizer)
    _write_snapshot(tmp_path, 2, model, optimizer)
    damaged = fmt.step_dir(tmp_path, 2) / "shard-001-of-002.safetensors"
    raw = bytearray(damaged.read_bytes())
    raw[-5] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    with pytest.raises(ResumeError, match=r"step 2\) fails verification") as caught:
        restore_latest({"sh1": _closed_port()}, tmp_path, timeout=2.0)
    assert str(damaged) in str(caught.value) and "start_over=True" in str(caught.value)
    # every rank's hosts.resume raises it (no process group here: this rank is rank 0)
    with pytest.raises(ResumeError, match="fails verification"):
        resume(model, optimizer, shadows={"sh1": _closed_port()}, snapshot_dir=tmp_path, timeout=2.0)
    assert restore_latest({"sh1": _closed_port()}, tmp_path, timeout=2.0, start_over=True) is None
    point = resume(model, optimizer, shadows={}, snapshot_dir=tmp_path, start_over=True)
    assert point.iteration == 0 and not point.restored


def test_resume_with_shadows_needs_no_process_group_and_measures_no_loss_it_cannot_see(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hosts.resume(shadows=...)`` outside a process group (no RANK, no job_id): the job id is
    CHECKMATE_JOB_ID's or 1; with every shadow gone the loss of a disk restore is unknown (None),
    never a figure from the shadows' periodic status files."""
    for name in ("RANK", "WORLD_SIZE", "CHECKMATE_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    model, optimizer = _model_and_optimizer(0)
    _write_snapshot(tmp_path, 2, model, optimizer)
    (tmp_path / "status-sh1.json").write_text('{"shadow": "sh1", "applied_iteration": 9}')
    fresh, fresh_optimizer = _model_and_optimizer(1)
    point = resume(
        fresh, fresh_optimizer, shadows={"sh1": _closed_port()}, snapshot_dir=tmp_path, timeout=2.0
    )
    assert point.restored and point.iteration == 3
    assert point.lost_iterations is None and point.workers_finished is None
