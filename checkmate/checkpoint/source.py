"""Sources of a job's state: one small interface, and the snapshot-directory source.

A *state source* hands out a certified state of the whole job — every parameter
by name, its optimizer state, the optimizer's description, the job state,
the data position — as one :class:`RestoredState`, whatever holds it:

* :class:`SnapshotDirectory` — the newest complete universal checkpoint in a
  directory (the shadows' snapshots on disk, or on an NFS export given as
  ``nfs://SERVER/EXPORT/PATH``), read through
  :class:`~checkmate.checkpoint.reader.CheckpointReader`;
* :class:`checkmate.checkpoint.shadow_memory.ShadowMemory` — the latest iteration every shadow holds
  in memory, fetched over their control port.

Restore code (``hosts.resume``, the shadows' digest command) asks sources through
:class:`StateSource` only and loads what they give with
:func:`checkmate.checkpoint.load.load_state`.
"""

from __future__ import annotations

import fnmatch
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from checkmate.checkpoint.format import PARAM_STATE, CheckpointError
from checkmate.checkpoint.reader import CheckpointReader
from checkmate.checkpoint.remote import RemoteRoot, url_of
from checkmate.job_state import JobState

logger = logging.getLogger(__name__)

SOURCE_SHADOW_MEMORY = "shadow-memory"
SOURCE_SNAPSHOT = "snapshot"
SOURCE_NONE = "none"
STATUS_FILES = "status-*.json"
"""The shadows' status files, rewritten beside their snapshots about once a second."""


class SourceError(RuntimeError):
    """A source holds no usable state; the message says which source and why."""


@dataclass
class RestoredState:
    """A certified state: everything of the job after ``iteration``."""

    iteration: int
    """The last iteration applied; training resumes at ``iteration + 1``."""
    source: str
    """:data:`SOURCE_SHADOW_MEMORY` or :data:`SOURCE_SNAPSHOT`."""
    parameters: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Parameter name -> its optimizer state (``exp_avg``, ``step``, ...)."""
    optimizer_step: int = 0
    data_position: Any = None
    """Where to resume the data after ``iteration`` (``agent.set_data_position``); None: unknown."""
    detail: str = ""
    """Where exactly it came from (shadow names, snapshot directory)."""
    job_state: JobState | None = None
    """Buffers, stateful objects, param groups after ``iteration`` (None: a version-1 checkpoint)."""
    optimizer_kind: str | None = None
    lost_iterations: int | None = None
    """From disk: iterations the shadows had applied beyond ``iteration`` (None: unknown; 0 from memory)."""
    optimizer: dict[str, Any] = field(default_factory=dict)
    """The optimizer's description: ``kind`` and ``param_groups`` (hyperparameters, parameter names)."""

    @property
    def next_iteration(self) -> int:
        return self.iteration + 1


@runtime_checkable
class StateSource(Protocol):
    """Something that holds a certified state of a job."""

    kind: str
    """:data:`SOURCE_SHADOW_MEMORY`, :data:`SOURCE_SNAPSHOT`, ..."""

    def describe(self) -> str:
        """Where the source looks (for logs and errors)."""
        ...

    def latest(self, timeout: float) -> RestoredState:
        """The newest state the source can certify, within ``timeout`` seconds; SourceError if none."""
        ...


def state_of_reader(reader: CheckpointReader, source: str = SOURCE_SNAPSHOT) -> RestoredState:
    """Everything of ``reader``'s step, read and checked (CheckpointError if a byte is off)."""
    parameters = {name: reader.parameter(name) for name in reader.parameters}
    states = {
        name: {s: reader.parameter(name, s) for s in reader.states_of(name) if s != PARAM_STATE}
        for name in reader.parameters
    }
    optimizer = reader.global_state.get("optimizer")
    optimizer = dict(optimizer) if isinstance(optimizer, dict) else {}
    extra = reader.global_state.get("extra")
    extra = extra if isinstance(extra, dict) else {}
    return RestoredState(
        iteration=reader.step,
        source=source,
        parameters=parameters,
        optimizer_state=states,
        optimizer_step=int(extra.get("optimizer_step", 0) or 0),
        data_position=extra.get("data_position"),
        detail=str(reader.directory),
        job_state=reader.job_state(),
        optimizer_kind=optimizer.get("kind"),
        optimizer=optimizer,
    )


def shadows_reached(directory: str | Path) -> int | None:
    """The latest iteration any shadow reported applied in its status file in ``directory`` (None: none).

    A remote directory (``nfs://``) holds the ``status-<shadow>.json`` that the shadows' snapshot
    writers put there (:meth:`shadow.snapshots.Snapshotter.publish_status`); None when it holds none.
    """
    reached = None
    url = url_of(directory)
    documents: list[bytes] = []
    if url is not None:
        remote = RemoteRoot(url)
        try:
            names = [n for n in remote.listdir() if fnmatch.fnmatch(n, STATUS_FILES)]
            documents = [remote.read_file(name) for name in names]
        except OSError as exc:
            logger.warning("cannot read the shadows' status files in %s: %s", url, exc)
        finally:
            remote.close()
    else:
        for path in Path(directory).glob(STATUS_FILES):
            try:
                documents.append(path.read_bytes())
            except OSError:
                continue
    for document in documents:
        try:
            applied = json.loads(document.decode("utf-8")).get("applied_iteration")
        except (ValueError, AttributeError):
            continue
        if isinstance(applied, int) and (reached is None or applied > reached):
            reached = applied
    return reached


class SnapshotDirectory:
    """The newest complete checkpoint in a snapshot directory (or one given ``step``).

    Its state's ``lost_iterations`` says how far the shadows' memory was ahead of
    it, from their status files in the same directory (rewritten once a second,
    so a lower bound); None when there are none.

    ``directory`` may be ``nfs://SERVER/EXPORT/PATH`` (also as the ``Path`` of it, which reads
    ``nfs:/SERVER/...``): the step is staged locally and read from there; each NFS call is
    bounded by ``timeout`` (60 s when not given).
    """

    kind = SOURCE_SNAPSHOT

    def __init__(self, directory: str | Path, step: int | None = None) -> None:
        url = url_of(directory)
        self.directory: str | Path = url if url is not None else Path(directory)
        self.step = step

    def describe(self) -> str:
        return f"snapshots in {self.directory}"

    def latest(self, timeout: float = 0.0) -> RestoredState:
        """Read the step (local reads take no timeout); SourceError when none is usable."""
        try:
            reader = CheckpointReader(self.directory, self.step, timeout if timeout > 0 else 60.0)
            state = state_of_reader(reader)
        except (CheckpointError, OSError, KeyError) as exc:
            raise SourceError(f"no usable checkpoint in {self.directory}: {exc}") from None
        if reader.location != str(reader.root):
            state.detail = f"{reader.location}/{reader.directory.name}"
        reached = shadows_reached(self.directory)
        state.lost_iterations = None if reached is None else max(0, reached - state.iteration)
        return state
