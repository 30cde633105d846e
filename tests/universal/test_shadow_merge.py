"""Shadows of a TP=2 x DP job write TP-local snapshots; merge writers turn them into universal atoms
that restore as TP=1 and as TP=2 (the format side of Checkmate for hybrid-parallel jobs)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from checkmate import checkpoint as fmt
from checkmate.checkpoint import CheckpointError, CheckpointReader
from checkmate.universal.layout import Layout
from checkmate.universal.load import checkpoint_shapes, load_rank
from checkmate.universal.shadow_merge import merge_tp_snapshots, staging_dir, write_tp_snapshot
from checkmate.universal.tiny import tiny_spec

from .helpers import CONFIG, assert_atoms_equal, random_atoms, write_atoms

torch.set_num_threads(1)
TP, SHADOWS = 2, 2


def shadow_states(reader: CheckpointReader, tp_index: int, shadow: int) -> dict[str, dict[str, torch.Tensor]]:
    """What shadow ``shadow`` of TP index ``tp_index`` holds: whole TP-local parameters, round robin."""
    local = load_rank(reader, Layout(tp=TP), tp_index)
    names = sorted(local.params)[shadow::SHADOWS]
    return {n: {"param": local.params[n], **local.states[n], **local.scalars[n]} for n in names}


def test_tp_shadow_snapshots_merge_into_atoms_that_restore_in_any_tp_degree(tmp_path: Path) -> None:
    atoms = random_atoms(11)
    source = write_atoms(tmp_path / "job", atoms)  # the TP=2 job's state, as its shadows would hold it
    spec, shapes = tiny_spec(CONFIG), checkpoint_shapes(source)
    root = tmp_path / "shadows"
    for tp_index in range(TP):
        for shadow in range(SHADOWS):
            states = shadow_states(source, tp_index, shadow)
            write_tp_snapshot(root, 7, tp_index, TP, shadow, SHADOWS, states, spec, shapes)
    assert fmt.complete_steps(root) == []
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        try:
            merge_tp_snapshots(root, 7, index, 3, TP, SHADOWS, spec, shapes, {"kind": "Adam"}, timeout=30)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    merged = CheckpointReader(root)
    assert fmt.read_latest(root) == 7 and not staging_dir(root, 7).exists()
    assert_atoms_equal(merged, atoms)
    one = load_rank(merged, Layout(), 0)  # restores as TP=1 ...
    for name, value in one.params.items():
        assert torch.equal(value, atoms[name]["param"]), name
    for tp_index in range(TP):  # ... and back as TP=2
        back, want = load_rank(merged, Layout(tp=TP), tp_index), load_rank(source, Layout(tp=TP), tp_index)
        for name, value in want.states.items():
            assert torch.equal(back.states[name]["exp_avg"], value["exp_avg"]), name


def test_a_missing_shadow_snapshot_leaves_the_step_incomplete_and_is_named(tmp_path: Path) -> None:
    source = write_atoms(tmp_path / "job", random_atoms(12))
    spec, shapes = tiny_spec(CONFIG), checkpoint_shapes(source)
    root = tmp_path / "shadows"
    for tp_index, shadow in [(0, 0), (0, 1), (1, 0)]:  # TP index 1's shadow 1 died
        write_tp_snapshot(
            root, 7, tp_index, TP, shadow, SHADOWS, shadow_states(source, tp_index, shadow), spec, shapes
        )
    with pytest.raises(CheckpointError, match=r"no snapshot from \['tp 1 shadow 1'\]"):
        merge_tp_snapshots(root, 7, 0, 1, TP, SHADOWS, spec, shapes, {}, timeout=0.2)
    assert fmt.complete_steps(root) == []
