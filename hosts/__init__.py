"""Host agents: the gradient transport and ring all-reduce inside PyTorch DDP.

Workers put fully reduced gradients on the wire once, tagged REPLICATE, so the
switch can copy them to shadows. The one line for a DDP script is
``hosts.enable_checkmate(ddp_model, optimizer)`` (see :mod:`hosts.ddp`); the one
call to resume after a failure is ``hosts.resume(ddp_model, optimizer)``
(see :mod:`hosts.recovery`). An FSDP2 (``fully_shard``) script on the ``checkmate``
backend calls ``hosts.enable_checkmate_fsdp(model, optimizer)`` and resumes with
``hosts.resume_fsdp`` (see :mod:`hosts.c10d_fsdp` and docs/backend.md).

Modules: :mod:`hosts.transport` (reliable UDP, assembled from :mod:`hosts.transport_io`
(socket writes, GSO), :mod:`hosts.transport_flow` (windows, ACKs, timers) and
:mod:`hosts.transport_receive` (the receive thread)), :mod:`hosts.ring_allreduce`
(ring all-reduce, tags, repair service), :mod:`hosts.ddp` (``enable_checkmate`` and the
agent, assembled from :mod:`hosts.ddp_config` (configuration, job file),
:mod:`hosts.ddp_hook` (the DDP comm hook), :mod:`hosts.ddp_gradients` (clipping, the
path to the optimizer step), :mod:`hosts.ddp_commits` (the iteration count, rank 0's job
start, commit records, fingerprints), :mod:`hosts.ddp_links` (the control channel, the
protection watch, the job file followed) and :mod:`hosts.ddp_tp` (DDP over a TP model)),
:mod:`hosts.control_channel` (rank 0 -> shadows, TCP), :mod:`hosts.recovery` (resume
from the shadows' memory or disk, through :mod:`checkmate.checkpoint`'s state sources),
:mod:`hosts.random_state` (``hosts.RandomState``: the job's generators as one
stateful object), :mod:`hosts.protection` (bounded lag, ``hosts.UnprotectedError``),
:mod:`hosts.metrics` (Prometheus), :mod:`hosts.faults` (seeded
loss/duplication/reordering for tests), and a benchmark: :mod:`hosts.benchmark`
(ring all-reduce and DDP step vs gloo); what authentication costs per TinyLM iteration
is measured with the experiments (:mod:`experiments.bench.auth`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hosts.c10d_fsdp import FsdpCheckmateAgent, enable_checkmate_fsdp, resume_fsdp  # noqa: F401
    from hosts.ddp import CheckmateAgent, CheckmateConfig, clip_grad_norm_, enable_checkmate  # noqa: F401
    from hosts.protection import UnprotectedError  # noqa: F401
    from hosts.random_state import RandomState  # noqa: F401
    from hosts.recovery import ResumeError, ResumePoint, resume, settle_buckets  # noqa: F401

_FROM_DDP = ("CheckmateAgent", "CheckmateConfig", "clip_grad_norm_", "enable_checkmate")
_FROM_RESUME = ("ResumeError", "ResumePoint", "resume", "settle_buckets")
_FROM_RANDOM_STATE = ("RandomState",)
_FROM_PROTECTION = ("UnprotectedError",)
_FROM_FSDP = ("FsdpCheckmateAgent", "enable_checkmate_fsdp", "resume_fsdp")
__all__ = [*_FROM_DDP, *_FROM_RESUME, *_FROM_RANDOM_STATE, *_FROM_PROTECTION, *_FROM_FSDP]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing hosts.transport does not pull in torch.distributed.
    if name in _FROM_DDP:
        from hosts import ddp

        return getattr(ddp, name)
    if name in _FROM_RESUME:
        from hosts import recovery

        return getattr(recovery, name)
    if name in _FROM_RANDOM_STATE:
        from hosts import random_state

        return getattr(random_state, name)
    if name in _FROM_PROTECTION:
        from hosts import protection

        return getattr(protection, name)
    if name in _FROM_FSDP:
        from hosts import c10d_fsdp

        return getattr(c10d_fsdp, name)
    raise AttributeError(f"module 'hosts' has no attribute {name!r}")
