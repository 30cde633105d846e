"""The control channel's messages to and from frames: :func:`encode_message`, :func:`decode_message`.

A frame's JSON holds the message's fields and its ``"type"``; tensors (a ``job_start``'s
model and optimizer state, a ``commit``'s job state) travel in the blob as raw
little-endian memory images, listed in the JSON with their offsets (docs/protocol.md,
"Control channel"). Torch is imported only to encode or decode a message with tensors.
Import these from :mod:`checkmate.control`, the public face.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from checkmate.control_frame import ControlProtocolError, frame_prefix
from checkmate.control_messages import (
    BucketLayout,
    BucketSpec,
    Certified,
    Commit,
    Diverged,
    Goodbye,
    JobStart,
    Message,
    ParamSlice,
    ParamSpec,
    RestoreRefused,
    RestoreRequest,
    StatusReport,
    StatusRequest,
)

if TYPE_CHECKING:
    import torch

    from checkmate.job_state import JobState

_DTYPE_NAMES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)
"""The tensor dtypes the control channel carries, by their torch names."""

if sys.byteorder != "little":  # pragma: no cover - no big-endian host is supported
    raise ImportError("checkmate.control_codec assumes a little-endian host")


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise ControlProtocolError(f"tensor dtype {dtype} cannot travel on the control channel")
    return name


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPE_NAMES:
        raise ControlProtocolError(f"unknown tensor dtype {name!r}")
    import torch  # only messages with tensors need torch (see the module docstring)

    dtype: torch.dtype = getattr(torch, name)
    return dtype


_COMMIT_OPTIONAL: dict[str, Any] = {
    "no_grad": [],
    "gradient_scaling": [],
    "fingerprint": None,
    "gradient_digests": None,
}
"""Commit fields left off the wire at their default (frames stay small; older readers unaffected)."""

_TYPES: dict[str, type] = {
    cls.TYPE: cls
    for cls in (
        JobStart,
        BucketLayout,
        Commit,
        Certified,
        Goodbye,
        StatusRequest,
        StatusReport,
        RestoreRequest,
        RestoreRefused,
        Diverged,
    )
}


# ---- encoding ---------------------------------------------------------------------------
def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    import torch  # only messages with tensors need torch (see the module docstring)

    t = tensor.detach().to("cpu").contiguous().reshape(-1)
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    if t.dtype is torch.bool:
        t = t.view(torch.uint8)
    return t.numpy().data.cast("B")


def _tensor_listing(tensors: dict[str, torch.Tensor]) -> tuple[list[dict[str, Any]], list[memoryview]]:
    """The JSON listing of ``tensors`` and their bytes, in order, for a frame's blob."""
    offset = 0
    listing = []
    blobs: list[memoryview] = []
    for key, tensor in tensors.items():
        data = _tensor_bytes(tensor)
        listing.append(
            {
                "key": key,
                "dtype": dtype_name(tensor.dtype),
                "shape": list(tensor.shape),
                "offset": offset,
                "nbytes": len(data),
            }
        )
        blobs.append(data)
        offset += len(data)
    return listing, blobs


