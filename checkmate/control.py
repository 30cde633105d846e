"""The control channel's messages: what a job's rank 0 tells its shadows, besides the gradients.

Shared by the host agent (``hosts.control_channel``, the sender) and the
shadow (the receiver), like :mod:`checkmate.wire` is for the data path; the
format is specified in docs/protocol.md ("Control channel").

A TCP connection opens with the shadow's hello (its nonce and name) and then carries
frames authenticated with that connection's keys (:mod:`checkmate.control_frame`)::

    magic "CMC3" | json_len | blob_len | job | run | seq | head tag | JSON (UTF-8) | blob | tag

The JSON object has a ``"type"`` (``job_start``, ``bucket_layout``,
``commit``, ``certified``, ``goodbye``; and on a shadow's same TCP port,
``status_request``/``status``, ``restore_request``/``restore_refused``, a
restore being answered with a ``job_start``) and the message's fields. Tensors
travel in the blob as raw little-endian memory images; the JSON lists each as
``{"key", "dtype", "shape", "offset", "nbytes"}`` with its offset in the blob.
Every read and write takes a timeout; a malformed frame raises
:class:`ControlProtocolError`.

Importable without torch: the messages, their JSON, and :func:`query_status` (the one
client that asks a shadow for its status, used by ``checkmate-ctl job show``,
``checkmate-shadow status`` and the restore client) need none. Only a message that
carries tensors (``job_start``, a ``commit`` with a job state) imports torch, when it
is encoded or decoded.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from checkmate.auth import AuthConfigError

# The framing and its constants live in the torch-free checkmate.control_frame; re-exported here.
from checkmate.control_frame import DEFAULT_CONTROL_PORT as DEFAULT_CONTROL_PORT
from checkmate.control_frame import MAGIC as MAGIC
from checkmate.control_frame import MAX_BLOB_BYTES as MAX_BLOB_BYTES
from checkmate.control_frame import MAX_JSON_BYTES as MAX_JSON_BYTES
from checkmate.control_frame import ControlAuth, FrameAuthError, bind, frame_prefix, recv_frame, send_frame
from checkmate.control_frame import ControlProtocolError as ControlProtocolError
from checkmate.network import Addr

if TYPE_CHECKING:
    import torch

    from checkmate.job_state import JobState

MAX_DATA_POSITION_BYTES = 64 << 10
"""Largest data position a commit may carry, measured as compact UTF-8 JSON."""

MAX_STATUS_BYTES = 16 << 20
"""A status document is a few KiB; a reply announcing more is not a shadow's."""

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
    raise ImportError("checkmate.control assumes a little-endian host")


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


def validate_data_position(position: Any) -> Any:
    """``position`` as JSON gives it back (a private copy), or ValueError saying why it cannot travel.

    A data position is any JSON value but null (null on the wire means "unchanged"):
    strict JSON (no NaN or infinities), at most :data:`MAX_DATA_POSITION_BYTES` as
    compact UTF-8. The copy is what a restore returns: tuples come back as lists and
    non-string dictionary keys as strings.
    """
    if position is None:
        raise ValueError("a data position cannot be None (null means 'unchanged' on the control channel)")
    try:
        text = json.dumps(position, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"data position is not JSON-serialisable: {exc}") from None
    size = len(text.encode())
    if size > MAX_DATA_POSITION_BYTES:
        raise ValueError(
            f"data position is {size} bytes as JSON; the limit is {MAX_DATA_POSITION_BYTES} bytes"
        )
    return json.loads(text)


