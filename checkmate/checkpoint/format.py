"""The universal checkpoint format: schema, paths, version constants and checks.

A checkpoint of step t is a directory ``step-<t:08d>/`` under a root:

* ``global.json`` — format version, step, every parameter of the model by
  fully-qualified name with shape and dtype, the optimizer (class, param
  groups with their hyperparameters and parameter names), ``extra`` (data
  position, job id, ...: whatever the writer passes) and, from version 2,
  ``job_state``: the model's persistent buffers, the job's stateful objects
  (scheduler, GradScaler, sampler, ...) and the param-group hyperparameters in
  force (:mod:`checkmate.job_state`), its tensors in
  ``job-state-<sha256 prefix>.safetensors``.
* ``shard-<k>-of-<K>.safetensors`` + ``shard-<k>-of-<K>.json`` — written
  natively by shard writer k (a shadow): tensors keyed ``<name>::<state>``
  (state ``param``, or an optimizer state such as ``exp_avg``, ``step``), and a
  manifest naming, for every tensor, which element range of the flattened
  state it holds and its SHA-256, plus the file's own SHA-256.
* ``latest`` beside the step directories names the newest complete step.

Nothing records ranks or padding, so any layout can load it. This module holds
what a file must look like (names, versions, the checks a document passes before
anything trusts it, the checksums); :mod:`checkmate.checkpoint.storage` writes
the files and :mod:`checkmate.checkpoint.reader` reads them. Version 2 (current)
reads version-1 steps as steps without a job state. docs/checkpoint-format.md is
the specification.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 2
"""Version 2 added ``job_state`` to global.json (version 1 steps read as steps without one)."""
READABLE_VERSIONS = (1, 2)
STEP_DIR = re.compile(r"^step-(\d{8})$")
SHARD_MANIFEST = re.compile(r"^shard-(\d{3})-of-(\d{3})\.json$")
KEY_SEPARATOR = "::"
PARAM_STATE = "param"
GLOBAL_FILE = "global.json"
LATEST_FILE = "latest"
CHUNK_BYTES = 1 << 20
"""A stored tensor larger than this gets one SHA-256 per chunk of rows (``chunk_rows``,
``chunk_sha256`` in its manifest entry), so a partial read verifies what it reads
without reading the rest; a smaller tensor is one chunk, its ``sha256``."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message says which file and why."""


@dataclass(frozen=True)
class TensorSlice:
    """Elements [start, end) of one state of one parameter, flattened."""

    name: str
    state: str
    start: int
    end: int
    file: str
    key: str
    sha256: str
    scalar: bool = False
    """A 0-d state (such as Adam's ``step``): one whole record, range [0, 1)."""
    shape: tuple[int, ...] = ()
    """The stored tensor's shape (the parameter's, or 1-D for a flat slice)."""
    chunk_rows: int = 0
    """Rows (of dim 0) per checksummed chunk; 0: the tensor is one chunk, checked by ``sha256``."""
    chunk_sha256: tuple[str, ...] = ()


def chunk_rows(shape: tuple[int, ...] | list[int], itemsize: int, chunk_bytes: int | None = None) -> int:
    """Rows of dim 0 per checksummed chunk of a stored tensor; 0 when it is one chunk (or 0-d)."""
    if not shape:
        return 0
    row = itemsize
    for dim in shape[1:]:
        row *= dim
    rows = max(1, (chunk_bytes if chunk_bytes is not None else CHUNK_BYTES) // max(row, 1))
    return rows if shape[0] > rows else 0


def chunk_sha256s(tensor: torch.Tensor, rows: int) -> list[str]:
    """SHA-256 of each ``rows``-row chunk of ``tensor`` along dim 0 (the last one may be short)."""
    return [tensor_sha256(tensor[i : i + rows]) for i in range(0, tensor.shape[0], rows)]


def step_dir(root: Path, step: int) -> Path:
    """The directory of ``step`` under ``root``."""
    return root / f"step-{step:08d}"


def step_name(step: int) -> str:
    """``step-<t:08d>``: a step directory's name, and what ``latest`` holds."""
    return f"step-{step:08d}"


def shard_stem(shard: int, num_shards: int) -> str:
    """``shard-<k>-of-<K>``: the name of shard k's data file and manifest, without suffix."""
    return f"shard-{shard:03d}-of-{num_shards:03d}"


def tensor_key(name: str, state: str) -> str:
    """A tensor's key in a shard file: ``<parameter name>::<state>``."""
    return f"{name}{KEY_SEPARATOR}{state}"


def sha256_file(path: Path) -> str:
    """SHA-256 of a whole file (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's elements, flattened, as stored (a manifest entry's ``sha256``)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return hashlib.sha256(flat.numpy().data).hexdigest()  # the array's own buffer: no copy


def load_document(path: Path) -> dict[str, Any]:
    """A global.json or shard manifest as a dict, or a CheckpointError (bad JSON, unreadable version)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(
            f"{path}: not valid JSON (not UTF-8 text: {exc.reason} at byte {exc.start})"
        ) from None
    if not isinstance(document, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    version = document.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: format version {version!r}; this build reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
            + (
                " (written by a newer Checkmate)"
                if isinstance(version, int) and version > FORMAT_VERSION
                else ""
            )
        )
    return document


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def checked_parameters(value: object, path: Path) -> dict[str, dict[str, Any]]:
    """global.json's ``parameters``, or a CheckpointError saying what is malformed."""
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: 'parameters' is missing or not an object")
    for name, meta in value.items():
        shape = meta.get("shape") if isinstance(meta, dict) else None
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{path}: parameter {name!r} has no valid shape (a list of sizes)")
    return value


_ENTRY_FIELDS = {
    "name": str,
    "state": str,
    "key": str,
    "sha256": str,
    "shape": list,
    "start": int,
    "end": int,
}


def checked_manifest(manifest: dict[str, Any], path: Path) -> dict[str, Any]:
    """A shard manifest whose fields have the types the reader relies on, else a CheckpointError."""
    file = manifest.get("file")
    if not isinstance(file, str) or not file or Path(file).name != file:
        raise CheckpointError(f"{path}: 'file' is missing or not a file name in the step's directory")
    if not isinstance(manifest.get("file_sha256"), str):
        raise CheckpointError(f"{path}: 'file_sha256' is missing or not a string")
    entries = manifest.get("entries")
    if not isinstance(entries, list):
        raise CheckpointError(f"{path}: 'entries' is missing or not a list")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise CheckpointError(f"{path}: entry {i} is not an object")
        for key, kind in _ENTRY_FIELDS.items():
            value = entry.get(key)
            if not isinstance(value, kind) or (kind is int and not _is_int(value)):
                raise CheckpointError(f"{path}: entry {i} field {key!r} is missing or not a {kind.__name__}")
        if not 0 <= entry["start"] <= entry["end"]:
            raise CheckpointError(f"{path}: entry {i} has the range [{entry['start']}, {entry['end']})")
        rows, hashes = entry.get("chunk_rows", 0), entry.get("chunk_sha256", [])
        if not _is_int(rows) or rows < 0 or not isinstance(hashes, list):
            raise CheckpointError(f"{path}: entry {i} has malformed 'chunk_rows' / 'chunk_sha256'")
        if rows and (not entry["shape"] or len(hashes) != -(-entry["shape"][0] // rows)):
            raise CheckpointError(
                f"{path}: entry {i} ({entry['key']}) lists {len(hashes)} chunk checksums for "
                f"{entry['shape'][:1]} rows in chunks of {rows}"
            )
    return manifest
