"""A job's state besides parameters and optimizer state: buffers, stateful objects, param groups.

What a resumed job needs that is not in the gradients (docs/checkpoint-format.md,
"Job state"):

* the model's **persistent buffers** (everything in ``module.state_dict()`` that
  is not a parameter: BatchNorm's ``running_mean``/``running_var``/
  ``num_batches_tracked``, ...);
* the job's **stateful objects** — anything following PyTorch's ``Stateful``
  convention (``state_dict()`` / ``load_state_dict()``, e.g. an LR scheduler, a
  ``GradScaler``, a sampler), by a name the job chooses;
* the optimizer's **param-group hyperparameters in force** for the next
  iteration (a scheduler changes ``lr`` after the step; restoring the scheduler
  alone would not restore the groups).

Rank 0 captures it after every iteration and sends it with the iteration's commit
record; shadows keep it with the applied state, write it into their snapshots
and return it in restore answers. On the wire and on disk it is a
:class:`JobState`: a JSON document in which every tensor is replaced by
``{"__tensor__": key}``, plus the tensors by key. The document encodes what plain
JSON cannot say with tagged objects: ``{"__tuple__": [...]}``,
``{"__dict__": [[key, value], ...]}`` (non-string keys, or keys starting with
``__``), ``{"__float__": "nan"|"inf"|"-inf"}``. Anything else (a generator, a
lambda, a NumPy array, ...) is refused with :class:`JobStateError` naming the
object and the path inside its state.
"""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_JOB_STATE_BYTES = 16 << 20
"""Largest job state one commit may carry (JSON plus tensor bytes)."""

TENSOR_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


class JobStateError(ValueError):
    """A job state that cannot be captured, sent, stored or loaded; the message names the object."""


@dataclass(eq=False)
class JobState:
    """The encoded job state: ``document`` (JSON) with ``{"__tensor__": key}`` references into ``tensors``.

    ``document`` has ``buffers`` (buffer name -> tensor reference), ``stateful``
    (object name -> its encoded ``state_dict()``) and ``param_groups`` (one object
    of encoded hyperparameters per optimizer param group, ``params`` left out).
    """

    document: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def nbytes(self) -> int:
        text = json.dumps(self.document, separators=(",", ":"), allow_nan=False)
        return len(text.encode()) + sum(t.numel() * t.element_size() for t in self.tensors.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JobState) and self.equals(other)

    __hash__ = None  # type: ignore[assignment]

    def equals(self, other: JobState | None) -> bool:
        """Same document and bit-identical tensors."""
        if other is None or self.document != other.document or set(self.tensors) != set(other.tensors):
            return False
        return all(_same_bits(t, other.tensors[k]) for k, t in self.tensors.items())

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        return {
            name: self._tensor(ref, f"buffer {name}")
            for name, ref in self.document.get("buffers", {}).items()
        }

    @property
    def stateful(self) -> dict[str, Any]:
        """Each stateful object's state dict, decoded (its tensors are this state's: clone to change)."""
        return {
            name: _decode(value, self.tensors, f"stateful object {name!r}")
            for name, value in self.document.get("stateful", {}).items()
        }

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [
            _decode(group, self.tensors, f"param group {i}")
            for i, group in enumerate(self.document.get("param_groups", []))
        ]

    def _tensor(self, ref: Any, where: str) -> torch.Tensor:
        value = _decode(ref, self.tensors, where)
        if not isinstance(value, torch.Tensor):
            raise JobStateError(f"{where}: not a tensor reference")
        return value

    def validate(self) -> JobState:
        """Check the document's shape and that every tensor reference resolves; returns self."""
        doc = self.document
        if not isinstance(doc, dict):
            raise JobStateError("job state: the document is not a JSON object")
        for key, kind in (("buffers", dict), ("stateful", dict), ("param_groups", list)):
            if key in doc and not isinstance(doc[key], kind):
                raise JobStateError(f"job state: {key!r} is not a JSON {kind.__name__}")
        _ = self.buffers, self.stateful, self.param_groups
        return self


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(_as_bits(a), _as_bits(b)))


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.is_floating_point():
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
    return t


