"""A sharded job's protected reduce-scatters on the ``checkmate`` backend (issue 32, item 2).

FSDP2 / ZeRO-3 reduce gradients with ``reduce_scatter_tensor``, which no DDP comm hook sees. A
sharded job's agent (:mod:`hosts.c10d_fsdp`) hands each reduce-scatter to
:meth:`ShardedProtection.tagged_reduce_scatter`: the flat input runs through the group's
:class:`~hosts.ring_allreduce.RingAllReduce` (the native data path's ring, unchanged) as one bucket
of the training iteration. Its chunk ``c`` is rank ``c``'s part of the input; it is fully reduced
at rank ``c - 1``, whose first transmission of it, to rank ``c``, carries REPLICATE, so the switch
copies exactly the fully reduced shards to the shadows (docs/protocol.md, "Which datagrams are
tagged"). The ring then completes the all-gather (every rank gets the whole reduced input;
each keeps its own part), ``2(N-1)/N`` of the input per rank instead of a reduce-scatter's
``(N-1)/N`` (equal at 2 ranks to a reduce-scatter with the owner hop).

:class:`ShardedProtection` is the component of :class:`hosts.c10d_backend.CheckmateProcessGroup`
that owns the group's ring: the backend's own all-reduces and their counter until an agent takes
the ring over, the hand-over, then the tagged reduce-scatters; it closes the ring. It asks the
group's :class:`~hosts.c10d_flows.FlowCollectives` whether the group is usable and for barriers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hosts.c10d_flows import FlowCollectives
from hosts.c10d_work import BACKEND_NAME, CheckmateBackendError, FutureWork
from hosts.ring_allreduce import MAX_ITERATION, RingAllReduce
from hosts.ring_config import ReduceOp, RingConfig
from hosts.transport import Transport

__all__ = ["ShardedProtection", "ring_op"]

logger = logging.getLogger(__name__)


class ShardedProtection:
    """The group's ring: its all-reduces, the hand-over to a sharded job's agent, the tagged reduce-scatters.

    ``transport`` and ``ring`` are None for a group of one rank (nothing to protect).
    """

    def __init__(
        self,
        rank: int,
        world: int,
        flows: FlowCollectives,
        transport: Transport | None = None,
        ring: RingAllReduce | None = None,
    ) -> None:
        self._rank = rank
        self._world = world
        self._flows = flows
        self._transport = transport
        self._ring = ring
        self._protected = False
        self._lock = threading.Lock()
        """Guards the backend's all-reduce counter."""
        self._ring_seq = 0

    @property
    def ring(self) -> RingAllReduce | None:
        """The group's ring (after :meth:`protect_reduce_scatters`, the agent's)."""
        return self._ring

    @property
    def protected(self) -> bool:
        """A sharded job's agent owns the ring: it runs only :meth:`tagged_reduce_scatter`."""
        return self._protected

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> dist.Work:
        """The backend's all-reduce of ``tensor`` in place on the ring, numbered by its own counter."""
        assert self._ring is not None
        with self._lock:
            self._flows.check_usable()
            seq = self._ring_seq
            self._ring_seq = (seq + 1) % (MAX_ITERATION + 1)
        ring_future = self._ring.allreduce_async(seq, 0, tensor, op)

        def copy_back(done: torch.futures.Future[torch.Tensor]) -> list[torch.Tensor]:
            tensor.copy_(done.value().view(tensor.shape))
            return [tensor]

        return FutureWork(ring_future.then(copy_back))

    def close(self) -> None:
        """Stop the ring (its pending all-reduces fail)."""
        if self._ring is not None:
            self._ring.close()

    def protect_reduce_scatters(self, ring_config: RingConfig, drain_timeout: float = 5.0) -> RingAllReduce:
        """Give the ring to a sharded job's agent; collective (every rank calls it, between collectives).

        The group's ring is rebuilt with ``ring_config`` (the job id the switch and the shadows know,
        the shard key of each bucket, host replication) and from then on runs only
        :meth:`tagged_reduce_scatter`, numbered by the agent's iterations and buckets; the group's
        all-reduces move to the flows (untagged, summed in rank order), so nothing else is tagged.
        """
        if self._transport is None or self._ring is None:
            raise CheckmateBackendError("a group of one rank has no ring to protect")
        if self._protected:
            raise CheckmateBackendError("this group's reduce-scatters are already protected by an agent")
        self._flows.barrier().wait()  # every rank is done with the old ring's collectives
        if not self._transport.wait_idle(drain_timeout):
            logger.warning("checkmate backend rank %d: datagrams unacknowledged at re-ringing", self._rank)
        self._ring.close()
        ring = RingAllReduce(self._transport, ring_config)
        self._ring = ring
        self._protected = True
        self._flows.barrier().wait()  # every rank's new ring listens before any tagged datagram moves
        return ring

    def tagged_reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp,
        iteration: int,
        bucket: int,
        on_reduced: Callable[[torch.Tensor], None] | None = None,
    ) -> dist.Work:
        """``reduce_scatter_tensor`` whose fully reduced chunks are tagged for the shadows.

        ``input`` runs through the ring as bucket ``bucket`` of ``iteration``: the ring's chunk ``c``
        is rank ``c``'s part ``[c·n, (c+1)·n)`` (``n`` = ``output.numel()``), fully reduced at rank
        ``c - 1``, whose first transmission of it goes to rank ``c`` with REPLICATE
        (docs/protocol.md, "Which datagrams are tagged"). ``on_reduced`` gets the whole reduced
        input (the bytes the shadows assemble) before the Work completes (rank 0's gradient tag).
        """
        if not self._protected or self._ring is None:
            raise CheckmateBackendError("tagged_reduce_scatter needs protect_reduce_scatters first")
        n = output.numel()
        if input.numel() != n * self._world or input.dtype != output.dtype:
            raise ValueError(
                f"reduce_scatter_tensor: input {input.dtype}{list(input.shape)} must hold {self._world} x "
                f"output {output.dtype}{list(output.shape)}"
            )
        self._flows.check_usable()
        ring_future = self._ring.allreduce_async(iteration, bucket, input, op)
        start = self._rank * n

        def take_mine(done: torch.futures.Future[torch.Tensor]) -> list[torch.Tensor]:
            reduced = done.value()  # raises the ring's error
            if on_reduced is not None:
                on_reduced(reduced)
            output.copy_(reduced[start : start + n].view(output.shape))
            return [output]

        return FutureWork(ring_future.then(take_mine))


def ring_op(collective: str, op: Any) -> ReduceOp:
    """A c10d ``ReduceOp`` as the ring's (SUM, AVG; others: NotImplementedError naming ``collective``)."""
    if op == dist.ReduceOp.SUM:
        return ReduceOp.SUM
    if op == dist.ReduceOp.AVG:
        return ReduceOp.AVG
    name = getattr(getattr(op, "op", op), "name", str(op))
    raise NotImplementedError(
        f'{collective} with ReduceOp.{name}: the "{BACKEND_NAME}" backend reduces with SUM and AVG only; '
        "use a gloo group (dist.new_group(backend='gloo')) for other reductions"
    )
