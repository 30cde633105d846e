"""The ``torch.distributed`` backend "checkmate" (hosts/c10d_backend.py) against gloo, in the same processes.

Each multi-rank test starts 2 or 3 ranks (forkserver children) whose default process group is
``backend="checkmate"`` (or ``"cpu:checkmate"``) on Checkmate's transport, bound to 127.0.0.200+, and a
gloo group over the same ranks. A randomized suite runs every supported collective on both and
compares: bit for bit where gloo's order is the same (all_gather, broadcast, integer sums, any sum of
2 ranks), and otherwise bit for bit against the backend's documented order (the ring's
``reference_allreduce``; reduce-scatter in rank order) and within float tolerance of gloo. A DDP
model trained a few steps on the backend must equal the same model trained on gloo.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch

from tests.hosts.harness import run_ranks
from tests.listen_ports import listen_port

SEEDS = 3
"""Random cases per collective and dtype in each run."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bind(rank: int, base: int = 200) -> str:
    return f"127.0.0.{base + rank}"


def _ours(group: Any) -> Any:
    """``group`` (None: the default group) as the backend's process group, with its transport."""
    import torch.distributed as dist

    from hosts.c10d_backend import CheckmateProcessGroup

    pg = dist.distributed_c10d._get_default_group() if group is None else group
    assert isinstance(pg, CheckmateProcessGroup) and pg.transport is not None, pg
    return pg


def _init(rank: int, world: int, port: int, backend: str = "checkmate", **options: Any) -> Any:
    """The default group on the backend, then a gloo group over the same ranks (returned).

    Without ``options`` this is the one-argument form a script uses: everything from the
    environment (``CHECKMATE_BACKEND_BIND`` here, torchrun's variables, the job secret)."""
    import torch.distributed as dist

    import hosts.c10d_backend as backend_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    if options:
        pg_options = backend_module.CheckmateBackendOptions(bind=_bind(rank), **options)
        dist.init_process_group(backend, pg_options=pg_options)
    else:
        os.environ[backend_module.BIND_ENV] = _bind(rank)
        dist.init_process_group(backend)
    return dist.new_group(backend="gloo")


def _inputs(seed: int, world: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input of one case (each rank can compute all of them: references need them)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * 10).to(dtype) for _ in range(world)]