# ---- encoding ---------------------------------------------------------------------------
class _Encoder:
    def __init__(self, prefix: str, tensors: dict[str, torch.Tensor]) -> None:
        self.prefix = prefix
        self.tensors = tensors
        self.count = 0

    def encode(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            if math.isfinite(value):
                return float(value)
            return {"__float__": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if isinstance(value, torch.Tensor):
            if value.dtype not in TENSOR_DTYPES:
                raise JobStateError(f"{where} is a {value.dtype} tensor, which cannot be stored")
            if value.is_sparse or value.layout is not torch.strided:
                raise JobStateError(f"{where} is a {value.layout} tensor; only dense tensors can be stored")
            key = f"{self.prefix}{self.count}"
            self.count += 1
            self.tensors[key] = value.detach().to("cpu", copy=True).contiguous()
            return {"__tensor__": key}
        if isinstance(value, tuple):
            return {"__tuple__": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: self.encode(v, f"{where}[{k!r}]") for k, v in value.items()}
            return {
                "__dict__": [
                    [self.encode(k, f"{where} key {k!r}"), self.encode(v, f"{where}[{k!r}]")]
                    for k, v in value.items()
                ]
            }
        raise JobStateError(
            f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which cannot be stored "
            "(allowed: None, bool, int, float, str, list, tuple, dict, dense torch tensors)"
        )


def _decode(value: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == "__tensor__":
            if not isinstance(inner, str) or inner not in tensors:
                raise JobStateError(f"{where}: tensor {inner!r} is missing from the job state")
            return tensors[inner]
        if tag == "__tuple__" and isinstance(inner, list):
            return tuple(_decode(v, tensors, where) for v in inner)
        if tag == "__float__" and inner in ("nan", "inf", "-inf"):
            return float(inner)
        if tag == "__dict__" and isinstance(inner, list):
            out = {}
            for pair in inner:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise JobStateError(f"{where}: a __dict__ item is not a [key, value] pair")
                key = _decode(pair[0], tensors, where)
                try:
                    out[key] = _decode(pair[1], tensors, where)
                except TypeError:
                    raise JobStateError(f"{where}: dictionary key {key!r} is not hashable") from None
            return out
    return {k: _decode(v, tensors, where) for k, v in value.items()}


def stateful_state(name: str, obj: Any) -> Any:
    """``obj.state_dict()``, or JobStateError naming ``name`` when it fails or ``obj`` is not Stateful."""
    method = getattr(obj, "state_dict", None)
    if not callable(method) or not callable(getattr(obj, "load_state_dict", None)):
        raise JobStateError(
            f"stateful object {name!r} ({type(obj).__qualname__}) has no state_dict()/load_state_dict() "
            "(torch.distributed.checkpoint.stateful.Stateful)"
        )
    try:
        return method()
    except Exception as exc:  # noqa: BLE001 - a user's object may raise anything; name it
        raise JobStateError(
            f"stateful object {name!r}: state_dict() raised {type(exc).__name__}: {exc}"
        ) from exc


_STATE_DICT_KEYS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[str, ...], frozenset[str]]] = (
    weakref.WeakKeyDictionary()
)


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers that ``state_dict()`` holds (persistent ones), by fully-qualified name.

    Which buffers ``state_dict()`` holds is asked of ``state_dict()`` itself (its hooks may
    change it), but only when the module's buffers change: building a state dict every
    iteration cost rank 0 about 0.5 ms per TinyLM iteration (docs/benchmarks.md). A module
    without buffers needs no state dict at all.
    """
    named = [(name, buffer) for name, buffer in module.named_buffers() if buffer is not None]
    if not named:
        return {}
    names = tuple(name for name, _ in named)
    cached = _STATE_DICT_KEYS.get(module)
    if cached is None or cached[0] != names:
        cached = (names, frozenset(module.state_dict(keep_vars=True)))
        _STATE_DICT_KEYS[module] = cached
    keys = cached[1]
    return {name: buffer for name, buffer in named if name in keys}


def capture(
    module: torch.nn.Module | None,
    stateful: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    limit: int = MAX_JOB_STATE_BYTES,
) -> JobState:
    """Encode the job state now (tensors copied); JobStateError naming the object that cannot travel."""
    tensors: dict[str, torch.Tensor] = {}
    buffers: dict[str, Any] = {}
    if module is not None:
        for name, buffer in persistent_buffers(module).items():
            buffers[name] = _Encoder(f"buffer/{name}#", tensors).encode(buffer, f"buffer {name!r}")
    encoded: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    for name, obj in stateful.items():
        before = sum(t.numel() * t.element_size() for t in tensors.values())
        encoded[name] = _Encoder(f"stateful/{name}/", tensors).encode(
            stateful_state(name, obj), f"stateful object {name!r}: state_dict()"
        )
        sizes[name] = (
            len(json.dumps(encoded[name], separators=(",", ":")).encode())
            + sum(t.numel() * t.element_size() for t in tensors.values())
            - before
        )
    groups: list[Any] = []
    if optimizer is not None:
        enc = _Encoder("param_groups/", tensors)
        for i, group in enumerate(optimizer.param_groups):
            groups.append(
                enc.encode({k: v for k, v in group.items() if k != "params"}, f"optimizer param group {i}")
            )
    state = JobState({"buffers": buffers, "stateful": encoded, "param_groups": groups}, tensors)
    size = state.nbytes()
    if size > limit:
        largest = max(sizes.items(), key=lambda kv: kv[1], default=None)
        biggest = f"; the largest stateful object is {largest[0]!r} ({largest[1]} bytes)" if largest else ""
        raise JobStateError(
            f"the job state is {size} bytes, more than the {limit} bytes a commit record may carry{biggest}"
        )
    return state


def merge(early: JobState, late: JobState, order: Mapping[str, Any] | None = None) -> JobState:
    """One job state from two captures of disjoint parts (stateful objects in ``order``'s order)."""
    stateful = {**early.document.get("stateful", {}), **late.document.get("stateful", {})}
    if order is not None:
        stateful = {name: stateful[name] for name in order if name in stateful}
    document = {
        "buffers": {**early.document.get("buffers", {}), **late.document.get("buffers", {})},
        "stateful": stateful,
        "param_groups": late.document.get("param_groups") or early.document.get("param_groups", []),
    }
    return JobState(document, {**early.tensors, **late.tensors})


def load_stateful(objects: Mapping[str, Any], state: JobState) -> None:
    """``load_state_dict`` each object from ``state`` (JobStateError naming a missing or failing one)."""
    saved = state.stateful
    missing = sorted(set(objects) - set(saved))
    if missing:
        raise JobStateError(
            f"the checkpoint holds no state for stateful object(s) {missing}; it has {sorted(saved)}"
        )
    for name, obj in objects.items():
        try:
            obj.load_state_dict(_cloned(saved[name]))
        except Exception as exc:  # noqa: BLE001 - name the object whatever it raised
            raise JobStateError(
                f"stateful object {name!r}: load_state_dict() raised {type(exc).__name__}: {exc}"
            ) from exc


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_cloned(v) for v in value)
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    return value
