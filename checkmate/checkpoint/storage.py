"""Where checkpoint bytes go: atomic writes, the ``latest`` pointer, complete steps, pruning.

* :func:`write_global` / :func:`write_shard` write one step's ``global.json``
  and one shard writer's data file + manifest (:mod:`checkmate.checkpoint.format`
  says what they hold). Every file is written to a temporary name, fsynced,
  renamed, and the directory fsynced (:func:`atomic_write_bytes`); a shard's
  manifest is written last, so its presence means the shard is whole.
* A step counts only when ``global.json`` and all K shard manifests are present
  (:func:`complete_steps`), so a crash mid-write leaves the previous step
  intact and the partial one ignored. :func:`update_latest` moves ``latest``
  forward only; :func:`prune` keeps the newest complete steps.
* :func:`capture_states` / :func:`parameters_of` clone what a writer needs from
  live objects.

What the files hold is built here once (:func:`global_document`, :func:`shard_contents`,
:func:`shard_manifest`, :func:`step_is_complete`, :func:`prunable`) and written either to a
local directory (this module) or to an NFS export (:mod:`checkmate.checkpoint.remote`, for a
root given as ``nfs://SERVER/EXPORT/PATH``), with the same guarantees.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes
from safetensors.torch import save_file

from checkmate.checkpoint.format import (
    FORMAT_VERSION,
    GLOBAL_FILE,
    LATEST_FILE,
    PARAM_STATE,
    SHARD_MANIFEST,
    STEP_DIR,
    CheckpointError,
    chunk_rows,
    chunk_sha256s,
    sha256_file,
    shard_stem,
    step_dir,
    step_name,
    tensor_key,
    tensor_sha256,
)
from checkmate.job_state import JobState

logger = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename inside it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so a reader sees the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def json_bytes(document: Mapping[str, Any]) -> bytes:
    """A global.json or manifest as written: indented, key-sorted JSON."""
    return (json.dumps(document, indent=1, sort_keys=True) + "\n").encode()


def atomic_write_json(path: Path, document: Mapping[str, Any]) -> None:
    """:func:`atomic_write_bytes` of ``document`` as indented, key-sorted JSON."""
    atomic_write_bytes(path, json_bytes(document))


def global_document(
    step: int,
    parameters: Mapping[str, tuple[list[int], str]],
    optimizer: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    job_state: JobState | None = None,
) -> tuple[dict[str, Any], tuple[str, bytes] | None]:
    """``global.json`` of ``step``, and the job state's file (name, bytes) it names, if any."""
    document: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "parameters": {n: {"shape": list(s), "dtype": d} for n, (s, d) in sorted(parameters.items())},
        "optimizer": dict(optimizer),
        "extra": dict(extra or {}),
    }
    job_file = None
    if job_state is not None:
        entry: dict[str, Any] = {"document": job_state.document, "file": None, "file_sha256": None}
        if job_state.tensors:
            data = safetensors_bytes(
                {k: t.detach().contiguous().cpu() for k, t in sorted(job_state.tensors.items())}
            )
            digest = hashlib.sha256(data).hexdigest()
            job_file = (f"job-state-{digest[:16]}.safetensors", data)
            entry.update(file=job_file[0], file_sha256=digest)
        document["job_state"] = entry
    return document, job_file


def write_global(
    root: Path,
    step: int,
    parameters: Mapping[str, tuple[list[int], str]],
    optimizer: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    job_state: JobState | None = None,
) -> Path:
    """Write ``global.json`` for ``step``. ``parameters``: name -> (shape, dtype string).

    ``job_state``'s tensors go first into ``job-state-<sha256 prefix>.safetensors``
    (named by its content, so shadows writing the same step never overwrite each
    other's file under another's checksum), then global.json names the file.
    """
    directory = step_dir(root, step)
    directory.mkdir(parents=True, exist_ok=True)
    document, job_file = global_document(step, parameters, optimizer, extra, job_state)
    if job_file is not None and not (directory / job_file[0]).is_file():
        atomic_write_bytes(directory / job_file[0], job_file[1])
    path = directory / GLOBAL_FILE
    atomic_write_json(path, document)
    return path


