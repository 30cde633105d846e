"""Boxes, pieces and merges: flat ranges as boxes, box reads of only their bytes, replica rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkmate import checkpoint as fmt
from checkmate.universal.box_reader import BoxReader, box_runs
from checkmate.universal.extract import AtomMerger, Record
from checkmate.universal.geometry import flat_range_boxes, numel, slices
from checkmate.universal.spec import LayoutError, ReshapeRule, ReshapeSpec

SHAPES = [(5,), (3, 4), (2, 3, 4)]


@pytest.mark.parametrize("shape", SHAPES)
def test_every_flat_range_is_covered_by_contiguous_boxes_in_order(shape: tuple[int, ...]) -> None:
    total = numel(tuple((0, n) for n in shape))
    tensor = torch.arange(total).reshape(shape)
    for start in range(total + 1):
        for stop in range(start, total + 1):
            boxes = flat_range_boxes(shape, start, stop)
            got = [int(v) for _, box in boxes for v in tensor[slices(box)].reshape(-1)]
            assert got == list(range(start, stop)), (shape, start, stop)
            assert [offset for offset, _ in boxes] == [
                start + sum(numel(b) for _, b in boxes[:i]) for i in range(len(boxes))
            ]


def test_box_runs_are_the_contiguous_rows_of_a_box() -> None:
    runs = box_runs((3, 4, 5), ((0, 3), (1, 3), (2, 4)))
    assert [(a, b) for a, b, _ in runs] == [(7, 9), (12, 14), (27, 29), (32, 34), (47, 49), (52, 54)]
    assert box_runs((3, 4, 5), ((1, 2), (0, 4), (0, 5)))[0][:2] == (20, 40)  # whole inner dims: one run


@pytest.mark.parametrize("zero_style", [False, True])
def test_box_reader_fetches_exactly_the_box(tmp_path: Path, zero_style: bool) -> None:
    tensor = torch.arange(60.0).reshape(3, 4, 5)
    fmt.write_global(tmp_path, 1, {"w": ([3, 4, 5], "torch.float32")}, {})
    if zero_style:
        fmt.write_shard(tmp_path, 1, 0, 2, {"w": {"param": tensor.reshape(-1)[:23].clone()}}, {"w": (0, 23)})
        fmt.write_shard(tmp_path, 1, 1, 2, {"w": {"param": tensor.reshape(-1)[23:].clone()}}, {"w": (23, 60)})
    else:
        fmt.write_shard(tmp_path, 1, 0, 1, {"w": {"param": tensor.clone()}})
    reader = BoxReader(fmt.CheckpointReader(tmp_path))
    for box in [
        ((0, 3), (1, 3), (2, 4)),
        ((1, 2), (0, 4), (0, 5)),
        ((2, 3), (3, 4), (0, 5)),
        ((0, 1), (0, 1), (4, 5)),
    ]:
        reader.elements_read = 0
        assert torch.equal(reader.read("w", "param", box), tensor[slices(box)])
        assert reader.elements_read == numel(box)
    with pytest.raises(fmt.CheckpointError, match="outside its shape"):
        reader.read("w", "param", ((0, 4), (0, 4), (0, 5)))


def test_replicas_must_agree_unless_their_rule_averages_them() -> None:
    spec = ReshapeSpec((ReshapeRule(r"norm\.weight", average=True),))
    box = ((0, 4),)
    merger = AtomMerger({"norm.weight": (4,), "bias": (4,)}, spec)
    merger.add(Record("norm.weight", "param", box, torch.tensor([1.0, 2.0, 3.0, 4.0])))
    merger.add(Record("norm.weight", "param", box, torch.tensor([3.0, 2.0, 1.0, 0.0])))
    merger.add(Record("bias", "param", box, torch.ones(4)))
    merger.add(Record("bias", "param", box, torch.ones(4)))
    atoms = merger.atoms()
    assert torch.equal(atoms["norm.weight"]["param"], torch.tensor([2.0, 2.0, 2.0, 2.0]))
    assert torch.equal(atoms["bias"]["param"], torch.ones(4))
    with pytest.raises(
        LayoutError, match=r"bias::param: two ranks hold different values .*unless its rule says average"
    ):
        merger.add(Record("bias", "param", box, torch.tensor([1.0, 1.0, 1.0, 1.5])))


def test_a_gap_names_the_parameter_state_and_element() -> None:
    merger = AtomMerger({"w": (2, 3)}, ReshapeSpec())
    merger.add(Record("w", "param", ((0, 1), (0, 3)), torch.zeros(1, 3)))
    merger.add(Record("w", "param", ((1, 2), (0, 2)), torch.zeros(1, 2)))
    with pytest.raises(LayoutError, match=r"w::param: element \(1, 2\) is held by no rank"):
        merger.atoms()
