"""Checkpoint roots on an NFS export: ``nfs://SERVER/EXPORT/PATH`` where a directory is expected.

The shadows' snapshot directory and the directory restore reads may be an NFS URL (the form
``make bench --storage remote``'s peers write to, :mod:`checkmate.nfs`). :class:`RemoteRoot`
writes there what :mod:`checkmate.checkpoint.storage` writes locally, built by the same
functions, with the same guarantees:

* every file is written to a temporary name of its own, committed (NFS COMMIT) and renamed
  over its final name (:func:`checkmate.nfs.write_atomically`): a reader sees the old file or
  the whole new one;
* a shard's manifest is written after its data file, so a step counts only when global.json
  and all K manifests are there (:func:`~checkmate.checkpoint.storage.step_is_complete`);
  ``latest`` moves forward only, to a complete step; pruning keeps the newest complete steps.

A shard's data file is serialized in memory before it is sent (``safetensors.torch.save``:
one more copy of the shard while it is written, where the local writer streams to the file).
A failed call (server unreachable, export full, no answer within the timeout) raises
:class:`checkmate.nfs.NFSError` naming the file; unless the error is the server's answer
(:data:`ANSWERS`) the connection is dropped and the next call connects again. Nothing of a
failed write is ever under a final name.

Reading stages one step (:meth:`RemoteRoot.stage`): its files are copied to a local directory
and :class:`~checkmate.checkpoint.reader.CheckpointReader` reads that, so every check of a
local read applies (the copy costs the step's size in local disk and one read over the link).

``Path("nfs://server/export/path")`` collapses the double slash (``nfs:/server/export/path``);
:func:`url_of` takes that form back to the URL, so a caller that made a ``Path`` of the URL
still reaches the export.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from checkmate import nfs
from checkmate.checkpoint import storage
from checkmate.checkpoint.format import (
    GLOBAL_FILE,
    LATEST_FILE,
    STEP_DIR,
    CheckpointError,
    shard_stem,
    step_name,
)
from checkmate.job_state import JobState

logger = logging.getLogger(__name__)

SCHEME = nfs.SCHEME
ANSWERS = frozenset(
    (errno.ENOENT, errno.ESTALE, errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR,
     errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)
)  # fmt: skip
"""Errors that are the server's answer: the connection is fine and kept (any other drops it)."""
GONE = frozenset((errno.ENOENT, errno.ESTALE, errno.ENOTEMPTY))
"""What pruning a step meets when another shadow prunes it at the same time (NFS3ERR_STALE included)."""
_COLLAPSED = "nfs:/"
"""What ``Path`` makes of ``nfs://``."""


def url_of(location: str | os.PathLike[str]) -> str | None:
    """The NFS URL ``location`` names (also the ``Path``-collapsed ``nfs:/SERVER/...`` form); None: local."""
    text = os.fspath(location)
    if text.startswith(SCHEME):
        return SCHEME + text[len(SCHEME) :].rstrip("/")
    if text.startswith(_COLLAPSED):
        return SCHEME + text[len(_COLLAPSED) :].rstrip("/")
    return None


