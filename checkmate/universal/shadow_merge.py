"""Shadows of a TP x DP job: TP-sharded snapshots merged into universal atoms.

Checkmate with tensor parallelism (docs/checkpoint-format.md "Checkmate for TP x
DP jobs"). With TP x DP, the DP group of TP index t all-reduces the gradients of
t's TP-local parameters: it is its own Checkmate job, a *lane*
(:attr:`checkmate.job.JobSpec.tp_index`), and the shadows that copy that
group's traffic hold, and snapshot, TP-local state.

:func:`merge_lane_snapshots` is what a real job uses: it reads each lane's
snapshot directory (its shadows' ordinary snapshots, TP-local tensors by
parameter name) at a step every lane has complete, and writes one universal
checkpoint through the two steps below, which restores into any TP degree.

The two steps (also usable by the shadows themselves, one writer each). At a
snapshot of step s:

1. shadow k (of K) of TP index t calls :func:`write_tp_snapshot` with the
   TP-local tensors it owns: they become records (logical boxes, via the
   reshape spec) in ``<root>/.tp-staging-<s>/rank-<t*K+k>.*``. Parameters that
   TP replicates are written by TP index 0 only (every copy with ``average``);
2. any W merge writers (say the shadows of TP index 0) call
   :func:`merge_tp_snapshots`: each waits for the T*K snapshot manifests,
   merges the parameters assigned to it and writes universal shard w of W;
   writer 0 writes ``global.json``. Whoever sees the step complete moves
   ``latest`` and removes the staging folder.

The completion rule is the format's own (``global.json`` + all W manifests),
so a shadow that dies mid-way leaves a step readers ignore; the universal
checkpoint then restores into any TP degree (:mod:`.load`).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from checkmate import checkpoint as fmt
from checkmate.checkpoint import CheckpointError
from checkmate.job_state import JobState
from checkmate.universal.extract import AtomMerger, Record, records_of_tensor
from checkmate.universal.layout import Layout, rank_holdings
from checkmate.universal.rank_files import rank_stem, read_rank_records, write_rank_file
from checkmate.universal.save import assign_owners
from checkmate.universal.spec import LayoutError, ReshapeSpec

logger = logging.getLogger(__name__)


def staging_dir(root: Path, step: int) -> Path:
    return Path(root) / f".tp-staging-{step:08d}"


def write_tp_snapshot(
    root: Path,
    step: int,
    tp_index: int,
    tp: int,
    shadow: int,
    shadows: int,
    states: Mapping[str, Mapping[str, torch.Tensor]],
    spec: ReshapeSpec,
    shapes: Mapping[str, Sequence[int]],
) -> Path:
    """Shadow ``shadow`` of TP index ``tp_index``: its TP-local ``states[name][state]`` as records."""
    if not (0 <= tp_index < tp and 0 <= shadow < shadows):
        raise LayoutError(f"shadow {shadow} of {shadows}, TP index {tp_index} of {tp}: out of range")
    holdings = rank_holdings(Layout(tp=tp), spec, shapes, tp_index)
    records: list[Record] = []
    for name, by_state in sorted(states.items()):
        if name not in holdings.tensors:
            raise LayoutError(f"{name}: not a parameter of the checkpoint")
        rule = spec.rule(name)
        if rule.cat_dim is None and tp_index > 0 and not rule.average:
            continue  # TP-replicated: TP index 0's shadows write it
        for state, tensor in sorted(by_state.items()):
            records += records_of_tensor(holdings.tensors[name], state, tensor)
    return write_rank_file(staging_dir(root, step), tp_index * shadows + shadow, records)


def merge_tp_snapshots(
    root: Path,
    step: int,
    writer: int,
    writers: int,
    tp: int,
    shadows: int,
    spec: ReshapeSpec,
    shapes: Mapping[str, Sequence[int]],
    optimizer: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    job_state: JobState | None = None,
) -> Path:
    """Merge writer ``writer`` of ``writers``: wait for every snapshot, write universal shard ``writer``.

    Writer 0 also writes ``global.json`` (with ``job_state``: buffers, schedulers, param groups).
    """
    staging = staging_dir(root, step)
    sources = tp * shadows
    deadline = time.monotonic() + timeout
    while True:
        missing = [r for r in range(sources) if not (staging / f"{rank_stem(r)}.json").is_file()]
        if not missing:
            break
        if time.monotonic() > deadline:
            named = [f"tp {r // shadows} shadow {r % shadows}" for r in missing]
            raise CheckpointError(
                f"step {step}: no snapshot from {named} after {timeout} s; the step stays incomplete"
            )
        time.sleep(0.02)
    owned = assign_owners(shapes, writers)[writer]
    merger = AtomMerger({n: shapes[n] for n in owned}, spec)
    for source in range(sources):
        merger.add_all(read_rank_records(staging, source, owned))
    fmt.write_shard(root, step, writer, writers, merger.atoms() if owned else {})
    if writer == 0:
        universal = {"spec": spec.to_json(), "source_layout": f"checkmate-shadows,tp={tp}"}
        fmt.write_global(
            root,
            step,
            {n: (list(s), "torch.float32") for n, s in shapes.items()},
            optimizer,
            {**dict(extra or {}), "universal": universal},
            job_state=job_state,
        )
    if step in fmt.complete_steps(Path(root)):
        fmt.update_latest(Path(root), step)
        shutil.rmtree(staging, ignore_errors=True)
    return fmt.step_dir(Path(root), step)


def lane_steps(lanes: Sequence[Path]) -> list[int]:
    """The steps complete in every lane's snapshot directory, oldest first."""
    common: set[int] | None = None
    for lane in lanes:
        steps = set(fmt.complete_steps(Path(lane)))
        common = steps if common is None else common & steps
    return sorted(common or ())


