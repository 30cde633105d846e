"""The job's random-number generators as one Stateful object, so that dropout resumes bit-identically.

A script with dropout (any transformer), random augmentation on the training thread or
a ``DataLoader`` that shuffles with the global generator draws from torch's generators
every iteration. Their state is part of what a resumed job needs: pass
``stateful={"rng": RandomState()}`` to both :func:`hosts.enable_checkmate` and
:func:`hosts.resume`. :class:`RandomState` follows PyTorch's ``Stateful`` convention
(``torch.distributed.checkpoint.stateful.Stateful``) and holds:

* ``torch``: torch's CPU generator (``torch.get_rng_state()``'s 5056 bytes, packed
  exactly into 2.5 KiB: :func:`_pack`);
* ``cuda``: every CUDA device's generator, when CUDA is initialised;
* ``numpy``: NumPy's global generator (MT19937 key as int32 bits, position, the
  cached Gaussian), when ``numpy`` is imported and its state changed since the
  RandomState was made (a job that never draws from it does not carry 2.5 KiB each
  iteration; a script that seeds it at start has that state again on resume);
* ``python``: Python's ``random`` module (its 625 state words as int32 bits), likewise
  only once it changed.

The job state is taken on rank 0 only, so every rank must draw the same numbers:
:func:`check_same_on_every_rank` (called by ``enable_checkmate``) compares a hash of
every rank's generators once and refuses per-rank seeds. On resume every rank loads
rank 0's saved state.
"""

from __future__ import annotations

import array
import hashlib
import logging
import random
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MT_WORDS = 624
"""MT19937's state words (NumPy's key and Python's state before its position)."""
NUMPY_KEYS = {"kind", "key", "pos", "has_gauss", "cached_gaussian"}


class RandomStateError(ValueError):
    """A state that is not a RandomState's (wrong keys, types or sizes); the message names the object."""


