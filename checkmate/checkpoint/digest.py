"""Digests that say whether two copies of a model's parameters and optimizer state are equal bit for bit.

One pair of functions for every comparison the project makes (rank 0's state
against a shadow's, a restored worker against an uninterrupted one, a snapshot
on disk against the workers):

* :func:`parameters_digest` — every parameter's name, shape, dtype and bytes.
* :func:`optimizer_digest` — every parameter's optimizer state: tensors by
  name, key, shape, dtype and bytes; the ``step`` counter by its *value* only.
  Optimizers and checkpoints keep the counter in different forms for the same
  state (AdamW: a float32 0-d tensor; a loaded checkpoint or a shadow may hold a
  number or another dtype), so those layout-only differences do not change the
  digest, while one step more or less does.

Memory layout (strides, device, insertion order of the mappings) never counts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

STEP_KEY = "step"


def _update(digest: Any, label: str, value: Any) -> None:
    tensor = torch.as_tensor(value).detach().to("cpu").contiguous()
    digest.update(f"{label}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def parameters_digest(parameters: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over every parameter's name, shape, dtype and bytes, in name order."""
    items = dict(parameters.items() if isinstance(parameters, Mapping) else parameters)
    digest = hashlib.sha256()
    for name in sorted(items):
        _update(digest, name, items[name])
    return digest.hexdigest()


def step_value(value: Any) -> float:
    """An optimizer's step counter as a number, whatever form it is kept in."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"a step counter holds one value, not {value.numel()}")
        return float(value.reshape(-1)[0].item())
    return float(value)


def optimizer_digest(states: Mapping[str, Mapping[str, Any]]) -> str:
    """SHA-256 over every parameter's optimizer state, in name and key order (``step`` by value)."""
    digest = hashlib.sha256()
    for name in sorted(states):
        for key in sorted(states[name]):
            value = states[name][key]
            if key == STEP_KEY:
                digest.update(f"{name}/{key}={step_value(value)!r};".encode())
            else:
                _update(digest, f"{name}/{key}", value)
    return digest.hexdigest()


def state_digests(
    parameters: Mapping[str, torch.Tensor], states: Mapping[str, Mapping[str, Any]]
) -> tuple[str, str]:
    """(:func:`parameters_digest`, :func:`optimizer_digest`) of one state."""
    return parameters_digest(parameters), optimizer_digest(states)
