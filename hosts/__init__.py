"""Host agents: the gradient transport and ring all-reduce inside PyTorch DDP.

Workers put fully reduced gradients on the wire once, tagged REPLICATE, so the
switch can copy them to shadows. The one line for a DDP script is
``hosts.enable_checkmate(ddp_model, optimizer)`` (see :mod:`hosts.ddp`).

Modules: :mod:`hosts.transport` (reliable UDP), :mod:`hosts.ring_allreduce`
(ring all-reduce, tags, repair service), :mod:`hosts.ddp` (DDP hook, commit
records), :mod:`hosts.control_channel` (rank 0 -> shadows, TCP),
:mod:`hosts.faults` (seeded loss/duplication/reordering for tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hosts.ddp import CheckmateAgent, CheckmateConfig, clip_grad_norm_, enable_checkmate

__all__ = ["CheckmateAgent", "CheckmateConfig", "clip_grad_norm_", "enable_checkmate"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing hosts.transport does not pull in torch.distributed.
    if name in __all__:
        from hosts import ddp

        return getattr(ddp, name)
    raise AttributeError(f"module 'hosts' has no attribute {name!r}")
