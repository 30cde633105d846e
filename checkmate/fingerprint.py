"""A cheap, exact fingerprint of training state: rank 0 sends it, the shadows compare theirs.

Every tensor's checksum is the sum, modulo 2**64, of its bytes read as
little-endian 64-bit words (the last partial word zero-padded). It is exact
(integer arithmetic: two tensors with the same bytes always agree, whatever the
machine's thread count or summation order) and changes with any single changed
element (an element lies within one word, so the word, and the sum, change by
a nonzero amount below 2**64), so a shadow whose parameters or optimizer state
drift by one ulp anywhere sees a different number. It is not a cryptographic
hash: it cannot tell permuted words apart, which no optimizer bug or missed
gradient transformation produces. A fingerprint costs
one native-width integer pass over the bytes of each tensor, without copying them
(measured in ``python -m shadow.benchmark --fingerprint``). Rank 0 and the shadows run this
same function on the same byte order (the shadows replay on the workers' CPU type).

A fingerprint is ``{parameter name: {"param": checksum, <optimizer state key>: checksum}}``
over tensor-valued state (non-tensor state such as an int step is compared by value).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy
import torch

logger = logging.getLogger(__name__)

PARAM = "param"

_MASK = (1 << 64) - 1


def checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's sum of its bytes as 64-bit words, modulo 2**64 (see the module docstring).

    Tensor by tensor, in place: the whole words of a (contiguous) tensor's bytes are
    summed by one ``numpy.add.reduce`` over a uint64 view of its memory (an unsigned sum
    that wraps modulo 2**64), and a last partial word is added zero-padded. No bytes are
    copied; a 356 MB state takes ~30-60 ms on one core (an earlier version concatenated
    all tensors first and took ~0.8 s).
    """
    out: list[int] = []
    for tensor in tensors:
        flat = tensor.detach()
        if flat.device.type != "cpu":
            flat = flat.to("cpu")
        flat = flat.reshape(-1)  # a view when contiguous (one copy otherwise)
        data = (flat if flat.dtype is torch.uint8 else flat.view(torch.uint8)).numpy()
        whole = data.size - data.size % 8
        total = int(numpy.add.reduce(data[:whole].view(numpy.uint64), dtype=numpy.uint64)) if whole else 0
        if whole < data.size:
            total += int.from_bytes(data[whole:].tobytes(), "little")  # zero-padded on the high side
        out.append(total & _MASK)
    return out


def checksum(tensor: torch.Tensor) -> int:
    """One tensor's checksum (:func:`checksums`)."""
    return checksums([tensor])[0]


def _plain(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def fingerprint(
    named: Iterable[tuple[str, torch.Tensor]], state: Mapping[torch.Tensor, Mapping[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """The fingerprint of parameters (``(name, tensor)`` pairs) and their optimizer ``state``."""
    out: dict[str, dict[str, Any]] = {}
    tensors: list[torch.Tensor] = []
    slots: list[tuple[dict[str, Any], str]] = []
    for name, parameter in named:
        entry: dict[str, Any] = {}
        out[name] = entry
        tensors.append(parameter)
        slots.append((entry, PARAM))
        if state is not None:
            for key, value in state.get(parameter, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
                    slots.append((entry, str(key)))
                else:
                    entry[str(key)] = _plain(value)
    for (entry, key), total in zip(slots, checksums(tensors), strict=True):
        entry[key] = total
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
