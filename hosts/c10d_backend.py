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
counter (docs/backend.md, "Tagging").
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from checkmate.auth import AuthConfigError, secret_from_env
from checkmate.wire import MAX_PAYLOAD_BYTES, DType, pack_data_header
from hosts.faults import FaultConfig
from hosts.ring_allreduce import MAX_ITERATION, CollectiveError, ReduceOp, RingAllReduce, RingConfig
from hosts.transport import Addr, PeerTimeoutError, Transport, TransportConfig, datapath_from_env, resolve

__all__ = [
    "BACKEND_NAME",
    "CheckmateBackendOptions",
    "CheckmateProcessGroup",
    "create_checkmate_backend",
]

logger = logging.getLogger(__name__)

BACKEND_NAME = "checkmate"
"""What ``init_process_group(backend=...)`` names (also ``"cpu:checkmate"``)."""
BIND_ENV = "CHECKMATE_BACKEND_BIND"
_RING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOW_JOB_OFFSET = 1 << 31
"""The flows job (gathers, broadcasts, reduce-scatters) is the ring's job id + 2**31 (mod 2**32)."""
_PIECE = MAX_PAYLOAD_BYTES - MAX_PAYLOAD_BYTES % 2
"""Bytes per datagram of a flow message (even: payloads travel as 2-byte elements)."""
_WIRE_UNIT = DType.FP16
"""Flow payloads are raw bytes; the header counts them in 2-byte units (odd tails padded)."""


class CheckmateBackendError(RuntimeError):
    """The backend could not start (rendezvous, transport) or a collective failed."""


