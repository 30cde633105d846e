"""The emulation's own bandwidths, measured at the start of every ``make bench`` (issue 27, item 1).

A benchmark of checkpointing systems measures the regime its machine emulates: how fast the
fabric carries an all-reduce, how fast the storage the peers write to takes a checkpoint,
and how long an iteration computes. This module measures the first two before any system
runs, on the same machine, CPU partition and emulated network as the systems, and reads the
third from the run itself:

* **fabric**: all-reduce bus bandwidth through the emulated switch at the bench's number of
  workers, gloo and Checkmate's ring interleaved in the same processes
  (:func:`experiments.bench.transport.run_network`; no job registered, nothing copied);
* **storage**: the peers' checkpoint directory written at the workload's checkpoint size,
  as ``torch.save`` writes (buffered: written and closed, the page cache takes it) and
  durable (``fsync`` before close), median of a few writes;
* **compute**: the training thread's CPU milliseconds per iteration in ``ideal-gloo``
  (forward, backward, optimizer step; gloo's all-reduce runs on its own threads), from the
  run's worker account (:func:`compute_from`).

Every figure is what was measured, with its conditions; a failed measurement is recorded as
an error, never as a number.
"""

from __future__ import annotations

import logging
import os
import secrets
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STORAGE_WRITES = 3
"""Writes per storage figure (the median is reported)."""
FABRIC_MIB = 8
"""All-reduce size of the fabric measurement (MiB of fp32)."""
FABRIC_REPS = 3
_CHUNK = 1 << 20


ADAMW_BYTES_PER_PARAMETER = 12
"""fp32 parameter + AdamW's two fp32 moments: what every peer's checkpoint holds per parameter."""
_MODEL_FLAGS = {"--width": "width", "--layers": "layers", "--heads": "heads", "--context": "context"}


def checkpoint_bytes(model_args: Sequence[str]) -> int:
    """The bytes of a checkpoint of the TinyLM that train_lm builds from ``model_args`` (with AdamW)."""
    import torch

    from experiments.tiny_lm import ModelConfig, TinyLM

    fields: dict[str, int] = {}
    args = list(model_args)
    for flag, name in _MODEL_FLAGS.items():
        if flag in args:
            fields[name] = int(args[args.index(flag) + 1])
    with torch.device("meta"):  # sizes only: no memory, no initialisation
        model = TinyLM(ModelConfig(**fields))
    return ADAMW_BYTES_PER_PARAMETER * sum(p.numel() for p in model.parameters())


def storage_rate(directory: Path, nbytes: int, writes: int = STORAGE_WRITES) -> dict[str, Any]:
    """Write ``nbytes`` into ``directory`` ``writes`` times, buffered and durable; MB/s (1e6 B/s), medians."""
    if nbytes <= 0:
        raise ValueError(f"a storage measurement needs a positive size, not {nbytes}")
    directory.mkdir(parents=True, exist_ok=True)
    chunk = os.urandom(min(_CHUNK, nbytes))
    buffered: list[float] = []
    durable: list[float] = []
    for i in range(writes):
        for sync, out in ((False, buffered), (True, durable)):
            path = directory / f".storage-probe-{os.getpid()}-{i}-{int(sync)}"
            started = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                left = nbytes
                while left > 0:
                    left -= os.write(fd, chunk[: min(left, len(chunk))])
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            out.append(time.perf_counter() - started)
            path.unlink(missing_ok=True)
    return {
        "directory": str(directory),
        "bytes": nbytes,
        "writes": writes,
        "buffered_MBps": nbytes / statistics.median(buffered) / 1e6,
        "durable_MBps": nbytes / statistics.median(durable) / 1e6,
        "buffered_s": [round(s, 6) for s in buffered],
        "durable_s": [round(s, 6) for s in durable],
    }


