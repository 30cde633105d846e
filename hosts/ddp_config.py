"""A rank's Checkmate configuration: torchrun's and ``CHECKMATE_*`` variables, or a job file.

:meth:`CheckmateConfig.from_env` is what :func:`hosts.ddp.enable_checkmate` reads when it
is given no configuration; :func:`read_job_file` parses ``CHECKMATE_JOB_FILE`` (rank 0
re-reads it after every step to follow a live shadow move). Nothing here starts a thread
or takes a lock: a config is a frozen value, built on the training thread.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from checkmate.auth import JOB_FILE_ENV, SECRET_ENV, SECRET_FILE_ENV, AuthConfigError, secret_from_env
from checkmate.control import DEFAULT_CONTROL_PORT
from checkmate.fingerprint import DEFAULT_FINGERPRINT_BYTES
from checkmate.job import JobSpec
from checkmate.metrics import parse_metrics_port
from checkmate.wire import CHECKMATE_UDP_PORT
from hosts.faults import FaultConfig
from hosts.protection import ProtectionPolicy
from hosts.transport import Addr, datapath_from_env, resolve

logger = logging.getLogger(__name__)


class CheckmateConfigError(ValueError):
    """The environment or job file does not describe a usable Checkmate job."""


@dataclass(frozen=True)
class CheckmateConfig:
    """What one rank needs; :meth:`from_env` builds it from torchrun's and CHECKMATE_* variables."""

    job_id: int
    rank: int
    """This rank's place in its ring: the DDP process group's rank (with TP: the DP index)."""
    world_size: int
    """Ranks in the ring: the DDP process group's size (with TP: the DP degree)."""
    bind: Addr
    """This rank's data address (UDP)."""
    workers: tuple[Addr, ...] | None = None
    """Data addresses in ring order; None: gathered from every rank's ``bind``, in rank order."""
    job: JobSpec | None = None
    shadow_control: Mapping[str, Addr] = field(default_factory=dict)
    """Shadow name -> control-channel TCP address (used by rank 0 only)."""
    unnamed_shadows: frozenset[str] = frozenset()
    """Names of ``shadow_control`` made up here (``shadow<i>``: a ``CHECKMATE_SHADOWS`` entry
    without ``NAME=``). Rank 0 refuses a shadow whose hello names another node than the name it
    was given; it cannot check these."""
    timeout: float = 300.0
    peer_timeout: float = 30.0
    keep_iterations: int = 4
    shadow_connect_timeout: float = 2.0
    faults: FaultConfig = field(default_factory=FaultConfig)
    datapath: str = "native"
    """The transport's data path (``CHECKMATE_TRANSPORT``): ``"native"`` (compiled; the Python one
    with a warning where it did not build) or ``"python"`` (:class:`hosts.transport.TransportConfig`)."""
    replication: str = "switch"
    """Who copies the reduced chunks to the shadows (``CHECKMATE_REPLICATION``): ``"switch"``
    (the tagged packets, REPLICATE set) or ``"host"`` (no switch: the chunk's owner sends an
    untagged copy to the shadow itself, :meth:`shadow_data_address`; for comparison)."""
    start_iteration: int = 0
    """The job's number for the first all-reduce of this process: 0 for a new job, ``t`` for a
    job resumed from a checkpoint of iteration ``t - 1`` (the shadows' snapshots and certificates
    are named by the job's iteration numbers, so a restart must keep them)."""
    optimizer_step: int = 0
    """Optimizer steps taken before ``start_iteration`` (the restored state's step count)."""
    job_file: str | None = None
    """The ``CHECKMATE_JOB_FILE`` this came from. Rank 0 re-reads it when it changes and follows a
    new shard map (``checkmate-ctl shadow move``): links to shadows that left close, links to new
    ones open and get the current state. A change of job id or workers needs a restart."""
    compress: str | None = None
    """All-reduce fp32 buckets in ``"bf16"`` or ``"fp16"`` (``CHECKMATE_COMPRESS``), like DDP's
    ``bf16_compress_hook``/``fp16_compress_hook`` (which cannot be combined with Checkmate's hook:
    it is the all-reduce). The shadows get the compressed result and widen it exactly as the
    workers do. None: buckets travel in their own dtype."""
    fingerprint_every: int | None = None
    """Rank 0 sends a fingerprint of its state (:mod:`checkmate.fingerprint`) with every K-th
    commit (``CHECKMATE_FINGERPRINT_EVERY``; 0: never); a shadow whose state differs says so
    within K iterations, withdraws its certification and is re-seeded. None: 1 when every
    parameter is on the CPU, 0 otherwise (CPU replay is not bit-identical to GPU kernels)."""
    fingerprint_bytes: int = DEFAULT_FINGERPRINT_BYTES
    """Parameter bytes one fingerprint covers (``CHECKMATE_FINGERPRINT_BYTES``; default 32 MiB; 0:
    the whole state every time). A model within it is fingerprinted whole; a larger one in turns
    (:class:`checkmate.fingerprint.FingerprintTurns`: consecutive groups of parameters of at most
    this many bytes, with their optimizer state), so every parameter is compared once every
    ``groups`` fingerprints: a divergence is seen within ``K * groups`` iterations instead of K,
    and a fingerprint costs a bounded pass instead of one over the whole state. The trade is in
    docs/benchmarks.md ("The fingerprint takes turns")."""
    metrics_port: int | None = None
    """Rank 0 serves Prometheus metrics on this TCP port (``CHECKMATE_METRICS_PORT``;
    hosts/metrics.py, docs/metrics.md). A port in use is logged; training goes on without."""
    tp_degree: int = 1
    """Tensor-parallel degree (``CHECKMATE_TP_DEGREE``). With TP x DP each TP index's DP group is
    its own Checkmate lane: job ``job_id`` (``CHECKMATE_JOB_ID`` + TP index), its own ring, rank 0
    and shadows, carrying that TP shard of the gradients (docs/checkpoint-format.md)."""
    tp_index: int = 0
    """This rank's TP index: its lane (``RANK % tp_degree``, the ``("dp", "tp")`` mesh order)."""
    shadow_data_ports: Mapping[str, int] = field(default_factory=dict)
    """Shadow name -> the UDP port it receives copies on, as the shadow itself said
    (:func:`ask_shadow_data_ports`; host replication). A shadow not here: the job's shadow port."""
    protection: ProtectionPolicy = field(default_factory=ProtectionPolicy)
    """Bounded lag and what an unprotected job does (``CHECKMATE_MAX_LAG``, ``CHECKMATE_ON_LAG``,
    ``CHECKMATE_UNPROTECTED``, ``CHECKMATE_CERTIFY_TIMEOUT``; :mod:`hosts.protection`)."""
    secret: bytes | None = field(default=None, repr=False, compare=False)
    """The job secret (:mod:`checkmate.auth`), read once by the entry point: :meth:`from_env` from
    ``CHECKMATE_JOB_SECRET``, ``CHECKMATE_JOB_SECRET_FILE`` or the job file; for a configuration
    built without one, :func:`hosts.enable_checkmate` reads this process's. The agent hands it to
    its transport, its shadow links and its gradient tags; nothing below reads the environment."""

    def __post_init__(self) -> None:
        if self.protection.on_lag == "wait" and self.protection.max_lag > self.keep_iterations:
            raise CheckmateConfigError(
                f"max_lag {self.protection.max_lag} exceeds keep_iterations {self.keep_iterations}: the "
                "workers keep only that many iterations for the shadows' repairs, so a shadow further "
                "behind could not be repaired"
            )
        if self.compress not in COMPRESSION:
            raise CheckmateConfigError(f"compress={self.compress!r}: expected 'bf16', 'fp16' or None")
        if self.fingerprint_every is not None and self.fingerprint_every < 0:
            raise CheckmateConfigError(f"fingerprint_every ({self.fingerprint_every}) must not be negative")
        if self.fingerprint_bytes < 0:
            raise CheckmateConfigError(f"fingerprint_bytes ({self.fingerprint_bytes}) must not be negative")
        if self.tp_degree < 1 or not 0 <= self.tp_index < self.tp_degree:
            raise CheckmateConfigError(
                f"tp_index {self.tp_index} / tp_degree {self.tp_degree}: need 0 <= tp_index < tp_degree"
            )
        if self.job is not None and (self.job.tp_degree, self.job.tp_index) != (
            self.tp_degree,
            self.tp_index,
        ):
            raise CheckmateConfigError(
                f"job {self.job.job_id} is TP index {self.job.tp_index} of {self.job.tp_degree}, "
                f"but this rank is TP index {self.tp_index} of {self.tp_degree} (CHECKMATE_TP_DEGREE, RANK)"
            )
        if self.start_iteration < 0 or self.optimizer_step < 0:
            raise CheckmateConfigError(
                f"start_iteration ({self.start_iteration}) and optimizer_step ({self.optimizer_step}) "
                "must not be negative"
            )

    def shard_key_for_bucket(self, bucket_id: int) -> int:
        if self.job is not None:
            return self.job.shard_key_for_bucket(bucket_id)
        return bucket_id % max(1, len(self.shadow_control))

    def shadow_data_address(self, shard_key: int) -> Addr | None:
        """Where the shadow owning ``shard_key`` receives copies: its host, the job's shadow port."""
        if self.job is not None:
            name = self.job.shard_to_shadow.get(shard_key)
            port = self.job.shadow_port
        else:
            names = list(self.shadow_control)
            name = names[shard_key] if 0 <= shard_key < len(names) else None
            port = CHECKMATE_UDP_PORT
        control = self.shadow_control.get(name) if name is not None else None
        if control is None or name is None:
            return None
        return (control[0], self.shadow_data_ports.get(name, port))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CheckmateConfig:
        """Read the configuration.

        ``RANK``/``WORLD_SIZE`` (torchrun; else the default process group),
        ``CHECKMATE_JOB_FILE`` (JSON: ``{"job": <JobSpec>, "worker_addresses":
        ["ip[:port]", ...] in ring order, "shadow_control": {"name":
        "ip[:port]"}}``), or: ``CHECKMATE_JOB_ID`` (default 1),
        ``CHECKMATE_BIND`` (``ip[:port]``; default ``127.0.0.(10+RANK)`` when
        ``MASTER_ADDR`` is a loopback address), ``CHECKMATE_SHADOWS``
        (``name=ip:port,...`` or ``ip:port,...``), ``CHECKMATE_TIMEOUT``,
        ``CHECKMATE_PEER_TIMEOUT``, ``CHECKMATE_START_ITERATION`` and
        ``CHECKMATE_OPTIMIZER_STEP`` (a resumed job; see :func:`enable_checkmate`),
        and for tests ``CHECKMATE_LOSS`` (a send drop fraction) with ``CHECKMATE_FAULT_SEED``.

        Tensor parallelism: ``CHECKMATE_TP_DEGREE`` = T > 1 makes each TP index t (``RANK % T``,
        the ``("dp", "tp")`` device mesh's order) its own lane: ring rank ``RANK // T`` of
        ``WORLD_SIZE // T``, job id ``CHECKMATE_JOB_ID + t``, shadows ``CHECKMATE_SHADOWS_TP<t>``
        (else ``CHECKMATE_SHADOWS``), and ``{tp_index}`` in ``CHECKMATE_JOB_FILE`` becomes t.
        """
        env = os.environ if environ is None else environ
        try:
            rank = int(env["RANK"]) if "RANK" in env else dist.get_rank()
            world = int(env["WORLD_SIZE"]) if "WORLD_SIZE" in env else dist.get_world_size()
        except (ValueError, RuntimeError) as exc:
            raise CheckmateConfigError(f"cannot tell this process's rank: {exc}") from None
        global_rank = rank
        tp = _int_env(env, "CHECKMATE_TP_DEGREE", 1)
        if tp < 1 or world % tp:
            raise CheckmateConfigError(f"CHECKMATE_TP_DEGREE={tp} does not divide WORLD_SIZE {world}")
        tp_index, rank, world = rank % tp, rank // tp, world // tp
        job: JobSpec | None = None
        workers: tuple[Addr, ...] | None = None
        shadows: dict[str, Addr] = {}
        job_id = _int_env(env, "CHECKMATE_JOB_ID", 1) + tp_index
        job_file = env.get("CHECKMATE_JOB_FILE")
        if job_file is not None:
            job_file = job_file.replace("{tp_index}", str(tp_index))
            job, workers, shadows = read_job_file(job_file)
            job_id = job.job_id
            if len(workers) != world:
                raise CheckmateConfigError(
                    f"{job_file} lists {len(workers)} workers but WORLD_SIZE is {world}"
                    + (f" / CHECKMATE_TP_DEGREE {tp}" if tp > 1 else "")
                )
        listed = env.get(f"CHECKMATE_SHADOWS_TP{tp_index}") if tp > 1 else None
        unnamed: set[str] = set()
        for i, item in enumerate(filter(None, (listed or env.get("CHECKMATE_SHADOWS", "")).split(","))):
            name, _, address = item.rpartition("=")
            if not name:
                name = f"shadow{i}"
                unnamed.add(name)
            shadows[name] = resolve(address, DEFAULT_CONTROL_PORT)
        if "CHECKMATE_BIND" in env:
            bind = resolve(env["CHECKMATE_BIND"])
        elif workers is not None:
            bind = workers[rank]
        else:
            master = env.get("MASTER_ADDR", "127.0.0.1")
            try:
                loopback = ipaddress.ip_address(resolve(master)[0]).is_loopback
            except (OSError, ValueError):
                loopback = False
            if not loopback:
                raise CheckmateConfigError(
                    "set CHECKMATE_BIND (this rank's data address) or CHECKMATE_JOB_FILE: "
                    f"MASTER_ADDR {master} is not a loopback address, so 127.0.0.(10+rank) will not do"
                )
            bind = (f"127.0.0.{10 + global_rank}", CHECKMATE_UDP_PORT)
        faults = FaultConfig(
            seed=int(env.get("CHECKMATE_FAULT_SEED", "0")) * 1000 + global_rank,
            send_drop=float(env.get("CHECKMATE_LOSS", "0")),
        )
        return cls(
            job_id=job_id,
            rank=rank,
            world_size=world,
            bind=bind,
            workers=workers,
            job=job,
            shadow_control=shadows,
            unnamed_shadows=frozenset(unnamed),
            timeout=float(env.get("CHECKMATE_TIMEOUT", "300")),
            peer_timeout=float(env.get("CHECKMATE_PEER_TIMEOUT", "30")),
            faults=faults,
            datapath=_datapath_env(env),
            replication=_replication_mode(env.get("CHECKMATE_REPLICATION", "switch")),
            start_iteration=_int_env(env, "CHECKMATE_START_ITERATION", 0),
            optimizer_step=_int_env(env, "CHECKMATE_OPTIMIZER_STEP", 0),
            job_file=job_file,
            fingerprint_every=(
                _int_env(env, "CHECKMATE_FINGERPRINT_EVERY", 0)
                if env.get("CHECKMATE_FINGERPRINT_EVERY")
                else None
            ),
            fingerprint_bytes=_int_env(env, "CHECKMATE_FINGERPRINT_BYTES", DEFAULT_FINGERPRINT_BYTES),
            compress=env.get("CHECKMATE_COMPRESS") or None,
            metrics_port=_metrics_port_env(env),
            tp_degree=tp,
            tp_index=tp_index,
            protection=_protection_env(env),
            secret=_secret_env(env),
        )


