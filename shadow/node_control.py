"""The shadow node's control port: rank 0's control channel, and status and restore requests.

One listener thread accepts TCP connections; each gets its own handler thread. Rank 0's
connection carries job_start (the state to start from), bucket_layout (which makes the
shadow build a new epoch and re-seed) and commit records; the shadow answers certified,
diverged and goodbye on it. Any connection may ask for status or a restore. A shadow
that needs fresh state says goodbye ``resync:``, shuts its side down and discards what
rank 0 still sends until rank 0 closes (so the goodbye and any report before it arrive).
Takes ``_lock`` for the job, epoch and commit bookkeeping, ``_state_lock`` (inside
``_lock``) to install a re-seeded epoch, ``_control_send`` for each write.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from checkmate.admission import Admission, Ticket
from checkmate.control import BucketLayout as LayoutMessage
from checkmate.control import (
    Commit,
    ControlProtocolError,
    Goodbye,
    JobStart,
    Message,
    RestoreRequest,
    StatusReport,
    StatusRequest,
    decode_message,
    job_state_of,
    send_message,
    torch_dtype,
    validate_data_position,
)
from checkmate.control_frame import ControlSession, FrameAuthError, bind
from checkmate.job import JobSpec, JobSpecError
from checkmate.optimizers import OptimizerReplayError, optimizer_class
from shadow.iteration_window import BucketLayout, DropReason, IterationWindow, ParameterSlot, check_segments
from shadow.node_state import Addr, CommitEntry, Epoch, Job, NodeState
from shadow.optimizer_apply import (
    GradientScaling,
    OptimizerSpec,
    OptimizerSpecError,
    ShadowOptimizer,
    StepRecord,
)
from shadow.repair import RepairTracker

logger = logging.getLogger(__name__)


class ControlServer(NodeState):
    """The control port's part of a shadow node: job_start, bucket_layout, commit, status, restore."""

    def _accept_loop(self) -> None:
        self._admission = Admission(f"shadow {self.name}", self.config.control_limits, self._drop)
        while not self._stop.is_set():
            try:
                conn, peer = self._tcp.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                logger.warning("shadow %s: accept failed: %s", self.name, exc)
                continue
            ticket = self._admission.admit(conn, peer[0])
            if ticket is None:
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            session = bind(
                conn, self._control_auth, self.config.job_id, server=True, name=self.name, hello_timeout=1.0
            )
            threading.Thread(
                target=self._serve,
                args=(conn, peer, session, ticket),
                name=f"shadow-{self.name}-conn",
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
                if retired_at is None and conn in self._retiring:
                    retired_at = time.monotonic()
                if conn.fileno() < 0:
                    return  # closed by another thread (rank 0 reconnected)
                readable = bool(poller.poll(200))
                if retired_at is not None:
                    # Said goodbye: what rank 0 sent meanwhile is discarded (unread bytes at close
                    # would reset the connection and could lose the goodbye and a 'diverged').
                    if readable and conn.recv(1 << 16):
                        continue
                    if readable or time.monotonic() - retired_at > self.config.io_timeout:
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
                    if is_control and self._control_conn is not conn:
                        return  # replaced by a newer connection from rank 0
                    continue
                head_timeout = None
                if not ticket.authenticated:  # the whole head by the authentication deadline
                    left = admission.limits.auth_timeout - (time.monotonic() - ticket.accepted)
                    head_timeout = max(0.05, min(left, self.config.io_timeout))
                try:
                    text, blob = session.recv(conn, self.config.io_timeout, head_timeout=head_timeout)
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
                        self._adopt_control(conn)
                    if not self._on_job_start(message, conn):
                        return
                elif isinstance(message, LayoutMessage):
                    if not self._on_layout(message, conn):
                        return
                elif isinstance(message, Commit):
                    self._on_commit(message)
                elif isinstance(message, StatusRequest):
                    send_message(conn, StatusReport(self._job_id(), self.status()), self.config.io_timeout)
                elif isinstance(message, RestoreRequest):
                    send_message(conn, self._restore(message), self.config.io_timeout)
                elif isinstance(message, Goodbye):
                    logger.info("shadow %s: %s said goodbye: %s", self.name, peer, message.reason)
                    return
                else:
                    self._drop(f"unexpected_control_{message.TYPE}")
        except (OSError, ControlProtocolError) as exc:
            logger.info("shadow %s: connection from %s closed: %s", self.name, peer, exc)
        finally:
            admission.release(ticket)
            with self._lock:
                if self._control_conn is conn:
                    self._control_conn = None
                self._retiring.discard(conn)
            conn.close()

    def _adopt_control(self, conn: socket.socket) -> None:
        with self._lock:
            old, self._control_conn = self._control_conn, conn
        if old is not None and old is not conn:
            logger.info("shadow %s: rank 0 reconnected; dropping the old control connection", self.name)
            old.close()

    def _send_control(self, message: Message) -> bool:
        conn = self._control_conn
        if conn is None:
            return False
        try:
            with self._control_send:
                send_message(conn, message, timeout=self.config.io_timeout)
            return True
        except OSError as exc:
            logger.info("shadow %s: control write failed: %s", self.name, exc)
            return False

    def _request_state(self, conn: socket.socket, why: str) -> bool:
        """Ask rank 0 for fresh state: goodbye on ``conn``, now retired; rank 0 reconnects and resends it.

        The connection is not closed here: its reader discards what rank 0 sent meanwhile until
        rank 0 closes its side (a close with unread bytes would reset the connection, and rank 0
        could lose this goodbye and a 'diverged' report before it). Returns True (keep reading).
        """
        with self._lock:
            self.stats.resync_requests += 1
            if self._control_conn is conn:
                self._control_conn = None
            self._retiring.add(conn)
        logger.warning("shadow %s: asking rank 0 for fresh state: %s", self.name, why)
        try:
            with self._control_send:
                send_message(conn, Goodbye(self._job_id(), f"resync: {why}"), timeout=1.0)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        return True

    def _on_job_start(self, message: JobStart, conn: socket.socket) -> bool:
        if self.config.job_id is not None and message.job_id != self.config.job_id:
            logger.error("shadow %s: job %d is not the configured job", self.name, message.job_id)
            with self._control_send:
                send_message(
                    conn, Goodbye(message.job_id, f"this shadow serves job {self.config.job_id}"), 1.0
                )
            return False
        try:
            job = self._job_from(message)
        except (JobSpecError, ValueError) as exc:
            logger.error("shadow %s: unusable job_start: %s", self.name, exc)
            return False
        try:  # an optimizer this shadow cannot import or replay: refused at once, rank 0 is told why
            optimizer_class(message.optimizer)
        except (OptimizerReplayError, KeyError, TypeError) as exc:
            logger.error("shadow %s: refusing job %d: %s", self.name, message.job_id, exc)
            with self._control_send:
                send_message(conn, Goodbye(message.job_id, f"refused: {exc}"), timeout=1.0)
            return False
        if message.extra.get("data_position") is not None:
            position = self._checked_position(message.extra["data_position"], message.start_iteration - 1)
            message.extra["data_position"] = position
        try:
            job_state_of(message)
        except ControlProtocolError as exc:
            logger.error("shadow %s: unusable job_start: %s", self.name, exc)
            return False
        with self._lock:
            new_run = conn is not self._job_conn or (
                self._job is not None
                and (self._job.world_size, self._job.workers) != (job.world_size, job.workers)
            )
            self._restash_unconfirmed()  # placed under the old layout: sorted out with the stash below
            self._job = job
            self._job_conn = conn
            self._pending_start = message
            self._epoch = None
            self._blocked = None
            self._repairs = RepairTracker(self.config.repair, len(job.workers))
            # Copies of earlier iterations are stale. A job_start on a new control connection
            # (the job restarted, maybe with another worker count) makes every held copy stale:
            # the failed run's iterations >= start are redone, possibly with other chunks and
            # sums. A layout change within a run keeps copies of later iterations (same run).
            for iteration in [i for i in self._stash if new_run or i < message.start_iteration]:
                for data, *_ in self._stash.pop(iteration):
                    self._stash_bytes -= len(data)
                    self._drop(DropReason.STALE.value)
            # Commit records arrive on the control connection after their job_start, so any
            # held for iterations >= start belong to a previous run or layout: drop them all.
            self._commits.clear()
            if new_run:
                self._latest_commit = min(self._latest_commit, message.start_iteration - 1)
                self._latest_seen = min(self._latest_seen, message.start_iteration - 1)
            self._lock.notify_all()
        logger.info(
            "shadow %s: job %d state before iteration %d received (shard keys %s)",
            self.name,
            job.job_id,
            message.start_iteration,
            sorted(job.shard_keys),
        )
        return True

    def _job_from(self, message: JobStart) -> Job:
        spec = JobSpec.from_json(message.job) if message.job else None
        if self.config.shard_keys is not None:
            keys = set(self.config.shard_keys)
        elif spec is not None:
            keys = {k for k, s in spec.shard_to_shadow.items() if s == self.name}
            if not keys:
                raise ValueError(f"the job's shard map gives {self.name!r} no shard: {spec.shard_to_shadow}")
        else:
            raise ValueError("the job_start has no job description; start the shadow with --shard-keys")
        owners = sorted(set(spec.shard_to_shadow.values())) if spec is not None else [self.name]
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
            shard_index=owners.index(self.name) if self.name in owners else 0,
            num_shards=len(owners),
            spec=spec,
            fingerprint_every=every,
        )

    def _on_layout(self, message: LayoutMessage, conn: socket.socket) -> bool:
        with self._lock:
            start, job = self._pending_start, self._job
            if job is None or message.job_id != job.job_id:
                self._drop("layout_for_unknown_job")
                return True
            if start is None or start.start_iteration != message.first_iteration:
                have = start.start_iteration if start is not None else None
                return self._request_state(
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
            logger.error("shadow %s: cannot join job %d: %s", self.name, job.job_id, exc)
            with self._lock:
                self._blocked = f"cannot join: {exc}"
            try:  # rank 0 is told why (hosts.protection: the job is unprotected, loudly)
                with self._control_send:
                    send_message(conn, Goodbye(job.job_id, f"refused: cannot join: {exc}"), timeout=1.0)
            except OSError:
                pass
            return True
        with self._lock:
            if self._pending_start is not start or self._job is not job:
                logger.info("shadow %s: layout for iteration %d superseded", self.name, start.start_iteration)
                return True
            self._generation += 1
            epoch.generation = self._generation
            with self._state_lock:
                self._epoch = epoch
                self._applied = start.start_iteration - 1
                self._optimizer_step = int(start.extra.get("optimizer_step", self._optimizer_step))
                self._data_position = start.extra.get("data_position")
                self._job_state = job_state_of(start)
            self._pending_start = None
            self._restored_from = None
            # Certificates name the job's iterations: after a re-seed at t (a restart may
            # resume before what an earlier run certified) the next certificate is t - 1's.
            self._certified = min(self._certified, start.start_iteration - 1)
            self._last_verified = start.start_iteration - 1  # rank 0's own state
            self._diverged = None
            self.stats.reseeds += 1
            if self._repairs is not None:
                self._repairs.forget_before(start.start_iteration)
            self._drain_stash()
            self._fulfil_captures_locked()
            self._lock.notify_all()
        if start.start_iteration >= 1:
            self._certify(start.start_iteration - 1, epoch, again=True)
        logger.info(
            "shadow %s: owns buckets %s (%d parameters) from iteration %d",
            self.name,
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
        optimizer = self._make_optimizer(job.optimizer, start, owned, self.config.threads())
        window = IterationWindow(
            job.job_id, window_layouts, owned_buckets, start.start_iteration, horizon=self.config.horizon
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

    @staticmethod
    def _make_optimizer(
        spec_json: Mapping[str, Any], start: JobStart, owned: set[str], threads: int = 1
    ) -> ShadowOptimizer:
        initial = {
            key[len("param/") :]: tensor for key, tensor in start.tensors.items() if key.startswith("param/")
        }
        spec = OptimizerSpec.from_json(spec_json)
        optimizer = ShadowOptimizer(initial, spec, owned, threads)
        for name, parameter in optimizer.parameters.items():
            state: dict[str, Any] = {}
            prefix = f"state/{name}/"
            for key, tensor in start.tensors.items():
                if key.startswith(prefix):
                    state[key[len(prefix) :]] = tensor.clone()
            state.update(start.optimizer_scalars.get(name, {}))
            if state:
                optimizer.optimizer.state[parameter] = state
        return optimizer

    def _checked_position(self, position: Any, iteration: int) -> Any:
        """``position`` validated, or None (logged and counted) if it is refused."""
        try:
            return validate_data_position(position)
        except ValueError as exc:
            with self._lock:
                self._drop("bad_data_position")
                self._bad_positions += 1
                first = self._bad_positions == 1
            (logger.error if first else logger.debug)(
                "shadow %s: data position of iteration %d refused (%d so far; its position is unknown): %s",
                self.name,
                iteration,
                self._bad_positions,
                exc,
            )
            return None

    def _on_commit(self, message: Commit) -> None:
        now = time.monotonic()
        sets_position = message.data_position is not None
        position = self._checked_position(message.data_position, message.iteration) if sets_position else None
        with self._lock:
            job = self._job
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
            if message.iteration <= self._applied:
                self._drop("stale_commit")
                return
            self._commits[message.iteration] = CommitEntry(
                record,
                now,
                message.optimizer_step,
                sets_position,
                position,
                job_state=message.job_state,
                fingerprint=message.fingerprint,
                gradient_digests=message.gradient_digests,
            )
            self._latest_commit = max(self._latest_commit, message.iteration)
            epoch = self._epoch
            if epoch is not None:
                epoch.confirmed_through = max(epoch.confirmed_through, message.iteration)
                self._forget_unconfirmed(epoch)
                self._drain_stash()
            self._lock.notify_all()
        self._wake.set()  # the maintenance thread: repairs of this iteration may be due after the grace