@dataclass(frozen=True)
class CheckmateBackendOptions:
    """Optional settings, passed as ``init_process_group(..., pg_options=CheckmateBackendOptions(...))``.

    Every field has an environment default, so a plain ``backend="checkmate"`` needs none.
    """

    bind: str | tuple[str, int] | None = None
    """This rank's transport address (``"ip"`` or ``"ip:port"``; port 0 or none: any free port).
    None: ``CHECKMATE_BACKEND_BIND``, else ``CHECKMATE_BIND``'s IP on a free port (the agent of
    :func:`hosts.enable_checkmate` keeps that address's own port), else the local IP that routes to
    ``MASTER_ADDR``."""
    job_id: int | None = None
    """The ring's job id (None: ``CHECKMATE_JOB_ID``, else 1); with ``tag=True`` the one the switch
    and shadows know."""
    secret: bytes | None = None
    """The job secret (None: :func:`checkmate.auth.secret_from_env`)."""
    tag: bool = False
    """Tag the all-reduce's fully reduced chunks (REPLICATE, switch mode) as the DDP hook's ring does."""
    datapath: str | None = None
    """``"native"`` or ``"python"`` (None: ``CHECKMATE_TRANSPORT``, default native)."""
    peer_timeout: float = 30.0
    """Seconds without acknowledgements before a peer is declared dead (its collectives fail)."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    """Injected datagram loss, duplication, reordering (tests; :class:`hosts.faults.FaultConfig`)."""


@dataclass
class _FlowOp:
    """One flow collective on this rank: the bytes it waits for from each peer."""

    name: str
    expected: dict[int, int]
    """Sender rank -> bytes it sends this rank."""
    buffers: dict[int, torch.Tensor]
    """Sender rank -> a uint8 tensor of ``expected[sender]`` bytes, filled as datagrams arrive."""
    finish: Callable[[dict[int, torch.Tensor]], Any]
    """Runs once everything arrived (receive thread); its value is the future's."""
    deadline: float
    received: dict[int, int] = field(default_factory=dict)
    future: torch.futures.Future[Any] = field(default_factory=torch.futures.Future)
    done: bool = False


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A private contiguous uint8 copy of ``tensor``'s memory (safe to resend after the caller moves on)."""
    flat = tensor.detach().to("cpu").reshape(-1).contiguous().clone()
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _from_bytes(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``raw`` (uint8) reinterpreted as ``like``'s dtype and shape."""
    if like.numel() == 0:
        return torch.empty_like(like, device="cpu")
    return raw.view(like.dtype).view(like.shape)


def _local_address_towards(host: str) -> str:
    """The local IP the kernel routes to ``host`` from (no datagram is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return str(probe.getsockname()[0])


def _bind_address(options: CheckmateBackendOptions) -> Addr:
    if options.bind is not None:
        return resolve(options.bind, default_port=0)
    if os.environ.get(BIND_ENV):
        return resolve(os.environ[BIND_ENV], default_port=0)
    if os.environ.get("CHECKMATE_BIND"):
        return (resolve(os.environ["CHECKMATE_BIND"])[0], 0)
    return (_local_address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1")), 0)


class CheckmateProcessGroup(dist.ProcessGroup):
    """One process group's collectives over one Checkmate transport (made by the registered creator).

    Calls must come in the same order on every rank (as with every c10d backend). Each returns a
    ``Work`` whose future completes with the collective's output tensors.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: timedelta,
        options: CheckmateBackendOptions | None = None,
    ) -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]  # (store, ...) builds no Python alias
        options = options or CheckmateBackendOptions()
        try:
            secret = options.secret if options.secret is not None else secret_from_env()
        except AuthConfigError as exc:
            raise AuthConfigError(f'torch.distributed backend "{BACKEND_NAME}": {exc}') from None
        self._rank = rank
        self._world = world_size
        self._group_name = ""
        self._group_desc = ""
        self._timeout = timeout.total_seconds()
        self.options = options
        job_id = (
            options.job_id if options.job_id is not None else int(os.environ.get("CHECKMATE_JOB_ID", "1"))
        )
        self.job_id = job_id
        self.flow_job_id = (job_id + _FLOW_JOB_OFFSET) % (1 << 32)
        self._lock = threading.Lock()
        self._ops: dict[int, _FlowOp] = {}
        self._early: dict[int, list[tuple[int, int, int, bytes]]] = {}
        """Flow op -> (sender, byte offset, bytes announced, payload) that came before the op started here."""
        self._flow_seq = 0
        self._ring_seq = 0
        self._failed: BaseException | None = None
        self._closed = False
        self.transport: Transport | None = None
        self.ring: RingAllReduce | None = None
        self.peers: tuple[Addr, ...] = ()
        self._watch_event = threading.Event()
        self._watchdog: threading.Thread | None = None
        if world_size == 1:
            return
        datapath = options.datapath or datapath_from_env()
        self.transport = Transport(
            TransportConfig(
                bind=_bind_address(options),
                peer_timeout=options.peer_timeout,
                datapath=datapath,
                faults=options.faults,
            )
        )
        try:
            self.peers = self._rendezvous(store)
            self.transport.add_job(
                self.flow_job_id,
                rank,
                {r: a for r, a in enumerate(self.peers) if r != rank},
                on_data=lambda header, payload, addr: self._on_fields(header.fields(), payload, addr),
                on_failure=self._on_peer_failure,
                secret=secret,
                on_data_fields=self._on_fields,
            )
            self.ring = RingAllReduce(
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
            # no rank sends before every rank accepts its jobs (else its first datagrams wait for an RTO)
            store.set(f"checkmate/ready/{rank}", "1")
            store.wait([f"checkmate/ready/{r}" for r in range(world_size)])
        except BaseException:
            self.transport.close()
            raise
        self._watchdog = threading.Thread(target=self._watch, name=f"cm-pg-{rank}", daemon=True)
        self._watchdog.start()
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
            return _done(tensors)
        if tensor.dtype in _RING_DTYPES:
            return self._ring_allreduce(tensor, op)
        # other dtypes: every rank's tensor to every rank, added in rank order (exact for integers)
        if op is ReduceOp.AVG and not tensor.is_floating_point():
            raise NotImplementedError(
                f"all_reduce with ReduceOp.AVG of {tensor.dtype}: average a float tensor"
            )

        def finish(parts: dict[int, torch.Tensor]) -> list[torch.Tensor]:
            total = self._sum_in_rank_order(parts, tensor)
            if op is ReduceOp.AVG:
                total = total / self._world
            tensor.copy_(total)
            return tensors

        return self._exchange("all_reduce", {r: tensor for r in range(self._world)}, tensor, finish)

    def allreduce_coalesced(self, *args: Any, **kwargs: Any) -> dist.Work:
        return _unsupported("all_reduce_coalesced", "call all_reduce once per tensor")

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
                out.copy_(mine if r == self._rank else _from_bytes(parts[r], mine))
            return output_tensors

        return self._exchange("all_gather", {r: mine for r in range(self._world)}, mine, finish)

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
                    input.reshape(-1) if r == self._rank else _from_bytes(parts[r], input).reshape(-1)
                )
            if not output.is_contiguous():
                output.copy_(flat.view(output.shape))
            return [output]

        return self._exchange("all_gather_into_tensor", {r: input for r in range(self._world)}, input, finish)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> dist.Work:
        return _unsupported("all_gather_coalesced", "call all_gather once per tensor")

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
            return _done(tensors)

        def finish(parts: dict[int, torch.Tensor]) -> list[torch.Tensor]:
            if self._rank != root:
                tensor.copy_(_from_bytes(parts[root], tensor))
            return tensors

        sends = {r: tensor for r in range(self._world) if r != root} if self._rank == root else {}
        expect_from = [root] if self._rank != root else []
        return self._flow_op("broadcast", sends, expect_from, tensor.numel() * tensor.element_size(), finish)

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
            return _done([])
        token = torch.zeros(1, dtype=torch.uint8)
        return self._exchange("barrier", {r: token for r in range(self._world)}, token, lambda parts: [])

    def reduce(self, *args: Any, **kwargs: Any) -> dist.Work:
        return _unsupported("reduce", "all_reduce (every rank gets the sum)")

    def gather(self, *args: Any, **kwargs: Any) -> dist.Work:
        return _unsupported("gather", "all_gather")

    def scatter(self, *args: Any, **kwargs: Any) -> dist.Work:
        return _unsupported("scatter", "broadcast the whole tensor and slice it")

    def alltoall(self, *args: Any, **kwargs: Any) -> dist.Work:
        return _unsupported("all_to_all", "all_gather, then take your part, or a gloo group for it")

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> dist.Work:
        return _unsupported(
            "all_to_all_single", "all_gather_into_tensor, then take your part, or a gloo group"
        )

    alltoall_base = all_to_all_single

    def send(self, *args: Any, **kwargs: Any) -> dist.Work:
        return _unsupported("send", "broadcast from the sender, or a gloo group for point-to-point")

    def recv(self, *args: Any, **kwargs: Any) -> dist.Work:
        return _unsupported("recv", "broadcast from the sender, or a gloo group for point-to-point")

    def recv_anysource(self, *args: Any, **kwargs: Any) -> dist.Work:
        return _unsupported("recv_anysource", "a gloo group for point-to-point")

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """``all_gather_into_tensor`` of each (output, input) pair, as one Work."""
        if len(outputs) != len(inputs):
            raise ValueError(f"{len(outputs)} outputs for {len(inputs)} inputs")
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return _all_of(works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]  # old name

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        """``reduce_scatter_tensor`` of each (output, input) pair, as one Work (functional collectives)."""
        if len(outputs) != len(inputs):
            raise ValueError(f"{len(outputs)} outputs for {len(inputs)} inputs")
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return _all_of(works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]  # old name

    def shutdown(self) -> None:
        """``dist.destroy_process_group``: drain, stop the ring and close the transport."""
        self.close()

    def abort(self) -> None:
        self.close(drain_timeout=0.0)

    def close(self, drain_timeout: float = 2.0) -> None:
        """Stop this rank's ring and transport (pending collectives fail); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._fail_all(CheckmateBackendError("the checkmate process group was shut down"))
        self._watch_event.set()
        if self.transport is not None:
            self.transport.wait_idle(drain_timeout)
            if self.ring is not None:
                self.ring.close()
            self.transport.remove_job(self.flow_job_id)
            self.transport.close()
        _live.discard(self)

    # ---- collectives ----------------------------------------------------------------------
    @staticmethod
    def _reduce_op(collective: str, opts: Any) -> ReduceOp:
        op = getattr(opts, "reduceOp", dist.ReduceOp.SUM) if opts is not None else dist.ReduceOp.SUM
        # opts.reduceOp is a c10d ReduceOp (comparable to RedOpType members)
        if op == dist.ReduceOp.SUM:
            return ReduceOp.SUM
        if op == dist.ReduceOp.AVG:
            return ReduceOp.AVG
        name = getattr(getattr(op, "op", op), "name", str(op))
        raise NotImplementedError(
            f'{collective} with ReduceOp.{name}: the "{BACKEND_NAME}" backend reduces with SUM and AVG only; '
            "use a gloo group (dist.new_group(backend='gloo')) for other reductions"
        )

    def _ring_allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> dist.Work:
        assert self.ring is not None
        with self._lock:
            self._check_usable()
            seq = self._ring_seq
            self._ring_seq = (seq + 1) % (MAX_ITERATION + 1)
        ring_future = self.ring.allreduce_async(seq, 0, tensor, op)

        def copy_back(done: torch.futures.Future[torch.Tensor]) -> list[torch.Tensor]:
            tensor.copy_(done.value().view(tensor.shape))
            return [tensor]

        return _FutureWork(ring_future.then(copy_back))

    def _reduce_scatter(
        self, name: str, output: torch.Tensor, chunks: list[torch.Tensor], op: ReduceOp, result: Any
    ) -> dist.Work:
        if self._world == 1:  # the sum (and the average) of one chunk is the chunk
            output.copy_(chunks[0].reshape(output.shape))
            return _done(result)
        if op is ReduceOp.AVG and not output.is_floating_point():
            raise NotImplementedError(f"{name} with ReduceOp.AVG of {output.dtype}: average a float tensor")
        mine = chunks[self._rank]

        def finish(parts: dict[int, torch.Tensor]) -> Any:
            total = self._sum_in_rank_order(parts, mine)
            if op is ReduceOp.AVG:
                total = total / self._world
            output.copy_(total.view(output.shape))
            return result

        sends = {r: chunks[r] for r in range(self._world)}
        return self._exchange(name, sends, mine, finish)

    def _sum_in_rank_order(self, parts: dict[int, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """``parts[0] + parts[1] + ... + parts[N-1]`` in ``like``'s dtype; this rank's part is ``like``."""
        values = [
            like.reshape(-1) if r == self._rank else _from_bytes(parts[r], like).reshape(-1)
            for r in range(self._world)
        ]
        total = values[0].clone()
        for value in values[1:]:
            total += value
        return total.view(like.shape)

    def _exchange(
        self,
        name: str,
        sends: dict[int, torch.Tensor],
        like: torch.Tensor,
        finish: Callable[[dict[int, torch.Tensor]], Any],
    ) -> dist.Work:
        """Send ``sends[r]`` to each other rank r and wait for every other rank's ``like``-sized part."""
        others = [r for r in range(self._world) if r != self._rank]
        return self._flow_op(
            name,
            {r: t for r, t in sends.items() if r != self._rank},
            others,
            like.numel() * like.element_size(),
            finish,
        )

    def _flow_op(
        self,
        name: str,
        sends: dict[int, torch.Tensor],
        expect_from: Sequence[int],
        nbytes: int,
        finish: Callable[[dict[int, torch.Tensor]], Any],
    ) -> dist.Work:
        """Start one flow collective: its sends and the receipt of ``nbytes`` from each of ``expect_from``."""
        assert self.transport is not None
        if (nbytes + 1) // 2 > 0xFFFFFFFF:
            raise ValueError(f"{name}: a {nbytes}-byte message exceeds the wire's 32-bit offsets")
        record = _FlowOp(
            name=name,
            expected={r: nbytes for r in expect_from},
            buffers={r: torch.empty(nbytes, dtype=torch.uint8) for r in expect_from},
            finish=finish,
            deadline=time.monotonic() + self._timeout,
        )
        payloads = {r: _as_bytes(t) for r, t in sends.items()}
        with self._lock:
            self._check_usable()
            seq = self._flow_seq
            self._flow_seq = (seq + 1) % (MAX_ITERATION + 1)
            self._ops[seq] = record
            early = self._early.pop(seq, [])
            self._watch_event.set()
        try:
            for dst, payload in payloads.items():
                self._send_message(seq, dst, payload)
        except (PeerTimeoutError, CollectiveError) as exc:
            self._fail_op(seq, exc)
        for sender, offset, announced, data in early:
            self._accept(seq, sender, offset, announced, memoryview(data))
        self._complete_if_done(seq)
        return _FutureWork(record.future)

    def _send_message(self, seq: int, dst: int, payload: torch.Tensor) -> None:
        assert self.transport is not None
        view = payload.numpy().data.cast("B") if payload.numel() else memoryview(b"")
        total = len(view)
        for start in range(0, total, _PIECE):
            piece = view[start : start + _PIECE]
            if len(piece) % 2:
                piece = memoryview(bytes(piece) + b"\0")
            header = bytearray(32)
            pack_data_header(
                header,
                0,
                int(_WIRE_UNIT),
                self.flow_job_id,
                seq,
                0,
                self._rank,
                0,
                start // 2,
                len(piece) // 2,
            )
            self.transport.send_packed(self.peers[dst], self.flow_job_id, header, piece)

    # ---- receive side (the transport's thread) -----------------------------------------------
    def _on_fields(self, fields: tuple[int, ...], payload: memoryview, addr: Addr) -> None:
        seq, sender = fields[5], fields[7]
        offset = fields[10] * 2
        with self._lock:
            if seq not in self._ops:
                if not self._closed:
                    self._early.setdefault(seq, []).append((sender, offset, len(payload), bytes(payload)))
                return
        self._accept(seq, sender, offset, len(payload), payload)
        self._complete_if_done(seq)

    def _accept(self, seq: int, sender: int, offset: int, announced: int, payload: memoryview) -> None:
        with self._lock:
            record = self._ops.get(seq)
            if record is None or record.done or sender not in record.expected:
                self._drop(f"{record.name if record else 'stale'} from unexpected rank {sender}")
                return
            expected = record.expected[sender]
            count = min(announced, expected - offset)
            if count < 0 or offset < 0:
                self._drop(f"{record.name}: bytes {offset}.. from rank {sender} beyond its {expected}")
                return
            record.buffers[sender][offset : offset + count].copy_(
                torch.frombuffer(payload[:count], dtype=torch.uint8)
                if count
                else torch.empty(0, dtype=torch.uint8)
            )
            record.received[sender] = record.received.get(sender, 0) + count

    def _complete_if_done(self, seq: int) -> None:
        with self._lock:
            record = self._ops.get(seq)
            if record is None or record.done:
                return
            if any(record.received.get(r, 0) < n for r, n in record.expected.items()):
                return
            record.done = True
            del self._ops[seq]
        try:
            value = record.finish(record.buffers)
        except Exception as exc:  # noqa: BLE001 - a failed finish fails the caller's Work, not this thread
            record.future.set_exception(exc)
            return
        record.future.set_result(value)

    def _drop(self, why: str) -> None:
        logger.warning("checkmate backend rank %d: dropped a datagram (%s)", self._rank, why)

    # ---- failures -----------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise CheckmateBackendError("the checkmate process group was shut down")
        if self._failed is not None:
            raise CheckmateBackendError(f"the checkmate process group failed earlier: {self._failed}")

    def _fail_op(self, seq: int, error: BaseException) -> None:
        with self._lock:
            record = self._ops.pop(seq, None)
            if record is None or record.done:
                return
            record.done = True
        record.future.set_exception(error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            records = [r for r in self._ops.values() if not r.done]
            for record in records:
                record.done = True
            self._ops.clear()
        for record in records:
            record.future.set_exception(error)

    def _on_peer_failure(self, error: PeerTimeoutError) -> None:
        with self._lock:
            if self._failed is None:
                self._failed = error
        self._fail_all(error)

    def _watch(self) -> None:
        """Fail flow collectives past their deadline (naming the ranks still silent)."""
        while not self._closed:
            now = time.monotonic()
            with self._lock:
                late = [(s, r) for s, r in self._ops.items() if not r.done and r.deadline < now]
                deadline = min((r.deadline for r in self._ops.values() if not r.done), default=None)
                self._watch_event.clear()
            for seq, record in late:
                missing = sorted(r for r, n in record.expected.items() if record.received.get(r, 0) < n)
                self._fail_op(
                    seq,
                    TimeoutError(
                        f"checkmate backend rank {self._rank}: {record.name} (collective {seq}) "
                        f"incomplete after {self._timeout:.1f}s; still waiting for ranks {missing}"
                    ),
                )
            if late:
                continue
            self._watch_event.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0) + 0.01)


