"""Can a job's shadows hold its state? The planner's memory model for ``checkmate-ctl job add``.

A job description may say how big the job is (:class:`checkmate.job.JobSpec`'s sizing fields:
``model_params``, ``optimizer``, ``grad_dtype``, ``shadow_memory_gib``). The shadows hold the
full (logical) state whatever the workers shard (DDP, FSDP2): a lane's parameters
(``model_params / tp_degree``) split among its shard keys, each shadow the keys it owns, at
:func:`controller.capacity.shadow_bytes_per_param` bytes each (docs/capacity.md). The split is
even by parameters: buckets are dealt to the keys round robin, so a real shadow holds up to one
bucket more or less. ``job add`` refuses a job some shadow of which cannot hold its share,
before anything is registered or installed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from checkmate.job import JobSpec, JobSpecError
from controller.capacity import shadow_bytes_per_param
from controller.capacity_inputs import GRAD_DTYPE_BYTES, OPTIMIZER_STATE_BYTES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShadowShare:
    """What one shadow of a job holds: its shard keys, parameters and state bytes, and its memory."""

    shadow: str
    keys: int
    parameters: int
    state_bytes: int
    memory_bytes: int

    @property
    def fits(self) -> bool:
        return self.state_bytes <= self.memory_bytes


def shadow_shares(spec: JobSpec) -> list[ShadowShare]:
    """Each shadow's share of a sized job (empty for a job without sizing fields); JobSpecError naming
    the field for an optimizer or gradient dtype the planner does not know."""
    if not spec.sized:
        return []
    assert spec.model_params is not None and spec.shadow_memory_gib is not None  # JobSpec.validate
    if spec.optimizer not in OPTIMIZER_STATE_BYTES:
        raise JobSpecError(f"unknown optimizer {spec.optimizer!r}; known: {', '.join(OPTIMIZER_STATE_BYTES)}")
    grad_dtype = spec.grad_dtype or "fp32"
    if grad_dtype not in GRAD_DTYPE_BYTES:
        raise JobSpecError(f"unknown grad_dtype {grad_dtype!r}; known: {', '.join(GRAD_DTYPE_BYTES)}")
    per_param = shadow_bytes_per_param(spec.optimizer, grad_dtype)
    lane_params = -(-spec.model_params // spec.tp_degree)
    keys = len(spec.shard_to_shadow)
    memory = int(spec.shadow_memory_gib * 2**30)
    shares = []
    for shadow in spec.shadows:
        owned = sum(1 for s in spec.shard_to_shadow.values() if s == shadow)
        parameters = -(-lane_params * owned // keys)
        shares.append(ShadowShare(shadow, owned, parameters, parameters * per_param, memory))
    return shares


def check_shadow_memory(spec: JobSpec) -> list[ShadowShare]:
    """Each shadow's share; JobSpecError naming ``shadow_memory_gib`` and the numbers if one is short."""
    shares = shadow_shares(spec)
    over = [s for s in shares if not s.fits]
    if over:
        worst = max(over, key=lambda s: s.state_bytes)
        assert spec.model_params is not None
        lane = f" (lane {spec.tp_index} of tp_degree {spec.tp_degree})" if spec.tp_degree > 1 else ""
        sharded = (
            f"; its {spec.parallelism} workers each hold 1/{spec.world_size} of it, the shadows hold it whole"
            if spec.parallelism != "ddp"
            else ""
        )
        per_param = worst.state_bytes // max(1, worst.parameters)
        raise JobSpecError(
            f"job {spec.job_id}{lane}: shadow {worst.shadow} holds {worst.keys} of "
            f"{len(spec.shard_to_shadow)} shard key(s): {worst.parameters:,} parameters x {per_param} bytes "
            f"({spec.optimizer}, {spec.grad_dtype or 'fp32'} gradients; docs/capacity.md) = "
            f"{worst.state_bytes / 2**30:,.1f} GiB of state, more than shadow_memory_gib "
            f"{spec.shadow_memory_gib:g} GiB{sharded} ({len(over)} of {len(shares)} shadow(s) too small: "
            f"add shadows or give them more memory; checkmate-ctl plan sizes them)"
        )
    for share in shares:
        logger.info(
            "job %d: shadow %s holds %d parameters, %.1f of %.1f GiB",
            spec.job_id,
            share.shadow,
            share.parameters,
            share.state_bytes / 2**30,
            share.memory_bytes / 2**30,
        )
    return shares
