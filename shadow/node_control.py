"""The shadow node's control server: rank 0's control channel, and status and restore requests.

One listener thread accepts TCP connections; each gets its own handler thread. Rank 0's
connection carries job_start (the state to start from), bucket_layout (which makes the
shadow build a new epoch and re-seed) and commit records; the shadow answers certified,
diverged and goodbye on it (through the :class:`~shadow.node_link.ControlLink`). Any
connection may ask for status or a restore. A shadow that needs fresh state says goodbye
``resync:``, shuts its side down and discards what rank 0 still sends until rank 0 closes
(so the goodbye and any report before it arrive).

The :class:`ControlServer` owns the listener, the admission of connections, the job_start
waiting for its layout and the epoch numbering, under its ``_lock``. It hands jobs, epochs
and commits to the :class:`~shadow.node_receive.Receiver` and the re-seeded state to the
:class:`~shadow.node_service.StateService`, with ``_lock`` held (lock order: this one
first), so that two connections' job_starts and layouts are taken one at a time.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from checkmate.admission import Admission, Ticket
from checkmate.control import BucketLayout as LayoutMessage
from checkmate.control import (
    Commit,
    ControlProtocolError,
    Goodbye,
    JobStart,
    RestoreRequest,
    StatusReport,
    StatusRequest,
    decode_message,
    job_state_of,
    send_message,
    torch_dtype,
)
from checkmate.control_frame import ControlAuth, ControlSession, FrameAuthError, bind
from checkmate.job import JobSpec, JobSpecError
from checkmate.optimizers import OptimizerReplayError, optimizer_class
from checkmate.sockets import create_server
from shadow.iteration_window import BucketLayout, IterationWindow, ParameterSlot, check_segments
from shadow.node_apply import Applier
from shadow.node_link import ControlLink
from shadow.node_receive import Receiver
from shadow.node_service import StateService
from shadow.node_state import (
    Addr,
    CommitEntry,
    ComponentThread,
    Drops,
    Epoch,
    Job,
    ShadowConfig,
    checked_position,
    make_optimizer,
)
from shadow.optimizer_apply import GradientScaling, OptimizerSpecError, StepRecord

logger = logging.getLogger(__name__)


class ControlServer:
    """The control port: job_start, bucket_layout, commit, status, restore (``_lock``, taken first)."""

    def __init__(
        self,
        config: ShadowConfig,
        auth: ControlAuth,
        drops: Drops,
        receiver: Receiver,
        state: StateService,
        link: ControlLink,
        applier: Applier,
        wake_maintenance: Callable[[], None],
        status: Callable[[], dict[str, Any]],
        stop: threading.Event,
    ) -> None:
        self._config = config
        self._name = config.name
        self._auth = auth
        self._drops = drops
        self._receiver = receiver
        self._state = state
        self._link = link
        self._applier = applier
        self._wake_maintenance = wake_maintenance
        self._status = status
        self._stop = stop
        self._admission = Admission(f"shadow {self._name}", config.control_limits, drops.add)
        self._lock = threading.Lock()
        self._pending_start: JobStart | None = None
        """The job_start whose bucket layout has not come yet."""
        self._generation = 0
        self._reseeds = 0
        self._tcp = create_server(config.control_bind, f"shadow {self._name}'s control socket")
        self._tcp.settimeout(0.1)
        self.address: Addr = self._tcp.getsockname()
        self._thread = ComponentThread(self._name, "ctl", self._accept_loop)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def close(self) -> None:
        self._tcp.close()

    def resumed(self) -> None:
        """The state service resumed from a snapshot (epoch 1): the next layout's epoch is 2."""
        with self._lock:
            self._generation = 1

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"reseeds": self._reseeds}

    def _drop(self, reason: str) -> str:
        return self._drops.add(reason)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._tcp.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                logger.warning("shadow %s: accept failed: %s", self._name, exc)
                continue
            ticket = self._admission.admit(conn, peer[0])
            if ticket is None:
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            session = bind(
                conn, self._auth, self._config.job_id, server=True, name=self._name, hello_timeout=1.0
            )
            threading.Thread(
                target=self._serve,
                args=(conn, peer, session, ticket),
                name=f"shadow-{self._name}-conn",
                daemon=True,
            ).start()

    def _serve(self, conn: socket.socket, peer: Addr, session: ControlSession, ticket: Ticket) -> None:
        is_control = False
        retired_at: float | None = None
        admission = self._admission
        poller = select.poll()  # not select(): descriptors past 1024 are fine
        poller.register(conn, select.POLLIN)
        try:
            while not self._stop.is_set():
                if ticket.evicted is not None:
                    return  # closed to make room (counted and logged by the admission)
                if retired_at is None and self._link.is_retired(conn):
                    retired_at = time.monotonic()
                if conn.fileno() < 0:
                    return  # closed by another thread (rank 0 reconnected)
                readable = bool(poller.poll(200))
                if retired_at is not None:
                    # Said goodbye: what rank 0 sent meanwhile is discarded (unread bytes at close
                    # would reset the connection and could lose the goodbye and a 'diverged').
                    if readable and conn.recv(1 << 16):
                        continue
                    if readable or time.monotonic() - retired_at > self._config.io_timeout:
                        return  # rank 0 closed its side (or never did)
                    continue
                if not readable:
                    if admission.expired(ticket):
                        admission.refuse(
                            "control_auth_timeout",
                            f"connection from {peer[0]}:{peer[1]} sent no authenticated frame within "
                            f"{admission.limits.auth_timeout:g} s",
                        )
                        return
                    if is_control and not self._link.is_current(conn):
                        return  # replaced by a newer connection from rank 0
                    continue
                head_timeout = None
                if not ticket.authenticated:  # the whole head by the authentication deadline
                    left = admission.limits.auth_timeout - (time.monotonic() - ticket.accepted)
                    head_timeout = max(0.05, min(left, self._config.io_timeout))
                try:
                    text, blob = session.recv(conn, self._config.io_timeout, head_timeout=head_timeout)
                except FrameAuthError as exc:
                    admission.refuse("control_unauthenticated", f"connection from {peer[0]}:{peer[1]}: {exc}")
                    return
                except (TimeoutError, ControlProtocolError) as exc:
                    if ticket.authenticated:
                        raise
                    cause = "control_auth_timeout" if isinstance(exc, TimeoutError) else "control_malformed"
                    admission.refuse(cause, f"connection from {peer[0]}:{peer[1]}: {exc}")
                    return
                admission.authenticated(ticket)
                if not text and not blob:
                    continue  # the client's proof of the key (checkmate.control_frame)
                message = decode_message(text, blob)
                if isinstance(message, JobStart):
                    if not is_control:
                        is_control = True
                        self._link.adopt(conn)
                    if not self._on_job_start(message, conn, ticket.accepted):
                        return
                elif isinstance(message, LayoutMessage):
                    if not self._on_layout(message, conn):
                        return
                elif isinstance(message, Commit):
                    self._on_commit(message)
                elif isinstance(message, StatusRequest):
                    send_message(
                        conn, StatusReport(self._link.job_id(), self._status()), self._config.io_timeout
                    )
                elif isinstance(message, RestoreRequest):
                    answer = self._state.restore(message, self._link.job_id())
                    send_message(conn, answer, self._config.io_timeout)
                elif isinstance(message, Goodbye):
                    logger.info("shadow %s: %s said goodbye: %s", self._name, peer, message.reason)
                    return
                else:
                    self._drop(f"unexpected_control_{message.TYPE}")
        except (OSError, ControlProtocolError) as exc:
            logger.info("shadow %s: connection from %s closed: %s", self._name, peer, exc)
        finally:
            admission.release(ticket)
            self._link.release(conn)
            conn.close()

    def _on_job_start(self, message: JobStart, conn: socket.socket, connected_at: float) -> bool:
        """Take rank 0's job_start; ``connected_at``: when ``conn`` was accepted (``time.monotonic()``)."""
        if self._config.job_id is not None and message.job_id != self._config.job_id:
            logger.error("shadow %s: job %d is not the configured job", self._name, message.job_id)
            refusal = Goodbye(message.job_id, f"this shadow serves job {self._config.job_id}")
            self._link.send_on(conn, refusal, 1.0)
            return False
        try:
            job = self._job_from(message)
        except (JobSpecError, ValueError) as exc:
            logger.error("shadow %s: unusable job_start: %s", self._name, exc)
            return False
        try:  # an optimizer this shadow cannot import or replay: refused at once, rank 0 is told why
            optimizer_class(message.optimizer)
        except (OptimizerReplayError, KeyError, TypeError) as exc:
            logger.error("shadow %s: refusing job %d: %s", self._name, message.job_id, exc)
            self._link.send_on(conn, Goodbye(message.job_id, f"refused: {exc}"), 1.0)
            return False
        if message.extra.get("data_position") is not None:
            position = checked_position(
                self._name, self._drops, message.extra["data_position"], message.start_iteration - 1
            )
            message.extra["data_position"] = position
        try:
            job_state_of(message)
        except ControlProtocolError as exc:
            logger.error("shadow %s: unusable job_start: %s", self._name, exc)
            return False
        with self._lock:
            new_run = self._link.begin_job(job, conn)
            self._receiver.begin_job(job, message.start_iteration, new_run, connected_at)
            self._state.forget_epoch()
            self._pending_start = message
        logger.info(
            "shadow %s: job %d state before iteration %d received (shard keys %s)",
            self._name,
            job.job_id,
            message.start_iteration,
            sorted(job.shard_keys),
        )
        return True

    def _job_from(self, message: JobStart) -> Job:
        spec = JobSpec.from_json(message.job) if message.job else None
        if self._config.shard_keys is not None:
            keys = set(self._config.shard_keys)
        elif spec is not None:
            keys = {k for k, s in spec.shard_to_shadow.items() if s == self._name}
            if not keys:
                raise ValueError(f"the job's shard map gives {self._name!r} no shard: {spec.shard_to_shadow}")
        else:
            raise ValueError("the job_start has no job description; start the shadow with --shard-keys")
        owners = sorted(set(spec.shard_to_shadow.values())) if spec is not None else [self._name]
        every = message.extra.get("fingerprint_every", 0)
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"fingerprint_every must be a non-negative integer, not {every!r}")
        return Job(
            job_id=message.job_id,
            world_size=message.world_size,
            workers=[(str(h), int(p)) for h, p in message.workers],
            parameters=list(message.parameters),
            optimizer=message.optimizer,
            shard_keys=keys,
            shard_index=owners.index(self._name) if self._name in owners else 0,
            num_shards=len(owners),
            spec=spec,
            fingerprint_every=every,
        )

    def _on_layout(self, message: LayoutMessage, conn: socket.socket) -> bool:
        with self._lock:
            start, job = self._pending_start, self._link.job()
            if job is None or message.job_id != job.job_id:
                self._drop("layout_for_unknown_job")
                return True
            if start is None or start.start_iteration != message.first_iteration:
                have = start.start_iteration if start is not None else None
                return self._link.request_state(
                    conn,
                    f"bucket layout from iteration {message.first_iteration} without the state before it "
                    f"(have state for {have}): parameters may have moved between shadows",
                )
        # Built without the lock: the first optimizer a process builds takes seconds (torch
        # initialises its optimizer machinery), and copies must keep arriving meanwhile
        # (there is no epoch yet, so they are stashed).
        try:
            epoch = self._build_epoch(job, start, message)
        except (OptimizerSpecError, KeyError, ValueError) as exc:
            logger.error("shadow %s: cannot join job %d: %s", self._name, job.job_id, exc)
            self._receiver.block(f"cannot join: {exc}")
            try:  # rank 0 is told why (hosts.protection: the job is unprotected, loudly)
                self._link.send_on(conn, Goodbye(job.job_id, f"refused: cannot join: {exc}"), 1.0)
            except OSError:
                pass
            return True
        with self._lock:
            if self._pending_start is not start or self._link.job() is not job:
                logger.info(
                    "shadow %s: layout for iteration %d superseded", self._name, start.start_iteration
                )
                return True
            self._generation += 1
            epoch.generation = self._generation
            self._pending_start = None
            self._reseeds += 1
            self._applier.reseeded(start.start_iteration)
            self._state.install(epoch, job, start)
            self._receiver.install_epoch(epoch)
        if start.start_iteration >= 1:
            self._applier.certify(start.start_iteration - 1, epoch, again=True)
        logger.info(
            "shadow %s: owns buckets %s (%d parameters) from iteration %d",
            self._name,
            sorted(epoch.owned_buckets),
            len(epoch.optimizer.parameters),
            message.first_iteration,
        )
        return True

    def _build_epoch(self, job: Job, start: JobStart, message: LayoutMessage) -> Epoch:
        shapes = {p.name: tuple(p.shape) for p in start.parameters}
        layout = {b.bucket_id: b for b in message.buckets}
        owned_buckets = {b.bucket_id for b in message.buckets if b.shard_key in job.shard_keys}
        window_layouts = {}
        for bucket in message.buckets:
            slots = []
            for piece in bucket.params:
                if piece.name not in shapes:
                    raise KeyError(f"bucket {bucket.bucket_id} names unknown parameter {piece.name!r}")
                if piece.offset + piece.numel > bucket.num_elements:
                    raise ValueError(f"parameter {piece.name} lies past bucket {bucket.bucket_id}'s end")
                shape = shapes[piece.name]
                slots.append(ParameterSlot(piece.name, piece.offset, piece.numel, shape, piece.param_offset))
            check_segments(bucket.bucket_id, slots)
            window_layouts[bucket.bucket_id] = BucketLayout(
                bucket.bucket_id, bucket.num_elements, tuple(slots), torch_dtype(bucket.dtype)
            )
        owned = {s.name for b in owned_buckets for s in window_layouts[b].parameters}
        bucketed = {s.name for layout_ in window_layouts.values() for s in layout_.parameters}
        unbucketed = [p.name for p in start.parameters if p.name not in bucketed]
        static: dict[str, torch.Tensor] = {}
        if unbucketed and job.shard_keys and min(job.shard_keys) == min(b.shard_key for b in message.buckets):
            static = {n: start.tensors[f"param/{n}"].clone() for n in unbucketed}
        optimizer = make_optimizer(job.optimizer, start, owned, self._config.threads())
        window = IterationWindow(
            job.job_id, window_layouts, owned_buckets, start.start_iteration, horizon=self._config.horizon
        )
        return Epoch(
            generation=0,  # numbered when it is installed
            first_iteration=start.start_iteration,
            layout=layout,
            owned_buckets=owned_buckets,
            window=window,
            optimizer=optimizer,
            static=static,
            confirmed_through=start.start_iteration - 1,
        )

    def _on_commit(self, message: Commit) -> None:
        now = time.monotonic()
        sets_position = message.data_position is not None
        position = (
            checked_position(self._name, self._drops, message.data_position, message.iteration)
            if sets_position
            else None
        )
        job = self._link.job()
        if job is None or message.job_id != job.job_id:
            self._drop("commit_for_unknown_job")
            return
        record = StepRecord(
            iteration=message.iteration,
            learning_rates=list(message.learning_rates),
            clip_coefficient=message.clip_coefficient,
            skip_step=message.skip_step,
            hyperparameters=[
                {k: tuple(v) if isinstance(v, list) else v for k, v in group.items()}
                for group in message.hyperparameters
            ],
            no_grad=frozenset(message.no_grad),
            gradient_scaling=tuple(
                GradientScaling(
                    str(op["by"]),
                    float(op["factor"]),
                    torch_dtype(op.get("dtype", "float32")),
                    frozenset(op["params"]) if op.get("params") is not None else None,
                )
                for op in message.gradient_scaling
            ),
        )
        if message.iteration <= self._state.applied:
            self._drop("stale_commit")
            return
        entry = CommitEntry(
            record,
            now,
            message.optimizer_step,
            sets_position,
            position,
            job_state=message.job_state,
            fingerprint=message.fingerprint,
            gradient_digests=message.gradient_digests,
        )
        self._receiver.add_commit(entry)
        self._wake_maintenance()  # repairs of this iteration may be due after the grace
