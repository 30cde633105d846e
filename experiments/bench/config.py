"""What ``make bench`` can run: the systems, the workloads, and one benchmark run's configuration.

A :class:`System` is one way of training (and checkpointing) the same job
(``systems_for``, ``all_systems``: the names ``--systems`` accepts); a
:class:`Workload` is a model and batch for ``examples/train_lm.py``
(``WORKLOADS``); :class:`BenchConfig` is one (workload, placement) run of
several systems. Pure: nothing here runs anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from experiments.bench.partition import CpuPartition
from experiments.bench.sweep import SWEEP_PEERS
from experiments.commands import REPO

DEFAULT_WORK_DIR = Path("/tmp/checkmate-bench")
GLOO = "gloo"
CM_UDP = "checkmate-udp"


class BenchError(RuntimeError):
    """The benchmark could not run; the message says why."""


@dataclass(frozen=True)
class System:
    """One way of training (and checkpointing) the same job."""

    name: str
    description: str
    transport: str
    """``gloo`` or ``checkmate-udp`` (Checkmate's transport and ring all-reduce)."""
    checkpoint: str
    """none | checkmate | host-replication | torch-save | checkfreq | dcp-async | dcp-process"""
    every: int | None
    """Checkpoint after every ``every``-th iteration (None: never)."""
    shadow_disk_every: int = 0
    """Shadows only: ``checkmate-shadow run --snapshot-every`` (0: by time only)."""
    shadow_disk_seconds: float = 30.0
    """Shadows only: ``--snapshot-seconds``: the shadows' background disk tier (see SHADOW_DISK)."""
    worker_env: tuple[tuple[str, str], ...] = ()
    """Extra environment of every worker (a Checkmate setting compared against its default)."""

    @property
    def shadows(self) -> bool:
        return self.checkpoint in ("checkmate", "host-replication")

    @property
    def switch_replicates(self) -> bool:
        return self.checkpoint == "checkmate"

    @property
    def ideal(self) -> str:
        """The ideal on the same transport."""
        return "ideal-gloo" if self.transport == GLOO else "ideal-cm-transport"


def systems_for(k: int) -> dict[str, System]:
    """Every system the benchmark knows, by name (``K`` in names is the chosen ``k``)."""
    found = [
        System("ideal-gloo", "DDP over gloo, no checkpoints", GLOO, "none", None),
        System("ideal-cm-transport", "DDP over Checkmate's UDP transport, no shadows", CM_UDP, "none", None),
        System("checkmate", "Checkmate: the switch copies to 2 shadows (in memory every iteration, "
               "to their disk every 30 s)", CM_UDP, "checkmate", 1),
        System("checkmate-disk-1", "Checkmate, the shadows also writing every iteration to their disk",
               CM_UDP, "checkmate", 1, shadow_disk_every=1, shadow_disk_seconds=0.0),
        System(
            "checkmate-fingerprint-8", "Checkmate with rank 0's state fingerprint every 8th iteration "
            "(CHECKMATE_FINGERPRINT_EVERY=8) instead of every one", CM_UDP, "checkmate", 1,
            worker_env=(("CHECKMATE_FINGERPRINT_EVERY", "8"),),
        ),
        System(
            "host-replication", "workers unicast their reduced chunks to 2 shadows (disk every 30 s)", CM_UDP,
            "host-replication", 1,
        ),
        System("torch-save-1", "rank 0 torch.save every iteration", GLOO, "torch-save", 1),
        System(f"torch-save-{k}", f"rank 0 torch.save every {k} iterations", GLOO, "torch-save", k),
        System("dcp-async-1", "DCP async_save every iteration", GLOO, "dcp-async", 1),
        System(f"dcp-async-{k}", f"DCP async_save every {k} iterations", GLOO, "dcp-async", k),
    ]  # fmt: skip
    return {s.name: s for s in found}


BASELINE_KINDS = ("torch-save", "checkfreq", "dcp-async", "dcp-process")
"""Checkpointing done by train_lm itself (``--checkpoint KIND``)."""

_PEER_DESCRIPTIONS = {
    "torch-save": "rank 0 torch.save",
    "checkfreq": "CheckFreq-style: rank 0 snapshots to CPU memory, a background thread persists",
    "dcp-async": "DCP async_save (thread)",
    "dcp-process": "DCP async_save, AsyncCheckpointerType.PROCESS, use_collectives=False",
}


def peer_system(peer: str, k: int) -> System:
    """A baseline peer checkpointing after every ``k``-th iteration, over gloo."""
    when = "every iteration" if k == 1 else f"every {k} iterations"
    return System(f"{peer}-{k}", f"{_PEER_DESCRIPTIONS[peer]} {when}", GLOO, peer, k)


def all_systems(k: int, sweep_ks: Sequence[int] = ()) -> dict[str, System]:
    """:func:`systems_for` plus the CheckFreq-style and DCP-process peers at 1 and ``k``, and the sweep."""
    found = dict(systems_for(k))
    for peer in ("checkfreq", "dcp-process"):
        for every in (1, k):
            found.setdefault(f"{peer}-{every}", peer_system(peer, every))
    for peer in SWEEP_PEERS:
        for every in sweep_ks:
            found.setdefault(f"{peer}-{every}", peer_system(peer, every))
    return found


@dataclass(frozen=True)
class Workload:
    """A model and batch for train_lm: TinyLM as the demo trains it, or a large-state one."""

    name: str
    description: str
    model_args: tuple[str, ...]
    per_worker_batch: int
    iterations: int
    """Iterations per run unless --iterations says otherwise."""
    rounds: int = 2
    """Runs per system unless --rounds says otherwise."""
    sweep_ks: tuple[int, ...] = (1, 2, 4, 8, 16)
    """The k sweep unless --sweep-k says otherwise (each k needs warmup + 3k + 2 iterations)."""
    placements: tuple[str, ...] = ("partitioned", "colocated")
    """The placements unless --placement says otherwise (the first also runs the sweep)."""
    storages: tuple[str, ...] = ("local",)
    """Where the peers write unless --storage says otherwise (each placement runs on each)."""


WORKLOADS = {
    w.name: w
    for w in (
        Workload("tinylm", "TinyLM (experiments/tiny_lm.py: width 64, 2 layers, ~0.1M parameters), "
                 "16 samples of 64 bytes per worker, AdamW", (), 16, 150),
        Workload("large-state", "TinyLM widened to width 768, 3 layers, 12 heads (~21.7M parameters, "
                 "~260 MB of parameters + AdamW state), 1 sample of 32 bytes per worker, 8 MB buckets",
                 ("--width", "768", "--layers", "3", "--heads", "12", "--context", "32",
                  "--bucket-cap-mb", "8"), 1, 30,
                 rounds=1, sweep_ks=(1, 2, 4, 8), placements=("partitioned",),
                 storages=("local", "remote")),
        Workload("medium", "TinyLM at width 256, 4 layers, 8 heads (~3.2M parameters), 4 samples of 64 bytes "
                 "per worker, 2 MB buckets (the scaling sweep's middle size)",
                 ("--width", "256", "--layers", "4", "--heads", "8", "--bucket-cap-mb", "2"), 4, 60),
    )
}  # fmt: skip
PLACEMENTS = ("partitioned", "colocated")
STORAGES = ("local", "remote")

SHADOW_DISK = """The shadows hold every iteration in memory (each of the 2 holds one shard) and persist it to
their own disk in the background (checkmate-shadow --snapshot-every/--snapshot-seconds). In a deployment
they are their own machines, so that cadence costs training nothing; here they share the infrastructure
CPU with the software switch that stands in for switch hardware, so writing 130 MB per shadow every
iteration slows the switch. `checkmate` and `host-replication` persist every 30 s;
`checkmate-disk-1` every iteration shows what that artifact costs."""

SHADOW_NICE = 10
"""Partitioned only: the shadows' niceness on the infrastructure CPUs, where the software switch stands in
for switch hardware (which never waits for a shadow host's CPU): under contention the switch gets ~90 %
of a CPU the shadows also want (CFS weights 1024 : 110). A shadow that cannot keep up shows in the
results as lag and uncertified iterations, not as a slower switch."""

DEFAULT_SYSTEMS = (
    "ideal-gloo", "ideal-cm-transport", "checkmate", "checkmate-disk-1", "host-replication",
    "torch-save-1", "checkfreq-1", "dcp-async-1", "dcp-process-1",
)  # fmt: skip
"""What ``make bench`` runs without --systems: both ideals, Checkmate and every peer checkpointing every
iteration; the sweep adds each swept peer at its other k (``--systems all``: every known system)."""
MIN_WORKERS, MAX_WORKERS = 2, 6


def worker_names(count: int) -> tuple[str, ...]:
    """The worker hosts of a run with ``count`` workers: h1, h2, ..."""
    return tuple(f"h{i}" for i in range(1, count + 1))


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run: a workload in a placement, the systems to run on it, where results go."""

    iterations: int = 150
    warmup: int = 5
    k: int = 10
    rounds: int = 3
    systems: tuple[str, ...] = ()
    """Names to run (empty: all), in this order; later rounds alternate the order."""
    work_dir: Path = DEFAULT_WORK_DIR
    json_out: Path | None = REPO / "results" / "bench.json"
    png_out: Path | None = REPO / "results" / "bench.png"
    docs: Path | None = REPO / "docs" / "benchmarks.md"
    rename_switches: tuple[tuple[str, str], ...] = (("s1", "bn1"),)
    target: str = "embedded"
    global_batch: int = 48
    model_args: tuple[str, ...] = ()
    train_timeout: float = 600.0
    command: str = "make bench"
    workers: int = 3
    workload: str = "tinylm"
    placement: str = "colocated"
    """partitioned: workers on ``partition.workers``, everything else on ``partition.infrastructure``."""
    partition: CpuPartition | None = None
    sweep_ks: tuple[int, ...] = ()
    """Checkpoint intervals swept for each of SWEEP_PEERS (run in the partitioned placement only)."""
    measure_emulation: bool = True
    """Measure the fabric and the peers' storage before the systems run (experiments.bench.emulation)."""
    storage: str = "local"
    """Where the peers write their checkpoints and the shadows their snapshots: ``local`` (this machine's
    disk, the page cache in front) or ``remote`` (the storage host's NFS export, its link shaped to a
    cited cluster's write-to-all-reduce ratio: experiments.bench.storage_host)."""
    storage_cluster: str = "llama3-405b"
    """``remote``: the cluster configuration (controller.named_clusters) whose ratio shapes the link."""
    storage_mbit: float | None = None
    """``remote``: the link's rate in Mbit/s instead of the cited ratio's (None: the ratio's)."""
    syscall_iterations: int = 0
    """Count the workers' system calls (``strace -c -f``) over this many iterations at the end of each
    run (0: not at all); the CPU figures then stop where the window starts (strace slows the calls)."""

    def known(self) -> dict[str, System]:
        return all_systems(self.k, self.sweep_ks)

    def selected(self) -> list[System]:
        known = self.known()
        names = list(self.systems) or list(known)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise BenchError(f"unknown system(s) {unknown}; known: {list(known)}")
        return [known[n] for n in names]
