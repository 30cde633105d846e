"""A ``torch.distributed`` backend on Checkmate's transport: ``init_process_group(backend="checkmate")``.

Importing this module registers the backend (``torch.distributed.Backend.register_backend``) under the
name ``"checkmate"`` for CPU tensors, so any script selects it with one argument::

    import hosts.c10d_backend  # noqa: F401  (registers "checkmate")
    import torch.distributed as dist

    dist.init_process_group(backend="checkmate")  # or "cpu:checkmate"

Rendezvous is torch's: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (or any
``init_method``/``store``); each rank binds its own :class:`~hosts.transport.Transport` and publishes
its address in the store torch hands the backend. The job secret is the one every Checkmate component
uses (:func:`checkmate.auth.secret_from_env`: ``CHECKMATE_JOB_SECRET``, ``CHECKMATE_JOB_SECRET_FILE`` or
the job file); without one the backend refuses to start (:class:`~checkmate.auth.AuthConfigError`).
The creator torch calls (:func:`create_checkmate_backend`) is the backend's entry point: it reads the
environment once, fills every unset field of :class:`CheckmateBackendOptions` from it
(:meth:`CheckmateBackendOptions.resolved`) and hands the group the complete options, the secret as a
value; nothing below it reads the environment.

Collectives (docs/backend.md has the table):

* ``all_reduce``: SUM and AVG of fp32/bf16/fp16 tensors run in :class:`~hosts.ring_allreduce.RingAllReduce`
  (the ring DDP's Checkmate hook uses, same reduction order, ``reference_allreduce``); SUM/AVG of other
  dtypes (int64 counters, fp64) gather every rank's tensor and add them in rank order. Other ops raise
  ``NotImplementedError``.
* ``all_gather``, ``all_gather_into_tensor``, ``broadcast``, ``barrier``: each rank sends its bytes
  straight to the ranks that need them over the transport's reliable flows (any dtype, bit for bit).
* ``reduce_scatter``, ``reduce_scatter_tensor``: rank ``j``'s chunk of every rank goes to rank ``j``,
  which adds them in rank order (0, 1, ..., N-1) in the tensors' dtype.
* everything else (``reduce``, ``gather``, ``scatter``, ``all_to_all``, ``send``/``recv``, ...) raises
  ``NotImplementedError`` naming the collective and what to use instead.

Checkmate's tagging: by default the backend's all-reduce runs untagged (no REPLICATE bit, no copies):
a shadow replays an iteration only with the commit record that :func:`hosts.enable_checkmate` sends,
so DDP keeps its protection through the hook (the hook's ring wraps the all-reduce; the backend
carries DDP's set-up broadcasts, barriers and every other collective). ``CheckmateBackendOptions(tag=True)``
makes the backend's ring tag each fully reduced chunk's first transmission exactly as the hook's
ring does (the same :class:`RingAllReduce` in switch mode), numbered by the backend's own collective
counter (docs/backend.md, "Tagging"). A sharded job's agent (:mod:`hosts.c10d_fsdp`) takes the ring
over for its gradient reduce-scatters (:mod:`hosts.c10d_sharded`): those alone are tagged, and the
group's all-reduces move to the flows.

The parts, components the group composes and calls through their methods (each owns its state;
docs/architecture.md, "The host agent"): :class:`~hosts.c10d_flows.FlowCollectives` (the flow
collectives' messages, receive side, deadlines, and the group's failed and closed state, under its
lock, with its watch thread), :class:`~hosts.c10d_sharded.ShardedProtection` (the ring: the
backend's all-reduces, the hand-over to a sharded job's agent, the protected reduce-scatters),
:class:`~hosts.c10d_liveness.StoreLiveness` (the heartbeat in the store that finds a dead rank);
:mod:`hosts.c10d_work` has the Work objects, :mod:`hosts.c10d_options` the options.
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from checkmate.auth import AuthConfigError, secret_from_env
from hosts.c10d_flows import FlowCollectives
from hosts.c10d_liveness import StoreLiveness
from hosts.c10d_options import BIND_ENV, CheckmateBackendOptions
from hosts.c10d_sharded import ShardedProtection, ring_op
from hosts.c10d_work import (
    BACKEND_NAME,
    CheckmateBackendError,
    all_of,
    done_work,
    from_bytes,
    unsupported,
)
from hosts.ring_allreduce import RingAllReduce
from hosts.ring_config import ReduceOp, RingConfig
from hosts.transport import Addr, Transport, TransportConfig, resolve

__all__ = [
    "BACKEND_NAME",
    "BIND_ENV",
    "CheckmateBackendError",
    "CheckmateBackendOptions",
    "CheckmateProcessGroup",
    "create_checkmate_backend",
]

logger = logging.getLogger(__name__)

_RING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOW_JOB_OFFSET = 1 << 31
"""The flows job (gathers, broadcasts, reduce-scatters) is the ring's job id + 2**31 (mod 2**32)."""


