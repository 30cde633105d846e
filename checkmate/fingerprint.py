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
(measured in ``python -m experiments.bench.shadow --fingerprint``). Rank 0 and the shadows run this
same function on the same byte order (the shadows replay on the workers' CPU type).

A fingerprint is ``{parameter name: {"param": checksum, <optimizer state key>: checksum}}``
over tensor-valued state (non-tensor state such as an int step is compared by value).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy
import torch

logger = logging.getLogger(__name__)

PARAM = "param"

_MASK = (1 << 64) - 1

_View = tuple[torch.Tensor, int, int, torch.dtype, numpy.ndarray, numpy.ndarray]
"""A cached tensor: itself, its data_ptr, numel and dtype when cached, its uint64 words, its tail bytes."""


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


class ChecksumCache:
    """:func:`checksums` for the same tensors call after call, without rebuilding their views.

    A training loop fingerprints the same parameter and optimizer-state tensors every
    iteration, updated in place: their memory does not move. Building the uint64 view of a
    tensor (detach, reshape, ``view``, ``numpy``) costs about 20 us, summing a small tensor
    2-3 us, so for a model of many small tensors the views were most of the cost (TinyLM:
    116 tensors, 3.3 ms per fingerprint before, see docs/benchmarks.md). This keeps each
    tensor's view while the tensor keeps its memory (same object, same ``data_ptr``, size and
    dtype); a tensor not passed in the last ``keep`` calls is forgotten (and released): 1, or the
    number of :class:`FingerprintTurns` groups when the fingerprints take turns. The result
    is :func:`checksums`' exactly (a test compares them). Calls are serialised by a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._views: dict[int, _View] = {}
        self._older: list[dict[int, _View]] = []

    def checksums(self, tensors: Sequence[torch.Tensor], keep: int = 1) -> list[int]:
        with self._lock:
            previous = self._views
            out = self._checksums(tensors, {k: v for view in self._older for k, v in view.items()} | previous)
            self._older = ([previous] + self._older)[: max(0, keep - 1)]
            return out

    def cached_ids(self) -> set[int]:
        """``id()`` of every tensor whose view is kept now (for tests)."""
        with self._lock:
            return set(self._views).union(*(set(view) for view in self._older))

    def _checksums(
        self,
        tensors: Sequence[torch.Tensor],
        old: dict[int, _View],
    ) -> list[int]:
        views: dict[int, _View] = {}
        out: list[int] = []
        add = numpy.add.reduce
        uint64 = numpy.uint64
        for tensor in tensors:
            key = id(tensor)
            entry = old.get(key)
            if (
                entry is None
                or entry[0] is not tensor
                or entry[1] != tensor.data_ptr()
                or entry[2] != tensor.numel()
                or entry[3] != tensor.dtype
            ):
                if tensor.device.type != "cpu" or not tensor.is_contiguous():
                    out.append(checksums([tensor])[0])  # not cacheable: a copy each time
                    continue
                flat = tensor.detach().reshape(-1)
                data = (flat if flat.dtype is torch.uint8 else flat.view(torch.uint8)).numpy()
                whole = data.size - data.size % 8
                entry = (
                    tensor,
                    tensor.data_ptr(),
                    tensor.numel(),
                    tensor.dtype,
                    data[:whole].view(uint64),
                    data[whole:],
                )
            views[key] = entry
            words, tail = entry[4], entry[5]
            total = int(add(words, dtype=uint64)) if words.size else 0
            if tail.size:
                total += int.from_bytes(tail.tobytes(), "little")
            out.append(total & _MASK)
        self._views = views
        return out


_CACHES: weakref.WeakKeyDictionary[object, ChecksumCache] = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def cache_for(owner: object) -> ChecksumCache:
    """The :class:`ChecksumCache` of ``owner`` (e.g. the optimizer whose state is fingerprinted),
    made on first use and dropped with ``owner``."""
    with _CACHES_LOCK:
        cache = _CACHES.get(owner)
        if cache is None:
            cache = _CACHES[owner] = ChecksumCache()
        return cache


def checksum(tensor: torch.Tensor) -> int:
    """One tensor's checksum (:func:`checksums`)."""
    return checksums([tensor])[0]


def _plain(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


DEFAULT_FINGERPRINT_BYTES = 32 << 20
"""Parameter bytes one fingerprint covers by default (``CheckmateConfig.fingerprint_bytes``): a model
up to 32 MiB of parameters (8M fp32) is checked whole at every fingerprint, a larger one in turns.
With AdamW's two state tensors that is a pass over at most ~96 MiB, about 10 ms on one core at
the summing rate measured here (docs/benchmarks.md)."""


class FingerprintTurns:
    """Which parameters each fingerprint covers: all of them, or in turns of at most ``budget`` bytes.

    The parameters, in the order given (``named_parameters()``: the same on every rank and in
    every run of the job), are cut into consecutive groups of at most ``budget`` parameter bytes
    (a parameter larger than the budget is a group of its own); fingerprint number ``turn``
    covers group ``turn % len(groups)`` and its optimizer state. Every parameter is thus compared
    once every ``len(groups)`` fingerprints, and each fingerprint costs at most about ``budget``
    bytes' share of the state. ``budget`` <= 0, or a model within it: one group, the whole state.
    The shadows need not know the groups: they compare the parameters a fingerprint names
    (:func:`mismatches`).
    """

    def __init__(self, sizes: Iterable[tuple[str, int]], budget: int) -> None:
        groups: list[frozenset[str]] = []
        current: list[str] = []
        filled = 0
        for name, size in sizes:
            if budget > 0 and current and filled + size > budget:
                groups.append(frozenset(current))
                current, filled = [], 0
            current.append(name)
            filled += size
        groups.append(frozenset(current))
        self.groups: tuple[frozenset[str], ...] = tuple(groups)

    @classmethod
    def of(cls, named: Iterable[tuple[str, torch.Tensor]], budget: int) -> FingerprintTurns:
        """The turns of ``named`` parameters (their bytes as stored)."""
        return cls(((name, p.numel() * p.element_size()) for name, p in named), budget)

    @property
    def whole(self) -> bool:
        """Whether every fingerprint covers the whole state (one group)."""
        return len(self.groups) == 1

    def names(self, turn: int) -> frozenset[str] | None:
        """The parameters fingerprint number ``turn`` covers; None: all of them."""
        return None if self.whole else self.groups[turn % len(self.groups)]


def fingerprint(
    named: Iterable[tuple[str, torch.Tensor]],
    state: Mapping[torch.Tensor, Mapping[str, Any]] | None = None,
    cache: ChecksumCache | None = None,
    names: Collection[str] | None = None,
    keep: int = 1,
) -> dict[str, dict[str, Any]]:
    """The fingerprint of parameters (``(name, tensor)`` pairs) and their optimizer ``state``.

    ``cache``: a caller that fingerprints the same tensors again and again keeps one
    :class:`ChecksumCache` and passes it (same result, a fraction of the cost). ``names``: only
    these parameters (a turn of :class:`FingerprintTurns`, or the names a received fingerprint
    holds); None: all. ``keep``: the cache keeps the views of the last ``keep`` calls' tensors
    (the number of turns, when fingerprints take turns).
    """
    out: dict[str, dict[str, Any]] = {}
    tensors: list[torch.Tensor] = []
    slots: list[tuple[dict[str, Any], str]] = []
    for name, parameter in named:
        if names is not None and name not in names:
            continue
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
    sums = cache.checksums(tensors, keep) if cache is not None else checksums(tensors)
    for (entry, key), total in zip(slots, sums, strict=True):
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
