"""Run an unmodified DDP script and record what its Checkmate agent did, for tests and benchmarks.

    python -m examples.ddp_probe --out DIR -- SCRIPT [SCRIPT ARGS...]

runs ``SCRIPT`` as ``__main__`` (like ``python SCRIPT``), with
:func:`hosts.enable_checkmate` wrapped so that the agent it makes is watched:

* every gradient bucket DDP hands to the agent: iteration, bucket index,
  element count and dtype (the bucket layout actually used, per iteration,
  including DDP's rebuild after the first one), the time it was handed over,
  and the SHA-256 of the reduced result once the all-reduce completes;
* after the script returns: the agent's tag log (every REPLICATE-tagged first
  transmission), its transport and ring counters, and a SHA-256 of the final
  parameters (names, shapes and bytes, in ``named_parameters`` order).

It writes ``DIR/rank<RANK>.json`` (also when the script fails; then with
``"error"``) and exits with the script's status. The script does not know it
is being watched: nothing in it changes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import runpy
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

PROBE_VERSION = 1


class AgentProbe:
    """Wraps one :class:`hosts.ddp.CheckmateAgent` and records its buckets, results and tags."""

    def __init__(self) -> None:
        self.agent: Any = None
        self._lock = threading.Lock()
        self.buckets: list[dict[str, Any]] = []
        """One record per bucket handed to the hook: iteration, bucket, elements, dtype, t."""
        self.results: dict[tuple[int, int], str] = {}
        """(iteration, bucket) -> SHA-256 of the reduced bucket's bytes."""

    def enable(self, real: Any) -> Any:
        """A replacement for ``hosts.enable_checkmate`` that watches the agent ``real`` makes."""

        def enable_checkmate(*args: Any, **kwargs: Any) -> Any:
            agent = real(*args, **kwargs)
            self.watch(agent)
            return agent

        enable_checkmate.__doc__ = real.__doc__
        return enable_checkmate

    def watch(self, agent: Any) -> None:
        if self.agent is not None:
            raise RuntimeError("ddp_probe watches one Checkmate agent per process; the script made two")
        self.agent = agent
        original = agent.on_bucket

        def on_bucket(bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
            buffer = bucket.buffer()
            iteration, index = agent.iteration, bucket.index()
            with self._lock:
                self.buckets.append(
                    {
                        "iteration": iteration,
                        "bucket": index,
                        "elements": buffer.numel(),
                        "dtype": str(buffer.dtype).removeprefix("torch."),
                        "t": time.monotonic(),
                    }
                )
            future = original(bucket)

            def record(done: torch.futures.Future[torch.Tensor]) -> None:
                try:
                    value = done.value()
                except RuntimeError:
                    return  # a failed all-reduce: DDP raises it in the script
                digest = hashlib.sha256(value.detach().to("cpu").contiguous().numpy().tobytes()).hexdigest()
                with self._lock:
                    self.results[(iteration, index)] = digest

            future.add_done_callback(record)
            return future

        agent.on_bucket = on_bucket  # the registered hook calls agent.on_bucket(bucket)

    def report(self) -> dict[str, Any]:
        """Everything recorded, as JSON-able data."""
        out: dict[str, Any] = {
            "probe_version": PROBE_VERSION,
            "rank": int(os.environ.get("RANK", "-1")),
            "world_size": int(os.environ.get("WORLD_SIZE", "-1")),
            "agent": self.agent is not None,
        }
        agent = self.agent
        if agent is None:
            return out
        with self._lock:
            buckets = list(self.buckets)
            results = dict(self.results)
        layouts: dict[str, dict[str, int]] = {}
        for b in buckets:
            layouts.setdefault(str(b["iteration"]), {})[str(b["bucket"])] = b["elements"]
        starts: dict[int, float] = {}
        for b in buckets:
            starts.setdefault(b["iteration"], b["t"])
        ordered = [starts[i] for i in sorted(starts)]
        params = hashlib.sha256()
        for name, p in agent.model.module.named_parameters():
            params.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
            params.update(p.detach().to("cpu").contiguous().numpy().tobytes())
        out.update(
            job_id=agent.config.job_id,
            bind=list(agent.config.bind),
            workers=[list(w) for w in agent.workers],
            iterations=agent.iteration,
            optimizer_steps=agent.optimizer_steps,
            layouts=layouts,
            dtypes=sorted({b["dtype"] for b in buckets}),
            iteration_seconds=[b - a for a, b in zip(ordered, ordered[1:], strict=False)],
            reduced_sha256={f"{i}/{b}": h for (i, b), h in sorted(results.items())},
            tags=[
                [t.iteration, t.bucket_id, t.element_offset, t.element_count, t.shard_key]
                for t in agent.ring.tag_log
            ],
            params_sha256=params.hexdigest(),
            stats=agent.stats(),
        )
        return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m examples.ddp_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for rank<RANK>.json")
    parser.add_argument("script", type=Path, help="the DDP script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import hosts
    import hosts.ddp

    probe = AgentProbe()
    wrapped = probe.enable(hosts.ddp.enable_checkmate)
    hosts.enable_checkmate = wrapped  # found before hosts.__getattr__
    hosts.ddp.enable_checkmate = wrapped
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    sys.argv = [str(args.script), *script_args]
    status = 0
    error: str | None = None
    try:
        runpy.run_path(str(args.script), run_name="__main__")
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if status:
            error = f"SystemExit({exc.code!r})"
    except BaseException:  # noqa: BLE001  recorded in the report, then the process fails
        error = traceback.format_exc()
        status = 1
    report = probe.report()
    report["exit_status"] = status
    if error is not None:
        report["error"] = error
        print(error, file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    rank = report["rank"] if report["rank"] >= 0 else os.getpid()
    path = args.out / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    tmp.replace(path)
    return status


if __name__ == "__main__":
    sys.exit(main())
