"""The universal checkpoint format: layout-free, one record per parameter.

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

Nothing records ranks or padding, so any layout can load it: the reader
merges the shard manifests, checks every parameter's every state is covered
exactly once, and reads only the bytes a caller asks for. Every file is
written to a temporary name, fsynced, renamed, and the directory fsynced; a
step counts only when ``global.json`` and all K shard manifests are present,
so a crash mid-write leaves the previous step intact and the partial one
ignored. docs/checkpoint-format.md is the specification.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from safetensors.torch import save as safetensors_bytes

from checkmate.job_state import JobState, JobStateError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""Version 2 added ``job_state`` to global.json (version 1 steps read as steps without one)."""
READABLE_VERSIONS = (1, 2)
STEP_DIR = re.compile(r"^step-(\d{8})$")
SHARD_MANIFEST = re.compile(r"^shard-(\d{3})-of-(\d{3})\.json$")
KEY_SEPARATOR = "::"
PARAM_STATE = "param"

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64)}


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


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def shard_stem(shard: int, num_shards: int) -> str:
    return f"shard-{shard:03d}-of-{num_shards:03d}"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _tensor_sha256(tensor: torch.Tensor) -> str:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _atomic_write_json(path: Path, document: Mapping[str, Any]) -> None:
    _atomic_write_bytes(path, (json.dumps(document, indent=1, sort_keys=True) + "\n").encode())


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
    document: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "parameters": {n: {"shape": list(s), "dtype": d} for n, (s, d) in sorted(parameters.items())},
        "optimizer": dict(optimizer),
        "extra": dict(extra or {}),
    }
    if job_state is not None:
        entry: dict[str, Any] = {"document": job_state.document, "file": None, "file_sha256": None}
        if job_state.tensors:
            data = safetensors_bytes(
                {k: t.detach().contiguous().cpu() for k, t in sorted(job_state.tensors.items())}
            )
            digest = hashlib.sha256(data).hexdigest()
            name = f"job-state-{digest[:16]}.safetensors"
            if not (directory / name).is_file():
                _atomic_write_bytes(directory / name, data)
            entry.update(file=name, file_sha256=digest)
        document["job_state"] = entry
    path = directory / "global.json"
    _atomic_write_json(path, document)
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
    if not 0 <= shard < num_shards:
        raise CheckpointError(f"shard {shard} is not one of 0..{num_shards - 1}")
    directory = step_dir(root, step)
    directory.mkdir(parents=True, exist_ok=True)
    stem = shard_stem(shard, num_shards)
    tensors: dict[str, torch.Tensor] = {}
    entries = []
    for name, by_state in sorted(states.items()):
        for state, tensor in sorted(by_state.items()):
            key = f"{name}{KEY_SEPARATOR}{state}"
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
            entries.append(
                {
                    "name": name,
                    "state": state,
                    "start": start,
                    "end": end,
                    "key": key,
                    "shape": list(value.shape),
                    "dtype": str(value.dtype),
                    "sha256": _tensor_sha256(value),
                }
            )
    data_path = directory / f"{stem}.safetensors"
    tmp = data_path.with_name(f".{data_path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    save_file(tensors, str(tmp), metadata={"format_version": str(FORMAT_VERSION), "step": str(step)})
    with tmp.open("rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, data_path)
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "shard": shard,
        "num_shards": num_shards,
        "file": data_path.name,
        "file_sha256": _sha256_file(data_path),
        "entries": entries,
    }
    manifest_path = directory / f"{stem}.json"
    _atomic_write_json(manifest_path, manifest)  # the manifest last: its presence means the shard is whole
    return manifest_path


def update_latest(root: Path, step: int) -> None:
    """Point ``root/latest`` at ``step`` unless it already names a later complete step."""
    current = read_latest(root)
    if current is not None and current >= step:
        return
    _atomic_write_bytes(root / "latest", f"step-{step:08d}\n".encode())


def read_latest(root: Path) -> int | None:
    try:
        match = STEP_DIR.match((root / "latest").read_text(encoding="utf-8").strip())
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        logger.warning("%s: not a step name; ignored", root / "latest")
        return None
    return int(match.group(1)) if match else None


def _load_json(path: Path) -> dict[str, Any]:
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


def complete_steps(root: Path) -> list[int]:
    """Steps under ``root`` whose global record and every shard manifest are present, ascending."""
    steps: list[int] = []
    if not root.is_dir():
        return steps
    for entry in root.iterdir():
        match = STEP_DIR.match(entry.name)
        if not match or not (entry / "global.json").is_file():
            continue
        counts: dict[int, set[int]] = {}
        for manifest in entry.iterdir():
            shard_match = SHARD_MANIFEST.match(manifest.name)
            if shard_match:
                counts.setdefault(int(shard_match.group(2)), set()).add(int(shard_match.group(1)))
        if any(len(shards) == total for total, shards in counts.items()):
            steps.append(int(match.group(1)))
    return sorted(steps)


def prune(root: Path, keep: int) -> list[int]:
    """Remove all but the newest ``keep`` complete steps (and older partial ones)."""
    complete = complete_steps(root)
    kept = set(complete[-keep:]) if keep > 0 else set()
    oldest_kept = min(kept) if kept else None
    removed = []
    for entry in root.iterdir() if root.is_dir() else []:
        match = STEP_DIR.match(entry.name)
        if not match:
            continue
        step = int(match.group(1))
        if step in kept or (oldest_kept is not None and step > oldest_kept):
            continue  # newer partial steps may still be in the making
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(step)
    return sorted(removed)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked_parameters(value: object, path: Path) -> dict[str, dict[str, Any]]:
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


def _checked_manifest(manifest: dict[str, Any], path: Path) -> dict[str, Any]:
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
    return manifest


class CheckpointReader:
    """A validated view of one complete step; reads only the bytes asked for."""

    def __init__(self, root: Path, step: int | None = None) -> None:
        self.root = Path(root)
        if step is None:
            steps = complete_steps(self.root)
            if not steps:
                raise CheckpointError(f"{self.root}: no complete checkpoint")
            step = steps[-1]
        self.step = step
        self.directory = step_dir(self.root, step)
        if not (self.directory / "global.json").is_file():
            raise CheckpointError(f"{self.directory}: no global.json (step {step} is not complete)")
        self.global_state = _load_json(self.directory / "global.json")
        if self.global_state.get("step") != step:
            raise CheckpointError(f"{self.directory}/global.json says step {self.global_state.get('step')}")
        self.parameters: dict[str, dict[str, Any]] = _checked_parameters(
            self.global_state.get("parameters"), self.directory / "global.json"
        )
        self.slices: dict[tuple[str, str], list[TensorSlice]] = {}
        self.manifests = self._load_manifests()
        self._validate_coverage()

    def _load_manifests(self) -> list[dict[str, Any]]:
        groups: dict[int, list[Path]] = {}
        for path in sorted(self.directory.glob("shard-*-of-*.json")):
            match = SHARD_MANIFEST.match(path.name)
            if match:
                groups.setdefault(int(match.group(2)), []).append(path)
        complete = [paths for total, paths in groups.items() if len(paths) == total]
        if len(complete) != 1:
            raise CheckpointError(
                f"{self.directory}: expected one complete set of shard manifests, found "
                f"{ {total: len(paths) for total, paths in groups.items()} }"
            )
        manifests = []
        for path in complete[0]:
            manifest = _checked_manifest(_load_json(path), path)
            if manifest.get("step") != self.step:
                raise CheckpointError(f"{path}: belongs to step {manifest.get('step')}, not {self.step}")
            if not (self.directory / manifest["file"]).is_file():
                raise CheckpointError(f"{path}: its data file {manifest['file']} is missing")
            for entry in manifest["entries"]:
                item = TensorSlice(
                    entry["name"],
                    entry["state"],
                    entry["start"],
                    entry["end"],
                    manifest["file"],
                    entry["key"],
                    entry["sha256"],
                    scalar=entry["shape"] == [],
                )
                if item.name not in self.parameters:
                    raise CheckpointError(
                        f"{path}: parameter {item.name!r} is not in the model "
                        f"(a checkpoint of another model?)"
                    )
                self.slices.setdefault((item.name, item.state), []).append(item)
            manifests.append(manifest)
        return manifests

    def _validate_coverage(self) -> None:
        for name, meta in self.parameters.items():
            numel = 1
            for dim in meta["shape"]:
                numel *= dim
            states = [state for (n, state) in self.slices if n == name]
            if PARAM_STATE not in states:
                raise CheckpointError(f"{self.directory}: parameter {name!r} is in no shard")
            for state in states:
                pieces = sorted(self.slices[(name, state)], key=lambda s: s.start)
                if any(p.scalar for p in pieces):
                    if len(pieces) != 1:
                        raise CheckpointError(
                            f"{self.directory}: {name}::{state} is stored {len(pieces)} times"
                        )
                    continue
                cursor = 0
                for piece in pieces:
                    if piece.start != cursor:
                        kind = "overlap" if piece.start < cursor else "gap"
                        raise CheckpointError(
                            f"{self.directory}: {name}::{state} has a {kind} at element {cursor}"
                        )
                    cursor = piece.end
                if cursor != numel:
                    raise CheckpointError(
                        f"{self.directory}: {name}::{state} covers {cursor} of {numel} elements"
                    )

    @contextlib.contextmanager
    def _open(self, file: str) -> Iterator[Any]:
        path = self.directory / file
        try:
            with safe_open(str(path), framework="pt") as handle:
                yield handle
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: cannot be read ({exc}); truncated or corrupted") from None

    def job_state(self) -> JobState | None:
        """The step's job state (buffers, stateful objects, param groups); None in a version-1 step."""
        return read_job_state(self.directory, self.global_state)

    def states_of(self, name: str) -> list[str]:
        return sorted(state for (n, state) in self.slices if n == name)

    def read(
        self, name: str, state: str = PARAM_STATE, start: int = 0, end: int | None = None, verify: bool = True
    ) -> torch.Tensor:
        """Elements [start, end) of ``name``'s ``state``, flattened (0-d states as they are).

        Only the bytes of the range are read. A tensor read whole is checked
        against its SHA-256; a partial read cannot be (``verify_files`` checks
        every byte of a step).
        """
        pieces = self.slices.get((name, state))
        if pieces is None:
            raise CheckpointError(f"step {self.step} has no {name}::{state}")
        if pieces[0].scalar:
            with self._open(pieces[0].file) as handle:
                tensor = handle.get_tensor(pieces[0].key)
            if verify and _tensor_sha256(tensor) != pieces[0].sha256:
                raise CheckpointError(
                    f"{self.directory / pieces[0].file}: {pieces[0].key} fails its checksum"
                )
            return tensor
        stop = end if end is not None else max(p.end for p in pieces)
        out = []
        for piece in sorted(pieces, key=lambda p: p.start):
            lo, hi = max(start, piece.start), min(stop, piece.end)
            if lo >= hi:
                continue
            with self._open(piece.file) as handle:
                if lo == piece.start and hi == piece.end:
                    part = handle.get_tensor(piece.key).reshape(-1)
                    if verify and _tensor_sha256(part) != piece.sha256:
                        raise CheckpointError(
                            f"{self.directory / piece.file}: {piece.key} fails its checksum"
                        )
                else:
                    part = self._read_range(handle, piece, lo - piece.start, hi - piece.start)
            out.append(part)
        if not out:
            return torch.empty(0)
        return torch.cat(out) if len(out) != 1 else out[0]

    @staticmethod
    def _read_range(handle: Any, piece: TensorSlice, lo: int, hi: int) -> torch.Tensor:
        """Flat elements [lo, hi) of a stored tensor, reading whole rows of its first dimension only."""
        view = handle.get_slice(piece.key)
        shape = view.get_shape()
        if len(shape) <= 1:
            return view[lo:hi].reshape(-1)
        row = 1
        for dim in shape[1:]:
            row *= dim
        first, last = lo // row, (hi + row - 1) // row
        rows = view[first:last].reshape(-1)
        return rows[lo - first * row : hi - first * row]

    def parameter(self, name: str, state: str = PARAM_STATE) -> torch.Tensor:
        """The whole state of ``name``, in the parameter's shape (0-d states as stored)."""
        flat = self.read(name, state)
        if flat.dim() == 0:
            return flat
        return flat.reshape(self.parameters[name]["shape"])

    def verify_files(self) -> None:
        """Hash every shard file against its manifest (reads every byte)."""
        for manifest in self.manifests:
            path = self.directory / manifest["file"]
            if _sha256_file(path) != manifest["file_sha256"]:
                raise CheckpointError(f"{path}: file checksum mismatch (corrupted or truncated)")


def read_job_state(directory: Path, global_state: Mapping[str, Any]) -> JobState | None:
    """The job state global.json names (its tensor file checked against its SHA-256), or None."""
    entry = global_state.get("job_state")
    if entry is None:
        return None
    where = directory / "global.json"
    if not isinstance(entry, dict) or not isinstance(entry.get("document"), dict):
        raise CheckpointError(f"{where}: 'job_state' is not an object with a 'document'")
    tensors: dict[str, torch.Tensor] = {}
    file = entry.get("file")
    if file is not None:
        if not isinstance(file, str) or Path(file).name != file:
            raise CheckpointError(f"{where}: job_state 'file' is not a file name in the step's directory")
        path = directory / file
        if not path.is_file():
            raise CheckpointError(f"{where}: its job state file {file} is missing")
        if _sha256_file(path) != entry.get("file_sha256"):
            raise CheckpointError(f"{path}: file checksum mismatch (corrupted or truncated)")
        try:
            tensors = load_file(str(path))
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: cannot be read ({exc})") from None
    try:
        return JobState(entry["document"], tensors).validate()
    except JobStateError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


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
