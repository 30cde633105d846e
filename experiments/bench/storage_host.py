"""The bench's storage host: an NFS server in its own namespace, its link shaped to a cited ratio.

Clusters write checkpoints to remote storage shared by every node, over a link far slower
than the GPUs' fabric; ``make bench --storage remote`` puts the peers' checkpoints (and the
Checkmate shadows' snapshots) there too (issue 27, item 2):

* **the host**: ``st1``, a plain host (role ``host``) on its own switch port of the emulated
  topology (:func:`with_storage_host`), so the storage traffic crosses the same emulated switch
  as the all-reduce, as on a cluster whose storage shares the fabric;
* **the server**: nfs-ganesha (Debian's ``nfs-ganesha`` + ``nfs-ganesha-vfs``, installed by
  ``make setup``), a userspace NFS server, serving NFSv3 over TCP on fixed ports (the client,
  :mod:`checkmate.nfs`, is libnfs 4.0, whose NFSv4 does not work; no NLM, no UDP), exporting a
  directory of the run as ``/checkpoints`` through its VFS backend, started inside the host's
  namespaces with an rpcbind of its own (:class:`NFSServer`: ready when its log says so,
  stopped with its process group);
* **the link**: a token bucket (``tc qdisc ... tbf``; this kernel has no netem) on both ends of
  the storage host's link (:func:`shape_link`), at the rate :func:`cited_rate` derives from a
  named configuration of :mod:`controller.named_clusters`.

The ratio kept is the one checkpoint overhead depends on: **the time to write one checkpoint
over the time of one all-reduce of the gradients**. On ``llama3-405b`` (every figure cited
there): 4.86 TB written at 2 TB/s take 2.43 s, and a ring all-reduce of one GPU's 12.7 GB of
fp32 gradients over 128 data-parallel ranks at 400 Gb/s takes 0.50 s: 4.84 all-reduces per
checkpoint write. The bench's own all-reduce time follows from the fabric's bus bandwidth
measured at the start of the run (:mod:`experiments.bench.emulation`), and the storage rate is
the one at which a checkpoint (12 bytes per parameter against the gradients' 4) takes 4.84 of
them: ``rate = (12 / 4) * busbw * n / (2 (n - 1)) / ratio``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

STORAGE_HOST = "st1"
STORAGE_IP = "10.0.8.1"
STORAGE_MAC = "08:00:00:00:08:01"
EXPORT_PSEUDO = "/checkpoints"
"""The export's path (ganesha's pseudo path, mounted by it): URLs are nfs://10.0.8.1/checkpoints/..."""
SHADOW_SNAPSHOTS = "shadows"
"""Where on the export the shadows persist their snapshots (the peers write under their system's name)."""
DEFAULT_CLUSTER = "llama3-405b"
"""The configuration whose write-to-all-reduce ratio shapes the link (its figures are cited)."""
GANESHA = "ganesha.nfsd"
NFS_PORT = 2049
MOUNT_PORT = 20048
"""Fixed ports: the client names them (libnfs's nfsport/mountport), so no rpcbind is needed."""
READY_LINE = "NFS SERVER INITIALIZED"
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0
TC_TIMEOUT_S = 10.0
GRAD_BYTES_PER_PARAMETER = 4
"""fp32 gradients, as the bench's workers all-reduce them."""


class StorageHostError(RuntimeError):
    """The storage host could not be started, shaped or reached; the message says why."""


def with_storage_host(topology: Mapping[str, Any]) -> dict[str, Any]:
    """``topology`` plus the storage host ``st1`` on the first switch's next free port."""
    data: dict[str, Any] = json.loads(json.dumps(topology))
    if STORAGE_HOST in data["hosts"]:
        return data
    switch = next(iter(data["switches"]))
    ports = [
        int(str(end).rsplit("-p", 1)[1]) for link in data["links"] for end in link[:2] if "-p" in str(end)
    ]
    data["hosts"][STORAGE_HOST] = {"ip": f"{STORAGE_IP}/8", "mac": STORAGE_MAC, "role": "host"}
    data["links"].append([STORAGE_HOST, f"{switch}-p{max(ports, default=0) + 1}"])
    return data


