"""Checkpoints: the universal, layout-free format, on disk and in the shadows' memory.

One package, shaped like ``torch.distributed.checkpoint``:

* :mod:`~checkmate.checkpoint.format` — what a step holds: schema, paths, version
  constants (version 2 writes, versions 1 and 2 read), the checks every document
  passes, checksums.
* :mod:`~checkmate.checkpoint.storage` — where the bytes go: atomic writes of
  ``global.json`` and shard files, the ``latest`` pointer, complete steps, pruning.
* :mod:`~checkmate.checkpoint.reader` — :class:`CheckpointReader`, a validated view
  of one complete step that reads only the bytes asked for.
* :mod:`~checkmate.checkpoint.source` — the state-source interface
  (:class:`~checkmate.checkpoint.source.StateSource`) and the snapshot-directory
  source; the shadow-memory source is :class:`checkmate.checkpoint.shadow_memory.ShadowMemory`.
* :mod:`~checkmate.checkpoint.load` — the one loader: a whole model, optimizer and
  job state from any source's state, or one rank's ZeRO-1 slice.
* :mod:`~checkmate.checkpoint.digest` — the digests that say whether two states are
  equal bit for bit.
* :mod:`~checkmate.checkpoint.export` — DCP, safetensors, DeepSpeed universal, resharding.
* :mod:`~checkmate.checkpoint.cli` — ``checkmate-ckpt``.

The names below are the format's API (writers and readers import them from here);
parallel layouts live in :mod:`checkmate.universal`. docs/checkpoint-format.md is
the specification.
"""

from __future__ import annotations

from checkmate.checkpoint.format import (
    FORMAT_VERSION,
    KEY_SEPARATOR,
    PARAM_STATE,
    READABLE_VERSIONS,
    SHARD_MANIFEST,
    STEP_DIR,
    CheckpointError,
    TensorSlice,
    shard_stem,
    step_dir,
)
from checkmate.checkpoint.reader import CheckpointReader, read_job_state
from checkmate.checkpoint.storage import (
    atomic_write_bytes,
    atomic_write_json,
    capture_states,
    complete_steps,
    fsync_dir,
    parameters_of,
    prune,
    read_latest,
    update_latest,
    write_global,
    write_shard,
)

__all__ = [
    "FORMAT_VERSION",
    "KEY_SEPARATOR",
    "PARAM_STATE",
    "READABLE_VERSIONS",
    "SHARD_MANIFEST",
    "STEP_DIR",
    "CheckpointError",
    "CheckpointReader",
    "TensorSlice",
    "atomic_write_bytes",
    "atomic_write_json",
    "capture_states",
    "complete_steps",
    "fsync_dir",
    "parameters_of",
    "prune",
    "read_job_state",
    "read_latest",
    "shard_stem",
    "step_dir",
    "update_latest",
    "write_global",
    "write_shard",
]
