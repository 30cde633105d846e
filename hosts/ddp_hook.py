"""The DDP communication hook: every gradient bucket all-reduced on Checkmate's ring.

:class:`CommHook` is the DDP agent's component DDP calls once per bucket (through
:func:`comm_hook`, registered with ``register_comm_hook`` with the agent as its state), on the
thread running the backward pass (autograd's; for a CPU model the training thread). It owns
the layout of the iteration's buckets so far and the random-state watch; it notes each
bucket's layout (which parameters, which shadow shard), optionally compresses the bucket, and
hands it to :meth:`~hosts.ring_allreduce.RingAllReduce.allreduce_async`, whose transport
receive thread completes the future under the ring's own lock (and records the bucket's
gradient tag, :class:`~checkmate.auth.GradientDigests`, under the tags' lock). The iteration's
number, its start and its end belong to :class:`~hosts.ddp_commits.ShadowMessages`
(:meth:`~hosts.ddp_commits.ShadowMessages.iteration_starts`,
:meth:`~hosts.ddp_commits.ShadowMessages.iteration_reduced`); it takes no lock of its own.

It also watches, on rank 0, for a job that draws random numbers without saving its
generators: if torch's CPU generator state changed between two iterations' last buckets
and no :class:`~hosts.random_state.RandomState` is among the stateful objects, it logs
one warning naming the fix (a resume would not be bit-identical: dropout, random
augmentation, a shuffling DataLoader). The check copies 5 KiB and compares it, once per
iteration until it has warned.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

import torch
import torch.distributed as dist

from checkmate.control import BucketSpec, ParamSlice, dtype_name
from checkmate.tensors import tensor_payload
from hosts.ddp_commits import ShadowMessages
from hosts.ddp_config import COMPRESSION
from hosts.ddp_links import ShadowLinks
from hosts.random_state import RandomState
from hosts.ring_allreduce import RingAllReduce
from hosts.ring_config import ReduceOp

logger = logging.getLogger(__name__)


class _BucketHandler(Protocol):
    """What DDP's registered hook state is: the agent (a script may wrap its ``on_bucket``)."""

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]: ...


def comm_hook(agent: _BucketHandler, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The function DDP calls per bucket: the agent's ``on_bucket``."""
    return agent.on_bucket(bucket)


# DDP checks the hook's annotations against the real classes (not the postponed strings).
comm_hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


class CommHook:
    """The bucket-by-bucket all-reduce on the ring, and the random-state watch."""

    def __init__(
        self,
        ring: RingAllReduce,
        names: Mapping[int, str],
        messages: ShadowMessages,
        links: ShadowLinks,
        watch_random_state: bool,
    ) -> None:
        """``names``: parameter id -> name; ``watch_random_state``: rank 0 without a RandomState."""
        self._ring = ring
        self._names = names
        self._messages = messages
        self._links = links
        self._compress = COMPRESSION[links.config.compress]
        self._bucket_layout: dict[int, BucketSpec] = {}
        """The layout of this iteration's buckets so far (bucket index -> spec)."""
        self._rng_seen: torch.Tensor | None = torch.get_rng_state() if watch_random_state else None
        """Rank 0 without a RandomState: torch's CPU generator state at the last iteration's end."""

    @staticmethod
    def watches_random_state(rank: int, stateful: Mapping[str, object]) -> bool:
        """Whether rank ``rank`` with ``stateful`` should watch torch's CPU generator."""
        return rank == 0 and not any(isinstance(o, RandomState) for o in stateful.values())

    def _watch_random_state(self, iteration: int) -> None:
        """Warn once if the job draws from torch's CPU generator and its state is not saved."""
        if self._rng_seen is None:
            return
        now = torch.get_rng_state()
        if torch.equal(now, self._rng_seen):
            self._rng_seen = now
            return
        self._rng_seen = None  # once
        logger.warning(
            "checkmate: this job draws random numbers (torch's CPU generator changed during iteration %d: "
            "dropout, random augmentation, a shuffling DataLoader?) but its generator state is not "
            "checkpointed, so a resumed job will NOT be bit-identical to an uninterrupted one. Fix: "
            'pass stateful={"rng": hosts.RandomState(), ...} to enable_checkmate and to hosts.resume '
            "(an object of yours that already saves torch's generator state makes this warning moot)",
            iteration,
        )

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """All-reduce one bucket on the ring (average); the future DDP waits for."""
        buffer = bucket.buffer()
        index = bucket.index()
        digests = self._messages.gradient_tags()
        wire = self._compress
        reduced = buffer.to(wire) if wire is not None and buffer.dtype is torch.float32 else buffer
        if not self._bucket_layout:
            self._messages.iteration_starts()
        iteration = self._messages.iteration
        offset = 0
        slices = []
        for p in bucket.parameters():
            slices.append(ParamSlice(self._names.get(id(p), f"<unnamed:{id(p)}>"), offset, p.numel()))
            offset += p.numel()
        self._bucket_layout[index] = BucketSpec(
            bucket_id=index,
            dtype=dtype_name(reduced.dtype),
            num_elements=buffer.numel(),
            shard_key=self._links.config.shard_key_for_bucket(index),
            params=tuple(slices),
        )
        future = self._ring.allreduce_async(iteration, index, reduced, ReduceOp.AVG)
        if bucket.is_last():
            layout = [self._bucket_layout[i] for i in sorted(self._bucket_layout)]
            self._bucket_layout = {}
            self._watch_random_state(iteration)
            self._messages.iteration_reduced(layout)
        # Always hand DDP a chained future: a failed all-reduce stores its exception as the
        # Python future's value, which DDP's C++ side would report as "Unable to cast ... to
        # Tensor"; raised inside a then() callback it becomes a proper error with our message.
        device = buffer.device

        def result(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            value = fut.value()  # raises the CollectiveError / PeerTimeoutError of a failed ring
            if digests is not None:  # what the shadows' copies must add up to (docs/security.md)
                digests.record(iteration, index, tensor_payload(value.contiguous()))
            if reduced is not buffer:  # compressed: widened exactly as the shadows widen it
                return buffer.copy_(value.to(device))
            return value if device.type == "cpu" else value.to(device)  # CUDA: back from host memory

        return future.then(result)
