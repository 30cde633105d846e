"""Offline conversion between a universal checkpoint and the rank files of a layout.

* :func:`to_rank_files` — ``checkmate-ckpt convert --to ranks --layout ...``:
  every rank's tensors of the target layout, as a job of that layout would
  load them (each rank's file holds only its pieces).
* :func:`from_rank_files` — ``checkmate-ckpt import ranks``: merge the rank
  files of any layout into a universal checkpoint (DeepSpeed's
  ``ds_to_universal`` plays this role for its own files).

Both validate everything before writing: :func:`plan` builds every rank's
holdings first, so a layout that cannot hold the checkpoint fails naming the
parameter and the rule with nothing on disk. Output goes to a hidden sibling
folder renamed into place at the end: an interrupted conversion leaves the
source untouched and no folder that readers take for complete.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from checkmate import checkpoint as fmt
from checkmate.checkpoint import PARAM_STATE, CheckpointError, CheckpointReader
from checkmate.universal.box_reader import BoxReader
from checkmate.universal.extract import AtomMerger, Record, records_of_flat, records_of_tensor
from checkmate.universal.geometry import numel
from checkmate.universal.layout import Layout, RankHoldings, rank_holdings
from checkmate.universal.load import RankState, checkpoint_shapes, load_rank, resolve_spec
from checkmate.universal.rank_files import (
    read_layout_file,
    read_layout_job_state,
    read_rank_records,
    write_layout_file,
    write_rank_file,
)
from checkmate.universal.save import assign_owners
from checkmate.universal.spec import LayoutError, ReshapeSpec

logger = logging.getLogger(__name__)


def records_of_rank(holdings: RankHoldings, state: RankState) -> list[Record]:
    """Every record a rank's loaded state holds (the inverse of :func:`load_rank`)."""
    records: list[Record] = []
    for local, tensor in holdings.tensors.items():
        if holdings.param_flat is None:
            records += records_of_tensor(tensor, PARAM_STATE, state.params[local])
        for key, value in state.states.get(local, {}).items():
            records += records_of_tensor(tensor, key, value)
        for key, value in state.scalars.get(local, {}).items():
            records.append(Record(tensor.name, key, None, value))
    if holdings.param_flat is not None and state.param_flat is not None:
        records += records_of_flat(holdings.param_flat, PARAM_STATE, state.param_flat)
    if holdings.state_flat is not None:
        for key, flat in state.state_flat.items():
            records += records_of_flat(holdings.state_flat, key, flat)
    return records


def plan(reader: CheckpointReader, layout: Layout, spec: ReshapeSpec | None = None) -> list[dict[str, Any]]:
    """Every rank's share of the checkpoint in ``layout`` (raises LayoutError before anything is read)."""
    spec = resolve_spec(reader, spec)
    shapes = checkpoint_shapes(reader)
    out = []
    for rank in range(layout.world_size):
        holdings = rank_holdings(layout, spec, shapes, rank)
        param_elements = sum(numel(p.logical) for t in holdings.tensors.values() for p in t.pieces)
        out.append(
            {
                "rank": rank,
                "coords": dict(zip(("pp", "dp", "tp"), layout.coords(rank), strict=True)),
                "parameters": len(holdings.tensors),
                "param_elements": param_elements,
                "flat_state_elements": holdings.state_flat.numel if holdings.state_flat else None,
            }
        )
    return out


@contextmanager
def staged_output(output: Path) -> Iterator[Path]:
    """A hidden sibling folder renamed to ``output`` on success, removed on failure."""
    output = Path(output)
    if output.exists():
        raise CheckpointError(f"{output}: already exists; choose a new output folder")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.partial-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        yield staging
        os.replace(staging, output)
        fmt.fsync_dir(output.parent)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def to_rank_files(
    reader: CheckpointReader, output: Path, layout: Layout, spec: ReshapeSpec | None = None
) -> tuple[Path, int]:
    """Write every rank's tensors of ``layout``; returns the folder and the elements read."""
    spec = resolve_spec(reader, spec)
    plan(reader, layout, spec)  # every rank validated before a byte is written
    shapes = checkpoint_shapes(reader)
    boxes = BoxReader(reader)
    with staged_output(output) as staging:
        for rank in range(layout.world_size):
            holdings = rank_holdings(layout, spec, shapes, rank)
            state = load_rank(reader, layout, rank, spec, boxes)
            write_rank_file(staging, rank, records_of_rank(holdings, state))
        write_layout_file(
            staging,
            layout,
            spec,
            shapes,
            reader.step,
            reader.global_state.get("optimizer", {}),
            reader.global_state.get("extra", {}),
            job_state=reader.job_state(),
        )
    return Path(output), boxes.elements_read


def from_rank_files(folder: Path, output: Path, num_shards: int = 1) -> Path:
    """Merge the rank files of any layout into a universal checkpoint under ``output``."""
    document = read_layout_file(folder)
    layout = Layout.parse(document["layout"])
    spec = ReshapeSpec.from_json(document["spec"], f"{folder}/layout.json")
    shapes = {n: tuple(m["shape"]) for n, m in document["parameters"].items()}
    step = int(document["step"])
    if num_shards < 1:
        raise LayoutError("import needs at least one shard")
    with staged_output(output) as staging:
        for shard, owned in enumerate(assign_owners(shapes, num_shards)):
            merger = AtomMerger({n: shapes[n] for n in owned}, spec)
            for rank in range(layout.world_size):
                merger.add_all(read_rank_records(folder, rank, owned))
            fmt.write_shard(staging, step, shard, num_shards, merger.atoms() if owned else {})
        extra = dict(document.get("extra") or {})
        extra["universal"] = {"spec": spec.to_json(), "source_layout": layout.describe()}
        fmt.write_global(
            staging,
            step,
            {
                n: (list(s), document["parameters"][n].get("dtype", "torch.float32"))
                for n, s in shapes.items()
            },
            document.get("optimizer") or {},
            extra,
            job_state=read_layout_job_state(folder, document),
        )
        fmt.update_latest(staging, step)
    return fmt.step_dir(Path(output), step)