def _suite(rank: int, world: int, seed: int, gloo: Any) -> list[str]:
    """Every supported collective on the default (checkmate) group and on ``gloo``; the mismatches."""
    import torch.distributed as dist

    from hosts.ring_config import ReduceOp, reference_allreduce

    failures: list[str] = []
    rng = random.Random(seed)

    def same(what: str, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        if ours.dtype != theirs.dtype or ours.shape != theirs.shape or not torch.equal(ours, theirs):
            diff = (ours.float() - theirs.float()).abs().max()
            failures.append(f"{what}: not bit-identical (max diff {diff})")

    def close(what: str, ours: torch.Tensor, theirs: torch.Tensor, magnitude: torch.Tensor) -> None:
        # two summation orders of N terms differ by at most (N-1) * eps * sum |x_i| per element
        bound = (world - 1) * torch.finfo(ours.dtype).eps * magnitude + 1e-30
        excess = (ours.float() - theirs.float()).abs() - bound
        if (excess > 0).any():
            failures.append(f"{what}: beyond (N-1)*eps*sum|x| (worst excess {excess.max()})")

    for dtype in DTYPES:
        for case in range(SEEDS):
            # sizes: tiny, odd (chunks of unequal size), several datagrams per chunk
            n = rng.choice([1, 7, 1001, 3 * 2235 + 5, 20000])
            tag = f"{dtype} n={n} case {case}"
            xs = _inputs(rng.randrange(1 << 30), world, n, dtype)
            mine = xs[rank]
            magnitude = torch.stack([x.float().abs() for x in xs]).sum(0)

            # all_reduce SUM and AVG: the ring's order exactly; gloo's exactly with 2 ranks
            for op, torch_op in ((ReduceOp.SUM, dist.ReduceOp.SUM), (ReduceOp.AVG, dist.ReduceOp.AVG)):
                ours = mine.clone()
                dist.all_reduce(ours, op=torch_op)
                same(f"all_reduce {op.name} vs reference_allreduce, {tag}", ours, reference_allreduce(xs, op))
                theirs = mine.clone()
                dist.all_reduce(theirs, group=gloo)  # gloo has no AVG: its SUM, divided
                if op is ReduceOp.AVG:
                    theirs = theirs / world
                if world == 2 and op is ReduceOp.SUM:
                    same(f"all_reduce SUM vs gloo, {tag}", ours, theirs)
                close(f"all_reduce {op.name} vs gloo, {tag}", ours, theirs, magnitude)

            # all_gather (list) and all_gather_into_tensor: bytes moved, bit for bit
            shaped = mine.view(-1, 1) if n % 2 else mine.view(2, -1)
            ours_list = [torch.empty_like(shaped) for _ in range(world)]
            theirs_list = [torch.empty_like(shaped) for _ in range(world)]
            dist.all_gather(ours_list, shaped)
            dist.all_gather(theirs_list, shaped, group=gloo)
            for r in range(world):
                same(f"all_gather[{r}], {tag}", ours_list[r], theirs_list[r])
            ours_flat = torch.empty(world * n, dtype=dtype)
            theirs_flat = torch.empty(world * n, dtype=dtype)
            dist.all_gather_single(ours_flat, mine)
            dist.all_gather_single(theirs_flat, mine, group=gloo)
            same(f"all_gather_into_tensor, {tag}", ours_flat, theirs_flat)

            # broadcast from a random root
            root = rng.randrange(world)
            ours = mine.clone()
            theirs = mine.clone()
            dist.broadcast(ours, src=root)
            dist.broadcast(theirs, src=root, group=gloo)
            same(f"broadcast from {root}, {tag}", ours, theirs)
            same(f"broadcast from {root} vs its input, {tag}", ours, xs[root])

            # reduce_scatter_tensor and reduce_scatter (list): rank order; gloo's exactly with 2 ranks
            big = [x.repeat(world)[: world * n] for x in xs]  # every rank's world*n input
            part = slice(rank * n, (rank + 1) * n)
            expected = big[0][part].clone()
            part_magnitude = torch.stack([b[part].float().abs() for b in big]).sum(0)
            for r in range(1, world):
                expected += big[r][part]
            ours = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_single(ours, big[rank])
            same(f"reduce_scatter_tensor vs rank-order sum, {tag}", ours, expected)
            ours_list_out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter(ours_list_out, list(big[rank].chunk(world)))
            same(f"reduce_scatter (list) vs reduce_scatter_tensor, {tag}", ours_list_out, ours)
            theirs = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_single(theirs, big[rank], group=gloo)
            if world == 2:
                same(f"reduce_scatter_tensor vs gloo, {tag}", ours, theirs)
            close(f"reduce_scatter_tensor vs gloo, {tag}", ours, theirs, part_magnitude)
            # functional collectives (DTensor's): all_reduce and reduce_scatter_tensor (its coalesced form)
            functional = torch.ops._c10d_functional
            group_name = _ours(None).group_name
            ours = functional.wait_tensor(
                functional.reduce_scatter_tensor(big[rank], "sum", world, group_name)
            )
            same(f"functional reduce_scatter_tensor, {tag}", ours, expected)
            ours = functional.wait_tensor(functional.all_reduce(mine, "sum", group_name))
            same(f"functional all_reduce, {tag}", ours, reference_allreduce(xs, ReduceOp.SUM))
            avg = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_single(avg, big[rank], op=dist.ReduceOp.AVG)
            close(f"reduce_scatter_tensor AVG vs SUM/world, {tag}", avg, expected / world, part_magnitude)

    # integers: exact sums in any order, equal to gloo's
    counts = torch.tensor([rank + 1, 10**12 + rank, -rank], dtype=torch.int64)
    ours = counts.clone()
    theirs = counts.clone()
    dist.all_reduce(ours)
    dist.all_reduce(theirs, group=gloo)
    same("all_reduce int64", ours, theirs)
    dist.barrier()
    return failures


def _unsupported(rank: int, world: int) -> list[str]:
    """Each unsupported call must raise NotImplementedError naming the collective; the others' messages."""
    import torch.distributed as dist

    t = torch.ones(4)
    calls = {
        "all_reduce with ReduceOp.MAX": lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX),
        "reduce": lambda: dist.reduce(t, dst=0),
        "gather": lambda: dist.gather(t, [torch.empty(4) for _ in range(world)] if rank == 0 else None),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(4 * world), torch.ones(4 * world)),
        "send": lambda: dist.send(t, dst=(rank + 1) % world),
    }
    messages = []
    for name, call in calls.items():
        try:
            call()
        except NotImplementedError as exc:
            messages.append(f"{name}: {exc}")
        else:
            messages.append(f"{name}: did not raise")
    return messages


