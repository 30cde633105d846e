"""A shadow slower than the job: how far it lags, what it holds, what the workers see, how it catches up.

    python -m tests.shadow.pressure [--steps 80] [--pace 0.05] [--json results/shadow_pressure.json]

Two DDP ranks train on loopback (copies emulated by tests/shadow/copy_tap.py) with two
in-process shadows; shadow ``s1`` is made slow by sleeping ``--delay`` seconds before each
optimizer step it applies (a stand-in for a busy CPU or a slow disk: the apply thread is
what falls behind), while the job runs an iteration every ``--pace`` seconds plus its own
compute. A sampler records both shadows' status every 20 ms (applied and certified
iteration, lag, bytes stashed ahead of the window, drops by reason, re-seeds), rank 0
records each iteration's wall time and the iteration every shadow has certified. After
the job ends, the slow shadow gets time to catch up, and both shadows' states are
compared bit for bit with the workers'. tests/shadow/test_pressure.py runs a small case
and asserts the behaviour; docs/shadow.md ("A shadow slower than the job") has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shadow.node import ShadowConfig, ShadowNode
from shadow.optimizer_apply import ShadowOptimizer
from shadow.repair import RepairPolicy
from tests.hosts.harness import run_ranks
from tests.shadow.copy_tap import CopyFaults

JOB_ID = 27


def _train(
    rank: int, world: int, store: str, env: dict[str, str], copies: dict[int, Any], steps: int, pace: float
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts
    from hosts.ddp import CheckmateConfig
    from tests.shadow.copy_tap import CopyTap

    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    os.environ["CHECKMATE_BIND"] = f"127.0.0.{70 + rank}:48879"  # not the default .10/.11 other tests use
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    ddp = DDP(model, bucket_cap_mb=0.02)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    agent = hosts.enable_checkmate(ddp, opt, CheckmateConfig.from_env())
    tap = CopyTap(agent.transport, copies, CopyFaults(), rank)
    g = torch.Generator().manual_seed(100 + rank)
    seconds: list[float] = []
    certified: list[int | None] = []
    for _ in range(steps):
        started = time.perf_counter()
        loss = torch.nn.functional.mse_loss(
            ddp(torch.randn(16, 64, generator=g)), torch.randn(16, 64, generator=g)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - started)
        if agent.channel is not None:
            certified.append(agent.channel.certified_through())
        time.sleep(pace)
    tap.flush()
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    out = {
        "seconds": seconds,
        "certified": certified,
        "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
        "state": {
            names[id(p)]: {k: torch.as_tensor(v).clone() for k, v in s.items()} for p, s in opt.state.items()
        },
        "stats": agent.stats(),
    }
    dist.barrier()
    agent.close()
    dist.destroy_process_group()
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def run_pressure(
    steps: int,
    delay: float,
    pace: float,
    horizon: int = 8,
    stash_bytes: int = 256 << 20,
    catch_up_s: float = 90.0,
    on_lag: str = "continue",
) -> dict[str, Any]:
    """Run the experiment; the figures as a JSON-able dict (``equal`` says whether states matched).

    ``on_lag``: the job's lag policy (``CHECKMATE_ON_LAG``). ``"continue"`` (the workers never
    wait; the lag is logged once per episode) shows what a slow shadow does on its own;
    ``"wait"`` (the default of a job) holds rank 0 within ``CHECKMATE_MAX_LAG`` of it.
    """
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="pressure-"))
    original = ShadowOptimizer.apply

    slow_steps = [0]  # optimizer steps s1 has applied (its apply thread only)

    def slow_apply(self: ShadowOptimizer, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "shadow-s1-apply":
            time.sleep(delay)
            slow_steps[0] += 1
        return original(self, *args, **kwargs)

    nodes = [
        ShadowNode(
            ShadowConfig(
                name=f"s{i}",
                control_bind=(f"127.0.0.{60 + i}", 0),
                data_bind=(f"127.0.0.{60 + i}", 0),
                horizon=horizon,
                stash_bytes=stash_bytes if i == 1 else ShadowConfig.stash_bytes,
                repair=RepairPolicy(grace=0.01, timeout=0.05),
            )
        ).start()
        for i in range(2)
    ]
    samples: list[dict[str, Any]] = []
    stop = threading.Event()

    def sampler() -> None:
        started = time.monotonic()
        while not stop.is_set():
            for node in nodes:
                s = node.status()
                samples.append(
                    {
                        "t": time.monotonic() - started,
                        "shadow": node.name,
                        "applied": s["applied_iteration"],
                        "certified": s["certified_iteration"],
                        "lag": s["lag_iterations"],
                        "stash_bytes": s["stash"]["bytes"],
                        "drops": dict(s["drops"]),
                        "reseeds": s["reseeds"],
                        "resync_requests": s["resync_requests"],
                    }
                )
            time.sleep(0.02)

    shadows = ",".join(f"{n.name}={n.control_address[0]}:{n.control_address[1]}" for n in nodes)
    env = {
        "CHECKMATE_JOB_ID": str(JOB_ID),
        "CHECKMATE_SHADOWS": shadows,
        "CHECKMATE_ON_LAG": on_lag,
        "CHECKMATE_UNPROTECTED": "log" if on_lag == "continue" else "raise",
    }
    copies = {i: n.data_address for i, n in enumerate(nodes)}
    thread = threading.Thread(target=sampler, daemon=True)
    ShadowOptimizer.apply = slow_apply  # type: ignore[method-assign]
    try:
        thread.start()
        job_started = time.monotonic()
        r0, _r1 = run_ranks(_train, 2, f"{tmp}/store", env, copies, steps, pace, timeout=600)
        job_seconds = time.monotonic() - job_started
        slow_steps_during_job = slow_steps[0]
        caught_up = nodes[1].wait_applied(steps - 1, catch_up_s)
        catch_up_seconds = time.monotonic() - job_started - job_seconds
        stop.set()
        thread.join(5)
        equal = caught_up and nodes[0].wait_applied(steps - 1, 10.0)
        if equal:
            params: dict[str, torch.Tensor] = {}
            states: dict[str, Any] = {}
            for node in nodes:
                params.update(node.parameters())
                states.update(node.optimizer_states())
            equal = set(params) == set(r0["params"]) and all(
                torch.equal(_bits(params[n]), _bits(v)) for n, v in r0["params"].items()
            )
            equal = equal and all(
                torch.equal(_bits(torch.as_tensor(states[n][k])), _bits(v))
                for n, per in r0["state"].items()
                for k, v in per.items()
            )
        final = {node.name: node.status() for node in nodes}
    finally:
        ShadowOptimizer.apply = original  # type: ignore[method-assign]
        stop.set()
        for node in nodes:
            node.close()
    slow = [s for s in samples if s["shadow"] == "s1"]
    seconds = sorted(r0["seconds"][2:])  # the first iterations build DDP's buckets
    lags = [c for c in r0["certified"] if c is not None]
    return {
        "steps": steps,
        "apply_delay_s": delay,
        "pace_s": pace,
        "horizon": horizon,
        "job_seconds": round(job_seconds, 2),
        "worker_iteration_ms": {
            "median": round(1e3 * seconds[len(seconds) // 2], 2),
            "max": round(1e3 * seconds[-1], 2),
        },
        "slow_shadow": {
            "max_lag_iterations": max((s["lag"] or 0) for s in slow),
            "steps_applied_during_job": slow_steps_during_job,
            "max_stash_bytes": max(s["stash_bytes"] for s in slow),
            "stash_limit_bytes": stash_bytes,
            "certified_never_went_back": all(
                b["certified"] >= a["certified"] for a, b in zip(slow, slow[1:], strict=False)
            ),
            "drops": final["s1"]["drops"],
            "reseeds": final["s1"]["reseeds"],
            "resync_requests": final["s1"]["resync_requests"],
            "repairs": final["s1"]["repairs"],
            "caught_up": caught_up,
            "catch_up_seconds_after_job": round(catch_up_seconds, 2),
        },
        "fast_shadow": {
            "max_lag_iterations": max((s["lag"] or 0) for s in samples if s["shadow"] == "s0"),
            "drops": final["s0"]["drops"],
            "resync_requests": final["s0"]["resync_requests"],
        },
        "rank0_last_certified_during_run": max(lags) if lags else None,
        "rank0_certified_lag_at_end": (steps - 1 - lags[-1]) if lags else None,
        "equal_to_workers": bool(equal),
        "timeline": [
            {k: s[k] for k in ("t", "shadow", "applied", "certified", "lag", "stash_bytes")}
            for s in samples[::25]
        ],
        "rank0_certified": r0["certified"],
        "transport": {
            k: v for k, v in r0["stats"]["transport"].items() if "retransmit" in k or k == "data_sent"
        },
    }


CASES = {
    "no slow shadow": {"delay": 0.0},
    "s1 sleeps 0.25 s per step, default stash (256 MiB)": {"delay": 0.25},
    "s1 sleeps 0.25 s per step, stash capped at 300 kB": {"delay": 0.25, "stash_bytes": 300_000},
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--pace", type=float, default=0.05, help="seconds the job sleeps per iteration")
    parser.add_argument(
        "--catch-up", type=float, default=20.0, help="seconds the slow shadow gets afterwards"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    results = {}
    for name, case in CASES.items():
        figures = run_pressure(args.steps, pace=args.pace, catch_up_s=args.catch_up, **case)  # type: ignore[arg-type]
        figures.pop("timeline")
        results[name] = figures
        print(name, json.dumps({k: v for k, v in figures.items() if k != "rank0_certified"}))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
