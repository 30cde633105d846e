"""A shadow node: copies in, optimizer steps applied in order, certified per-iteration checkpoints out.

One :class:`ShadowNode` serves one job (docs/shadow.md). It is assembled from one part
per thread or request type, each in its own module, over the state they share
(:class:`~shadow.node_state.NodeState`, with :class:`~shadow.node_state.ShadowConfig`):

* **receive** (:mod:`shadow.node_receive`, one UDP thread): decodes copied datagrams
  and REPAIR_DATA/NACK answers and places them into the
  :class:`~shadow.iteration_window.IterationWindow`, or stashes them raw until their
  iteration's commit fixes the layout. Takes ``_lock`` per datagram, briefly.
* **control** (:mod:`shadow.node_control`, a TCP listener and one thread per
  connection): rank 0's control channel (job_start, bucket_layout, commit; the shadow
  answers certified, diverged, goodbye) and, on the same port, status and restore
  requests. Takes ``_lock`` for job, epoch and commit bookkeeping, ``_state_lock``
  inside it to install a re-seeded epoch, ``_control_send`` for each write.
* **apply** (:mod:`shadow.node_apply`, one thread): the next ready iteration through
  :class:`~shadow.optimizer_apply.ShadowOptimizer`, the fingerprint check,
  certification (only of a state known to match the workers'), a snapshot offer.
  Takes ``_lock`` to pick and to advance, ``_state_lock`` to step; never both.
* **state service** (:mod:`shadow.node_service`): resume from this shadow's own
  snapshot at start, and the restore answers (waiting for an iteration if asked).
  Takes ``_state_lock``.
* **maintenance** (:mod:`shadow.node_maintenance`, one thread): repair requests and
  the status document and file. Takes ``_lock`` to plan and to read the status.

Lock order: ``_lock`` before ``_state_lock``; ``_control_send`` is taken alone.

Ownership and layout changes: the shadow owns the buckets whose shard key the
job maps to its name, and so the parameters in them. Every bucket layout
arrives right after a job_start carrying the state before the layout's first
iteration; the shadow re-seeds from it, so it never applies an update to a
parameter whose previous state it does not hold. A layout without that state
makes the shadow ask for it (goodbye; rank 0 reconnects and resends).

Data position: the workers' data position after each iteration (any JSON value,
``CheckmateAgent.set_data_position``) arrives in the commit record, or in a
job_start's ``extra`` for the state it seeds; a commit without one keeps the
previous iteration's. The shadow keeps the position with the applied state and
hands it out with it (restore answers, snapshots' ``extra``). A position that is
not strict JSON or is too large is refused (logged, counted as the drop
``bad_data_position``): the iteration is still applied, its position is unknown
(null) until a valid one arrives.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import torch

from checkmate.auth import DatagramKeys, secret_or_env
from checkmate.control import Goodbye, send_message
from checkmate.control_frame import ControlAuth
from checkmate.sockets import bind, create_server, grow_buffer
from shadow.gradient_check import GradientCheck
from shadow.node_apply import Applier
from shadow.node_control import ControlServer
from shadow.node_maintenance import Maintenance
from shadow.node_receive import Receiver
from shadow.node_service import StateService
from shadow.node_state import NodeStats, ShadowConfig
from shadow.snapshots import Snapshotter

__all__ = ["ShadowConfig", "ShadowNode", "serve"]  # ShadowConfig: what ShadowNode is made from

logger = logging.getLogger(__name__)


class ShadowNode(Receiver, ControlServer, Applier, StateService, Maintenance):
    """One shadow of one job. ``start()``, then ``close()``; everything runs on its own threads."""

    def __init__(self, config: ShadowConfig) -> None:
        self.config = config
        self.name = config.name
        self.stats = NodeStats()
        secret = secret_or_env(config.secret, "ShadowNode")  # checkmate-shadow passes the one it read
        self._control_auth = ControlAuth(secret)
        self._datagram_keys = DatagramKeys(secret)
        self._gradient_check = GradientCheck(secret)
        self._lock = threading.Condition(threading.RLock())
        self._state_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._job = None
        self._epoch = None
        self._generation = 0
        self._pending_start = None
        self._stash = {}
        self._stash_bytes = 0
        self._commits = {}
        self._latest_commit = -1
        self._latest_seen = -1
        self._applied = -1
        self._optimizer_step = 0
        self._data_position = None
        self._job_state = None
        self._bad_positions = 0
        self._certified = -1
        self._last_verified = -1
        self._diverged = None
        self._last_divergence = None
        self._retiring = set()
        self._blocked = None
        self._captures = {}
        self._repairs = None
        self._restored_from = None
        self._control_conn = None
        self._job_conn = None
        self._control_send = threading.Lock()
        self._started = time.time()
        self.snapshotter = Snapshotter(config.snapshots) if config.snapshots is not None else None
        self._last_snapshot_time = time.monotonic()

        self._udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        grow_buffer(self._udp, socket.SO_RCVBUF, config.recv_buffer_bytes)  # past rmem_max as root
        bind(self._udp, config.data_bind, f"shadow {self.name}'s data socket")
        self._udp.settimeout(0.1)
        self.data_address = self._udp.getsockname()
        self._tcp = create_server(config.control_bind, f"shadow {self.name}'s control socket")
        self._tcp.settimeout(0.1)
        self.control_address = self._tcp.getsockname()
        self._threads: list[threading.Thread] = []
        if config.resume and config.snapshots is not None:
            self._resume(config.snapshots.directory)

    def start(self) -> ShadowNode:
        for target, name in (
            (self._receive_loop, "rx"),
            (self._accept_loop, "ctl"),
            (self._apply_loop, "apply"),
            (self._maintenance_loop, "maint"),
        ):
            thread = threading.Thread(target=target, name=f"shadow-{self.name}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        logger.info(
            "shadow %s: control %s:%d, copies %s:%d", self.name, *self.control_address, *self.data_address
        )
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        with self._lock:
            self._lock.notify_all()
            conn, self._control_conn = self._control_conn, None
        if conn is not None:
            try:
                with self._control_send:
                    send_message(conn, Goodbye(self._job_id(), "shadow closing"), timeout=0.5)
            except OSError:
                pass
            conn.close()
        for thread in self._threads:
            thread.join(timeout)
        if self._epoch is not None:
            self._epoch.optimizer.close()  # its apply threads (an epoch replaced earlier: collected)
        if self.snapshotter is not None:
            self.snapshotter.close(timeout)
        self._write_status()
        self._udp.close()
        self._tcp.close()

    def __enter__(self) -> ShadowNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def applied_iteration(self) -> int:
        """The last iteration whose state this shadow holds (-1: none)."""
        return self._applied

    def wait_applied(self, iteration: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._applied < iteration:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.1))
            return True

    def parameters(self) -> dict[str, torch.Tensor]:
        """Clones of the owned parameters (bucketed and static)."""
        with self._state_lock:
            epoch = self._epoch
            if epoch is None:
                return {}
            out = {n: p.detach().clone() for n, p in epoch.optimizer.parameters.items()}
            out.update({n: t.clone() for n, t in epoch.static.items()})
            return out

    def optimizer_states(self) -> dict[str, dict[str, torch.Tensor]]:
        with self._state_lock:
            epoch = self._epoch
            if epoch is None:
                return {}
            return {
                n: {k: torch.as_tensor(v).clone() for k, v in epoch.optimizer.optimizer_state(n).items()}
                for n in epoch.optimizer.parameters
            }


def serve(config: ShadowConfig, until: Callable[[], bool] | None = None) -> None:
    """Run a shadow until ``until()`` is true (default: forever, i.e. until interrupted)."""
    node = ShadowNode(config).start()
    try:
        while until is None or not until():
            time.sleep(0.5)
    finally:
        node.close()
