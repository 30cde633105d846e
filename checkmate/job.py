"""The description of a training job that controller, host agents and shadows share.

A job names its workers in ring order and its shadows, and says which shadow
owns which shard key. Workers put a bucket's shard key in every tagged packet
(``shard_key_for_bucket``); the controller turns the shard map into replication
entries; shadows learn from it which buckets are theirs. The default map is the
one the authors' prototype used: bucket b -> shard b mod K -> shadow K.

A tensor-parallel job (TP x DP) is one Checkmate job per TP index, a *lane*: the
DP group of TP index t all-reduces t's shard of the gradients, under its own job
id, to its own shadows; ``tp_degree`` and ``tp_index`` say which TP shard a lane's
copies (and its shadows' state and snapshots) carry, so the lanes' snapshots can
be merged into one universal checkpoint (:mod:`checkmate.universal.shadow_merge`).

Optional sizing fields say how big the job is and what its shadows can hold:
``parallelism`` (how the workers reduce their gradients), ``model_params``, ``optimizer``,
``grad_dtype`` and ``shadow_memory_gib`` (memory each shadow may use). ``checkmate-ctl job add``
refuses a job whose shadows cannot hold its state (:mod:`controller.capacity_job`); a job file
without them loads as before and is not sized.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from checkmate.wire import CHECKMATE_UDP_PORT

MAX_JOB_ID = (1 << 32) - 1
MAX_SHARD_KEY = (1 << 16) - 1
MAX_MODEL_PARAMS = 10**15

PARALLELISMS = ("ddp", "fsdp2")
"""How a protected job's workers reduce their gradients (``JobSpec.parallelism``): DDP's all-reduce
(``hosts.enable_checkmate``), FSDP2's reduce-scatter (``hosts.c10d_fsdp.enable_checkmate_fsdp``).
Tensor parallelism is ``tp_degree``."""
UNPROTECTED_PARALLELISMS = {
    "zero1": "ZeRO-1 (torch's ZeroRedundancyOptimizer, DeepSpeed stage 1)",
    "zero2": "ZeRO-2 (DeepSpeed stage 2)",
}
"""Parallelisms ``checkmate-ctl plan`` sizes but nothing protects yet (docs/backend.md's feature table)."""
SIZING_FIELDS = ("model_params", "optimizer", "shadow_memory_gib")
"""Given together or not at all: what ``job add`` needs to size the shadows (``grad_dtype`` is optional)."""


class JobSpecError(ValueError):
    """A job description that cannot be used; the message names the field."""


@dataclass(frozen=True)
class JobSpec:
    job_id: int
    workers: tuple[str, ...]
    """Worker host names in ring order: rank r sends to rank (r + 1) mod N."""
    shadows: tuple[str, ...]
    shard_to_shadow: Mapping[int, str] = field(default_factory=dict)
    """Shard key -> shadow host. Empty means the default: shard k -> shadows[k]."""
    shadow_port: int = CHECKMATE_UDP_PORT
    """UDP port the shadows listen on for copies of this job."""
    tp_degree: int = 1
    """Tensor-parallel degree of the training job this lane belongs to (1: no tensor parallelism)."""
    tp_index: int = 0
    """The TP index whose DP group this job is: its gradients, and its shadows' state, are that TP shard."""
    parallelism: str = "ddp"
    """How the workers reduce their gradients (``PARALLELISMS``); shadows hold the full state either way."""
    model_params: int | None = None
    """Parameters of the whole model (a TP job's lanes together; each lane's shadows hold 1/tp_degree)."""
    optimizer: str | None = None
    """The optimizer, as ``checkmate-ctl plan --optimizer`` names it (adamw, sgd-momentum, ...)."""
    grad_dtype: str | None = None
    """The gradients' dtype on the wire (fp32, bf16, fp16); None: fp32."""
    shadow_memory_gib: float | None = None
    """Memory each of the job's shadows may use for it, GiB."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "workers", tuple(self.workers))
        object.__setattr__(self, "shadows", tuple(self.shadows))
        if not self.shard_to_shadow:
            object.__setattr__(self, "shard_to_shadow", {k: s for k, s in enumerate(self.shadows)})
        else:
            object.__setattr__(self, "shard_to_shadow", dict(self.shard_to_shadow))
        self.validate()

    def validate(self) -> None:
        if isinstance(self.job_id, bool) or not isinstance(self.job_id, int):
            raise JobSpecError(f"job_id must be an integer, got {self.job_id!r}")
        if not 1 <= self.job_id <= MAX_JOB_ID:
            raise JobSpecError(f"job_id {self.job_id} is outside 1..{MAX_JOB_ID}")
        if len(self.workers) < 2:
            raise JobSpecError(f"a job needs at least 2 workers, got {list(self.workers)}")
        if not self.shadows:
            raise JobSpecError("a job needs at least 1 shadow")
        for role, names in (("worker", self.workers), ("shadow", self.shadows)):
            seen: set[str] = set()
            for name in names:
                if not isinstance(name, str) or not name:
                    raise JobSpecError(f"{role} names must be non-empty strings, got {name!r}")
                if name in seen:
                    raise JobSpecError(f"{role} {name!r} is listed twice")
                seen.add(name)
        both = sorted(set(self.workers) & set(self.shadows))
        if both:
            raise JobSpecError(f"host(s) {both} cannot be both worker and shadow")
        for key, shadow in self.shard_to_shadow.items():
            if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key <= MAX_SHARD_KEY:
                raise JobSpecError(f"shard key {key!r} is outside 0..{MAX_SHARD_KEY}")
            if shadow not in self.shadows:
                raise JobSpecError(f"shard {key} maps to {shadow!r}, which is not one of the shadows")
        if not 1 <= self.shadow_port <= 65535:
            raise JobSpecError(f"shadow_port {self.shadow_port} is not a UDP port")
        for name in ("tp_degree", "tp_index"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise JobSpecError(f"{name} must be an integer, got {value!r}")
        if self.tp_degree < 1:
            raise JobSpecError(f"tp_degree {self.tp_degree} must be at least 1")
        if not 0 <= self.tp_index < self.tp_degree:
            raise JobSpecError(f"tp_index {self.tp_index} is outside 0..{self.tp_degree - 1}")
        self._validate_sizing()

    def _validate_sizing(self) -> None:
        """The optional sizing fields: known values, positive sizes, given together."""
        if self.parallelism in UNPROTECTED_PARALLELISMS:
            raise JobSpecError(
                f"parallelism {self.parallelism!r}: {UNPROTECTED_PARALLELISMS[self.parallelism]} is not "
                f"protected by Checkmate yet (docs/backend.md); a job is one of: {', '.join(PARALLELISMS)}"
            )
        if self.parallelism not in PARALLELISMS:
            raise JobSpecError(
                f"unknown parallelism {self.parallelism!r}; known: {', '.join(PARALLELISMS)} "
                "(tensor parallelism is tp_degree)"
            )
        if self.parallelism == "fsdp2" and self.tp_degree > 1:
            raise JobSpecError(
                f"parallelism 'fsdp2' with tp_degree {self.tp_degree}: FSDP2 with tensor parallelism is not "
                "protected yet (docs/backend.md); a TP x DP job's lanes are DDP ('ddp')"
            )
        if self.model_params is not None:
            value = self.model_params
            if isinstance(value, bool) or not isinstance(value, int):
                raise JobSpecError(f"model_params must be an integer, got {value!r}")
            if not 1 <= value <= MAX_MODEL_PARAMS:
                raise JobSpecError(f"model_params {value} is not a model size (1..10^15 parameters)")
            if value < self.tp_degree:
                raise JobSpecError(
                    f"model_params {value} is fewer than the tp_degree {self.tp_degree} lanes it is split "
                    "into"
                )
        if self.shadow_memory_gib is not None:
            memory = self.shadow_memory_gib
            if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not math.isfinite(memory):
                raise JobSpecError(f"shadow_memory_gib must be a number, got {memory!r}")
            if memory <= 0:
                raise JobSpecError(f"shadow_memory_gib {memory:g} must be positive (GiB per shadow)")
        for name in ("optimizer", "grad_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise JobSpecError(f"{name} must be a name such as 'adamw' or 'bf16', got {value!r}")
        given = [name for name in SIZING_FIELDS if getattr(self, name) is not None]
        if self.grad_dtype is not None:
            given.append("grad_dtype")
        missing = [name for name in SIZING_FIELDS if getattr(self, name) is None]
        if given and missing:
            raise JobSpecError(
                f"{', '.join(given)} given without {', '.join(missing)}: sizing a job's shadows needs "
                f"{', '.join(SIZING_FIELDS)} together (grad_dtype optional), or none of them"
            )

    @property
    def sized(self) -> bool:
        """Whether the job says how big it is (``SIZING_FIELDS``), so its shadows can be checked."""
        return self.model_params is not None

    def sizing_fields(self) -> dict[str, Any]:
        """The sizing fields that differ from their defaults (what ``to_json`` adds)."""
        out: dict[str, Any] = {}
        if self.parallelism != "ddp":
            out["parallelism"] = self.parallelism
        for name in ("model_params", "optimizer", "grad_dtype", "shadow_memory_gib"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def shard_keys(self) -> tuple[int, ...]:
        return tuple(sorted(self.shard_to_shadow))

    def shard_key_for_bucket(self, bucket_id: int) -> int:
        """The shard key a worker puts in packets of ``bucket_id`` (round robin)."""
        keys = self.shard_keys
        return keys[bucket_id % len(keys)]

    def shadow_for_bucket(self, bucket_id: int) -> str:
        return self.shard_to_shadow[self.shard_key_for_bucket(bucket_id)]

    def ring_next(self, worker: str) -> str:
        """The worker that ``worker`` sends to in the ring."""
        index = self.workers.index(worker)
        return self.workers[(index + 1) % len(self.workers)]

    def with_shard_moved(self, shard_key: int, shadow: str) -> JobSpec:
        """A copy where ``shard_key`` is owned by ``shadow`` (which must be one of the shadows)."""
        if shard_key not in self.shard_to_shadow:
            raise JobSpecError(f"job {self.job_id} has no shard {shard_key}; shards: {list(self.shard_keys)}")
        moved = dict(self.shard_to_shadow)
        moved[shard_key] = shadow
        shadows = self.shadows if shadow in self.shadows else (*self.shadows, shadow)
        return dataclasses.replace(self, shadows=shadows, shard_to_shadow=moved)

    def with_workers(self, workers: tuple[str, ...] | list[str]) -> JobSpec:
        """A copy with another worker ring (a job restarted with more or fewer workers)."""
        return dataclasses.replace(self, workers=tuple(workers), shard_to_shadow=dict(self.shard_to_shadow))

    def tp_fields(self) -> dict[str, int]:
        """``{"tp_degree", "tp_index"}`` for a lane of a tensor-parallel job, else empty (in snapshots)."""
        return {"tp_degree": self.tp_degree, "tp_index": self.tp_index} if self.tp_degree > 1 else {}

    # ---- JSON -------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The JSON form; ``tp_degree``/``tp_index`` only for a lane of a tensor-parallel job."""
        out: dict[str, Any] = {
            "job_id": self.job_id,
            "workers": list(self.workers),
            "shadows": list(self.shadows),
            "shard_to_shadow": {str(k): v for k, v in sorted(self.shard_to_shadow.items())},
            "shadow_port": self.shadow_port,
        }
        out.update(self.tp_fields())
        out.update(self.sizing_fields())
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobSpec:
        known = {
            "job_id",
            "workers",
            "shadows",
            "shard_to_shadow",
            "shadow_port",
            "tp_degree",
            "tp_index",
            "parallelism",
            "model_params",
            "optimizer",
            "grad_dtype",
            "shadow_memory_gib",
        }
        if not isinstance(data, Mapping):
            raise JobSpecError(f"a job description is a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - known)
        if unknown:
            raise JobSpecError(f"unknown job field(s) {unknown}; known: {sorted(known)}")
        for required in ("job_id", "workers", "shadows"):
            if required not in data:
                raise JobSpecError(f"job description lacks {required!r}")
        workers, shadows = data["workers"], data["shadows"]
        for name, value in (("workers", workers), ("shadows", shadows)):
            if not isinstance(value, Sequence) or isinstance(value, str):
                raise JobSpecError(f"{name} must be a list of host names")
        raw_map = data.get("shard_to_shadow", {})
        if not isinstance(raw_map, Mapping):
            raise JobSpecError("shard_to_shadow must be an object {shard_key: shadow}")
        shard_map: dict[int, str] = {}
        for key, shadow in raw_map.items():
            try:
                shard_map[int(key)] = shadow
            except (TypeError, ValueError):
                raise JobSpecError(f"shard key {key!r} is not an integer") from None
        return cls(
            job_id=data["job_id"],
            workers=tuple(workers),
            shadows=tuple(shadows),
            shard_to_shadow=shard_map,
            shadow_port=data.get("shadow_port", CHECKMATE_UDP_PORT),
            tp_degree=data.get("tp_degree", 1),
            tp_index=data.get("tp_index", 0),
            parallelism=data.get("parallelism", "ddp"),
            model_params=_whole(data.get("model_params")),
            optimizer=data.get("optimizer"),
            grad_dtype=data.get("grad_dtype"),
            shadow_memory_gib=data.get("shadow_memory_gib"),
        )

    @classmethod
    def loads(cls, text: str) -> JobSpec:
        try:
            return cls.from_json(json.loads(text))
        except json.JSONDecodeError as exc:
            raise JobSpecError(f"job description is not valid JSON: {exc}") from None


def _whole(value: Any) -> Any:
    """A JSON count written as a float (``7e9``) as the integer it is; anything else unchanged."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
