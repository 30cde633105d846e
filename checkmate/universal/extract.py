"""Universal atoms from the pieces of any layout: records in, whole parameters out.

A :class:`Record` is one logical box of one state of one parameter (or a
0-d state such as Adam's ``step``), as some rank held it. :class:`AtomMerger`
places records into whole tensors and checks the result: every element
covered, copies held by several ranks bit-identical — unless the parameter's
rule says ``average``, then their mean — and a clear error naming the
parameter, the state and the first uncovered element otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from checkmate.universal.geometry import Box, extents, numel, slices
from checkmate.universal.layout import FlatPartition, LocalTensor
from checkmate.universal.spec import LayoutError, ReshapeSpec

logger = logging.getLogger(__name__)


@dataclass
class Record:
    name: str
    state: str
    box: Box | None
    """None for a 0-d state."""
    value: torch.Tensor


def records_of_tensor(local: LocalTensor, state: str, tensor: torch.Tensor) -> list[Record]:
    """The records a local tensor (``local.shape``) holds; padding is dropped."""
    if tensor.dim() == 0:
        return [Record(local.name, state, None, tensor.detach().clone())]
    if tuple(tensor.shape) != tuple(local.shape):
        raise LayoutError(
            f"{local.name}::{state}: local shape {tuple(tensor.shape)}, layout says {local.shape}"
        )
    return [
        Record(local.name, state, piece.logical, tensor.detach()[slices(piece.local)].clone())
        for piece in local.pieces
    ]


def records_of_flat(partition: FlatPartition, state: str, flat: torch.Tensor) -> list[Record]:
    """The records a ZeRO flat partition holds; padding is dropped."""
    if flat.dim() != 1 or flat.numel() != partition.numel:
        raise LayoutError(
            f"flat {state} partition has {tuple(flat.shape)}, the layout says {partition.numel}"
        )
    out = []
    for piece in partition.pieces:
        count = numel(piece.logical)
        value = flat.detach()[piece.offset : piece.offset + count].reshape(extents(piece.logical)).clone()
        out.append(Record(piece.name, state, piece.logical, value))
    return out


class AtomMerger:
    """Whole tensors from records of parameters whose logical shapes are ``shapes``."""

    def __init__(self, shapes: Mapping[str, Sequence[int]], spec: ReshapeSpec) -> None:
        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        self.spec = spec
        self._sums: dict[tuple[str, str], torch.Tensor] = {}
        self._counts: dict[tuple[str, str], torch.Tensor] = {}
        self._scalars: dict[tuple[str, str], torch.Tensor] = {}

    def add_all(self, records: Iterable[Record]) -> None:
        for record in records:
            self.add(record)

    def add(self, record: Record) -> None:
        key = (record.name, record.state)
        if record.name not in self.shapes:
            raise LayoutError(f"{record.name}: not a parameter of the checkpoint (another model?)")
        if record.box is None:
            held = self._scalars.get(key)
            if held is not None and not torch.equal(held, record.value):
                raise LayoutError(
                    f"{record.name}::{record.state}: ranks hold different values {held} and {record.value}"
                )
            self._scalars[key] = record.value
            return
        shape = self.shapes[record.name]
        if tuple(record.value.shape) != extents(record.box):
            raise LayoutError(
                f"{record.name}::{record.state}: box {record.box} but a tensor of {tuple(record.value.shape)}"
            )
        average = self.spec.rule(record.name).average
        if key not in self._sums:
            dtype = torch.float64 if average else record.value.dtype
            self._sums[key] = torch.zeros(shape, dtype=dtype)
            self._counts[key] = torch.zeros(shape, dtype=torch.int32)
        total, count = self._sums[key][slices(record.box)], self._counts[key][slices(record.box)]
        if average:
            total += record.value.to(total.dtype)
        else:
            held = count > 0
            if bool(held.any()) and not torch.equal(total[held], record.value[held].to(total.dtype)):
                raise LayoutError(
                    f"{record.name}::{record.state}: two ranks hold different values for box {record.box}; "
                    f"replicas must be identical unless its rule says average "
                    f"({self.spec.rule(record.name).describe()})"
                )
            total.copy_(record.value)
        count += 1

    def atoms(self, dtypes: Mapping[str, torch.dtype] | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """name -> state -> whole tensor; raises when an element of a state is in no record."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for (name, state), total in sorted(self._sums.items()):
            count = self._counts[(name, state)]
            missing = (count == 0).nonzero()
            if missing.numel():
                raise LayoutError(
                    f"{name}::{state}: element {tuple(missing[0].tolist())} is held by no rank "
                    f"(a layout that does not cover the parameter, or a missing rank file)"
                )
            if total.dtype == torch.float64 and self.spec.rule(name).average:
                value = (total / count).to((dtypes or {}).get(name, torch.float32))
            else:
                value = total
            out.setdefault(name, {})[state] = value
        for (name, state), value in sorted(self._scalars.items()):
            out.setdefault(name, {})[state] = value
        absent = sorted(set(self.shapes) - {n for n, states in out.items() if "param" in states})
        if absent:
            raise LayoutError(f"parameters held by no rank: {absent[:5]}")
        return out
