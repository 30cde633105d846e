"""Per-rank shard files of one layout: what a parallel job writes or reads, rank by rank.

A folder holds ``rank-<r:05d>.safetensors`` + ``rank-<r:05d>.json`` per rank
(the records: parameter, state, logical box, tensor key) and ``layout.json``
(the layout, the reshape spec, every parameter's logical shape, the step, the
optimizer's groups) written last: a folder without ``layout.json`` is
incomplete and is refused. It is the layout-specific side of the universal
format — DeepSpeed's ``mp_rank_*`` / ``zero_pp_rank_*`` files play that role —
and both the online save (staging) and ``checkmate-ckpt convert --to ranks``
use it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from checkmate import checkpoint as fmt
from checkmate.job_state import JobState
from checkmate.universal.extract import Record
from checkmate.universal.layout import Layout
from checkmate.universal.spec import LayoutError, ReshapeSpec

logger = logging.getLogger(__name__)

LAYOUT_FILE = "layout.json"
JOB_STATE_FILE = "job-state.safetensors"
RANK_FORMAT_VERSION = 1


def rank_stem(rank: int) -> str:
    return f"rank-{rank:05d}"


def write_rank_file(folder: Path, rank: int, records: Sequence[Record]) -> Path:
    """Write one rank's records (data first, manifest last, each atomically)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    entries = []
    for index, record in enumerate(records):
        key = f"t{index}"
        tensors[key] = record.value.detach().contiguous().clone()
        entries.append(
            {
                "name": record.name,
                "state": record.state,
                "box": [list(b) for b in record.box] if record.box is not None else None,
                "key": key,
            }
        )
    stem = rank_stem(rank)
    data = folder / f"{stem}.safetensors"
    tmp = data.with_name(f".{data.name}.tmp")

    save_file(tensors, str(tmp))
    with tmp.open("rb+") as handle:
        os.fsync(handle.fileno())
    tmp.replace(data)
    fmt.atomic_write_json(
        folder / f"{stem}.json",
        {"version": RANK_FORMAT_VERSION, "rank": rank, "file": data.name, "entries": entries},
    )
    return data


def write_layout_file(
    folder: Path,
    layout: Layout,
    spec: ReshapeSpec,
    shapes: Mapping[str, Sequence[int]],
    step: int,
    optimizer: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    dtypes: Mapping[str, str] | None = None,
    job_state: JobState | None = None,
) -> Path:
    """The folder's completion marker: written after every rank file (and the job state's tensors)."""
    document = {
        "version": RANK_FORMAT_VERSION,
        "layout": layout.describe(),
        "world_size": layout.world_size,
        "spec": spec.to_json(),
        "parameters": {
            n: {"shape": list(s), "dtype": (dtypes or {}).get(n, "torch.float32")}
            for n, s in sorted(shapes.items())
        },
        "step": step,
        "optimizer": dict(optimizer),
        "extra": dict(extra or {}),
    }
    if job_state is not None:
        document["job_state"] = job_state.document
        if job_state.tensors:
            tensors = {k: t.detach().contiguous().clone() for k, t in sorted(job_state.tensors.items())}
            save_file(tensors, str(folder / JOB_STATE_FILE))
    path = folder / LAYOUT_FILE
    fmt.atomic_write_json(path, document)
    return path


def read_layout_file(folder: Path) -> dict[str, Any]:
    path = Path(folder) / LAYOUT_FILE
    if not path.is_file():
        raise LayoutError(
            f"{folder}: no {LAYOUT_FILE}; the rank files are incomplete (an interrupted write?)"
        )
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayoutError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("version") != RANK_FORMAT_VERSION:
        raise LayoutError(f"{path}: not a version-{RANK_FORMAT_VERSION} layout file")
    for key in ("layout", "spec", "parameters", "step"):
        if key not in document:
            raise LayoutError(f"{path}: missing {key!r}")
    return document


def read_layout_job_state(folder: Path, document: Mapping[str, Any]) -> JobState | None:
    """The job state a rank folder carries (written by ``write_layout_file``), or None."""
    if "job_state" not in document:
        return None
    tensors: dict[str, torch.Tensor] = {}
    path = Path(folder) / JOB_STATE_FILE
    if path.is_file():
        try:
            with safe_open(str(path), framework="pt") as handle:
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        except SafetensorError as exc:
            raise LayoutError(f"{path}: cannot be read ({exc})") from None
    return JobState(dict(document["job_state"]), tensors)


def read_rank_records(folder: Path, rank: int, names: Iterable[str] | None = None) -> list[Record]:
    """The records of ``rank`` (only those of ``names`` when given; only their bytes are read)."""
    stem = rank_stem(rank)
    manifest_path = Path(folder) / f"{stem}.json"
    if not manifest_path.is_file():
        raise LayoutError(f"{folder}: rank {rank}'s manifest {manifest_path.name} is missing")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayoutError(f"{manifest_path}: not valid JSON ({exc})") from None
    wanted = set(names) if names is not None else None
    records = []
    data = Path(folder) / str(manifest.get("file", ""))
    try:
        with safe_open(str(data), framework="pt") as handle:
            for entry in manifest.get("entries", []):
                if wanted is not None and entry["name"] not in wanted:
                    continue
                box = tuple((int(a), int(b)) for a, b in entry["box"]) if entry["box"] is not None else None
                records.append(Record(entry["name"], entry["state"], box, handle.get_tensor(entry["key"])))
    except (SafetensorError, FileNotFoundError) as exc:
        raise LayoutError(f"{data}: cannot be read ({exc})") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"{manifest_path}: malformed entry ({exc})") from None
    return records
