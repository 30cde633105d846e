"""Boxes and pieces: which elements of a logical parameter a local tensor holds.

A *box* is a rectangular region ``((start, stop), ...)`` of a tensor, one pair
per dimension. A *piece* says that box ``logical`` of the whole (universal)
parameter sits at box ``local`` of some local tensor (same extents). Every
sharded layout — a DTensor's local shard, a TP rank's fused QKV rows, a ZeRO
flat partition — is described as a list of pieces, so saving is "copy each
piece out" and loading is "read each piece's logical box, place it locally".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Box = tuple[tuple[int, int], ...]


def whole(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def extents(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def numel(box: Box) -> int:
    total = 1
    for a, b in box:
        total *= b - a
    return total


def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def intersect(first: Box, second: Box) -> Box | None:
    out = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(first, second, strict=True))
    return out if all(a < b for a, b in out) or (not out) else None


@dataclass(frozen=True)
class Piece:
    """Logical box ``logical`` of the parameter is held at box ``local`` of a local tensor."""

    logical: Box
    local: Box


def restrict(pieces: Sequence[Piece], window: Box) -> list[Piece]:
    """The pieces seen through ``window`` (a box of the local tensor), re-based to its origin."""
    out = []
    for piece in pieces:
        hit = intersect(piece.local, window)
        if hit is None:
            continue
        logical = tuple(
            (la + (ha - pa), la + (hb - pa))
            for (la, _), (pa, _), (ha, hb) in zip(piece.logical, piece.local, hit, strict=True)
        )
        local = tuple((ha - wa, hb - wa) for (ha, hb), (wa, _) in zip(hit, window, strict=True))
        out.append(Piece(logical, local))
    return out


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[int, Box]]:
    """Elements [start, stop) of a row-major tensor as contiguous boxes, each with its flat offset."""
    shape = tuple(int(n) for n in shape)
    if not shape:
        return [(0, ())] if start < stop else []
    out: list[tuple[int, Box]] = []

    def walk(prefix: tuple[tuple[int, int], ...], dims: tuple[int, ...], base: int, lo: int, hi: int) -> None:
        # elements [lo, hi) of a sub-tensor of shape ``dims`` starting at flat ``base``
        if lo >= hi:
            return
        inner = 1
        for n in dims[1:]:
            inner *= n
        if len(dims) == 1 or (lo % inner == 0 and hi % inner == 0):
            out.append((base + lo, prefix + ((lo // inner, hi // inner),) + whole(dims[1:])))
            return
        first_full, last_full = -(-lo // inner), hi // inner
        if first_full > last_full:  # inside one row
            row = lo // inner
            walk(prefix + ((row, row + 1),), dims[1:], base + row * inner, lo - row * inner, hi - row * inner)
            return
        if lo < first_full * inner:
            row = lo // inner
            walk(prefix + ((row, row + 1),), dims[1:], base + row * inner, lo - row * inner, inner)
        if first_full < last_full:
            out.append((base + first_full * inner, prefix + ((first_full, last_full),) + whole(dims[1:])))
        if last_full * inner < hi:
            walk(
                prefix + ((last_full, last_full + 1),),
                dims[1:],
                base + last_full * inner,
                0,
                hi - last_full * inner,
            )

    walk((), shape, 0, start, stop)
    return out


def chunk_bounds(size: int, rank: int, world: int) -> tuple[int, int]:
    """torch.chunk / DTensor ``Shard`` semantics: ceil-sized chunks, the last ones short or empty."""
    step = -(-size // world) if world else size
    return min(rank * step, size), min((rank + 1) * step, size)


def even_bounds(size: int, rank: int, world: int) -> tuple[int, int]:
    step = size // world
    return rank * step, (rank + 1) * step