def _ddp_steps(process_group: Any, rank: int, steps: int, hook: bool = False) -> dict[str, Any]:
    """A small MLP under DDP on ``process_group``, trained ``steps`` SGD steps; its parameters after.

    ``hook``: with :func:`hosts.enable_checkmate` too (no shadows): the hook's ring reduces the
    gradients, tagged per iteration, and the backend carries DDP's set-up and the agent's rendezvous.
    """
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hosts.ddp import CheckmateConfig, enable_checkmate

    torch.manual_seed(100 + rank)  # different on every rank: DDP's initial broadcast must fix that
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    ddp = DDP(model, process_group=process_group, bucket_cap_mb=0.001)  # several buckets
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    agent = None
    if hook:
        config = CheckmateConfig(
            job_id=5, rank=rank, world_size=process_group.size(), bind=(_bind(rank, 225), 48879)
        )
        agent = enable_checkmate(ddp, optimizer, config)
    data = torch.Generator().manual_seed(7 + rank)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=data)
        loss = ddp(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    out: dict[str, Any] = {"params": [p.detach().clone() for p in model.parameters()]}
    if agent is not None:
        out["tagged_iterations"] = sorted({tag.iteration for tag in agent.ring.tag_log})
        agent.close()
    return out


def _tagging(rank: int, world: int) -> dict[str, int]:
    """REPLICATE datagrams this rank sends in one all_reduce: untagged default group, tagged group."""
    import torch.distributed as dist

    from checkmate.wire import Flags
    from hosts.c10d_backend import CheckmateBackendOptions

    tagged_group = dist.new_group(
        backend="checkmate", pg_options=CheckmateBackendOptions(bind=_bind(rank, 220), tag=True, job_id=9)
    )
    counts = {}
    for name, group in (("default", dist.group.WORLD), ("tagged", tagged_group)):
        pg = _ours(tagged_group if name == "tagged" else None)
        seen = {"data": 0, "replicate": 0}

        def tap(
            header: Any, addr: Any, retransmit: bool, seen: dict[str, int] = seen, job: int = pg.job_id
        ) -> None:
            if header.job_id == job and not retransmit:
                seen["data"] += 1
                seen["replicate"] += bool(header.flags & Flags.REPLICATE)

        pg.transport.tap = tap
        t = torch.ones(3000)
        dist.all_reduce(t, group=group)
        dist.barrier(group=group)
        pg.transport.tap = None
        counts.update({f"{name}.{k}": v for k, v in seen.items()})
    dist.destroy_process_group(tagged_group)
    return counts


def _silent_peers(rank: int, world: int) -> str:
    """Rank 0 gathers on a group (timeout 1 s) where no other rank joins: its error, else ""."""
    import datetime

    import torch.distributed as dist

    from hosts.c10d_backend import CheckmateBackendOptions

    group = dist.new_group(
        backend="checkmate",
        timeout=datetime.timedelta(seconds=1),
        pg_options=CheckmateBackendOptions(bind=_bind(rank, 215)),
    )
    message = ""
    if rank == 0:
        try:
            dist.all_gather_single(torch.empty(4 * world), torch.ones(4), group=group)
        except Exception as exc:  # noqa: BLE001 - torch wraps the Work's error in its own type
            message = str(exc)
    dist.barrier()
    dist.destroy_process_group(group)
    return message


def _dead_peer(rank: int, world: int) -> str:
    """On a group with a 1 s peer timeout, every rank but 0 shuts its transport; rank 0's
    all_gather then fails naming a peer that stopped answering (its error, else "")."""
    import datetime

    import torch.distributed as dist

    from hosts.c10d_backend import CheckmateBackendOptions

    group = dist.new_group(
        backend="checkmate",
        timeout=datetime.timedelta(seconds=60),
        pg_options=CheckmateBackendOptions(bind=_bind(rank, 210), peer_timeout=1.0),
    )
    message = ""
    if rank != 0:
        _ours(group).close(drain_timeout=0.0)
    dist.barrier()
    if rank == 0:
        try:
            dist.all_gather_single(torch.empty(4 * world), torch.ones(4), group=group)
        except Exception as exc:  # noqa: BLE001 - torch wraps the Work's error in its own type
            message = str(exc)
    dist.barrier()
    dist.destroy_process_group(group)
    return message


def _rank_main(
    rank: int, world: int, port: int, backend: str, datapath: str, loss: float, seed: int
) -> dict[str, Any]:
    import torch.distributed as dist

    from hosts.faults import FaultConfig

    if datapath == "native" and not loss:  # the plain one-argument call, configured by the environment
        os.environ["CHECKMATE_TRANSPORT"] = datapath
        gloo = _init(rank, world, port, backend)
    else:
        faults = FaultConfig(seed=seed + rank, send_drop=loss, reorder=loss)
        gloo = _init(rank, world, port, backend, datapath=datapath, faults=faults)
    default = _ours(None)  # asserts the default group is the backend's
    out: dict[str, Any] = {
        "backend": dist.get_backend(),
        "name": default.name(),
        "address": default.transport.address,
        "datapath": default.transport.datapath,
    }
    out["failures"] = _suite(rank, world, seed, gloo)
    out["unsupported"] = _unsupported(rank, world)
    ours = _ddp_steps(default, rank, steps=3)["params"]
    theirs = _ddp_steps(gloo, rank, steps=3)["params"]
    hooked = _ddp_steps(default, rank, steps=3, hook=True)
    out["ddp_same"] = [torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)]
    out["ddp_close"] = [torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ours, theirs, strict=True)]
    out["ddp_params"] = ours
    out["hook_same"] = [torch.equal(a, b) for a, b in zip(hooked["params"], theirs, strict=True)]
    out["hook_close"] = [
        torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(hooked["params"], theirs, strict=True)
    ]
    out["hook_tagged_iterations"] = hooked["tagged_iterations"]
    out["tagging"] = _tagging(rank, world)
    out["silent"] = _silent_peers(rank, world)
    out["dead"] = _dead_peer(rank, world)
    out["drops"] = default.transport.drops()
    out["faults"] = {k: v for k, v in default.transport.stats().items() if k.startswith("fault.")}
    # every rank still listens until all are idle (a lost last ACK is resent only to a live peer)
    out["idle"] = default.transport.wait_idle(10.0)
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    out["closed_at_destroy"] = default.closed
    return out