class RandomState:
    """torch's (CPU and, when initialised, CUDA), NumPy's and Python's global generators (Stateful)."""

    def __init__(self, name: str = "RandomState") -> None:
        self.name = name
        """How errors name this object."""
        self._untouched = _optional_states()
        """NumPy's and Python's states at construction: left out of the state while unchanged."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"torch": _pack(torch.get_rng_state())}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        for part, now in _optional_states().items():
            if not _same(now, self._untouched.get(part)):
                state[part] = now
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Set the generators; RandomStateError naming this object if ``state`` is not one of ours.

        Everything is checked before any generator is set, so a bad state changes nothing.
        """
        setters = [self._torch(state)]
        if "cuda" in state:
            setters.append(self._cuda(state["cuda"]))
        # absent: unchanged since construction when saved, so back to this object's own start
        numpy_state = state.get("numpy", self._untouched.get("numpy"))
        if numpy_state is not None:
            setters.append(self._numpy(numpy_state))
        setters.append(self._python(state.get("python", self._untouched["python"])))
        unknown = sorted(set(state) - {"torch", "cuda", "numpy", "python"})
        if unknown:
            self._fail(f"unknown keys {unknown}")
        for apply in setters:
            apply()

    # ---- validation, then a setter ---------------------------------------------------
    def _fail(self, what: str) -> None:
        raise RandomStateError(f"{self.name}.load_state_dict: {what}; expected a RandomState.state_dict()")

    def _bytes(self, value: Any, where: str, size: int | None) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) or value.dtype is not torch.uint8 or value.dim() != 1:
            self._fail(f"{where} is {_describe(value)}, not a 1-D uint8 tensor")
        if size is not None and value.numel() != size:
            self._fail(f"{where} has {value.numel()} bytes, this generator's state has {size}")
        return value.detach().to("cpu").contiguous().clone()

    def _torch(self, state: Mapping[str, Any]) -> Any:
        if not isinstance(state, Mapping) or "torch" not in state:
            self._fail(f"the state is {_describe(state)} without a 'torch' generator state")
        packed = state["torch"]
        if not isinstance(packed, Mapping) or set(packed) != {"low", "high"}:
            self._fail(f"'torch' is {_describe(packed)}, not {{low, high}}")
        low, high = packed["low"], packed["high"]
        words = torch.get_rng_state().numel() // 8
        if not isinstance(low, torch.Tensor) or low.dtype is not torch.int32 or low.shape != (words,):
            self._fail(f"'torch' low is {_describe(low)}, not {words} int32 words")
        if not isinstance(high, list) or not all(
            isinstance(pair, list)
            and len(pair) == 2
            and all(type(v) is int for v in pair)
            and 0 <= pair[0] < words
            and -(1 << 31) <= pair[1] < (1 << 31)
            for pair in high
        ):
            self._fail(f"'torch' high is {_describe(high)}, not a list of [word index, int32] pairs")
        value = _unpack(low, high)
        return lambda: torch.set_rng_state(value)

    def _cuda(self, states: Any) -> Any:
        if not isinstance(states, (list, tuple)):
            self._fail(f"'cuda' is {_describe(states)}, not a list of per-device states")
        values = [self._bytes(s, f"'cuda'[{i}]", None) for i, s in enumerate(states)]
        if not torch.cuda.is_available() or len(values) != torch.cuda.device_count():
            available = torch.cuda.device_count() if torch.cuda.is_available() else 0
            self._fail(f"'cuda' holds {len(values)} device states, this process has {available} CUDA devices")
        return lambda: torch.cuda.set_rng_state_all(values)

    def _numpy(self, saved: Any) -> Any:
        if not isinstance(saved, Mapping) or set(saved) != NUMPY_KEYS:
            self._fail(f"'numpy' is {_describe(saved)}, not {{kind, key, pos, has_gauss, cached_gaussian}}")
        key = saved["key"]
        if not isinstance(key, torch.Tensor) or key.dtype is not torch.int32 or key.shape != (MT_WORDS,):
            self._fail(f"'numpy' key is {_describe(key)}, not {MT_WORDS} int32 words")
        pos = saved["pos"]
        if saved["kind"] != "MT19937" or not isinstance(pos, int) or not 0 <= pos <= MT_WORDS:
            self._fail(f"'numpy' is kind {saved['kind']!r} at position {pos!r}, not MT19937 at 0..{MT_WORDS}")
        if not isinstance(saved["has_gauss"], int) or not isinstance(saved["cached_gaussian"], float):
            self._fail("'numpy' has_gauss/cached_gaussian are not an int and a float")
        import numpy  # the job saved NumPy's state: it uses NumPy

        words = key.numpy().view(numpy.uint32).copy()
        value = ("MT19937", words, pos, saved["has_gauss"], saved["cached_gaussian"])
        return lambda: numpy.random.set_state(value)

    def _python(self, saved: Any) -> Any:
        if not isinstance(saved, Mapping) or set(saved) != {"version", "state", "gauss_next"}:
            self._fail(f"'python' is {_describe(saved)}, not {{version, state, gauss_next}}")
        words = saved["state"]
        size = (MT_WORDS + 1,)
        if not isinstance(words, torch.Tensor) or words.dtype is not torch.int32 or words.shape != size:
            self._fail(f"'python' state is {_describe(words)}, not {MT_WORDS + 1} int32 words")
        if type(saved["version"]) is not int or saved["version"] != random.getstate()[0]:
            self._fail(f"'python' version is {saved['version']!r}, not {random.getstate()[0]}")
        gauss = saved["gauss_next"]
        if gauss is not None and not isinstance(gauss, float):
            self._fail(f"'python' gauss_next is {_describe(gauss)}, not None or a float")
        unsigned = array.array("I", words.contiguous().numpy().tobytes())
        value = (saved["version"], tuple(unsigned), gauss)

        def apply() -> None:
            try:
                random.setstate(value)
            except (TypeError, ValueError) as exc:
                self._fail(f"'python' state refused by random.setstate: {exc}")

        return apply


