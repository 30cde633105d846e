"""Tensor <-> payload bytes for the wire format, without copies.

Kept apart from :mod:`checkmate.wire` so the switch never imports torch.
Payload bytes are the tensor's little-endian memory image (docs/protocol.md).
"""

from __future__ import annotations

import sys
import warnings

import torch

from checkmate.wire import DType, WireFormatError

_TO_TORCH = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}

if sys.byteorder != "little":  # pragma: no cover - no big-endian host is supported
    raise ImportError("checkmate.tensors assumes a little-endian host (payloads are little-endian)")

# torch.frombuffer over a read-only buffer (a received datagram's bytes) warns once per process
# that the tensor is not write-protected. payload_tensor's tensors are only read (or cloned), so
# that warning says nothing to a user: spend torch's one warning here, silenced, at import.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(bytes(4), dtype=torch.float32)


def wire_dtype(dtype: torch.dtype) -> DType:
    """The wire dtype for a torch dtype; WireFormatError if it has none."""
    try:
        return _FROM_TORCH[dtype]
    except KeyError:
        raise WireFormatError(f"torch dtype {dtype} has no wire encoding (fp32, bf16, fp16)") from None


def torch_dtype(dtype: DType) -> torch.dtype:
    try:
        return _TO_TORCH[dtype]
    except KeyError:
        raise WireFormatError(f"wire dtype {dtype!r} carries no elements") from None


def tensor_payload(tensor: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory (no copy)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor is on {tensor.device}; copy it to host memory first")
    if not tensor.is_contiguous():
        raise ValueError("tensor slice is not contiguous")
    wire_dtype(tensor.dtype)
    # numpy has no bfloat16: view 2-byte types as int16 first; the bytes are the same.
    flat = tensor.reshape(-1)
    if tensor.element_size() == 2:
        flat = flat.view(torch.int16)
    return flat.numpy().data.cast("B")


def payload_tensor(payload: memoryview | bytes | bytearray, dtype: DType) -> torch.Tensor:
    """A 1-D tensor over the payload bytes (no copy; clone it to keep it past the buffer)."""
    element_type = torch_dtype(dtype)
    if len(payload) == 0:
        return torch.empty(0, dtype=element_type)
    return torch.frombuffer(payload, dtype=element_type)
