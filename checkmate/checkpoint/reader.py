"""Reading one complete checkpoint step: validated first, then only the bytes asked for.

:class:`CheckpointReader` merges a step's shard manifests, checks that every
parameter's every state is covered exactly once (no gap, no overlap) and that
every parameter belongs to the model's list in ``global.json``; its reads check
each tensor read whole against its SHA-256. :func:`read_job_state` reads the
step's job state (format version 2). Everything that reads a checkpoint on disk
(the loader, the exports, the CLI, the snapshot-directory state source, the
universal layouts) reads through this class.

A root given as ``nfs://SERVER/EXPORT/PATH`` (or the ``Path`` of one) is read by staging the
step first: its files are copied into a temporary local directory (removed with the reader)
and read from there (:meth:`checkmate.checkpoint.remote.RemoteRoot.stage`); ``root`` and
``directory`` are then that copy, ``location`` the URL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from checkmate.checkpoint.format import (
    GLOBAL_FILE,
    PARAM_STATE,
    SHARD_MANIFEST,
    CheckpointError,
    TensorSlice,
    checked_manifest,
    checked_parameters,
    load_document,
    sha256_file,
    step_dir,
    tensor_sha256,
)
from checkmate.checkpoint.optim_states import missing_optimizer_states
from checkmate.checkpoint.remote import RemoteRoot, url_of
from checkmate.checkpoint.storage import complete_steps
from checkmate.job_state import JobState, JobStateError

logger = logging.getLogger(__name__)


class CheckpointReader:
    """A validated view of one complete step; reads only the bytes asked for."""

    def __init__(self, root: str | os.PathLike[str], step: int | None = None, timeout: float = 60.0) -> None:
        self.location = str(root)
        """Where the checkpoint is: the root as given, or its NFS URL."""
        self._staged: tempfile.TemporaryDirectory[str] | None = None
        url = url_of(root)
        if url is not None:
            self.location = url
            root, step = self._stage(url, step, timeout)
        self.root = Path(root)
        if step is None:
            steps = complete_steps(self.root)
            if not steps:
                raise CheckpointError(f"{self.root}: no complete checkpoint")
            step = steps[-1]
        self.step = step
        self.directory = step_dir(self.root, step)
        if not (self.directory / GLOBAL_FILE).is_file():
            raise CheckpointError(f"{self.directory}: no global.json (step {step} is not complete)")
        self.global_state = load_document(self.directory / GLOBAL_FILE)
        if self.global_state.get("step") != step:
            raise CheckpointError(f"{self.directory}/global.json says step {self.global_state.get('step')}")
        self.parameters: dict[str, dict[str, Any]] = checked_parameters(
            self.global_state.get("parameters"), self.directory / GLOBAL_FILE
        )
        self.slices: dict[tuple[str, str], list[TensorSlice]] = {}
        self.elements_fetched = 0
        """Elements read from disk, checksummed chunks included (``read`` returns fewer)."""
        self.manifests = self._load_manifests()
        self._validate_coverage()

    def _stage(self, url: str, step: int | None, timeout: float) -> tuple[Path, int]:
        """Copy ``url``'s step (default: its newest complete one) into this reader's temporary directory."""
        self._staged = tempfile.TemporaryDirectory(prefix="checkmate-staged-")
        remote = RemoteRoot(url, timeout)
        try:
            step = remote.stage(Path(self._staged.name), step)
        except BaseException:
            self._staged.cleanup()
            raise
        finally:
            remote.close()
        return Path(self._staged.name), step

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
            manifest = checked_manifest(load_document(path), path)
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
                    shape=tuple(entry["shape"]),
                    chunk_rows=entry.get("chunk_rows", 0),
                    chunk_sha256=tuple(entry.get("chunk_sha256", [])),
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

    def check_optimizer_states(self) -> None:
        """Every stepped parameter holds every state its optimizer needs (:mod:`.optim_states`)."""
        optimizer = self.global_state.get("optimizer")
        problems = missing_optimizer_states(
            optimizer if isinstance(optimizer, dict) else {},
            {name: self.states_of(name) for name in self.parameters},
        )
        if problems:
            raise CheckpointError(
                f"{self.directory}: incomplete optimizer state: "
                + "; ".join(problems[:3])
                + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
            )

    def states_of(self, name: str) -> list[str]:
        return sorted(state for (n, state) in self.slices if n == name)

    def read(
        self, name: str, state: str = PARAM_STATE, start: int = 0, end: int | None = None
    ) -> torch.Tensor:
        """Elements [start, end) of ``name``'s ``state``, flattened (0-d states as they are).

        Every byte returned is checked: a tensor read whole against its SHA-256, a
        range through the checksummed chunks of rows that hold it (only those are
        read). A mismatch raises CheckpointError naming the file and the tensor.
        """
        pieces = self.slices.get((name, state))
        if pieces is None:
            raise CheckpointError(f"step {self.step} has no {name}::{state}")
        if pieces[0].scalar:
            with self._open(pieces[0].file) as handle:
                tensor = handle.get_tensor(pieces[0].key)
            self._check(pieces[0], tensor, pieces[0].sha256, "")
            self.elements_fetched += 1
            return tensor
        stop = end if end is not None else max(p.end for p in pieces)
        out = []
        for piece in sorted(pieces, key=lambda p: p.start):
            lo, hi = max(start, piece.start), min(stop, piece.end)
            if lo >= hi:
                continue
            with self._open(piece.file) as handle:
                out.append(self._read_range(handle, piece, lo - piece.start, hi - piece.start))
        if not out:
            return torch.empty(0)
        return torch.cat(out) if len(out) != 1 else out[0]

    def _check(self, piece: TensorSlice, tensor: torch.Tensor, expected: str, what: str) -> None:
        if tensor_sha256(tensor) != expected:
            raise CheckpointError(
                f"{self.directory / piece.file}: {piece.key}{what} fails its checksum (corrupted file)"
            )

    def read_rows(self, handle: Any, piece: TensorSlice, first: int, last: int) -> torch.Tensor:
        """Rows [first, last) of dim 0 of ``piece``'s stored tensor (of an open file), checksum-verified.

        Reads the checksummed chunks that hold the rows (or the whole tensor when
        it is one chunk) and checks each before anything is returned.
        """
        view = handle.get_slice(piece.key)
        shape = tuple(view.get_shape())
        if shape != piece.shape:
            raise CheckpointError(
                f"{self.directory / piece.file}: {piece.key} has shape {shape}, manifest {piece.shape}"
            )
        rows = piece.chunk_rows
        if not rows:
            tensor = handle.get_tensor(piece.key)
            self._check(piece, tensor, piece.sha256, "")
            self.elements_fetched += tensor.numel()
            return tensor[first:last]
        lo, hi = (first // rows) * rows, min(-(-last // rows) * rows, shape[0])
        block = view[lo:hi]
        for chunk in range(lo // rows, -(-hi // rows)):
            a, b = chunk * rows - lo, min((chunk + 1) * rows, shape[0]) - lo
            self._check(piece, block[a:b], piece.chunk_sha256[chunk], f" (rows {a + lo}..{b + lo})")
        self.elements_fetched += block.numel()
        return block[first - lo : last - lo]

    def _read_range(self, handle: Any, piece: TensorSlice, lo: int, hi: int) -> torch.Tensor:
        """Flat elements [lo, hi) of a stored tensor: the verified rows of dim 0 that hold them."""
        row = 1
        for dim in piece.shape[1:]:
            row *= dim
        first, last = lo // row, (hi + row - 1) // row
        rows = self.read_rows(handle, piece, first, last).reshape(-1)
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
            if sha256_file(path) != manifest["file_sha256"]:
                raise CheckpointError(f"{path}: file checksum mismatch (corrupted or truncated)")


def read_job_state(directory: Path, global_state: Mapping[str, Any]) -> JobState | None:
    """The job state global.json names (its tensor file checked against its SHA-256), or None."""
    entry = global_state.get("job_state")
    if entry is None:
        return None
    where = directory / GLOBAL_FILE
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
        if sha256_file(path) != entry.get("file_sha256"):
            raise CheckpointError(f"{path}: file checksum mismatch (corrupted or truncated)")
        try:
            tensors = load_file(str(path))
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: cannot be read ({exc})") from None
    try:
        return JobState(entry["document"], tensors).validate()
    except JobStateError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
