"""Reading one box of a parameter from a universal checkpoint, and only its bytes.

A stored tensor kept in the parameter's shape (a writer that owns whole
parameters) is sliced n-dimensionally through safetensors, which copies only
the box's bytes; a stored flat slice (a ZeRO-style writer) is read as the
contiguous runs of the box that fall in it. ``elements_read`` counts what
was fetched, so tests can check a rank read no more than its share.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from checkmate.checkpoint import CheckpointError, CheckpointReader
from checkmate.universal.geometry import Box, extents, flat_range_boxes, numel, slices, whole

logger = logging.getLogger(__name__)


def _shape(reader: CheckpointReader, name: str) -> tuple[int, ...]:
    return tuple(reader.parameters[name]["shape"])


def box_runs(shape: Sequence[int], box: Box) -> list[tuple[int, int, Box]]:
    """The contiguous flat runs of ``box``: (start, stop, sub-box), in row-major order."""
    shape = tuple(shape)
    dims = len(shape)
    split = dims
    while split > 0 and box[split - 1] == (0, shape[split - 1]):
        split -= 1
    lead = max(split - 1, 0)
    runs: list[tuple[int, int, Box]] = []
    inner = 1
    for n in shape[lead:]:
        inner *= n

    def walk(prefix: tuple[tuple[int, int], ...], dim: int, base: int) -> None:
        if dim == lead:
            rest = box[lead:]
            sub_inner = 1
            for n in shape[lead + 1 :]:
                sub_inner *= n
            if rest:
                start = base + rest[0][0] * sub_inner
                stop = base + rest[0][1] * sub_inner
            else:
                start, stop = base, base + 1
            runs.append((start, stop, prefix + rest))
            return
        stride = 1
        for n in shape[dim + 1 :]:
            stride *= n
        for i in range(box[dim][0], box[dim][1]):
            walk(prefix + ((i, i + 1),), dim + 1, base + i * stride)

    if numel(box) > 0:
        walk((), 0, 0)
    return runs


class BoxReader:
    """Reads boxes of parameters' states from ``reader``, counting the elements fetched."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.elements_read = 0

    def read(self, name: str, state: str, box: Box | None = None) -> torch.Tensor:
        """``name``'s ``state`` restricted to ``box`` (the whole tensor when None), in box extents."""
        reader = self.reader
        pieces = reader.slices.get((name, state))
        if pieces is None:
            raise CheckpointError(f"step {reader.step} has no {name}::{state}")
        shape = _shape(reader, name)
        if pieces[0].scalar:
            self.elements_read += 1
            return reader.read(name, state)
        box = whole(shape) if box is None else box
        if len(box) != len(shape) or any(not 0 <= a <= b <= n for (a, b), n in zip(box, shape, strict=True)):
            raise CheckpointError(f"{name}: box {box} is outside its shape {shape}")
        if box == whole(shape):
            self.elements_read += numel(box)
            return reader.parameter(name, state).reshape(shape)  # whole: checksum-verified
        total = 1
        for n in shape:
            total *= n
        for piece in pieces:
            if piece.start == 0 and piece.end == total:
                # one stored tensor holds the whole parameter: one n-d slice, only the box's bytes
                with reader._open(piece.file) as handle:
                    view = handle.get_slice(piece.key)
                    if tuple(view.get_shape()) == shape:
                        self.elements_read += numel(box)
                        return view[slices(box)].reshape(extents(box))
        parts: list[tuple[int, torch.Tensor]] = []
        runs = box_runs(shape, box)
        offsets = []
        cursor = 0
        for run_start, run_stop, _ in runs:
            offsets.append(cursor)
            cursor += run_stop - run_start
        for piece in pieces:  # each stored slice opened once, its runs read as flat ranges
            hits = [
                (at + max(a, piece.start) - a, max(a, piece.start), min(b, piece.end))
                for at, (a, b, _) in zip(offsets, runs, strict=True)
                if max(a, piece.start) < min(b, piece.end)
            ]
            if not hits:
                continue
            with reader._open(piece.file) as handle:
                view = handle.get_slice(piece.key)
                stored = tuple(view.get_shape())
                for at, lo, hi in hits:
                    if stored == shape and piece.start == 0:
                        part = torch.cat(
                            [view[slices(sub)].reshape(-1) for _, sub in flat_range_boxes(shape, lo, hi)]
                        )
                    elif len(stored) == 1:
                        part = view[lo - piece.start : hi - piece.start].reshape(-1)
                    else:
                        raise CheckpointError(
                            f"{reader.directory / piece.file}: {piece.key} holds a slice in shape {stored}"
                        )
                    parts.append((at, part))
                    self.elements_read += hi - lo
        if sum(p.numel() for _, p in parts) != cursor:
            raise CheckpointError(f"{name}::{state}: box {box} is not fully covered by the checkpoint")
        out = torch.empty(cursor, dtype=parts[0][1].dtype)
        for at, part in parts:
            out[at : at + part.numel()] = part
        return out.reshape(extents(box))
