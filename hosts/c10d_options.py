"""The ``checkmate`` backend's options: :class:`CheckmateBackendOptions` and where each default comes from.

Passed as ``init_process_group(..., pg_options=CheckmateBackendOptions(...))``; the creator
(:func:`hosts.c10d_backend.create_checkmate_backend`) fills every unset field from the environment
once (:meth:`CheckmateBackendOptions.resolved`). Re-exported by :mod:`hosts.c10d_backend`, the
public face.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from hosts.faults import FaultConfig
from hosts.transport import Addr, datapath_from_env, resolve

__all__ = ["BIND_ENV", "CheckmateBackendOptions"]

BIND_ENV = "CHECKMATE_BACKEND_BIND"
"""The environment variable naming this rank's transport address (``ip`` or ``ip:port``)."""


@dataclass(frozen=True)
class CheckmateBackendOptions:
    """Optional settings, passed as ``init_process_group(..., pg_options=CheckmateBackendOptions(...))``.

    Every field has an environment default, so a plain ``backend="checkmate"`` needs none: the
    creator (:func:`create_checkmate_backend`) fills the unset ones once (:meth:`resolved`).
    """

    bind: str | tuple[str, int] | None = None
    """This rank's transport address (``"ip"`` or ``"ip:port"``; port 0 or none: any free port).
    None: ``CHECKMATE_BACKEND_BIND``, else ``CHECKMATE_BIND``'s IP on a free port (the agent of
    :func:`hosts.enable_checkmate` keeps that address's own port), else the local IP that routes to
    ``MASTER_ADDR``."""
    job_id: int | None = None
    """The ring's job id (None: ``CHECKMATE_JOB_ID``, else 1); with ``tag=True`` the one the switch
    and shadows know."""
    secret: bytes | None = field(default=None, repr=False)
    """The job secret (None: the creator's :func:`checkmate.auth.secret_from_env`)."""
    tag: bool = False
    """Tag the all-reduce's fully reduced chunks (REPLICATE, switch mode) as the DDP hook's ring does."""
    datapath: str | None = None
    """``"native"`` or ``"python"`` (None: ``CHECKMATE_TRANSPORT``, default native)."""
    peer_timeout: float = 30.0
    """Seconds without acknowledgements, or without a heartbeat in the store while a collective waits
    (:mod:`hosts.c10d_liveness`), before a peer is declared dead (its collectives fail)."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    """Injected datagram loss, duplication, reordering (tests; :class:`hosts.faults.FaultConfig`)."""

    def resolved(self, env: Mapping[str, str], secret: bytes, world_size: int) -> CheckmateBackendOptions:
        """These options with every unset field taken from ``env`` (the creator's one read of the
        environment) and the job ``secret`` its entry point read; the bind address is looked up only
        for a group of more than one rank (a lone rank starts no transport)."""
        job_id = self.job_id if self.job_id is not None else int(env.get("CHECKMATE_JOB_ID", "1"))
        return dataclasses.replace(
            self,
            bind=self.bind if world_size == 1 else _bind_address(self.bind, env),
            job_id=job_id,
            secret=secret,
            datapath=self.datapath or datapath_from_env(env),
        )


def _local_address_towards(host: str) -> str:
    """The local IP the kernel routes to ``host`` from (no datagram is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return str(probe.getsockname()[0])


def _bind_address(bind: str | tuple[str, int] | None, env: Mapping[str, str]) -> Addr:
    """The transport's address: ``bind``, else ``env``'s ``CHECKMATE_BACKEND_BIND`` / ``CHECKMATE_BIND``'s IP,
    else the local IP routing to ``MASTER_ADDR`` (port 0: any free port)."""
    if bind is not None:
        return resolve(bind, default_port=0)
    if env.get(BIND_ENV):
        return resolve(env[BIND_ENV], default_port=0)
    if env.get("CHECKMATE_BIND"):
        return (resolve(env["CHECKMATE_BIND"])[0], 0)
    return (_local_address_towards(env.get("MASTER_ADDR", "127.0.0.1")), 0)