@dataclass(frozen=True)
class ResumeConfig:
    """What :func:`hosts.resume` takes from the environment when its caller does not give it (built
    once, at that entry point, by :meth:`from_env`; the shadows' addresses are :class:`CheckmateConfig`'s)."""

    job_id: int = 1
    """The first lane's job id (``CHECKMATE_JOB_ID``, default 1); lane t is ``job_id + t``."""
    tp_degree: int = 1
    """``CHECKMATE_TP_DEGREE`` (default 1: no tensor parallelism)."""
    snapshot_dir: str | None = None
    """``CHECKMATE_SNAPSHOT_DIR``: the shadows' snapshot directory (None: unset)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ResumeConfig:
        """Read ``CHECKMATE_JOB_ID``, ``CHECKMATE_TP_DEGREE`` and ``CHECKMATE_SNAPSHOT_DIR`` (no rank
        needed); CheckmateConfigError naming a variable that is not an integer."""
        env = os.environ if environ is None else environ
        return cls(
            job_id=_int_env(env, "CHECKMATE_JOB_ID", 1),
            tp_degree=_int_env(env, "CHECKMATE_TP_DEGREE", 1),
            snapshot_dir=env.get("CHECKMATE_SNAPSHOT_DIR") or None,
        )


def _protection_env(env: Mapping[str, str]) -> ProtectionPolicy:
    """``CHECKMATE_MAX_LAG`` (default 2), ``CHECKMATE_ON_LAG`` (wait|continue), ``CHECKMATE_UNPROTECTED``
    (raise|log), ``CHECKMATE_CERTIFY_TIMEOUT`` (seconds, default 120)."""
    default = ProtectionPolicy()
    try:
        return ProtectionPolicy(
            max_lag=_int_env(env, "CHECKMATE_MAX_LAG", default.max_lag),
            on_lag=env.get("CHECKMATE_ON_LAG") or default.on_lag,
            unprotected=env.get("CHECKMATE_UNPROTECTED") or default.unprotected,
            certify_timeout=float(env.get("CHECKMATE_CERTIFY_TIMEOUT") or default.certify_timeout),
        )
    except ValueError as exc:
        raise CheckmateConfigError(f"protection policy (CHECKMATE_MAX_LAG, ...): {exc}") from None


def _secret_env(env: Mapping[str, str]) -> bytes | None:
    """The job secret ``env`` gives (:func:`checkmate.auth.secret_from_env`), or None when it gives
    none that will do: :func:`hosts.enable_checkmate` then reads this process's, and raises its error."""
    if not any(env.get(name) for name in (SECRET_ENV, SECRET_FILE_ENV, JOB_FILE_ENV)):
        return None
    try:
        return secret_from_env(env)
    except AuthConfigError:
        return None


