"""A cheap, exact fingerprint of training state: rank 0 sends it, the shadows compare theirs.

Every tensor's checksum is the sum of its elements' bit patterns read as integers
(int32 words for 4- and 8-byte dtypes, int16 for 2-byte ones, bytes for 1-byte),
accumulated in int64. It is exact (no rounding: two tensors with the same bytes
always agree, whatever the machine's thread count or summation order) and
changes with any single changed element, so a shadow whose parameters or
optimizer state drift by one ulp anywhere sees a different number. It is not
a cryptographic hash: it cannot tell permuted elements apart, which no optimizer
bug or missed gradient transformation produces. It costs one pass over the
bytes (measured in ``python -m shadow.benchmark --fingerprint``).

A fingerprint is ``{parameter name: {"param": checksum, <optimizer state key>: checksum}}``
over tensor-valued state (non-tensor state such as an int step is compared by value).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import numpy
import torch

logger = logging.getLogger(__name__)

PARAM = "param"

_WORDS = {8: torch.int32, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def checksum(tensor: torch.Tensor) -> int:
    """Sum of ``tensor``'s bit patterns as integers (see the module docstring)."""
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.to("cpu")
    flat = flat.contiguous().reshape(-1)
    if flat.dtype is torch.bool:
        flat = flat.view(torch.uint8)
    words = flat.view(_WORDS[flat.element_size()])
    return int(words.numpy().sum(dtype=numpy.int64))  # numpy's integer sum: ~2x torch's here


def _value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return checksum(value)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def fingerprint(
    named: Iterable[tuple[str, torch.Tensor]], state: Mapping[torch.Tensor, Mapping[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """The fingerprint of parameters (``(name, tensor)`` pairs) and their optimizer ``state``."""
    out: dict[str, dict[str, Any]] = {}
    for name, parameter in named:
        entry: dict[str, Any] = {PARAM: checksum(parameter)}
        if state is not None:
            for key, value in state.get(parameter, {}).items():
                entry[str(key)] = _value(value)
        out[name] = entry
    return out


def mismatches(
    expected: Mapping[str, Mapping[str, Any]], actual: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    """``name::key`` of every entry of ``actual`` that differs from ``expected`` (names in both only).

    A state key present on one side only is a mismatch too (e.g. ``max_exp_avg_sq``).
    """
    out = []
    for name in sorted(set(expected) & set(actual)):
        want, got = expected[name], actual[name]
        for key in sorted(set(want) | set(got)):
            if want.get(key, "<absent>") != got.get(key, "<absent>"):
                out.append(f"{name}::{key}")
    return out