@pytest.mark.parametrize(
    ("world", "backend", "datapath", "loss"),
    [(2, "checkmate", "native", 0.0), (3, "cpu:checkmate", "python", 0.02)],
)
def test_backend_matches_gloo(world: int, backend: str, datapath: str, loss: float) -> None:
    """Both spellings, both data paths (the compiled one and the Python reference), 2 and 3 ranks;
    the 3-rank run drops and reorders 2 % of its datagrams (the flows and the ring repair them)."""
    seed = random.SystemRandom().randrange(1 << 30)
    results = run_ranks(_rank_main, world, listen_port(), backend, datapath, loss, seed, timeout=150)
    for rank, out in enumerate(results):
        assert out["backend"] == backend and out["name"] == "checkmate", out
        assert out["address"][0] == _bind(rank) and out["datapath"] == datapath
        assert out["closed_at_destroy"]  # destroy_process_group closed the transport
        # no datagram refused (a retransmission's duplicate, under load, is the transport working)
        assert set(out["drops"]) <= {"duplicate"} and out["idle"], (out["drops"], out["idle"])
        if loss:
            assert out["faults"].get("fault.send_drop", 0) > 0, out["faults"]
        assert out["failures"] == [], f"seed {seed}, rank {rank}:\n" + "\n".join(out["failures"])
        for message in out["unsupported"]:
            name = message.split(":")[0]
            assert "did not raise" not in message, message
            assert name.split()[0] in message.split(":", 1)[1] and "use " in message, message
        assert all(out["ddp_close"]), f"rank {rank}: DDP on checkmate drifted from gloo"
        if world == 2:  # one addition per element: the same bits as gloo
            assert all(out["ddp_same"]), f"rank {rank}: DDP on checkmate differs from gloo"
        # DDP + enable_checkmate on the backend: the hook's ring reduces (tagged, per iteration)
        assert out["hook_tagged_iterations"] == [0, 1, 2], out["hook_tagged_iterations"]
        assert all(out["hook_close"]), f"rank {rank}: DDP + hook on checkmate drifted from gloo"
        if world == 2:
            assert all(out["hook_same"]), f"rank {rank}: DDP + hook on checkmate differs from gloo"
        # every rank ends DDP with the same parameters
        for a, b in zip(out["ddp_params"], results[0]["ddp_params"], strict=True):
            assert torch.equal(a, b)
        if rank == 0:  # a collective the others never join fails in time, naming them
            silent = list(range(1, world))
            assert f"still waiting for ranks {silent}" in out["silent"], out["silent"]
        if rank == 0:  # a peer that stops answering fails the collective, naming it
            assert "is not responding" in out["dead"] and "rank " in out["dead"], out["dead"]
        tags = out["tagging"]
        assert tags["default.data"] > 0 and tags["default.replicate"] == 0, tags
        # tagged: exactly the owner's first transmission of its reduced chunk (3000 fp32 / world: 1 datagram)
        assert tags["tagged.replicate"] == 1, tags


def test_missing_secret_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from checkmate.auth import AuthConfigError
    from hosts.c10d_backend import BACKEND_NAME

    for name in ("CHECKMATE_JOB_SECRET", "CHECKMATE_JOB_SECRET_FILE", "CHECKMATE_JOB_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(AuthConfigError, match=f'backend "{BACKEND_NAME}": no job secret'):
        dist.init_process_group(BACKEND_NAME, store=dist.HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()


def test_wrong_options_type_is_refused() -> None:
    import torch.distributed as dist

    import hosts.c10d_backend  # noqa: F401

    with pytest.raises(TypeError, match="CheckmateBackendOptions"):
        dist.init_process_group("checkmate", store=dist.HashStore(), rank=0, world_size=1, pg_options=1)
    assert not dist.is_initialized()