def write_shard(
    root: Path,
    step: int,
    shard: int,
    num_shards: int,
    states: Mapping[str, Mapping[str, torch.Tensor]],
    ranges: Mapping[str, tuple[int, int]] | None = None,
) -> Path:
    """Write shard ``shard`` of ``num_shards`` for ``step``: ``states[name][state] = tensor``.

    A tensor holds the whole state unless ``ranges[name]`` says it holds elements
    [start, end) of the flattened parameter (ZeRO-style writers); 0-d states
    such as Adam's ``step`` are always whole.
    """
    directory = step_dir(root, step)
    tensors, entries = shard_contents(shard, num_shards, states, ranges)
    directory.mkdir(parents=True, exist_ok=True)
    data_path = directory / f"{shard_stem(shard, num_shards)}.safetensors"
    tmp = data_path.with_name(f".{data_path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    save_file(tensors, str(tmp), metadata=shard_metadata(step))
    with tmp.open("rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, data_path)
    manifest = shard_manifest(step, shard, num_shards, data_path.name, sha256_file(data_path), entries)
    manifest_path = directory / f"{shard_stem(shard, num_shards)}.json"
    atomic_write_json(manifest_path, manifest)  # the manifest last: its presence means the shard is whole
    return manifest_path


def shard_metadata(step: int) -> dict[str, str]:
    """The safetensors header metadata of a shard's data file."""
    return {"format_version": str(FORMAT_VERSION), "step": str(step)}


def shard_manifest(
    step: int, shard: int, num_shards: int, file: str, file_sha256: str, entries: list[dict[str, Any]]
) -> dict[str, Any]:
    """A shard's manifest: its data file, that file's SHA-256 and one entry per tensor."""
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "shard": shard,
        "num_shards": num_shards,
        "file": file,
        "file_sha256": file_sha256,
        "entries": entries,
    }


def shard_contents(
    shard: int,
    num_shards: int,
    states: Mapping[str, Mapping[str, torch.Tensor]],
    ranges: Mapping[str, tuple[int, int]] | None = None,
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """A shard's tensors by key and its manifest entries (ranges and checksums checked and computed)."""
    if not 0 <= shard < num_shards:
        raise CheckpointError(f"shard {shard} is not one of 0..{num_shards - 1}")
    tensors: dict[str, torch.Tensor] = {}
    entries = []
    for name, by_state in sorted(states.items()):
        for state, tensor in sorted(by_state.items()):
            key = tensor_key(name, state)
            value = tensor.detach().contiguous().cpu()
            if value.dim() == 0:
                start, end = 0, 1
            elif ranges and name in ranges:
                start, end = ranges[name]
            else:
                start, end = 0, value.numel()
            if end - start != value.numel():
                raise CheckpointError(f"{key}: range [{start}, {end}) but the tensor has {value.numel()}")
            tensors[key] = value
            entry: dict[str, Any] = {
                "name": name,
                "state": state,
                "start": start,
                "end": end,
                "key": key,
                "shape": list(value.shape),
                "dtype": str(value.dtype),
                "sha256": tensor_sha256(value),
            }
            rows = chunk_rows(tuple(value.shape), value.element_size())
            if rows:  # a partial read checks the chunks it reads (format.CHUNK_BYTES)
                entry.update(chunk_rows=rows, chunk_sha256=chunk_sha256s(value, rows))
            entries.append(entry)
    return tensors, entries


def update_latest(root: Path, step: int) -> None:
    """Point ``root/latest`` at ``step`` unless it already names a later complete step."""
    current = read_latest(root)
    if current is not None and current >= step:
        return
    atomic_write_bytes(root / LATEST_FILE, latest_bytes(step))


def latest_bytes(step: int) -> bytes:
    """What ``latest`` holds when it names ``step``."""
    return f"{step_name(step)}\n".encode()


def parse_latest(data: bytes, where: str) -> int | None:
    """The step a ``latest`` file's bytes name (None: not a step name; ``where`` names it in the log)."""
    try:
        match = STEP_DIR.match(data.decode("utf-8").strip())
    except UnicodeDecodeError:
        logger.warning("%s: not a step name; ignored", where)
        return None
    return int(match.group(1)) if match else None


def read_latest(root: Path) -> int | None:
    """The step ``root/latest`` names (None: no pointer, or not a step name)."""
    try:
        data = (root / LATEST_FILE).read_bytes()
    except FileNotFoundError:
        return None
    return parse_latest(data, str(root / LATEST_FILE))


def step_is_complete(names: Iterable[str]) -> bool:
    """Whether a step directory holding the files ``names`` is complete: global.json and all K manifests."""
    names = list(names)
    if GLOBAL_FILE not in names:
        return False
    counts: dict[int, set[int]] = {}
    for name in names:
        shard_match = SHARD_MANIFEST.match(name)
        if shard_match:
            counts.setdefault(int(shard_match.group(2)), set()).add(int(shard_match.group(1)))
    return any(len(shards) == total for total, shards in counts.items())


def prunable(present: Iterable[int], complete: list[int], keep: int) -> list[int]:
    """Of the steps ``present``, those pruning removes: all but the newest ``keep`` complete ones, and
    partial steps older than the oldest kept (newer partial ones may still be in the making)."""
    kept = set(complete[-keep:]) if keep > 0 else set()
    oldest_kept = min(kept) if kept else None
    return sorted(
        step for step in present if step not in kept and (oldest_kept is None or step <= oldest_kept)
    )


def complete_steps(root: Path) -> list[int]:
    """Steps under ``root`` whose global record and every shard manifest are present, ascending."""
    steps: list[int] = []
    if not root.is_dir():
        return steps
    for entry in root.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and entry.is_dir() and step_is_complete(p.name for p in entry.iterdir()):
            steps.append(int(match.group(1)))
    return sorted(steps)


def prune(root: Path, keep: int) -> list[int]:
    """Remove all but the newest ``keep`` complete steps (and older partial ones)."""
    present = {}
    for entry in root.iterdir() if root.is_dir() else []:
        match = STEP_DIR.match(entry.name)
        if match:
            present[int(match.group(1))] = entry
    removed = prunable(present, complete_steps(root), keep)
    for step in removed:
        shutil.rmtree(present[step], ignore_errors=True)
    return removed


def parameters_of(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) for ``write_global``."""
    return {name: (list(t.shape), str(t.dtype)) for name, t in named}


def capture_states(
    named: Iterable[tuple[str, torch.Tensor]], optimizer: torch.optim.Optimizer | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    """Clone ``{name: {"param": value, <optimizer state>: tensor}}`` from live objects."""
    states: dict[str, dict[str, torch.Tensor]] = {}
    for name, parameter in named:
        record = {PARAM_STATE: parameter.detach().clone()}
        if optimizer is not None:
            for key, value in optimizer.state.get(parameter, {}).items():
                record[key] = torch.as_tensor(value).detach().clone()
        states[name] = record
    return states