class RemoteRoot:
    """A checkpoint root on an NFS export, one connection (made when first needed, again after a failure).

    ``file_mode``/``dir_mode``: what it creates (the snapshots hold the model: the owner's only).
    One thread at a time (the snapshot writer); :meth:`close` drops the connection.
    """

    def __init__(
        self,
        url: str,
        timeout: float = nfs.DEFAULT_TIMEOUT_S,
        file_mode: int = 0o600,
        dir_mode: int = 0o700,
    ) -> None:
        found = url_of(url)
        if found is None:
            raise ValueError(f"not an NFS URL (nfs://SERVER/EXPORT/PATH): {url!r}")
        self.location = nfs.NFSURL.parse(found)
        self.url = str(self.location)
        if timeout <= 0:
            raise ValueError(f"{self.url}: the NFS timeout must be positive, not {timeout}")
        self.timeout = timeout
        self.file_mode, self.dir_mode = file_mode, dir_mode
        self._client: nfs.NFSClient | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteRoot({self.url!r})"

    # ---- the connection ----------------------------------------------------------------------
    def client(self) -> nfs.NFSClient:
        with self._lock:
            if self._client is None:
                self._client = nfs.NFSClient(self.location.server, self.location.export, self.timeout)
            return self._client

    def close(self) -> None:
        """Drop the connection (the next call connects again)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _path(self, *parts: str) -> str:
        return "/".join([self.location.path.rstrip("/"), *parts]) or "/"

    def _step_path(self, step: int, *parts: str) -> str:
        return self._path(step_name(step), *parts)

    def _failed(self, exc: nfs.NFSError) -> None:
        """Drop the connection unless ``exc`` is the server's answer (a timed-out one is not reused)."""
        if exc.errno not in ANSWERS:
            self.close()

    def _write(self, path: str, data: bytes | memoryview) -> None:
        try:
            nfs.write_atomically(self.client(), path, lambda stream: stream.write(data), self.file_mode)
        except nfs.NFSError as exc:
            self._failed(exc)
            raise

    def _call(self, what: str, *args: Any) -> Any:
        """``client.<what>(*args)``; an NFS failure raises (the connection kept if the server answered)."""
        try:
            return getattr(self.client(), what)(*args)
        except nfs.NFSError as exc:
            self._failed(exc)
            raise

    def _listdir(self, path: str) -> list[str]:
        """The names in ``path`` ([] when it does not exist)."""
        try:
            names: list[str] = self._call("listdir", path)
        except nfs.NFSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                return []
            raise
        return names

    # ---- writing (storage.py's functions, on the export) ------------------------------------
    def write_global(
        self,
        step: int,
        parameters: Mapping[str, tuple[list[int], str]],
        optimizer: Mapping[str, Any],
        extra: Mapping[str, Any] | None = None,
        job_state: JobState | None = None,
    ) -> str:
        """:func:`checkmate.checkpoint.storage.write_global` on the export; the URL of its global.json."""
        document, job_file = storage.global_document(step, parameters, optimizer, extra, job_state)
        self._call("makedirs", self._step_path(step), True, self.dir_mode)
        if job_file is not None and job_file[0] not in self._listdir(self._step_path(step)):
            self._write(self._step_path(step, job_file[0]), job_file[1])
        self._write(self._step_path(step, GLOBAL_FILE), storage.json_bytes(document))
        return f"{self.url}/{step_name(step)}/{GLOBAL_FILE}"

    def write_shard(
        self,
        step: int,
        shard: int,
        num_shards: int,
        states: Mapping[str, Mapping[str, torch.Tensor]],
        ranges: Mapping[str, tuple[int, int]] | None = None,
    ) -> str:
        """:func:`checkmate.checkpoint.storage.write_shard` on the export (data file, then its manifest)."""
        tensors, entries = storage.shard_contents(shard, num_shards, states, ranges)
        data = safetensors_bytes(tensors, metadata=storage.shard_metadata(step))
        stem = shard_stem(shard, num_shards)
        self._call("makedirs", self._step_path(step), True, self.dir_mode)
        self._write(self._step_path(step, f"{stem}.safetensors"), data)
        manifest = storage.shard_manifest(
            step, shard, num_shards, f"{stem}.safetensors", hashlib.sha256(data).hexdigest(), entries
        )
        self._write(self._step_path(step, f"{stem}.json"), storage.json_bytes(manifest))
        return f"{self.url}/{step_name(step)}/{stem}.json"

    def write_file(self, name: str, data: bytes) -> None:
        """A file directly under the root (``status-sh1.json``), whole or not at all (temporary, RENAME)."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"{name!r} is not a plain file name under {self.url}")
        self._call("makedirs", self._path(), True, self.dir_mode)
        self._write(self._path(name), data)

    def has_global(self, step: int) -> bool:
        """Whether ``step``'s global.json is on the export (another shard started the step)."""
        return GLOBAL_FILE in self._listdir(self._step_path(step))

    def steps_present(self) -> list[int]:
        """Every step directory on the export, complete or not."""
        return sorted(int(m.group(1)) for name in self._listdir(self._path()) if (m := STEP_DIR.match(name)))

    def complete_steps(self) -> list[int]:
        """:func:`checkmate.checkpoint.storage.complete_steps` on the export."""
        return [
            s for s in self.steps_present() if storage.step_is_complete(self._listdir(self._step_path(s)))
        ]

    def read_latest(self) -> int | None:
        """The step the export's ``latest`` names (None: none)."""
        try:
            data = self._read(self._path(LATEST_FILE))
        except nfs.NFSError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise
        return storage.parse_latest(data, f"{self.url}/{LATEST_FILE}")

    def update_latest(self, step: int) -> None:
        """Point ``latest`` at ``step`` unless it already names a later step."""
        current = self.read_latest()
        if current is None or current < step:
            self._write(self._path(LATEST_FILE), storage.latest_bytes(step))

    def prune(self, keep: int) -> list[int]:
        """:func:`checkmate.checkpoint.storage.prune` on the export.

        Shadows sharing the directory prune the same steps: a step another one is removing
        (ENOENT, or NFS3ERR_STALE for a directory gone under a listing) is left to it.
        """
        removed = storage.prunable(self.steps_present(), self.complete_steps(), keep)
        for step in removed:
            try:
                self._call("rmtree", self._step_path(step))
            except nfs.NFSError as exc:
                if exc.errno not in GONE:
                    raise
                logger.debug("%s/%s: pruned by another writer meanwhile (%s)", self.url, step_name(step), exc)
        return removed

    # ---- reading ----------------------------------------------------------------------------
    def _read(self, path: str) -> bytes:
        try:
            with self.client().open(path, "rb") as stream:
                data: bytes = stream.read()
        except nfs.NFSError as exc:
            self._failed(exc)
            raise
        return data

    def read_file(self, name: str) -> bytes:
        """A file under the root by its relative name (``status-sh1.json``, ``step-00000003/global.json``)."""
        return self._read(self._path(*name.split("/")))

    def listdir(self, name: str = "") -> list[str]:
        """The names under the root (or under ``name`` in it); [] when it does not exist."""
        return self._listdir(self._path(*[p for p in name.split("/") if p]))

    def stage(self, into: Path, step: int | None = None) -> int:
        """Copy ``step`` (default: the newest complete one) and ``latest`` into the local ``into``.

        CheckpointError when the export holds no such complete step; NFSError when it cannot be read.
        """
        complete = self.complete_steps()
        if step is None:
            if not complete:
                raise CheckpointError(f"{self.url}: no complete checkpoint")
            step = complete[-1]
        elif step not in complete:
            raise CheckpointError(f"{self.url}: step {step} is not complete (complete: {complete})")
        target = into / step_name(step)
        target.mkdir(parents=True, exist_ok=True, mode=0o700)
        for name in self._listdir(self._step_path(step)):
            if name.startswith("."):  # another writer's temporary file
                continue
            (target / name).write_bytes(self._read(self._step_path(step, name)))
        latest = self.read_latest()
        if latest is not None:
            (into / LATEST_FILE).write_bytes(storage.latest_bytes(latest))
        logger.info("staged %s/%s into %s", self.url, step_name(step), target)
        return step