def storage_url(subpath: str = "") -> str:
    """The URL of ``subpath`` on the storage host's export."""
    return f"nfs://{STORAGE_IP}{EXPORT_PSEUDO}/{subpath.strip('/')}".rstrip("/")


# ---- the cited rate ----------------------------------------------------------------------------
@dataclass(frozen=True)
class CitedRate:
    """The storage link's rate and the configuration figures it comes from."""

    cluster: str
    write_s: float
    """One checkpoint written on the cluster (controller.cluster_model.write_seconds)."""
    allreduce_s: float
    """One ring all-reduce of a GPU's gradients on the cluster's NICs."""
    fabric_busbw_MBps: float
    workers: int
    state_per_gradient_byte: float
    rate_MBps: float

    @property
    def ratio(self) -> float:
        return self.write_s / self.allreduce_s

    @property
    def rate_mbit(self) -> float:
        return self.rate_MBps * 8

    def describe(self) -> str:
        return (
            f"{self.cluster}: a checkpoint write takes {self.ratio:.2f} all-reduces of the gradients "
            f"({self.write_s:.2f} s / {self.allreduce_s:.3f} s, controller/cluster_model.py); at the "
            f"fabric's measured {self.fabric_busbw_MBps:.1f} MB/s busbw ({self.workers} ranks) the storage "
            f"link gets {self.rate_MBps:.1f} MB/s ({self.rate_mbit:.0f} Mbit/s)"
        )


def cited_rate(fabric_busbw_MBps: float, workers: int, cluster: str = DEFAULT_CLUSTER) -> CitedRate:
    """The storage rate that keeps ``cluster``'s write-to-all-reduce time ratio on this fabric."""
    from controller.capacity_inputs import GRAD_DTYPE_BYTES
    from controller.cluster_model import write_seconds
    from controller.named_clusters import named
    from experiments.bench.emulation import ADAMW_BYTES_PER_PARAMETER

    if not fabric_busbw_MBps or fabric_busbw_MBps <= 0:
        raise StorageHostError(
            f"the storage link needs the fabric's measured busbw, got {fabric_busbw_MBps!r}"
        )
    if workers < 2:
        raise StorageHostError(f"an all-reduce needs at least 2 workers, got {workers}")
    config = named(cluster)
    config.validate()
    gradient_bytes = config.model_params / config.model_parallel * GRAD_DTYPE_BYTES[config.grad_dtype]
    allreduce_s = 2 * (config.dp - 1) / config.dp * gradient_bytes / (config.nic_gbps * 1e9 / 8)
    write_s = write_seconds(config)
    state_per_gradient = ADAMW_BYTES_PER_PARAMETER / GRAD_BYTES_PER_PARAMETER
    bench_allreduce_per_byte = 2 * (workers - 1) / workers / fabric_busbw_MBps
    rate = state_per_gradient / ((write_s / allreduce_s) * bench_allreduce_per_byte)
    return CitedRate(cluster, write_s, allreduce_s, fabric_busbw_MBps, workers, state_per_gradient, rate)


# ---- shaping --------------------------------------------------------------------------------------
def tbf_command(interface: str, rate_mbit: float) -> list[str]:
    """``tc`` replacing ``interface``'s root qdisc with a token bucket at ``rate_mbit``."""
    if rate_mbit <= 0:
        raise StorageHostError(f"a storage link rate must be positive, got {rate_mbit} Mbit/s")
    # burst: at least one jumbo frame and 10 ms at the rate; queue: 100 ms at the rate
    burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.01))
    return ["tc", "qdisc", "replace", "dev", interface, "root", "tbf", "rate", f"{rate_mbit:.3f}mbit",
            "burst", str(burst), "latency", "100ms"]  # fmt: skip


