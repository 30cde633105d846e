"""Digests that say whether two copies of a model and its optimizer state are equal bit for bit."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from topologies.recovery import parameters_digest


def optimizer_state_digest(states: Mapping[str, Mapping[str, Any]]) -> str:
    """SHA-256 over every parameter's optimizer state, in name and key order.

    Tensors count with their dtype, shape and bytes; the step counter counts by its
    value only (AdamW keeps it as a float tensor, a checkpoint may hold a number).
    """
    digest = hashlib.sha256()
    for name in sorted(states):
        for key in sorted(states[name]):
            value = states[name][key]
            if key == "step":
                number = float(value.item()) if isinstance(value, torch.Tensor) else float(value)
                digest.update(f"{name}/step={number!r};".encode())
                continue
            tensor = torch.as_tensor(value).detach().to("cpu").contiguous()
            digest.update(f"{name}/{key}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def state_digests(
    parameters: Mapping[str, torch.Tensor], states: Mapping[str, Mapping[str, Any]]
) -> tuple[str, str]:
    """(parameters digest, optimizer state digest)."""
    return parameters_digest(parameters), optimizer_state_digest(states)