# ---- messages ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamSpec:
    """A model parameter: fully-qualified name (``model.named_parameters()``), shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class ParamSlice:
    """Where a parameter's gradient lies in a bucket: ``numel`` elements from ``offset``.

    ``param_offset``: the slice holds elements ``[param_offset, param_offset + numel)`` of the
    flattened parameter (a *segment*: an FSDP2 / ZeRO reduce-scatter's bucket holds every rank's
    shard of a parameter at another place); DDP's buckets hold whole parameters (0, all elements).
    A parameter's segments in a bucket tile it exactly.
    """

    name: str
    offset: int
    numel: int
    param_offset: int = 0


@dataclass(frozen=True)
class BucketSpec:
    """One DDP gradient bucket: its id on the wire, dtype, size, shard key and parameters."""

    bucket_id: int
    dtype: str
    num_elements: int
    shard_key: int
    params: tuple[ParamSlice, ...]


@dataclass
class JobStart:
    """Rank 0 -> shadow, first on every (re)connection: the model, optimizer and state.

    ``tensors`` holds ``param/<name>`` for every parameter and
    ``state/<name>/<key>`` for every tensor in the optimizer state;
    non-tensor optimizer state is in ``optimizer_scalars[name][key]``. The
    state is the one *before* iteration ``start_iteration``'s optimizer step.
    """

    TYPE: ClassVar[str] = "job_start"
    job_id: int
    world_size: int
    workers: list[tuple[str, int]]
    """Worker data addresses in ring order (where to send REPAIR_REQUESTs)."""
    parameters: list[ParamSpec]
    optimizer: dict[str, Any]
    """``{"kind": "SGD"|"Adam"|..., "param_groups": [hyperparameters + "params": [names]]}``."""
    start_iteration: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer_scalars: dict[str, dict[str, Any]] = field(default_factory=dict)
    job: dict[str, Any] | None = None
    """The job description (``JobSpec.to_json()``) when the workers have one."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else: from rank 0, ``data_position`` (the data position after iteration
    ``start_iteration`` - 1, when the workers set one); in a shadow's restore answer,
    ``shadow``, ``iteration``, ``optimizer_step``, ``data_position``, ..."""


@dataclass
class BucketLayout:
    """Rank 0 -> shadow: the bucket layout from ``first_iteration`` on (sent again when DDP rebuilds it)."""

    TYPE: ClassVar[str] = "bucket_layout"
    job_id: int
    first_iteration: int
    buckets: list[BucketSpec]


@dataclass
class Commit:
    """Rank 0 -> shadow, once per iteration after the optimizer step (or its skip)."""

    TYPE: ClassVar[str] = "commit"
    job_id: int
    iteration: int
    learning_rates: list[float]
    """``lr`` of each param group as the step used it, in group order."""
    clip_coefficient: float | None = None
    """The clamped float32 coefficient ``clip_grad_norm_`` multiplied the gradients by (exact)."""
    skip_step: bool = False
    """No optimizer step happened for this iteration (e.g. the loss scaler found inf/nan)."""
    hyperparameters: list[dict[str, Any]] = field(default_factory=list)
    """Per group, the scalar hyperparameters that changed since the last message (often empty)."""
    optimizer_step: int = 0
    """How many optimizer steps the workers have taken, this one included."""
    data_position: Any = None
    """Where to resume reading data after this iteration (a JSON value, see
    :func:`validate_data_position`); None, and absent on the wire: unchanged since
    the previous iteration."""
    job_state: JobState | None = None
    """The job's state after this iteration besides parameters and optimizer state
    (persistent buffers, stateful objects, param-group hyperparameters in force:
    :mod:`checkmate.job_state`); its tensors travel in the frame's blob. None, and
    absent on the wire: unchanged since the previous iteration."""
    no_grad: list[str] = field(default_factory=list)
    """Parameters of the optimizer whose ``grad`` was None at this step (unused in forward,
    frozen, ``set_to_none``): torch.optim skipped them and so do the shadows. Absent: none."""
    gradient_scaling: list[dict[str, Any]] = field(default_factory=list)
    """In-place multiplications of the gradients between the all-reduce and the step, in the
    order made: ``{"by": "unscale"|"clip", "factor": float, "dtype": "float32", "params":
    [names]}`` (``params`` absent: every parameter with a gradient). When present, the shadows
    use it instead of ``clip_coefficient``. Absent: none."""
    fingerprint: dict[str, dict[str, int]] | None = None
    """Rank 0's state after this step, per parameter name: ``{"param": checksum, <optimizer
    state key>: checksum}`` (:mod:`checkmate.fingerprint`); sent every K iterations
    (``CHECKMATE_FINGERPRINT_EVERY``). Absent: not checked this iteration."""
    gradient_digests: dict[str, Any] | None = None
    """Rank 0's MAC of each fully reduced bucket as it crossed the wire (:class:`checkmate.auth.
    GradientDigests`): ``{"run": hex, "buckets": {"<bucket id>": [counter, tag hex]}}``. A shadow
    applies a bucket only if its copies carry the same tag. Absent: an older rank 0 (not checked)."""


@dataclass
class Diverged:
    """Shadow -> rank 0: after applying ``iteration`` its state differs from rank 0's fingerprint.

    The shadow has withdrawn certification of everything after ``last_verified`` and asks
    for fresh state (it says goodbye; rank 0 reconnects and re-seeds it)."""

    TYPE: ClassVar[str] = "diverged"
    job_id: int
    shadow: str
    iteration: int
    last_verified: int
    """The last iteration whose fingerprint matched (-1: none); certificates after it are withdrawn."""
    mismatches: list[str] = field(default_factory=list)
    """``name::state`` of the tensors that differ (at most 20 listed)."""


_COMMIT_OPTIONAL: dict[str, Any] = {
    "no_grad": [],
    "gradient_scaling": [],
    "fingerprint": None,
    "gradient_digests": None,
}
"""Commit fields left off the wire at their default (frames stay small; older readers unaffected)."""


@dataclass
class Certified:
    """Shadow -> rank 0: this shadow has applied every iteration up to ``iteration``."""

    TYPE: ClassVar[str] = "certified"
    job_id: int
    shadow: str
    iteration: int


@dataclass
class Goodbye:
    """Either side: the sender closes the connection on purpose."""

    TYPE: ClassVar[str] = "goodbye"
    job_id: int
    reason: str = ""


@dataclass
class StatusRequest:
    """Anyone -> shadow (its control port): send your status."""

    TYPE: ClassVar[str] = "status_request"
    job_id: int = 0


@dataclass
class StatusReport:
    """Shadow -> asker: the shadow's status document (docs/shadow.md lists the fields)."""

    TYPE: ClassVar[str] = "status"
    job_id: int
    status: dict[str, Any]


@dataclass
class RestoreRequest:
    """Recovering worker -> shadow: the shard of the state after ``iteration`` (None: the latest).

    A shadow behind ``iteration`` waits up to ``wait`` seconds to reach it and
    answers with a :class:`JobStart` holding its owned parameters and their
    optimizer state (``start_iteration`` = ``iteration`` + 1), or with
    :class:`RestoreRefused`.
    """

    TYPE: ClassVar[str] = "restore_request"
    job_id: int
    iteration: int | None = None
    wait: float = 0.0


@dataclass
class RestoreRefused:
    """Shadow -> asker: no state for the requested iteration; ``iteration`` is where the shadow is."""

    TYPE: ClassVar[str] = "restore_refused"
    job_id: int
    shadow: str
    iteration: int
    reason: str


Message = (
    JobStart
    | BucketLayout
    | Commit
    | Certified
    | Goodbye
    | StatusRequest
    | StatusReport
    | RestoreRequest
    | RestoreRefused
    | Diverged
)
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


# ---- sockets ----------------------------------------------------------------------------
def send_message(sock: socket.socket, message: Message, timeout: float) -> None:
    """Write one authenticated frame; OSError (TimeoutError included) if it cannot within ``timeout``."""
    parts = encode_message(message)
    send_frame(sock, parts[1:], int(getattr(message, "job_id", 0)), timeout)


def recv_message(sock: socket.socket, timeout: float) -> Message:
    """Read one frame (each socket read waits at most ``timeout`` seconds); FrameAuthError if forged."""
    text, blob = recv_frame(sock, timeout)
    return decode_message(text, blob)


# ---- asking a shadow for its status -----------------------------------------------------
class ShadowStatusError(ConnectionError):
    """One shadow could not be asked or gave no usable answer; the message says why."""


def _left(deadline: float, timeout: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no answer within {timeout:g} s")
    return left


def query_status(
    address: Addr, timeout: float, job_id: int = 0, auth: ControlAuth | None = None, name: str | None = None
) -> dict[str, Any]:
    """One shadow's status document (docs/shadow.md); raises :class:`ShadowStatusError` naming the cause.

    The whole exchange (connect, request, reply) takes at most ``timeout`` seconds, and is
    authenticated with ``auth`` (the job's secret; None: this process's). ``name``: the
    shadow meant; a node that names itself otherwise in its hello is refused (nothing is
    sent to it), so a redirected connection cannot answer for another shadow.
    """
    deadline = time.monotonic() + timeout
    request = encode_message(StatusRequest(job_id))[1:]
    try:
        with socket.create_connection(address, timeout=timeout) as conn:
            session = bind(conn, auth, job_id, name=name)
            try:
                session.send(conn, request, job_id, _left(deadline, timeout))
            except FrameAuthError as exc:  # the hello named another node
                raise ShadowStatusError(f"refused: {exc}") from None
            try:
                text, blob = session.recv(conn, _left(deadline, timeout), MAX_STATUS_BYTES)
                reply = decode_message(text, blob)
            except FrameAuthError as exc:
                raise ShadowStatusError(
                    f"bad reply: {exc} (does the shadow have this job's secret?)"
                ) from None
            except ControlProtocolError as exc:
                raise ShadowStatusError(f"bad reply: {exc}") from None
    except ShadowStatusError:
        raise
    except TimeoutError:
        raise ShadowStatusError(f"no answer within {timeout:g} s") from None
    except ConnectionRefusedError:
        raise ShadowStatusError("connection refused (no shadow listening)") from None
    except ConnectionError as exc:
        raise ShadowStatusError(
            f"bad reply: {exc} (a shadow closes a connection it cannot authenticate: does it have "
            "this job's secret?)"
        ) from None
    except AuthConfigError as exc:
        raise ShadowStatusError(str(exc)) from None
    except OSError as exc:
        raise ShadowStatusError(exc.strerror or str(exc)) from None
    if not isinstance(reply, StatusReport):
        raise ShadowStatusError(f"bad reply: {reply.TYPE!r} to a status request")
    if not isinstance(reply.status, dict):
        raise ShadowStatusError("bad reply: the status is not a JSON object")
    return reply.status
