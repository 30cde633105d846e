"""Reading one box of a parameter from a universal checkpoint, and only its bytes.

A stored tensor kept in the parameter's shape (a writer that owns whole
parameters) is read as the rows of dim 0 the box spans, through the
checksummed chunks that hold them (:meth:`CheckpointReader.read_rows`), and cut
to the box in memory; a stored flat slice (a ZeRO-style writer) as the span of
the box's contiguous runs that fall in it. Every element returned has been
checked against its chunk's SHA-256 before it is returned. ``elements_read``
counts the elements returned (a rank's share, which tests check);
``reader.elements_fetched`` what was read from disk to verify them (whole
chunks: for a box cut along dim 1 that is every row it spans).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from checkmate.checkpoint import CheckpointError, CheckpointReader
from checkmate.universal.geometry import Box, extents, numel, slices, whole

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
            if piece.start == 0 and piece.end == total and piece.shape == shape:
                # one stored tensor holds the whole parameter: the box's rows, verified, then its columns
                with reader._open(piece.file) as handle:
                    rows = reader.read_rows(handle, piece, box[0][0], box[0][1])
                self.elements_read += numel(box)
                return rows[(slice(None), *slices(box[1:]))].reshape(extents(box))
        parts: list[tuple[int, torch.Tensor]] = []
        runs = box_runs(shape, box)
        offsets = []
        cursor = 0
        for run_start, run_stop, _ in runs:
            offsets.append(cursor)
            cursor += run_stop - run_start
        for piece in pieces:  # each stored slice opened once, the span of its runs read verified
            hits = [
                (at + max(a, piece.start) - a, max(a, piece.start), min(b, piece.end))
                for at, (a, b, _) in zip(offsets, runs, strict=True)
                if max(a, piece.start) < min(b, piece.end)
            ]
            if not hits:
                continue
            if len(piece.shape) != 1:
                raise CheckpointError(
                    f"{reader.directory / piece.file}: {piece.key} holds a slice in shape {piece.shape}"
                )
            first, last = hits[0][1] - piece.start, hits[-1][2] - piece.start
            with reader._open(piece.file) as handle:
                span = reader.read_rows(handle, piece, first, last)
            for at, lo, hi in hits:
                parts.append((at, span[lo - piece.start - first : hi - piece.start - first]))
                self.elements_read += hi - lo
        if sum(p.numel() for _, p in parts) != cursor:
            raise CheckpointError(f"{name}::{state}: box {box} is not fully covered by the checkpoint")
        out = torch.empty(cursor, dtype=parts[0][1].dtype)
        for at, part in parts:
            out[at : at + part.numel()] = part
        return out.reshape(extents(box))