class CheckmateProcessGroup(dist.ProcessGroup):
    """One process group's collectives over one Checkmate transport (made by the registered creator).

    Calls must come in the same order on every rank (as with every c10d backend). Each returns a
    ``Work`` whose future completes with the collective's output tensors. The group checks the
    arguments and composes two components: :class:`FlowCollectives` (every collective but the
    ring's all-reduce) and :class:`ShardedProtection` (the ring).
    """

    ring_op = staticmethod(ring_op)

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: timedelta,
        options: CheckmateBackendOptions | None = None,
    ) -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]  # (store, ...) builds no Python alias
        if options is None or options.secret is None or options.job_id is None or options.datapath is None:
            raise CheckmateBackendError(
                f'the "{BACKEND_NAME}" group needs resolved options (a secret, a job id, a data path): '
                'create it with init_process_group(backend="checkmate"), whose creator fills them'
            )
        secret, job_id = options.secret, options.job_id
        self._rank = rank
        self._world = world_size
        self._group_name = ""
        self._group_desc = ""
        self._timeout = timeout.total_seconds()
        self.options = options
        self.job_id = job_id
        self.flow_job_id = (job_id + _FLOW_JOB_OFFSET) % (1 << 32)
        self.transport: Transport | None = None
        self.peers: tuple[Addr, ...] = ()
        self._flows = FlowCollectives(rank, world_size, self._timeout)
        self._sharded = ShardedProtection(rank, world_size, self._flows)
        self._liveness: StoreLiveness | None = None
        if world_size == 1:
            return
        assert options.bind is not None  # resolved() looks it up for every group of several ranks
        self.transport = Transport(
            TransportConfig(
                bind=resolve(options.bind, default_port=0),
                peer_timeout=options.peer_timeout,
                datapath=options.datapath,
                faults=options.faults,
            )
        )
        try:
            self.peers = self._rendezvous(store)
            flows = FlowCollectives(
                rank, world_size, self._timeout, self.transport, self.peers, self.flow_job_id
            )
            self._flows = flows
            self.transport.add_job(
                self.flow_job_id,
                rank,
                {r: a for r, a in enumerate(self.peers) if r != rank},
                on_data=lambda header, payload, addr: flows.on_fields(header.fields(), payload, addr),
                on_failure=flows.on_peer_failure,
                secret=secret,
                on_data_fields=flows.on_fields,
            )
            ring = RingAllReduce(
                self.transport,
                RingConfig(
                    job_id=job_id,
                    rank=rank,
                    workers=self.peers,
                    timeout=self._timeout,
                    keep_iterations=2,
                    future_iterations=1 << 16,
                    host_replica=None if options.tag else (lambda key: None),
                ),
            )
            self._sharded = ShardedProtection(rank, world_size, flows, self.transport, ring)
            # no rank sends before every rank accepts its jobs (else its first datagrams wait for an RTO)
            store.set(f"checkmate/ready/{rank}", "1")
            store.wait([f"checkmate/ready/{r}" for r in range(world_size)])
            sharded = self._sharded
            liveness = StoreLiveness(
                store, rank, self.peers, job_id, options.peer_timeout, flows, lambda: sharded.ring
            )
            liveness.start()  # its first beat is a store call: a store that fails it fails the group here
        except BaseException:
            self.transport.close()
            raise
        self._liveness = liveness
        flows.start_watch()
        _live.add(self)
        logger.info(
            "checkmate backend: rank %d/%d on %s:%d (%s), job %d%s",
            rank,
            world_size,
            *self.transport.address,
            self.transport.datapath,
            job_id,
            ", tagged" if options.tag else "",
        )

    def _rendezvous(self, store: dist.Store) -> tuple[Addr, ...]:
        assert self.transport is not None
        host, port = self.transport.address[:2]
        store.set(f"checkmate/addr/{self._rank}", f"{host}:{port}")
        peers: list[Addr] = []
        for r in range(self._world):
            value = store.get(f"checkmate/addr/{r}").decode()
            peers.append(resolve(value))
        return tuple(peers)

    # ---- torch's ProcessGroup interface -------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def getRank(self) -> int:  # noqa: N802
        return self._rank

    def getSize(self) -> int:  # noqa: N802
        return self._world

    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    # ---- what the components own, as the group's attributes -----------------------------------
    @property
    def ring(self) -> RingAllReduce | None:
        """The group's ring (None for one rank); after :meth:`protect_reduce_scatters`, the agent's."""
        return self._sharded.ring

    @property
    def protected(self) -> bool:
        """A sharded job's agent owns the ring (:meth:`protect_reduce_scatters`): it runs only
        :meth:`tagged_reduce_scatter`, and all-reduces go on the flows."""
        return self._sharded.protected

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (every later collective raises)."""
        return self._flows.closed

    def protect_reduce_scatters(self, ring_config: RingConfig, drain_timeout: float = 5.0) -> RingAllReduce:
        """Give the ring to a sharded job's agent (:meth:`ShardedProtection.protect_reduce_scatters`)."""
        return self._sharded.protect_reduce_scatters(ring_config, drain_timeout)

    def tagged_reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp,
        iteration: int,
        bucket: int,
        on_reduced: Callable[[torch.Tensor], None] | None = None,
    ) -> dist.Work:
        """``reduce_scatter_tensor`` whose fully reduced chunks are tagged for the shadows
        (:meth:`ShardedProtection.tagged_reduce_scatter`)."""
        return self._sharded.tagged_reduce_scatter(output, input, op, iteration, bucket, on_reduced)

    def __repr__(self) -> str:
        return f"CheckmateProcessGroup(rank={self._rank}, size={self._world}, job={self.job_id})"

    def allreduce(  # type: ignore[override]  # torch's stub overloads it
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """``dist.all_reduce``: SUM or AVG; in place on each tensor of ``tensors``."""
        op = self._reduce_op("all_reduce", opts)
        if len(tensors) != 1:
            raise ValueError(f"all_reduce takes one tensor per call, got {len(tensors)}")
        tensor = tensors[0]
        if self._world == 1 or tensor.numel() == 0:
            return done_work(tensors)
        if tensor.dtype in _RING_DTYPES and not self.protected:
            return self._sharded.allreduce(tensor, op)
        # other dtypes: every rank's tensor to every rank, added in rank order (exact for integers)
        if op is ReduceOp.AVG and not tensor.is_floating_point():
            raise NotImplementedError(
                f"all_reduce with ReduceOp.AVG of {tensor.dtype}: average a float tensor"
            )

        def finish(parts: dict[int, torch.Tensor]) -> list[torch.Tensor]:
            total = self._flows.sum_in_rank_order(parts, tensor)
            if op is ReduceOp.AVG:
                total = total / self._world
            tensor.copy_(total)
            return tensors

        return self._flows.exchange("all_reduce", {r: tensor for r in range(self._world)}, tensor, finish)

    def allreduce_coalesced(self, *args: Any, **kwargs: Any) -> dist.Work:
        return unsupported("all_reduce_coalesced", "call all_reduce once per tensor")

    def allgather(  # type: ignore[override]  # torch's stub overloads it
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """``dist.all_gather``: rank r's tensor into ``output_tensors[0][r]`` on every rank."""
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise ValueError("all_gather takes one input tensor and one output list per call")
        mine, outputs = input_tensors[0], output_tensors[0]
        if len(outputs) != self._world:
            raise ValueError(f"all_gather needs {self._world} output tensors, got {len(outputs)}")
        for out in outputs:
            if out.shape != mine.shape or out.dtype != mine.dtype:
                raise ValueError(
                    f"all_gather output {out.dtype}{list(out.shape)} != input {mine.dtype}{list(mine.shape)}"
                )

        def finish(parts: dict[int, torch.Tensor]) -> list[list[torch.Tensor]]:
            for r, out in enumerate(outputs):
                out.copy_(mine if r == self._rank else from_bytes(parts[r], mine))
            return output_tensors

        return self._flows.exchange("all_gather", {r: mine for r in range(self._world)}, mine, finish)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """``dist.all_gather_into_tensor``: ranks' inputs concatenated along dim 0 (or stacked)."""
        if output.numel() != input.numel() * self._world or output.dtype != input.dtype:
            raise ValueError(
                f"all_gather_into_tensor: output {output.dtype}{list(output.shape)} must hold "
                f"{self._world} x input {input.dtype}{list(input.shape)}"
            )

        def finish(parts: dict[int, torch.Tensor]) -> list[torch.Tensor]:
            flat = (
                output.view(-1) if output.is_contiguous() else torch.empty(output.numel(), dtype=output.dtype)
            )
            n = input.numel()
            for r in range(self._world):
                flat[r * n : (r + 1) * n].copy_(
                    input.reshape(-1) if r == self._rank else from_bytes(parts[r], input).reshape(-1)
                )
            if not output.is_contiguous():
                output.copy_(flat.view(output.shape))
            return [output]

        return self._flows.exchange(
            "all_gather_into_tensor", {r: input for r in range(self._world)}, input, finish
        )

    _allgather_base = all_gather_single

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> dist.Work:
        return unsupported("all_gather_coalesced", "call all_gather once per tensor")

    def broadcast(  # type: ignore[override]  # torch's stub overloads it
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """``dist.broadcast``: the root's tensor into every rank's (in place)."""
        if len(tensors) != 1:
            raise ValueError(f"broadcast takes one tensor per call, got {len(tensors)}")
        tensor = tensors[0]
        root = int(getattr(opts, "rootRank", 0)) if opts is not None else 0
        if not 0 <= root < self._world:
            raise ValueError(f"broadcast root {root} is outside 0..{self._world - 1}")
        if self._world == 1:
            return done_work(tensors)

        def finish(parts: dict[int, torch.Tensor]) -> list[torch.Tensor]:
            if self._rank != root:
                tensor.copy_(from_bytes(parts[root], tensor))
            return tensors

        sends = {r: tensor for r in range(self._world) if r != root} if self._rank == root else {}
        expect_from = [root] if self._rank != root else []
        return self._flows.flow_op(
            "broadcast", sends, expect_from, tensor.numel() * tensor.element_size(), finish
        )

    def reduce_scatter(  # type: ignore[override]  # torch's stub overloads it
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        """``dist.reduce_scatter``: ``output = sum over ranks of input_list[this rank]`` (SUM or AVG)."""
        op = self._reduce_op("reduce_scatter", opts)
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise ValueError("reduce_scatter takes one output tensor and one input list per call")
        output, inputs = output_tensors[0], input_tensors[0]
        if len(inputs) != self._world:
            raise ValueError(f"reduce_scatter needs {self._world} input tensors, got {len(inputs)}")
        for t in inputs:
            if t.numel() != output.numel() or t.dtype != output.dtype:
                raise ValueError(
                    f"reduce_scatter input {t.dtype}{list(t.shape)} != "
                    f"output {output.dtype}{list(output.shape)}"
                )
        return self._reduce_scatter("reduce_scatter", output, list(inputs), op, output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        """``dist.reduce_scatter_tensor``: ``input`` is N equal chunks (dim 0); rank j gets chunk j's sum."""
        op = self._reduce_op("reduce_scatter_tensor", opts)
        if input.numel() != output.numel() * self._world or input.dtype != output.dtype:
            raise ValueError(
                f"reduce_scatter_tensor: input {input.dtype}{list(input.shape)} must hold {self._world} x "
                f"output {output.dtype}{list(output.shape)}"
            )
        flat = input.reshape(-1)
        n = output.numel()
        chunks = [flat[r * n : (r + 1) * n] for r in range(self._world)]
        return self._reduce_scatter("reduce_scatter_tensor", output, chunks, op, [output])

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # deprecated alias

    def barrier(self, opts: Any = None) -> dist.Work:
        """``dist.barrier``: completes once every rank has entered it."""
        if self._world == 1:
            return done_work([])
        return self._flows.barrier()

    def reduce(self, *args: Any, **kwargs: Any) -> dist.Work:
        return unsupported("reduce", "all_reduce (every rank gets the sum)")

    def gather(self, *args: Any, **kwargs: Any) -> dist.Work:
        return unsupported("gather", "all_gather")

    def scatter(self, *args: Any, **kwargs: Any) -> dist.Work:
        return unsupported("scatter", "broadcast the whole tensor and slice it")

    def alltoall(self, *args: Any, **kwargs: Any) -> dist.Work:
        return unsupported("all_to_all", "all_gather, then take your part, or a gloo group for it")

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> dist.Work:
        return unsupported(
            "all_to_all_single", "all_gather_into_tensor, then take your part, or a gloo group"
        )

    alltoall_base = all_to_all_single

    def send(self, *args: Any, **kwargs: Any) -> dist.Work:
        return unsupported("send", "broadcast from the sender, or a gloo group for point-to-point")

    def recv(self, *args: Any, **kwargs: Any) -> dist.Work:
        return unsupported("recv", "broadcast from the sender, or a gloo group for point-to-point")

    def recv_anysource(self, *args: Any, **kwargs: Any) -> dist.Work:
        return unsupported("recv_anysource", "a gloo group for point-to-point")

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """``all_gather_into_tensor`` of each (output, input) pair, as one Work."""
        if len(outputs) != len(inputs):
            raise ValueError(f"{len(outputs)} outputs for {len(inputs)} inputs")
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return all_of(works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]  # old name

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """``reduce_scatter_tensor`` of each (output, input) pair, as one Work (functional collectives)."""
        if len(outputs) != len(inputs):
            raise ValueError(f"{len(outputs)} outputs for {len(inputs)} inputs")
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return all_of(works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]  # old name

    def shutdown(self) -> None:
        """``dist.destroy_process_group``: drain, stop the ring and close the transport."""
        self.close()

    def abort(self) -> None:
        self.close(drain_timeout=0.0)

    def close(self, drain_timeout: float = 2.0) -> None:
        """Stop this rank's ring and transport (pending collectives fail); idempotent."""
        if not self._flows.close(CheckmateBackendError("the checkmate process group was shut down")):
            return
        if self._liveness is not None:
            self._liveness.close()
        if self.transport is not None:
            self.transport.wait_idle(drain_timeout)
            self._sharded.close()
            self.transport.remove_job(self.flow_job_id)
            self.transport.close()
        _live.discard(self)

    # ---- collectives ----------------------------------------------------------------------
    @classmethod
    def _reduce_op(cls, collective: str, opts: Any) -> ReduceOp:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM) if opts is not None else dist.ReduceOp.SUM
        return ring_op(collective, op)

    def _reduce_scatter(
        self, name: str, output: torch.Tensor, chunks: list[torch.Tensor], op: ReduceOp, result: Any
    ) -> dist.Work:
        if self._world == 1:  # the sum (and the average) of one chunk is the chunk
            output.copy_(chunks[0].reshape(output.shape))
            return done_work(result)
        if op is ReduceOp.AVG and not output.is_floating_point():
            raise NotImplementedError(f"{name} with ReduceOp.AVG of {output.dtype}: average a float tensor")
        mine = chunks[self._rank]

        def finish(parts: dict[int, torch.Tensor]) -> Any:
            total = self._flows.sum_in_rank_order(parts, mine)
            if op is ReduceOp.AVG:
                total = total / self._world
            output.copy_(total.view(output.shape))
            return result

        sends = {r: chunks[r] for r in range(self._world)}
        return self._flows.exchange(name, sends, mine, finish)


_live: weakref.WeakSet[CheckmateProcessGroup] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Close every live group's transport before the interpreter goes (their threads take the GIL)."""
    for group in list(_live):
        group.close(drain_timeout=0.5)


def create_checkmate_backend(
    backend_options: Any, pg_options: CheckmateBackendOptions | None = None
) -> CheckmateProcessGroup:
    """The creator torch calls for ``backend="checkmate"`` (extended API: store, ranks, timeout, options).

    The backend's entry point: reads the environment once, here, and passes the complete options
    (the job secret as a value) to the group.
    """
    if pg_options is not None and not isinstance(pg_options, CheckmateBackendOptions):
        raise TypeError(
            f'the "{BACKEND_NAME}" backend takes pg_options=CheckmateBackendOptions(...), '
            f"got {type(pg_options).__name__}"
        )
    options = pg_options or CheckmateBackendOptions()
    env = dict(os.environ)
    try:
        secret = options.secret if options.secret is not None else secret_from_env(env)
    except AuthConfigError as exc:
        raise AuthConfigError(f'torch.distributed backend "{BACKEND_NAME}": {exc}') from None
    return CheckmateProcessGroup(
        backend_options.store,
        backend_options.group_rank,
        backend_options.group_size,
        backend_options.timeout,
        options.resolved(env, secret, backend_options.group_size),
    )


dist.Backend.register_backend(BACKEND_NAME, create_checkmate_backend, extended_api=True, devices=["cpu"])
