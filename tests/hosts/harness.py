"""Run one function per rank in child processes (forkserver with torch preloaded) and collect results."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

from checkmate.wire import CHECKMATE_UDP_PORT

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "numpy", "hosts.ring_allreduce", "torch.distributed"])


def worker_addr(rank: int) -> tuple[str, int]:
    """Rank r's data address in non-root tests: 127.0.0.(10+r):48879."""
    return (f"127.0.0.{10 + rank}", CHECKMATE_UDP_PORT)


def _child(fn: Callable[..., Any], rank: int, world: int, args: tuple[Any, ...], out: Any) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        # plain pickle: tensors are copied, not shared through file descriptors that die with us
        out.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        out.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own process."""
    out = _CTX.Queue()
    procs = [_CTX.Process(target=_child, args=(fn, r, world, args, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            try:
                rank, ok, value = out.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world)) - set(results))} did not finish"
                ) from None
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, 9)
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