def _pack(state: torch.Tensor) -> dict[str, Any]:
    """torch's CPU generator state (5056 bytes: 632 little-endian 64-bit words, the MT19937 words
    among them, whose high halves are zero) as its 632 low 32-bit halves plus the few nonzero
    high halves as [index, value]: 2.5 KiB instead of 5 KiB, and exact (:func:`_unpack`)."""
    words = state.contiguous().clone().view(torch.int32)
    high = words[1::2]
    return {
        "low": words[0::2].clone(),
        "high": [[int(i), int(high[i])] for i in high.nonzero().flatten().tolist()],
    }


def _unpack(low: torch.Tensor, high: list[list[int]]) -> torch.Tensor:
    words = torch.zeros(2 * low.numel(), dtype=torch.int32)
    words[0::2] = low
    for index, value in high:
        words[2 * index + 1] = value
    return words.view(torch.uint8)


def _optional_states() -> dict[str, Any]:
    """NumPy's global generator (when NumPy is imported) and Python's ``random``, encoded."""
    out: dict[str, Any] = {}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, key, pos, has_gauss, cached = numpy.random.get_state()
        out["numpy"] = {
            "kind": str(kind),
            "key": torch.from_numpy(key.astype(numpy.uint32).view(numpy.int32).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    version, words, gauss_next = random.getstate()
    out["python"] = {
        "version": int(version),
        "state": torch.frombuffer(bytearray(array.array("I", words).tobytes()), dtype=torch.int32),
        "gauss_next": gauss_next,
    }
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__qualname__}"


def state_digest(state: Mapping[str, Any]) -> str:
    """SHA-256 over a RandomState.state_dict()'s generator bytes (key order fixed)."""
    digest = hashlib.sha256()

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            digest.update(value.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(value, Mapping):
            for key in sorted(value):
                digest.update(str(key).encode())
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                feed(item)
        else:
            digest.update(repr(value).encode())

    feed(state)
    return digest.hexdigest()


def check_same_on_every_rank(stateful: Mapping[str, Any], group: Any) -> None:
    """Every rank's RandomState objects hold the same torch generators; RandomStateError otherwise.

    The job state is rank 0's: a rank that draws other numbers (a per-rank seed) would
    resume with rank 0's generators and train differently from the uninterrupted run.
    torch's generators (CPU, CUDA) differing is refused. NumPy's and Python's global
    generators are seeded from the OS per process unless the script seeds them, and most
    jobs never draw from them: differing, they get one warning on rank 0 (naming them and
    the fix), not a refusal. One ``all_gather_object`` of a SHA-256 per generator over
    ``group`` (the DDP model's), bounded by the process group's own timeout.
    """
    mine = {
        f"{name}/{part}": state_digest({part: value})
        for name, obj in stateful.items()
        if isinstance(obj, RandomState)
        for part, value in obj.state_dict().items()
    }
    if not mine or not dist.is_initialized():
        return
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    seen = [g if isinstance(g, dict) else {} for g in gathered]
    differ = [key for key in mine if len({str(g.get(key)) for g in seen}) > 1]
    torch_differ = sorted(
        {key.rsplit("/", 1)[0] for key in differ if key.rsplit("/", 1)[1] in ("torch", "cuda")}
    )
    if torch_differ:
        raise RandomStateError(
            f"stateful object(s) {torch_differ} (RandomState): the ranks' torch random-number generators "
            "differ (seeded per rank?). Checkmate saves rank 0's generators, so a resumed job would draw "
            "different numbers on the other ranks than an uninterrupted one. Seed every rank identically "
            "(torch.manual_seed(same) on every rank) before enable_checkmate, and give per-rank randomness "
            "(e.g. data shuffling) its own torch.Generator seeded from (seed, rank, iteration)."
        )
    if differ and dist.get_rank(group) == 0:
        logger.warning(
            "checkmate: %s differ between ranks (unseeded?); RandomState saves rank 0's, so if the job "
            "draws from them a resumed job is not bit-identical. Seed them identically on every rank "
            "(numpy.random.seed(s); random.seed(s)) before enable_checkmate",
            ", ".join(sorted(differ)),
        )