def run_tc(argv: Sequence[str]) -> None:
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=TC_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StorageHostError(f"`{' '.join(argv)}`: {exc}") from None
    if result.returncode != 0:
        raise StorageHostError(f"`{' '.join(argv)}` failed: {(result.stderr or result.stdout).strip()}")


def shape_link(ends: Sequence[tuple[Sequence[str], str]], rate_mbit: float) -> None:
    """A token bucket at ``rate_mbit`` on each (namespace prefix, interface) end of a link."""
    for prefix, interface in ends:
        run_tc([*prefix, *tbf_command(interface, rate_mbit)])
    logger.info("storage link shaped to %.1f Mbit/s (tbf) on %s", rate_mbit, [i for _, i in ends])


# ---- the server ---------------------------------------------------------------------------------
def ganesha_config(export_dir: Path, state_dir: Path) -> str:
    """nfs-ganesha's configuration: NFSv3 over TCP on fixed ports, no grace period, one VFS export."""
    return f"""NFS_CORE_PARAM {{
    Protocols = 3;
    NFS_Port = {NFS_PORT};
    MNT_Port = {MOUNT_PORT};
    Enable_UDP = false;
    Enable_NLM = false;
    Enable_RQUOTA = false;
    Mount_Path_Pseudo = true;
}}
NFSV4 {{
    Graceless = true;
    RecoveryBackend = fs;
    RecoveryRoot = "{state_dir / "recovery"}";
}}
EXPORT {{
    Export_Id = 1;
    Path = "{export_dir}";
    Pseudo = "{EXPORT_PSEUDO}";
    Protocols = 3;
    Transports = TCP;
    Access_Type = RW;
    Squash = No_Root_Squash;
    SecType = sys;
    FSAL {{ Name = VFS; }}
}}
LOG {{
    Default_Log_Level = EVENT;
}}
"""


def ganesha_missing() -> str | None:
    """None when nfs-ganesha, its VFS backend and rpcbind are installed, else what is missing."""
    if shutil.which(GANESHA) is None:
        return f"{GANESHA} is not installed (make setup installs nfs-ganesha and nfs-ganesha-vfs)"
    if shutil.which("rpcbind") is None:
        return "rpcbind is not installed (make setup installs it; nfs-ganesha's NFSv3 registers with it)"
    if not any(
        Path(d).glob("libfsalvfs*") for d in ("/usr/lib/x86_64-linux-gnu/ganesha", "/usr/lib/ganesha")
    ):
        return "nfs-ganesha's VFS backend (libfsalvfs) is not installed (make setup installs nfs-ganesha-vfs)"
    return None


_WITH_RPCBIND = """set -e
mount -t tmpfs -o size=16m,mode=0755 checkmate-storage-run /run
mkdir -p /run/rpcbind
rpcbind -f &
for _ in $(seq 100); do [ -S /run/rpcbind.sock ] && break; sleep 0.05; done
exec "$@"
"""
"""ganesha's NFSv3 registers with rpcbind over /run/rpcbind.sock, a path every namespace shares: each
server gets its own rpcbind on a private /run (a mount namespace of its own), started first."""