def ask_shadow_data_ports(
    shadow_control: Mapping[str, Addr], job_id: int, timeout: float, secret: bytes | None = None
) -> dict[str, int]:
    """Each shadow's data port, from its status (host replication sends its copies there, whatever
    ``checkmate-shadow --data`` was given). A shadow that does not answer is left out (logged).
    ``secret``: the job's (the agent passes its configuration's)."""
    from checkmate.control import ShadowStatusError, query_status
    from checkmate.control_frame import process_auth

    auth = process_auth(secret)
    ports: dict[str, int] = {}
    for name, address in shadow_control.items():
        try:
            status = query_status(address, timeout, job_id, auth)
            ports[name] = int(status["data_address"][1])
        except (ShadowStatusError, OSError, KeyError, TypeError, ValueError, IndexError) as exc:
            logger.warning(
                "checkmate: could not ask shadow %s at %s:%d for its data port (%s): host replication "
                "sends its copies to the job's shadow port",
                name,
                *address,
                exc,
            )
    return ports


def _metrics_port_env(env: Mapping[str, str]) -> int | None:
    try:
        return parse_metrics_port(env.get("CHECKMATE_METRICS_PORT"), "CHECKMATE_METRICS_PORT")
    except ValueError as exc:
        raise CheckmateConfigError(str(exc)) from None


