"""A shadow node: copies in, optimizer steps applied in order, certified per-iteration checkpoints out.

One :class:`ShadowNode` serves one job (docs/shadow.md). It is composed of a few
components, each owning its state, its thread (if any) and its lock, that talk through
typed methods (docs/architecture.md draws them):

* **receiver** (:class:`~shadow.node_receive.Receiver`, one UDP thread): the data socket;
  decodes copied datagrams and REPAIR_DATA/NACK answers and places them into the
  :class:`~shadow.iteration_window.IterationWindow` of the epoch in force, or stashes them
  raw until their iteration's commit fixes the layout; holds the commit records until
  their iteration is applied, the repair tracker, and why the shadow is blocked.
* **state service** (:class:`~shadow.node_service.StateService`, no thread): the shard's
  state (the epoch's optimizer, the iteration applied, data position, job state, the
  last verified iteration or a divergence); resume from this shadow's own snapshot at
  start; the restore answers (waiting for an iteration if asked).
* **applier** (:class:`~shadow.node_apply.Applier`, one thread): the next ready iteration
  stepped through the state service, the fingerprint check, certification (only of a
  state known to match the workers'), snapshot offers; owns the snapshotter.
* **control server** (:class:`~shadow.node_control.ControlServer`, a TCP listener and one
  thread per connection): rank 0's control channel (job_start, bucket_layout, commit)
  and, on the same port, status and restore requests.
* **control link** (:class:`~shadow.node_link.ControlLink`, no thread): the job rank 0
  announced, its connection, and the shadow's writes on it (certified, diverged, goodbye).
* **maintenance** (:class:`~shadow.node_maintenance.Maintenance`, one thread): repair
  requests and the status file.

Lock order: the control server's lock before the link's, the state service's and the
receiver's; no component calls another while holding its own lock otherwise (the drop
counter's lock is always taken last).

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
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from checkmate.auth import DatagramKeys, secret_or_env
from checkmate.control_frame import ControlAuth
from shadow.gradient_check import GradientCheck
from shadow.iteration_window import DropReason
from shadow.node_apply import Applier
from shadow.node_control import ControlServer
from shadow.node_link import ControlLink
from shadow.node_maintenance import Maintenance
from shadow.node_receive import Receiver
from shadow.node_service import StateService
from shadow.node_state import Addr, Drops, ShadowConfig
from shadow.snapshots import Snapshotter

__all__ = ["ShadowConfig", "ShadowNode", "serve"]  # ShadowConfig: what ShadowNode is made from

logger = logging.getLogger(__name__)


class ShadowNode:
    """One shadow of one job. ``start()``, then ``close()``; everything runs on its components' threads."""

    def __init__(self, config: ShadowConfig) -> None:
        self.config = config
        self.name = config.name
        secret = secret_or_env(config.secret, "ShadowNode")  # checkmate-shadow passes the one it read
        keys = DatagramKeys(secret)
        self._started = time.time()
        self._stop = threading.Event()
        self._drops = Drops()
        self._receiver = Receiver(config, self._drops, keys, self._stop)
        self._state = StateService(config, self._drops)
        self._link = ControlLink(config)
        self._maintenance = Maintenance(
            config,
            self._receiver,
            self._state,
            self._link,
            keys,
            self.status,
            self._stop,
            self._publish_status,
        )
        self._applier = Applier(
            config,
            self._receiver,
            self._state,
            self._link,
            GradientCheck(secret),
            self._maintenance.wake,
            self._stop,
        )
        self._control = ControlServer(
            config,
            ControlAuth(secret),
            self._drops,
            self._receiver,
            self._state,
            self._link,
            self._applier,
            self._maintenance.wake,
            self.status,
            self._stop,
        )
        self.data_address: Addr = self._receiver.address
        self.control_address: Addr = self._control.address
        if config.resume and config.snapshots is not None:
            resumed = self._state.resume(config.snapshots.directory)
            if resumed is not None:
                blocked = "resumed from a snapshot: waiting for rank 0's state to rejoin the job"
                self._receiver.install_resumed(resumed.job, resumed.epoch, blocked)
                self._link.resume(resumed.job)
                self._applier.resumed(resumed.step)
                self._control.resumed()

    def _publish_status(self, name: str, document: bytes) -> None:
        """The status document to the remote snapshot directory (the snapshotter's, when remote)."""
        snapshotter = self._applier.snapshotter
        if snapshotter is not None:
            snapshotter.publish_status(name, document)

    def start(self) -> ShadowNode:
        self._receiver.start()
        self._control.start()
        self._applier.start()
        self._maintenance.start()
        logger.info(
            "shadow %s: control %s:%d, copies %s:%d", self.name, *self.control_address, *self.data_address
        )
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._maintenance.wake()
        self._link.close()  # goodbye to rank 0
        self._receiver.join(timeout)
        self._control.join(timeout)
        self._applier.join(timeout)
        self._maintenance.join(timeout)
        self._state.close()  # its optimizer's apply threads
        self._maintenance.write_status()  # remote snapshots: the last status goes out with the writer
        self._applier.close(timeout)  # the snapshotter
        self._maintenance.write_status()
        self._receiver.close()
        self._control.close()

    def __enter__(self) -> ShadowNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def snapshotter(self) -> Snapshotter | None:
        return self._applier.snapshotter

    @property
    def applied_iteration(self) -> int:
        """The last iteration whose state this shadow holds (-1: none)."""
        return self._state.applied

    def wait_applied(self, iteration: int, timeout: float) -> bool:
        return self._state.wait_applied(iteration, timeout)

    def parameters(self) -> dict[str, torch.Tensor]:
        """Clones of the owned parameters (bucketed and static)."""
        return self._state.parameters()

    def optimizer_states(self) -> dict[str, dict[str, torch.Tensor]]:
        return self._state.optimizer_states()

    def snapshot_now(self, timeout: float = 30.0) -> int | None:
        """Write a snapshot of the current state and wait for it; the step written, or None."""
        return self._applier.snapshot_now(timeout)

    def waiting_restores(self) -> list[int]:
        """The iterations restore requests now wait for (the apply thread has not reached them)."""
        return self._state.waiting_restores()

    def on_datagram(self, data: memoryview, addr: Addr) -> DropReason | str | None:
        """Handle one datagram as the receive thread does (callable directly in tests and benchmarks)."""
        return self._receiver.on_datagram(data, addr)

    def status(self) -> dict[str, Any]:
        """The status document (``checkmate-shadow status``, the status file): each component's fields."""
        job = self._link.job()
        received = self._receiver.status()
        held = self._state.status()
        applied = held["applied_iteration"]
        if job is None:
            state = "waiting_for_job"
        elif not received["has_epoch"]:
            state = "waiting_for_layout"
        elif held["divergence"] is not None:
            state = "diverged"
        elif received["blocked"]:
            state = "stalled"
        else:
            state = "running"
        now = time.time()
        document: dict[str, Any] = {
            "shadow": self.name,
            "time": now,
            "uptime_seconds": round(now - self._started, 3),
            "job_id": job.job_id if job else None,
            "data_address": list(self.data_address),
            "state": state,
            "lag_iterations": max(0, received["latest_commit"] - applied) if job else None,
            "shard": {
                "keys": sorted(job.shard_keys) if job else [],
                "index": job.shard_index if job else None,
                "count": job.num_shards if job else None,
                "buckets": received.pop("buckets"),
                "parameters": held.pop("parameters"),
                "elements": held.pop("elements"),
            },
            "drops": self._drops.snapshot(),
        }
        del received["has_epoch"]
        document.update(received)
        document.update(held)
        document.update(self._applier.status(applied))
        document.update(self._control.status())
        document.update(self._link.status())
        return document


def serve(config: ShadowConfig, until: Callable[[], bool] | None = None) -> None:
    """Run a shadow until ``until()`` is true (default: forever, i.e. until interrupted)."""
    node = ShadowNode(config).start()
    try:
        while until is None or not until():
            time.sleep(0.5)
    finally:
        node.close()