def _lane_reader(lane: Path, step: int, tp_index: int, tp: int) -> fmt.CheckpointReader:
    reader = fmt.CheckpointReader(Path(lane), step)
    extra = reader.global_state.get("extra", {})
    said = (extra.get("tp_degree", 1), extra.get("tp_index", 0))
    if said != (tp, tp_index):
        raise LayoutError(
            f"{lane} step {step} holds TP index {said[1]} of {said[0]} (job {extra.get('job_id')}), "
            f"but it was given as lane {tp_index} of {tp}: list every lane, in TP index order"
        )
    return reader


def merge_lane_snapshots(
    lanes: Sequence[Path],
    root: Path,
    spec: ReshapeSpec,
    shapes: Mapping[str, Sequence[int]],
    step: int | None = None,
    timeout: float = 60.0,
) -> int:
    """One universal checkpoint in ``root`` from the snapshots of a TP x DP job's lanes.

    ``lanes[t]``: the snapshot directory of TP index t's shadows (each a complete
    Checkmate checkpoint of that TP shard: TP-local tensors under the parameters'
    names); ``spec`` and ``shapes`` describe the model's TP sharding and logical
    shapes (as for :func:`~checkmate.universal.save.save_universal`). ``step``: the
    newest step every lane has complete when None. Returns the step written.
    Everything is checked before ``root`` gets a complete step: a lane whose job
    description names another TP index, a tensor whose shape the TP layout does not
    give, or lanes whose replicated parameters differ raise, leaving no step readers
    would take as complete. Lane 0's optimizer description, job state and extra
    (data position) go into ``global.json``.
    """
    tp = len(lanes)
    if tp < 1:
        raise LayoutError("no lanes to merge")
    if step is None:
        steps = lane_steps(lanes)
        if not steps:
            raise CheckpointError(f"no step is complete in every lane: {[str(p) for p in lanes]}")
        step = steps[-1]
    readers = [_lane_reader(lane, step, t, tp) for t, lane in enumerate(lanes)]
    for t, reader in enumerate(readers):
        states: dict[str, dict[str, torch.Tensor]] = {}
        for name in reader.parameters:
            states[name] = {state: reader.parameter(name, state) for state in reader.states_of(name)}
        write_tp_snapshot(root, step, t, tp, 0, 1, states, spec, shapes)
    first = readers[0]
    lane_keys = ("job_id", "shards", "tp_degree", "tp_index")  # per lane: not the merged checkpoint's
    extra = {k: v for k, v in first.global_state.get("extra", {}).items() if k not in lane_keys}
    extra["lane_job_ids"] = [r.global_state.get("extra", {}).get("job_id") for r in readers]
    merge_tp_snapshots(
        root,
        step,
        0,
        1,
        tp,
        1,
        spec,
        shapes,
        first.global_state.get("optimizer", {}),
        extra,
        timeout=timeout,
        job_state=first.job_state(),
    )
    logger.info("merged %d TP lanes' step %d into %s", tp, step, root)
    return step