def _read_tensors(listing: Any, blob: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The tensors a frame's listing names, read out of its blob."""
    if not isinstance(listing, list):
        raise ControlProtocolError("'tensors' is not a list")
    import torch  # only messages with tensors need torch (see the module docstring)

    tensors: dict[str, torch.Tensor] = {}
    view = memoryview(blob)
    for entry in listing:
        lo, n = int(entry["offset"]), int(entry["nbytes"])
        if lo < 0 or lo + n > len(view):
            raise ControlProtocolError(f"tensor {entry['key']!r} lies outside the blob")
        dtype = torch_dtype(entry["dtype"])
        raw = bytearray(view[lo : lo + n])
        flat = torch.frombuffer(raw, dtype=dtype) if n else torch.empty(0, dtype=dtype)
        tensors[entry["key"]] = flat.reshape(entry["shape"])
    return tensors


JOB_STATE_TENSOR_PREFIX = "jobstate/"
"""A job_start's tensors under this prefix are its job state's (document in ``extra["job_state"]``)."""


def attach_job_state(message: JobStart, state: JobState | None) -> JobStart:
    """Put ``state`` into a job_start (``extra["job_state"]`` and ``jobstate/<key>`` tensors)."""
    if state is not None:
        message.extra["job_state"] = state.document
        for key, tensor in state.tensors.items():
            message.tensors[JOB_STATE_TENSOR_PREFIX + key] = tensor
    return message


def job_state_of(message: JobStart) -> JobState | None:
    """The job state a job_start carries (None: none); ControlProtocolError if it is malformed."""
    document = message.extra.get("job_state")
    if document is None:
        return None
    from checkmate.job_state import JobState, JobStateError  # a job state holds tensors: torch

    n = len(JOB_STATE_TENSOR_PREFIX)
    tensors = {k[n:]: t for k, t in message.tensors.items() if k.startswith(JOB_STATE_TENSOR_PREFIX)}
    try:
        return JobState(document, tensors).validate()
    except JobStateError as exc:
        raise ControlProtocolError(f"job_start carries a bad job state: {exc}") from None


def _slice_json(piece: ParamSlice) -> dict[str, Any]:
    """A bucket layout's slice on the wire (``param_offset`` only for a segment: DDP's read as before)."""
    out: dict[str, Any] = {"name": piece.name, "offset": piece.offset, "numel": piece.numel}
    if piece.param_offset:
        out["param_offset"] = piece.param_offset
    return out


def encode_message(message: Message) -> list[bytes | memoryview]:
    """The frame for ``message`` as buffers for ``sendmsg``/``sendall`` (tensor bytes not copied)."""
    body: dict[str, Any] = {"type": message.TYPE}
    blobs: list[memoryview] = []
    if isinstance(message, JobStart):
        listing, blobs = _tensor_listing(message.tensors)
        body.update(
            job_id=message.job_id,
            world_size=message.world_size,
            workers=[list(w) for w in message.workers],
            parameters=[
                {"name": p.name, "shape": list(p.shape), "dtype": p.dtype} for p in message.parameters
            ],
            optimizer=message.optimizer,
            start_iteration=message.start_iteration,
            tensors=listing,
            optimizer_scalars=message.optimizer_scalars,
            job=message.job,
            extra=message.extra,
        )
    elif isinstance(message, BucketLayout):
        body.update(
            job_id=message.job_id,
            first_iteration=message.first_iteration,
            buckets=[
                {
                    "bucket_id": b.bucket_id,
                    "dtype": b.dtype,
                    "num_elements": b.num_elements,
                    "shard_key": b.shard_key,
                    "params": [_slice_json(p) for p in b.params],
                }
                for b in message.buckets
            ],
        )
    else:
        body.update({k: v for k, v in vars(message).items()})
        if isinstance(message, Commit) and message.data_position is None:
            del body["data_position"]  # optional: a commit without it reads as before
        if isinstance(message, Commit):
            for key, default in _COMMIT_OPTIONAL.items():
                if body.get(key) == default:
                    del body[key]
        if isinstance(message, Commit):
            state = body.pop("job_state")
            if state is not None:  # optional too; its tensors go into the blob
                body["job_state"] = state.document
                body["tensors"], blobs = _tensor_listing(state.tensors)
    try:
        text = json.dumps(body, allow_nan=True, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise ControlProtocolError(f"{message.TYPE} message is not JSON-serialisable: {exc}") from None
    blob_len = sum(len(b) for b in blobs)
    return [frame_prefix(len(text), blob_len), text, *blobs]


def decode_message(
    text: bytes | bytearray | memoryview, blob: bytes | bytearray | memoryview = b""
) -> Message:
    """Parse one frame's JSON and blob into a message."""
    try:
        body = json.loads(bytes(text))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ControlProtocolError(f"frame JSON is invalid: {exc}") from None
    if not isinstance(body, dict) or "type" not in body:
        raise ControlProtocolError("frame JSON is not an object with a 'type'")
    kind = body.pop("type")
    cls = _TYPES.get(kind)
    if cls is None:
        raise ControlProtocolError(f"unknown control message type {kind!r}; known: {sorted(_TYPES)}")
    try:
        if cls is Commit and "job_state" in body:
            from checkmate.job_state import JobState, JobStateError  # a job state holds tensors: torch

            state = JobState(body.pop("job_state"), _read_tensors(body.pop("tensors", []), blob))
            try:
                body["job_state"] = state.validate()
            except JobStateError as exc:
                raise ControlProtocolError(f"commit carries a bad job state: {exc}") from None
        if cls is JobStart:
            tensors = _read_tensors(body.pop("tensors"), blob)
            body["parameters"] = [
                ParamSpec(p["name"], tuple(p["shape"]), p["dtype"]) for p in body.pop("parameters")
            ]
            body["workers"] = [(str(h), int(p)) for h, p in body.pop("workers")]
            return JobStart(tensors=tensors, **body)
        if cls is BucketLayout:
            body["buckets"] = [
                BucketSpec(
                    bucket_id=b["bucket_id"],
                    dtype=b["dtype"],
                    num_elements=b["num_elements"],
                    shard_key=b["shard_key"],
                    params=tuple(
                        ParamSlice(p["name"], p["offset"], p["numel"], p.get("param_offset", 0))
                        for p in b["params"]
                    ),
                )
                for b in body.pop("buckets")
            ]
        message: Message = cls(**body)
        return message
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        if isinstance(exc, ControlProtocolError):
            raise
        raise ControlProtocolError(f"bad {kind} message: {exc}") from None
