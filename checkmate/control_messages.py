"""The control channel's messages as dataclasses: what rank 0 and a shadow tell each other.

One class per message ``"type"`` (:class:`JobStart`, :class:`BucketLayout`, :class:`Commit`,
...), the pieces they carry (:class:`ParamSpec`, :class:`BucketSpec`, :class:`ParamSlice`) and
the rule for a data position (:func:`validate_data_position`). How they travel is
:mod:`checkmate.control_codec`; import them from :mod:`checkmate.control`, the public face.
Importable without torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from checkmate.job_state import JobState

MAX_DATA_POSITION_BYTES = 64 << 10
"""Largest data position a commit may carry, measured as compact UTF-8 JSON."""


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
