"""The DDP communication hook: every gradient bucket all-reduced on Checkmate's ring.

:class:`CommHook` is the agent's part DDP calls once per bucket (:func:`_hook`, registered
with ``register_comm_hook``), on the thread running the backward pass (autograd's; for a
CPU model the training thread). It notes the bucket's layout (which parameters, which
shadow shard), optionally compresses the bucket, and hands it to
:meth:`~hosts.ring_allreduce.RingAllReduce.allreduce_async`, whose transport receive thread
completes the future under the ring's own lock. At the last bucket of an iteration it
sends the shadows a changed bucket layout (re-seeding them when the buckets were rebuilt)
and counts the iteration; it takes no lock of its own.

It also watches, on rank 0, for a job that draws random numbers without saving its
generators: if torch's CPU generator state changed between two iterations' last buckets
and no :class:`~hosts.random_state.RandomState` is among the stateful objects, it logs
one warning naming the fix (a resume would not be bit-identical: dropout, random
augmentation, a shuffling DataLoader). The check copies 5 KiB and compares it, once per
iteration until it has warned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from checkmate.auth import GradientDigests
from checkmate.control import BucketLayout, BucketSpec, JobStart, ParamSlice, dtype_name
from checkmate.tensors import tensor_payload
from hosts.control_channel import ControlChannel
from hosts.ddp_config import COMPRESSION, CheckmateConfig, CheckmateConfigError
from hosts.random_state import RandomState, RandomStateError, check_same_on_every_rank
from hosts.ring_allreduce import ReduceOp, RingAllReduce
from hosts.transport import Transport

logger = logging.getLogger(__name__)


def _hook(agent: CommHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return agent.on_bucket(bucket)


# DDP checks the hook's annotations against the real classes (not the postponed strings).
_hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}


class CommHook:
    """The agent's bucket-by-bucket all-reduce and its iteration count."""

    config: CheckmateConfig
    names: dict[int, str]
    ring: RingAllReduce
    transport: Transport
    channel: ControlChannel | None
    iteration: int
    """The next all-reduce iteration."""
    _bucket_layout: dict[int, BucketSpec]
    _layout_sent: list[BucketSpec] | None
    _uncommitted: int | None
    _commit: Callable[..., None]
    """ShadowMessages': commit an iteration."""
    _job_start: Callable[[int], JobStart]
    """ShadowMessages': the state before an iteration, for the shadows."""
    rank: int
    stateful: dict[str, object]
    _group: object
    _rng_seen: torch.Tensor | None
    """Rank 0 without a RandomState: torch's CPU generator state at the last iteration's end."""

    def register(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Make this the DDP model's all-reduce (collective: compares the ranks' RandomStates first).

        CheckmateConfigError when the ranks' generators differ (RandomState saves rank 0's).
        """
        try:
            check_same_on_every_rank(self.stateful, self._group)
        except RandomStateError as exc:
            if self.channel is not None:  # nothing was registered yet: stop what the agent started
                self.channel.close(1.0)
            self.ring.close()
            self.transport.close()
            metrics = getattr(self, "_metrics", None)
            if metrics is not None:
                metrics.close()
            raise CheckmateConfigError(str(exc)) from None
        watch = self.rank == 0 and not any(isinstance(o, RandomState) for o in self.stateful.values())
        self._rng_seen = torch.get_rng_state() if watch else None
        ddp_model.register_comm_hook(self, _hook)

    def _watch_random_state(self) -> None:
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
            self.iteration,
        )

    _gradient_digests: GradientDigests | None = None
    """Rank 0 (with shadows): tags of each reduced bucket for the commit (checkmate.auth)."""

    def _digests(self) -> GradientDigests | None:
        if self.channel is None:
            return None
        if self._gradient_digests is None:
            secret = self.config.secret  # filled by the agent (CheckmateAgent, enable_checkmate)
            if secret is None:
                raise CheckmateConfigError("the agent's configuration carries no job secret")
            self._gradient_digests = GradientDigests(secret, self.config.job_id)
        return self._gradient_digests

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        index = bucket.index()
        iteration, digests = self.iteration, self._digests()
        wire = COMPRESSION[self.config.compress]
        reduced = buffer.to(wire) if wire is not None and buffer.dtype is torch.float32 else buffer
        if not self._bucket_layout and self._uncommitted is not None:
            self._commit(self._uncommitted, skipped=True, capture=False)
        offset = 0
        slices = []
        for p in bucket.parameters():
            slices.append(ParamSlice(self.names.get(id(p), f"<unnamed:{id(p)}>"), offset, p.numel()))
            offset += p.numel()
        self._bucket_layout[index] = BucketSpec(
            bucket_id=index,
            dtype=dtype_name(reduced.dtype),
            num_elements=buffer.numel(),
            shard_key=self.config.shard_key_for_bucket(index),
            params=tuple(slices),
        )
        future = self.ring.allreduce_async(self.iteration, index, reduced, ReduceOp.AVG)
        if bucket.is_last():
            self._end_of_iteration()
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

    def _end_of_iteration(self) -> None:
        layout = [self._bucket_layout[i] for i in sorted(self._bucket_layout)]
        if layout != self._layout_sent:
            rebuilt = self._layout_sent is not None
            self._layout_sent = layout
            if self.channel is not None:
                if rebuilt:
                    # Buckets (and with them parameters) may move between shadows: re-seed every
                    # shadow with the state before this iteration's step, then the new layout
                    # (docs/protocol.md, "Bucket layout changes"). The parameters are untouched
                    # until this iteration's optimizer step, so this is exactly that state.
                    self.channel.post(self._job_start(self.iteration))
                self.channel.post(BucketLayout(self.config.job_id, self.iteration, layout))
        self._bucket_layout = {}
        self._watch_random_state()
        self._uncommitted = self.iteration
        self.iteration += 1