class NFSServer:
    """nfs-ganesha serving ``export_dir`` from the namespaces ``prefix`` enters; a context manager."""

    def __init__(self, export_dir: Path, state_dir: Path, prefix: Sequence[str] = ()) -> None:
        self.export_dir, self.state_dir, self.prefix = export_dir, state_dir, tuple(prefix)
        self.log_file = state_dir / "ganesha.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._output: IO[bytes] | None = None

    def __enter__(self) -> NFSServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start ganesha; return once it serves (StorageHostError with its log's tail if it does not)."""
        missing = ganesha_missing()
        if missing:
            raise StorageHostError(missing)
        self.export_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "recovery").mkdir(parents=True, exist_ok=True)
        config = self.state_dir / "ganesha.conf"
        config.write_text(ganesha_config(self.export_dir, self.state_dir))
        self.log_file.unlink(missing_ok=True)
        ganesha = [GANESHA, "-F", "-L", str(self.log_file), "-f", str(config),
                   "-p", str(self.state_dir / "ganesha.pid"), "-N", "NIV_EVENT"]  # fmt: skip
        private_run = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _WITH_RPCBIND, "sh"]
        argv = [*self.prefix, *private_run, *ganesha]
        self._output = open(self.state_dir / "ganesha.out", "wb")  # noqa: SIM115 - closed in stop()
        try:
            self._process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=self._output, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        except OSError as exc:
            self.stop()
            raise StorageHostError(f"cannot start {GANESHA}: {exc}") from None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if READY_LINE in self._log():
                logger.info("nfs-ganesha serves %s as %s (pid %d)", self.export_dir, EXPORT_PSEUDO, self.pid)
                return
            if self._process.poll() is not None:
                break
            time.sleep(0.2)
        code = self._process.poll()
        self.stop()
        why = f"exited with {code}" if code is not None else f"not serving within {timeout:.0f} s"
        raise StorageHostError(f"{GANESHA} {why}; its log:\n{self._log()[-3000:]}")

    @property
    def pid(self) -> int:
        return self._process.pid if self._process is not None else -1

    def _log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""

    def pause(self) -> None:
        """Stop answering (SIGSTOP): the server is there but silent, as an overloaded one."""
        if self._process is not None:
            os.killpg(self._process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self._process is not None:
            os.killpg(self._process.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM ganesha's process group, SIGKILL after a grace period; idempotent."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            for signum in (signal.SIGCONT, signal.SIGTERM):
                try:
                    os.killpg(process.pid, signum)
                except ProcessLookupError:
                    break
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait(timeout=STOP_GRACE_S)
        if self._output is not None:
            self._output.close()
            self._output = None


def host_prefix(net_dir: Path, host: str = STORAGE_HOST) -> tuple[str, ...]:
    """The argv prefix that runs a command in ``host``'s namespaces of the network in ``net_dir``."""
    from experiments.commands import NET

    return (*NET, "exec", "--run-dir", str(net_dir), host, "--")


def switch_end(network: Any, host: str = STORAGE_HOST) -> str:
    """The switch-side interface of ``host``'s link (named after the link end, in the root namespace)."""
    for link in network.links:
        ends = (link.a, link.b)
        for mine, other in (ends, ends[::-1]):
            if mine.node == host and other.port is not None:
                return str(other)
    raise StorageHostError(f"{host} has no link to a switch in the network")


class StorageHost:
    """The storage host of a bench network that is up: ganesha serving, its link shaped; ``stop`` undoes."""

    def __init__(self, net_dir: Path, network: Any, work_dir: Path) -> None:
        self.net_dir, self.network = net_dir, network
        self.export_dir = work_dir / "export"
        self.server = NFSServer(self.export_dir, work_dir / "server", host_prefix(net_dir))
        self.rate_mbit: float | None = None

    def start(self, rate_mbit: float) -> None:
        """Shape the link to ``rate_mbit`` both ways, then serve (StorageHostError; stops what it started)."""
        from topologies.hosts import HOST_INTERFACE

        shutil.rmtree(self.export_dir, ignore_errors=True)
        try:
            shape_link(
                [(host_prefix(self.net_dir), HOST_INTERFACE), ((), switch_end(self.network))], rate_mbit
            )
            self.server.start()
        except StorageHostError:
            self.stop()
            raise
        self.rate_mbit = rate_mbit

    def local_path(self, subpath: str) -> Path:
        """Where ``storage_url(subpath)`` lies on this machine's disk (the server's export directory)."""
        return self.export_dir / subpath.strip("/")

    def stop(self) -> None:
        self.server.stop()
