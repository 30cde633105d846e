"""Universal checkpointing across parallel layouts (TP, PP, DP, ZeRO-1/2/3, FSDP2).

The universal format (:mod:`checkmate.checkpoint.format`) stores every parameter
whole, by fully-qualified name. This package maps it to and from the shards a
parallel job holds:

* :mod:`.spec` — the declarative reshaping rules (cat dim, fused sub-parameters,
  vocabulary padding, averaged replicas), by parameter-name pattern;
* :mod:`.geometry` — boxes and pieces: which logical elements a local tensor holds;
* :mod:`.layout` — a target layout (tp, pp, dp, zero, fsdp) and what each rank holds;
* :mod:`.box_reader` — reading only the bytes of a box from a checkpoint;
* :mod:`.rank_files` — per-rank shard files of one layout (what a job saves or loads);
* :mod:`.extract` — merging pieces from any layout into universal atoms;
* :mod:`.load` — filling a rank's tensors (plain or DTensor) and optimizer state;
* :mod:`.save` — a live job of any layout saving one universal checkpoint (collective);
* :mod:`.convert` — offline: universal <-> rank files, validated before writing;
* :mod:`.interop` — DeepSpeed universal export keys and import, torch DCP import;
* :mod:`.zero` — a minimal flat-partition ZeRO-1 Adam (for the CPU runs);
* :mod:`.shadow_merge` — TP-sharded shadow snapshots merged into atoms (design piece);
* :mod:`.tiny`, :mod:`.runs`, :mod:`.reshard_demo` — the tiny transformer, its
  multi-rank CPU runs and the loss-across-layouts figure;
* :mod:`.live` — the layout, rank and shapes a live module's DTensors and FSDP2
  parameters describe.

The public names (README's example uses only these): :func:`save_universal`,
:func:`load_module`, :class:`ReshapeSpec`, :class:`ReshapeRule`,
:class:`Layout`, :class:`LayoutError`, :func:`describe_module`, and
``checkmate.checkpoint.CheckpointReader``.
"""

from __future__ import annotations

from checkmate.universal.layout import Layout
from checkmate.universal.live import describe_module
from checkmate.universal.load import load_module
from checkmate.universal.save import save_universal
from checkmate.universal.spec import LayoutError, ReshapeRule, ReshapeSpec

__all__ = [
    "Layout",
    "LayoutError",
    "ReshapeRule",
    "ReshapeSpec",
    "describe_module",
    "load_module",
    "save_universal",
]