class _FutureWork(dist._Work):
    """A collective's Work over its future: ``wait`` raises the collective's error.

    (torch's ``_create_work_from_future`` wraps a future whose error its ``wait`` does not raise, so
    a failed collective would pass silently.) ``wait``'s timeout is the group's: every pending
    collective fails at its deadline.
    """

    def __init__(self, future: torch.futures.Future[Any]) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()  # raises what the collective failed with
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return bool(self._future.done())

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:  # noqa: BLE001 - any stored error means the collective failed
            return False
        return True

    def result(self) -> Any:
        return self._future.wait()


def _done(value: Any) -> dist.Work:
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(value)
    return _FutureWork(future)


def _all_of(works: list[dist.Work], value: Any) -> dist.Work:
    """One Work completing with ``value`` once all ``works`` have (failing with the first error)."""
    futures = [work.get_future() for work in works]

    def check(done: torch.futures.Future[Any]) -> Any:
        for future in done.value():
            future.value()  # raises the collective's error
        return value

    return _FutureWork(torch.futures.collect_all(futures).then(check))


def _unsupported(collective: str, instead: str) -> dist.Work:
    raise NotImplementedError(
        f'{collective} is not supported by the torch.distributed backend "{BACKEND_NAME}"; use {instead}'
    )


_live: weakref.WeakSet[CheckmateProcessGroup] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Close every live group's transport before the interpreter goes (their threads take the GIL)."""
    for group in list(_live):
        group.close(drain_timeout=0.5)


def create_checkmate_backend(
    backend_options: Any, pg_options: CheckmateBackendOptions | None = None
) -> CheckmateProcessGroup:
    """The creator torch calls for ``backend="checkmate"`` (extended API: store, ranks, timeout, options)."""
    if pg_options is not None and not isinstance(pg_options, CheckmateBackendOptions):
        raise TypeError(
            f'the "{BACKEND_NAME}" backend takes pg_options=CheckmateBackendOptions(...), '
            f"got {type(pg_options).__name__}"
        )
    return CheckmateProcessGroup(
        backend_options.store,
        backend_options.group_rank,
        backend_options.group_size,
        backend_options.timeout,
        pg_options,
    )


dist.Backend.register_backend(BACKEND_NAME, create_checkmate_backend, extended_api=True, devices=["cpu"])