def read_job_file(path: str) -> tuple[JobSpec, tuple[Addr, ...], dict[str, Addr]]:
    """``CHECKMATE_JOB_FILE``: (job, worker data addresses in ring order, shadow control addresses).

    Raises CheckmateConfigError naming the file and the problem.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        job = JobSpec.from_json(data["job"])
        workers = tuple(resolve(a) for a in data.get("worker_addresses", list(job.workers)))
        shadows = {
            str(name): resolve(a, DEFAULT_CONTROL_PORT) for name, a in data.get("shadow_control", {}).items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckmateConfigError(f"cannot read CHECKMATE_JOB_FILE {path}: {exc}") from None
    return job, workers, shadows


REPLICATION_MODES = ("switch", "host")
COMPRESSION: dict[str | None, torch.dtype | None] = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def _fingerprint_every(configured: int | None, module: torch.nn.Module) -> int:
    """K: ``configured``, else 1 with every parameter on the CPU and 0 (off) otherwise.

    The shadows replay on CPU: bit for bit what CPU workers compute, not what GPU kernels
    do, so with GPU parameters every check would find a (last-bit) divergence.
    """
    if configured is not None:
        return configured
    devices = sorted({p.device.type for p in module.parameters()} - {"cpu"})
    if devices:
        logger.warning(
            "checkmate: parameters on %s: the shadows replay the step on CPU, which is not bit-identical "
            "to %s kernels, so the divergence check is off (set CHECKMATE_FINGERPRINT_EVERY to turn it on)",
            ", ".join(devices),
            ", ".join(devices),
        )
        return 0
    return 1


def _file_stamp(path: str | None) -> tuple[int, int, int] | None:
    """(inode, size, mtime) of ``path``, or None: cheap enough to look at once per iteration."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _datapath_env(env: Mapping[str, str]) -> str:
    try:
        return datapath_from_env(env)
    except ValueError as exc:
        raise CheckmateConfigError(str(exc)) from None


def _replication_mode(mode: str) -> str:
    if mode not in REPLICATION_MODES:
        raise CheckmateConfigError(f"CHECKMATE_REPLICATION={mode!r}: expected one of {REPLICATION_MODES}")
    return mode


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise CheckmateConfigError(f"{name}={text!r} is not an integer") from None
