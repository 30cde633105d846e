"""A long run with failures along the way: memory, descriptors, threads and disk must stay flat.

    python -m tests.shadow.soak [--steps 2000] [--json results/soak.json]

Two DDP ranks (child processes) train on loopback for ``--steps`` iterations with two
in-process shadows writing snapshots every 10 iterations (keep 2). Failures injected
along the way: 1% of the switch's copies lost, 1% duplicated and 2% reordered all the
time (tests/shadow/copy_tap.py), and shadow s1 killed (closed) and restarted from its
snapshots (``--resume``) every ``--restart-every`` iterations. A sampler records, every
0.5 s, the resident memory, open file descriptors and threads of both workers and of the
shadows' process, and the bytes in the snapshot directory. At the end both shadows'
states must equal the workers' bit for bit. tests/shadow/test_soak.py (marked soak)
runs it and checks that the samples are flat; docs/shadow.md has the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shadow.node import ShadowConfig, ShadowNode
from shadow.repair import RepairPolicy
from shadow.snapshots import SnapshotPolicy
from tests.hosts.harness import run_ranks
from tests.shadow.copy_tap import CopyFaults

JOB_ID = 29


def _train(rank: int, world: int, tmp: str, env: dict[str, str], copies: dict[int, Any], steps: int) -> Any:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts
    from hosts.ddp import CheckmateConfig
    from tests.shadow.copy_tap import CopyTap

    Path(tmp, f"pid{rank}").write_text(str(os.getpid()))
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    os.environ["CHECKMATE_BIND"] = f"127.0.0.{90 + rank}:48879"
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 16))
    ddp = DDP(model, bucket_cap_mb=0.01)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    # workers keep 64 iterations for repairs (4 by default): a lost copy must still be held when the
    # shadow asks, in a job whose iterations take milliseconds (tests/shadow/test_shadow_e2e.py does the same)
    agent = hosts.enable_checkmate(
        ddp, opt, dataclasses.replace(CheckmateConfig.from_env(), keep_iterations=64)
    )
    tap = CopyTap(agent.transport, copies, CopyFaults(loss=0.01, duplicate=0.01, reorder=0.02, seed=9), rank)
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(
            ddp(torch.randn(8, 32, generator=g)), torch.randn(8, 16, generator=g)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        Path(tmp, f"step{rank}").write_text(str(step))
        time.sleep(0.005)
    tap.flush()
    if agent.channel is not None:
        agent.wait_certified(steps - 1, timeout=60.0)
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    out = {
        "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
        "state": {
            names[id(p)]: {k: torch.as_tensor(v).clone() for k, v in s.items()} for p, s in opt.state.items()
        },
        "tap": tap.counters,
        "stats": agent.stats(),
    }
    dist.barrier()
    agent.close()
    dist.destroy_process_group()
    return out


def _proc(pid: int) -> dict[str, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_kib": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"]), "fds": fds}


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def run_soak(steps: int, restart_every: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    ckpt = tmp / "ckpt"

    def config(i: int, **kw: Any) -> ShadowConfig:
        return ShadowConfig(
            name=f"s{i}",
            control_bind=kw.pop("control_bind", (f"127.0.0.{92 + i}", 0)),
            data_bind=kw.pop("data_bind", (f"127.0.0.{92 + i}", 0)),
            snapshots=SnapshotPolicy(ckpt, every_iterations=10, keep=2),
            repair=RepairPolicy(grace=0.01, timeout=0.05),
            **kw,
        )

    nodes = [ShadowNode(config(i)).start() for i in range(2)]
    shadows = ",".join(f"{n.name}={n.control_address[0]}:{n.control_address[1]}" for n in nodes)
    env = {"CHECKMATE_JOB_ID": str(JOB_ID), "CHECKMATE_SHADOWS": shadows}
    copies = {i: n.data_address for i, n in enumerate(nodes)}
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    outcome: dict[str, Any] = {}
    restarts: list[int] = []

    def step_now() -> int:
        try:
            return int(Path(tmp, "step0").read_text())
        except (OSError, ValueError):
            return -1

    def sampler() -> None:
        started = time.monotonic()
        while not stop.wait(0.5):
            row: dict[str, Any] = {
                "t": round(time.monotonic() - started, 2),
                "step": step_now(),
                "disk": _du(ckpt),
            }
            row["step_dirs"] = len(list(ckpt.glob("step-*"))) if ckpt.exists() else 0
            for rank in range(2):
                try:
                    row[f"rank{rank}"] = _proc(int(Path(tmp, f"pid{rank}").read_text()))
                except (OSError, ValueError):
                    row[f"rank{rank}"] = None
            row["shadows"] = _proc(os.getpid())
            samples.append(row)

    def train() -> None:
        try:
            outcome["results"] = run_ranks(_train, 2, str(tmp), env, copies, steps, timeout=3600)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            outcome["error"] = exc

    threading.Thread(target=sampler, daemon=True).start()
    trainer = threading.Thread(target=train, daemon=True)
    started = time.monotonic()
    trainer.start()
    try:
        next_restart = restart_every
        while trainer.is_alive():
            trainer.join(0.2)
            if next_restart < steps - restart_every // 2 and step_now() >= next_restart:
                old = nodes[1]
                old.close()
                time.sleep(0.2)  # the job goes on without s1
                nodes[1] = ShadowNode(
                    dataclasses.replace(
                        old.config, control_bind=old.control_address, data_bind=old.data_address, resume=True
                    )
                ).start()
                restarts.append(step_now())
                next_restart += restart_every
        seconds = time.monotonic() - started
        if "error" in outcome:
            raise outcome["error"]
        r0 = outcome["results"][0]
        equal = all(n.wait_applied(steps - 1, 30.0) for n in nodes)
        params: dict[str, torch.Tensor] = {}
        states: dict[str, Any] = {}
        for node in nodes:
            params.update(node.parameters())
            states.update(node.optimizer_states())
        equal = equal and set(params) == set(r0["params"])
        equal = equal and all(torch.equal(_bits(params[n]), _bits(v)) for n, v in r0["params"].items())
        equal = equal and all(
            torch.equal(_bits(torch.as_tensor(states[n][k])), _bits(v))
            for n, per in r0["state"].items()
            for k, v in per.items()
        )
        statuses = [n.status() for n in nodes]
    finally:
        stop.set()
        for node in nodes:
            node.close()
    return {
        "steps": steps,
        "seconds": round(seconds, 1),
        "shadow_restarts_at": restarts,
        "copies": {
            k: sum(r["tap"][k] for r in outcome["results"])
            for k in ("copied", "lost", "duplicated", "reordered")
        },
        "repaired_elements": sum(s["repairs"].get("elements_repaired", 0) for s in statuses),
        "equal_to_workers": bool(equal),
        "samples": samples,
    }


def flatness(samples: list[dict[str, Any]], key: str, field: str) -> dict[str, float]:
    """The median of ``field`` over the second quarter of the run and over the last quarter."""
    values = [s[key][field] for s in samples if s.get(key)]
    if len(values) < 8:
        return {"early": float("nan"), "late": float("nan"), "max": float("nan")}
    q = len(values) // 4
    return {
        "early": statistics.median(values[q : 2 * q]),
        "late": statistics.median(values[3 * q :]),
        "max": max(values[q:]),
    }


def summary(result: dict[str, Any]) -> dict[str, Any]:
    samples = result["samples"]
    out = {k: v for k, v in result.items() if k != "samples"}
    for key in ("rank0", "rank1", "shadows"):
        out[key] = {field: flatness(samples, key, field) for field in ("rss_kib", "fds", "threads")}
    disk = [s["disk"] for s in samples]
    out["disk_bytes"] = {"max": max(disk), "last": disk[-1]} if disk else {}
    out["step_dirs_max"] = max((s["step_dirs"] for s in samples), default=0)
    out["step_dirs_last"] = samples[-1]["step_dirs"] if samples else 0
    out["step_dirs_timeline"] = [(s["step"], s["step_dirs"]) for s in samples[::4]]
    out["samples_taken"] = len(samples)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--restart-every", type=int, default=500)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    figures = summary(run_soak(args.steps, args.restart_every))
    print(json.dumps(figures, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
