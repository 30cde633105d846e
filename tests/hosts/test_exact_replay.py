"""Real 2-rank DDP runs over the host agent (``CHECKMATE_REPLICATION=host``) with two real shadows.

Each scenario is an ordinary training loop with one thing the shadows must reproduce
exactly (another torch.optim optimizer, an unused or frozen parameter, clipping
imported by name before enable, a GradScaler with skipped steps, a bf16 model).
After the run the shadows' parameters and optimizer state equal rank 0's bit for
bit, every iteration was certified, and no shadow reported a divergence. A
gradient changed behind the shadows' back is caught by the fingerprint within K
iterations, reported on rank 0 and in the shadow's status, and the shadow is
re-seeded. What cannot be replayed is refused at ``enable_checkmate`` or at the
step that changes it, naming the cause.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.utils import clip_grad_norm_  # imported by name before enable_checkmate, on purpose

from checkmate.fingerprint import DEFAULT_FINGERPRINT_BYTES
from checkmate.optimizers import OptimizerReplayError, check_replayable, non_elementwise_state
from checkmate.wire import CHECKMATE_UDP_PORT
from shadow.node import ShadowConfig, ShadowNode
from shadow.repair import RepairPolicy
from tests.hosts.harness import run_ranks

JOB_ID = 33
STEPS = 8
NET = f"127.{os.getpid() % 200 + 20}.{os.getpid() // 200 % 250}"
"""This test process's own loopback /24 (shadows .70/.71, workers .80+): suites that run at
the same time (other test files, other checkouts) never share an address."""


class Net(torch.nn.Module):
    def __init__(self, unused: bool = False, frozen: bool = False) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
        self.head = torch.nn.Linear(16, 4)
        self.spare = torch.nn.Linear(16, 4) if unused else None  # never used in forward
        if frozen:
            self.body[0].weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    body = [p for p in model.body.parameters()]  # type: ignore[union-attr]
    rest = [p for n, p in model.named_parameters() if not n.startswith("body.")]
    groups = [{"params": body}, {"params": rest, "lr": 5e-3}]
    return {
        "rmsprop": lambda: torch.optim.RMSprop(
            groups, lr=1e-2, momentum=0.5, centered=True, weight_decay=1e-3
        ),
        "adagrad": lambda: torch.optim.Adagrad(groups, lr=5e-2, lr_decay=1e-3, initial_accumulator_value=0.1),
        "asgd": lambda: torch.optim.ASGD(groups, lr=1e-2, t0=3, weight_decay=1e-3),
        "rprop": lambda: torch.optim.Rprop(groups, lr=1e-2, etas=(0.4, 1.3), maximize=True),
        "nadam": lambda: torch.optim.NAdam(groups, lr=1e-2, weight_decay=1e-3, decoupled_weight_decay=True),
        "radam": lambda: torch.optim.RAdam(groups, lr=1e-2, weight_decay=1e-3, foreach=True),
        "adamax": lambda: torch.optim.Adamax(groups, lr=1e-2, weight_decay=1e-3),
        "adadelta": lambda: torch.optim.Adadelta(groups, lr=0.5, weight_decay=1e-3),
        "adam-fused": lambda: torch.optim.Adam(groups, lr=1e-2, amsgrad=True, fused=True),
        "sgd": lambda: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    }[kind]()


def _train(
    rank: int, world: int, store: str, scenario: dict[str, Any], env: dict[str, str]
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts
    from hosts.ddp import CheckmateConfig

    # data addresses of their own: other suites use 127.0.0.10+rank
    os.environ.update(
        env,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        CHECKMATE_BIND=f"{env['TEST_NET']}.{80 + rank}",
    )
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Net(unused=scenario.get("unused", False), frozen=scenario.get("frozen", False))
    if scenario.get("bf16"):
        model = model.to(torch.bfloat16)
    ddp = DDP(model, bucket_cap_mb=0.002, find_unused_parameters=scenario.get("unused", False))
    opt = _optimizer(scenario.get("optimizer", "sgd"), ddp.module)
    config = dataclasses.replace(
        CheckmateConfig.from_env(),
        keep_iterations=64,
        fingerprint_every=scenario.get("every"),
        fingerprint_bytes=scenario.get("fingerprint_bytes", DEFAULT_FINGERPRINT_BYTES),
        compress=scenario.get("compress"),
    )
    agent = hosts.enable_checkmate(ddp, opt, config)
    # A scale that overflows at once (inf/NaN: a skipped step), then backs off far enough to train.
    scaler = (
        torch.amp.GradScaler("cpu", init_scale=2.0**127, backoff_factor=2.0**-20)
        if scenario.get("scaler")
        else None
    )
    g = torch.Generator().manual_seed(100 + rank)
    skipped = 0
    for step in range(STEPS):
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        if scenario.get("bf16"):
            x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(scenario.get("autocast"))):
            loss = torch.nn.functional.mse_loss(ddp(x).float(), y.float())
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss * 1e3).backward()
            scaler.unscale_(opt)
            clip_grad_norm_(ddp.parameters(), 0.5)
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += int(scaler.get_scale() < before)
            continue
        loss.backward()
        if scenario.get("clip"):
            clip_grad_norm_(ddp.parameters(), 0.05)  # the name imported at the top, before enable
        if scenario.get("tamper") is not None and step == scenario["tamper"]:
            with torch.no_grad():  # a user's own in-place change the shadows do not reproduce
                ddp.module.head.weight.grad.mul_(0.5)
        opt.step()
    # A diverged shadow certifies again only after rank 0 re-seeded it, which follows its
    # 'diverged' report on the same connection: when this returns True, rank 0 has been told.
    certified = agent.wait_certified(STEPS - 1, timeout=30.0)
    dist.barrier()
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    out = {
        "params": {n: p.detach().clone() for n, p in ddp.module.named_parameters()},
        "state": {
            names[id(p)]: {k: torch.as_tensor(v).clone() for k, v in s.items()} for p, s in opt.state.items()
        },
        "certified": certified,
        "divergences": agent.divergences,
        "commits": [(c.no_grad, c.gradient_scaling, c.clip_coefficient, c.skip_step) for c in agent.commits],
        "skipped": skipped,
    }
    agent.close()
    dist.destroy_process_group()
    return out


def _shadows() -> list[ShadowNode]:
    nodes = []
    for i in range(2):
        config = ShadowConfig(
            name=f"s{i}",
            control_bind=(f"{NET}.{70 + i}", 0),
            data_bind=(f"{NET}.{70 + i}", CHECKMATE_UDP_PORT),  # where host replication sends copies
            repair=RepairPolicy(grace=0.05, timeout=0.2),
        )
        nodes.append(ShadowNode(config).start())
    return nodes


def run_scenario(scenario: dict[str, Any]) -> tuple[dict[str, Any], list[ShadowNode]]:
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="exact-replay-"))
    nodes = _shadows()
    env = {
        "CHECKMATE_JOB_ID": str(JOB_ID),
        "CHECKMATE_REPLICATION": "host",
        "TEST_NET": NET,
        "CHECKMATE_SHADOWS": ",".join(
            f"{n.name}={n.control_address[0]}:{n.control_address[1]}" for n in nodes
        ),
    }
    try:
        results = run_ranks(_train, 2, f"{tmp}/store", scenario, env, timeout=120)
        for node in nodes:
            assert node.wait_applied(STEPS - 1, 10.0), node.status()
    except BaseException:
        for n in nodes:
            n.close()
        raise
    return results[0], nodes


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return (
        t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32) if t.element_size() == 4 else t
    )


def assert_shadows_equal(r0: dict[str, Any], nodes: list[ShadowNode]) -> None:
    params: dict[str, torch.Tensor] = {}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for node in nodes:
        params.update(node.parameters())
        states.update(node.optimizer_states())
    for name, value in r0["params"].items():
        assert params[name].dtype == value.dtype, name
        assert torch.equal(_bits(params[name]), _bits(value)), f"parameter {name} differs"
        want = r0["state"].get(name, {})
        got = {k: v for k, v in states.get(name, {}).items()}
        assert set(got) == set(want), (name, set(got), set(want))
        for key, tensor in want.items():
            assert torch.equal(_bits(torch.as_tensor(got[key])), _bits(tensor)), f"{name}::{key} differs"


def _exact(scenario: dict[str, Any]) -> dict[str, Any]:
    r0, nodes = run_scenario(scenario)
    try:
        assert r0["certified"], [n.status() for n in nodes]
        assert r0["divergences"] == []
        assert_shadows_equal(r0, nodes)
        for node in nodes:
            status = node.status()
            assert status["divergences"] == 0 and status["fingerprints_checked"] >= STEPS - 2, status
        return r0
    finally:
        for n in nodes:
            n.close()


@pytest.mark.parametrize("kind", ["rmsprop", "asgd", "adagrad"])
def test_other_torch_optimizers_replay_bit_for_bit(kind: str) -> None:
    _exact({"optimizer": kind})


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["rprop", "nadam", "radam", "adamax", "adadelta", "adam-fused"])
def test_every_torch_optimizer_replays_bit_for_bit(kind: str) -> None:
    _exact({"optimizer": kind})


def test_unused_and_frozen_parameters_are_skipped_like_torch_optim() -> None:
    r0 = _exact({"optimizer": "sgd", "unused": True, "frozen": True})
    # the unused parameters had no gradient at any step, and the commits said so
    assert all(set(no_grad) >= {"spare.weight", "spare.bias"} for no_grad, *_ in r0["commits"])
    assert "spare.weight" not in r0["state"]  # torch.optim never touched it


def test_clipping_imported_by_name_before_enable_is_replayed() -> None:
    r0 = _exact({"optimizer": "sgd", "clip": True})
    coefficients = [clip for _, _, clip, _ in r0["commits"]]
    assert all(c is not None and c < 1.0 for c in coefficients), coefficients


def test_grad_scaler_unscaling_and_skipped_steps_with_autocast_are_replayed() -> None:
    r0 = _exact({"optimizer": "adamax", "scaler": True, "autocast": True})
    assert r0["skipped"] >= 1, "the huge initial scale must overflow at least once"
    skips = [skip for *_, skip in r0["commits"]]
    assert sum(skips) == r0["skipped"]
    applied = [scaling for _, scaling, _, skip in r0["commits"] if not skip]
    assert applied and all([op["by"] for op in ops] == ["unscale", "clip"] for ops in applied), applied


def test_a_bf16_model_has_bf16_buckets_replayed_exactly() -> None:
    r0 = _exact({"optimizer": "sgd", "bf16": True})
    assert all(v.dtype == torch.bfloat16 for v in r0["params"].values())


def test_bf16_compressed_buckets_of_an_fp32_model_are_replayed_exactly() -> None:
    r0 = _exact({"optimizer": "adam-fused", "compress": "bf16"})
    assert all(v.dtype == torch.float32 for v in r0["params"].values())


def _hook_first(rank: int, world: int, store: str) -> str:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts
    from hosts.ddp import CheckmateConfigError

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    ddp = DDP(Net())
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)  # bf16 needs NCCL
    try:
        hosts.enable_checkmate(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
        return "nothing raised"
    except CheckmateConfigError as exc:
        return str(exc)
    finally:
        dist.destroy_process_group()


def test_ddps_own_compression_hook_is_refused_pointing_at_checkmate_compress() -> None:
    store = f"{tempfile.mkdtemp(prefix='hook-')}/store"
    for message in run_ranks(_hook_first, 2, store, timeout=60):
        assert "already has a communication hook (fp16_compress_hook)" in message, message
        assert "CHECKMATE_COMPRESS=bf16" in message


def test_a_gradient_changed_behind_the_shadows_back_is_caught_and_the_shadow_reseeded() -> None:
    every = 2
    r0, nodes = run_scenario({"optimizer": "sgd", "tamper": 2, "every": every})
    try:
        assert r0["divergences"], "rank 0 was not told"
        assert len(r0["divergences"]) == 1, r0["divergences"]  # the re-seeded shadow never diverges again
        first = r0["divergences"][0]
        assert 2 <= first["iteration"] < 2 + every, first  # caught within K iterations
        assert first["last_verified"] == 1, first  # the check before the change; 2 was never certified
        assert any(m.startswith("head.weight::") for m in first["mismatches"]), first
        owner = next(n for n in nodes if n.name == first["shadow"])
        status = owner.status()
        assert status["divergences"] == 1 and status["last_divergence"]["iteration"] == first["iteration"]
        # re-seeded from rank 0's state: equal again at the end, and certified
        deadline = time.monotonic() + 10
        while owner.status()["divergence"] is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert owner.status()["divergence"] is None and owner.status()["reseeds"] >= 3, owner.status()
        assert r0["certified"]
        assert_shadows_equal(r0, nodes)
    finally:
        for n in nodes:
            n.close()


def test_fingerprints_in_turns_catch_the_change_at_the_turn_of_the_changed_parameter() -> None:
    # 2048 parameter bytes per fingerprint cut Net into 4 turns: [body.0.weight], [body.0.bias],
    # [body.2.weight], [body.2.bias, head.weight, head.bias]; fingerprint t covers turn t % 4
    r0, nodes = run_scenario({"optimizer": "sgd", "tamper": 2, "every": 1, "fingerprint_bytes": 2048})
    try:
        assert len(r0["divergences"]) == 1, r0["divergences"]
        first = r0["divergences"][0]
        # head.weight differs from iteration 2 on; iteration 2's fingerprint covered body.2.weight
        # only, iteration 3's covers head.weight: seen there (with whole fingerprints: at 2)
        assert first["iteration"] == 3, first
        assert first["last_verified"] == 2, first  # iteration 2's turn matched
        assert all(m.startswith("head.weight::") for m in first["mismatches"]), first
        owner = next(n for n in nodes if n.name == first["shadow"])
        deadline = time.monotonic() + 10
        while owner.status()["divergence"] is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert owner.status()["divergence"] is None, owner.status()
        assert r0["certified"]
        assert_shadows_equal(r0, nodes)
    finally:
        for n in nodes:
            n.close()


# ---- refused at enable, or at the step that changes what the shadows were given -------------------
class _LocalOptimizer(torch.optim.SGD):
    pass


def test_what_the_shadows_cannot_replay_is_refused_naming_the_cause() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(OptimizerReplayError, match="LBFGS: its step\\(\\) needs a closure"):
        check_replayable(torch.optim.LBFGS(params))
    with pytest.raises(OptimizerReplayError, match="SparseAdam takes sparse gradients"):
        check_replayable(torch.optim.SparseAdam(params))
    with pytest.raises(OptimizerReplayError, match="differentiable=True"):
        check_replayable(torch.optim.Adam(params, differentiable=True))
    with pytest.raises(OptimizerReplayError, match="capturable=True"):
        check_replayable(torch.optim.Adam(params, capturable=True))

    class Inside(torch.optim.SGD):
        pass

    with pytest.raises(OptimizerReplayError, match="inside a function"):
        check_replayable(Inside(params, lr=0.1))
    main = type("MainOpt", (torch.optim.SGD,), {"__module__": "__main__"})
    with pytest.raises(OptimizerReplayError, match="defined in the training script"):
        check_replayable(main(params, lr=0.1))
    with pytest.raises(OptimizerReplayError, match="Adafactor: its state is factored"):
        check_replayable(torch.optim.Adafactor(params))
    # a class whose state is not element-wise is caught at its first step (it has no state before)
    matrix = torch.nn.Parameter(torch.ones(4, 3))
    factored = torch.optim.Adafactor([matrix])
    assert non_elementwise_state(factored) is None
    matrix.grad = torch.ones(4, 3)
    factored.step()
    assert "state 'row_var' of a [4, 3] parameter has shape [4, 1]" in str(non_elementwise_state(factored))
    check_replayable(_LocalOptimizer(params, lr=0.1))  # importable by module + name: replayed
    check_replayable(torch.optim.Adam(params, fused=True))  # fused on CPU: replayed


def _changes_mid_run(rank: int, world: int, store: str, change: str, net: str) -> str:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts
    from hosts.ddp import CheckmateStateError

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        CHECKMATE_JOB_ID="34",
        CHECKMATE_BIND=f"{net}.{84 + rank}",
    )
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    ddp = DDP(Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    agent = hosts.enable_checkmate(ddp, opt)
    message = "nothing raised"
    for step in range(3):
        loss = ddp(torch.randn(4, 16)).sum()
        opt.zero_grad()
        loss.backward()
        try:
            if step == 1 and change == "add_param_group":
                opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
            if step == 1 and change == "replace_parameter":
                ddp.module.head.bias = torch.nn.Parameter(torch.zeros(4))
            if step == 1 and change == "closure":
                opt.step(lambda: torch.zeros(()))
            opt.step()
        except CheckmateStateError as exc:
            message = str(exc)
            break
    agent.close()
    dist.destroy_process_group()
    return message


@pytest.mark.parametrize(
    "change,expected",
    [
        ("add_param_group", "SGD.add_param_group after enable_checkmate"),
        ("replace_parameter", "model parameter 'head.bias' was replaced"),
        ("closure", "SGD.step was given a closure"),
    ],
)
def test_a_change_mid_run_is_a_clear_error_where_it_happens(change: str, expected: str) -> None:
    store = f"{tempfile.mkdtemp(prefix='change-')}/store"
    for message in run_ranks(_changes_mid_run, 2, store, change, NET, timeout=60):
        assert expected in message, message


def test_compression_and_fingerprint_settings_from_the_environment() -> None:
    from hosts.ddp import CheckmateConfig, CheckmateConfigError

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    config = CheckmateConfig.from_env(env)
    assert (config.compress, config.fingerprint_every) == (None, None)  # None: 1 on CPU, 0 on a GPU
    config = CheckmateConfig.from_env(
        {**env, "CHECKMATE_COMPRESS": "bf16", "CHECKMATE_FINGERPRINT_EVERY": "5"}
    )
    assert (config.compress, config.fingerprint_every) == ("bf16", 5)
    with pytest.raises(CheckmateConfigError, match="compress='zstd': expected 'bf16', 'fp16' or None"):
        CheckmateConfig.from_env({**env, "CHECKMATE_COMPRESS": "zstd"})
    with pytest.raises(CheckmateConfigError, match="CHECKMATE_FINGERPRINT_EVERY='often' is not an integer"):
        CheckmateConfig.from_env({**env, "CHECKMATE_FINGERPRINT_EVERY": "often"})
    with pytest.raises(CheckmateConfigError, match="fingerprint_every \\(-1\\) must not be negative"):
        CheckmateConfig.from_env({**env, "CHECKMATE_FINGERPRINT_EVERY": "-1"})
    assert config.fingerprint_bytes == 32 << 20  # the default: a model over 32 MiB takes turns
    assert CheckmateConfig.from_env({**env, "CHECKMATE_FINGERPRINT_BYTES": "0"}).fingerprint_bytes == 0
    with pytest.raises(CheckmateConfigError, match="CHECKMATE_FINGERPRINT_BYTES='32M' is not an integer"):
        CheckmateConfig.from_env({**env, "CHECKMATE_FINGERPRINT_BYTES": "32M"})
    with pytest.raises(CheckmateConfigError, match="fingerprint_bytes \\(-5\\) must not be negative"):
        CheckmateConfig.from_env({**env, "CHECKMATE_FINGERPRINT_BYTES": "-5"})


def test_the_check_is_on_by_default_for_cpu_parameters_only() -> None:
    from hosts.ddp import _fingerprint_every

    cpu = torch.nn.Linear(2, 2)
    assert _fingerprint_every(None, cpu) == 1
    assert _fingerprint_every(3, cpu) == 3
    meta = torch.nn.Linear(2, 2, device="meta")  # stands in for a GPU: not the CPU the shadows replay on
    assert _fingerprint_every(None, meta) == 0
    assert _fingerprint_every(2, meta) == 2