def remote_storage_rate(
    net_dir: Path,
    host: str,
    url: str,
    nbytes: int,
    writes: int = STORAGE_WRITES,
    prefix: Sequence[str] = (),
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Write ``nbytes`` to the NFS ``url`` from inside ``host`` (the workers' path), ``writes`` times.

    The probe (:mod:`experiments.bench.storage_probe`) writes through :mod:`checkmate.nfs` as the
    peers do: ``written_MBps`` when the server answered every WRITE, ``durable_MBps`` after the
    COMMIT and CLOSE (what a peer's checkpoint costs: the client commits every file it closes).
    RuntimeError with the probe's output when it fails or does not finish within ``timeout``.
    """
    import json
    import subprocess

    from experiments.bench.network import host_environment
    from experiments.commands import NET, REPO

    if nbytes <= 0:
        raise ValueError(f"a storage measurement needs a positive size, not {nbytes}")
    argv = [
        *NET,
        "exec",
        "--run-dir",
        str(net_dir),
        host,
        "--",
        *prefix,
        "-m",
        "experiments.bench.storage_probe",
    ]
    argv += [url, str(nbytes), str(writes)]
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
            env=host_environment(),
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the remote storage probe did not finish within {timeout:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError(
            f"the remote storage probe failed ({done.returncode}): {done.stderr.strip()[-1500:]}"
        )
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def fabric_rate(
    topology: Path, workers: int, work_dir: Path, prefix: Sequence[str] = (), timeout: float = 300.0
) -> dict[str, Any]:
    """All-reduce busbw through the emulated switch at ``workers`` ranks, gloo and Checkmate's ring.

    ``prefix``: the argv prefix each rank starts with (the bench's worker CPU set).
    """
    from experiments.bench.transport import run_network

    # The ranks' transports authenticate their control datagrams: they share a fresh secret, in a
    # file of the run (never on a command line), named by the environment of each rank alone.
    work_dir.mkdir(parents=True, exist_ok=True)
    secret = work_dir / "fabric.secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32) + "\n")
    found = run_network(
        topology,
        [workers],
        FABRIC_MIB,
        FABRIC_REPS,
        steps=0,
        timeout=timeout,
        work_dir=work_dir,
        prefix=("env", f"CHECKMATE_JOB_SECRET_FILE={secret}", *prefix),
    )
    row = found["rows"][0] if found["rows"] else None
    return {
        "world_size": workers,
        "mib": FABRIC_MIB,
        "reps": FABRIC_REPS,
        "gloo_busbw_MBps": row["gloo_busbw_MBps"] if row else None,
        "checkmate_busbw_MBps": row["checkmate_busbw_MBps"] if row else None,
        "checkmate_datapath": row.get("checkmate_datapath") if row else None,
        "gloo_cpu_ms": row["gloo_cpu_ms"] if row else None,
        "checkmate_cpu_ms": row["checkmate_cpu_ms"] if row else None,
        "errors": found["errors"],
        "switch_drops": found["switch_drops"],
    }


def compute_from(systems: Mapping[str, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The training thread's CPU per iteration in ``ideal-gloo`` (None: it did not run with an account)."""
    account = (systems.get("ideal-gloo") or {}).get("worker_account") or {}
    main = (account.get("by_thread") or {}).get("main")
    if not main:
        return None
    return {
        "source": "ideal-gloo's worker account: the training thread (forward, backward, optimizer step)",
        "cpu_ms_per_iteration": round(float(main["user_ms"]) + float(main["system_ms"]), 3),
        "mean_iteration_ms": (systems.get("ideal-gloo") or {}).get("mean_iteration_ms"),
    }


def measure(
    topology: Path,
    workers: int,
    checkpoint_dir: Path,
    checkpoint_bytes: int | None,
    work_dir: Path,
    prefix: Sequence[str] = (),
) -> dict[str, Any]:
    """The fabric and the storage, each measured or its error recorded (never raises for one)."""
    out: dict[str, Any] = {"errors": {}}
    try:
        out["fabric"] = fabric_rate(topology, workers, work_dir, prefix)
    except (OSError, ValueError, RuntimeError) as exc:
        out["errors"]["fabric"] = str(exc)[:2000]
        logger.warning("the fabric could not be measured: %s", exc)
    if checkpoint_bytes is None:
        out["errors"]["storage"] = "the workload states no checkpoint size"
    else:
        try:
            out["storage"] = storage_rate(checkpoint_dir, checkpoint_bytes)
        except (OSError, ValueError) as exc:
            out["errors"]["storage"] = str(exc)[:2000]
            logger.warning("the storage could not be measured: %s", exc)
    return out


def header_line(emulation: Mapping[str, Any] | None) -> str:
    """One sentence for docs/benchmarks.md's header: what the emulation itself delivered."""
    if not emulation:
        return "The emulation's bandwidths were not measured in this run."
    parts = []
    fabric = emulation.get("fabric") or {}
    if fabric.get("gloo_busbw_MBps") is not None:
        parts.append(
            f"fabric (all-reduce busbw through the emulated switch, {fabric['world_size']} ranks, "
            f"{fabric['mib']} MiB): gloo {fabric['gloo_busbw_MBps']:.1f} MB/s, Checkmate's ring "
            f"{fabric['checkmate_busbw_MBps']:.1f} MB/s"
        )
    remote = emulation.get("remote_storage") or {}
    if remote.get("durable_MBps") is not None:
        parts.append(
            f"the peers' remote storage (NFS on the storage host, link shaped to "
            f"{remote.get('link_mbit', 0):.3g} Mbit/s: {remote.get('shaped_by', 'given')}; "
            f"{remote['bytes'] / 1e6:.1f} MB writes from a worker): "
            f"{remote['written_MBps']:.1f} MB/s written, {remote['durable_MBps']:.1f} MB/s committed"
        )
    storage = emulation.get("storage") or {}
    whose = "this machine's local" if remote else "the peers'"
    if storage.get("buffered_MBps") is not None:
        parts.append(
            f"{whose} storage ({storage['bytes'] / 1e6:.1f} MB writes): "
            f"{storage['buffered_MBps']:.0f} MB/s buffered, {storage['durable_MBps']:.0f} MB/s with fsync"
        )
    compute = emulation.get("compute") or {}
    if compute.get("cpu_ms_per_iteration") is not None:
        parts.append(f"compute: {compute['cpu_ms_per_iteration']:.1f} ms CPU per iteration (ideal-gloo)")
    errors = emulation.get("errors") or {}
    parts += [f"{what} not measured: {why[:200]}" for what, why in errors.items()]
    return "The emulation itself, measured at the start: " + "; ".join(parts) + "."
