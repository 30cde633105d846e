"""The gallery: ordinary DDP scripts (tests/gallery/scripts) under Checkmate, 2 ranks, 2 shadows, loopback.

Each script uses only the public API (``hosts.resume``, ``hosts.enable_checkmate``)
and runs as torchrun would run it (``RANK``/``WORLD_SIZE``/``MASTER_*``, here in
forkserver children with torch preloaded), with ``CHECKMATE_REPLICATION=host`` (no
switch: the owner of each reduced chunk sends the shadow its copy). For each:

1. an uninterrupted run of N iterations: both ranks end bit-identical, every
   iteration is certified by both shadows (with fingerprints when the agent sends
   them: no divergence reported), and the shadows' state — parameters, optimizer
   state, buffers, stateful objects — equals the workers' bit for bit;
2. a run killed (SIGKILL, both ranks) in the middle of iteration K, then the same
   script started again: ``hosts.resume`` restores from the shadows' memory and the
   job ends bit-identical to the uninterrupted run (model state dict, optimizer
   state dict, every stateful object), and the shadows equal it again.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import runpy
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from checkmate import checkpoint as fmt
from checkmate.checkpoint.shadow_memory import fetch_state
from hosts.recovery import from_snapshots, workers_finished
from shadow.node import ShadowConfig, ShadowNode
from shadow.snapshots import SnapshotPolicy
from tests.listen_ports import listen_port

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parents[2]
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "numpy", "torch.distributed", "hosts.ddp"])
JOB_ID = 31
WORKER_HOST = 160
"""Rank r binds 127.0.0.(160 + r), shadow i 127.0.0.(162 + i): addresses no other test uses."""
SHADOW_HOST = 162


def _rank_main(script: str, argv: list[str], env: dict[str, str]) -> None:
    os.environ.update(env)
    if "GALLERY_STDOUT" in env:  # this rank's output to a file ({rank} replaced)
        sys.stdout = open(env["GALLERY_STDOUT"].format(rank=env["RANK"]), "w", buffering=1)  # noqa: SIM115
    sys.path[:0] = [str(SCRIPTS), str(ROOT)]
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")
    atexit._run_exitfuncs()  # as a python process does at exit (multiprocessing children skip it)


class Job:
    """Both ranks of one script run."""

    def __init__(
        self, script: str, argv: list[str], nodes: list[ShadowNode], env: dict[str, str] | None = None
    ) -> None:
        shadows = ",".join(f"{n.name}={n.control_address[0]}:{n.control_address[1]}" for n in nodes)
        base = {
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(listen_port()),
            "CHECKMATE_JOB_ID": str(JOB_ID),
            "CHECKMATE_SHADOWS": shadows,
            "CHECKMATE_REPLICATION": "host",
            "CHECKMATE_TIMEOUT": "60",
        }
        base.update({k: v for k, v in os.environ.items() if k.startswith("CHECKMATE_JOB_SECRET")})
        base.update(env or {})
        self.procs = [
            _CTX.Process(
                target=_rank_main,
                args=(
                    str(SCRIPTS / script),
                    argv,
                    {**base, "RANK": str(rank), "CHECKMATE_BIND": f"127.0.0.{WORKER_HOST + rank}"},
                ),
                daemon=True,
            )
            for rank in range(2)
        ]
        for p in self.procs:
            p.start()

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in self.procs]
        if None in codes:
            self.kill()
        return codes

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, 9)
        for p in self.procs:
            p.join(5)


def _shadows(directory: Path) -> list[ShadowNode]:
    nodes = []
    for i in range(2):
        config = ShadowConfig(
            name=f"s{i}",
            control_bind=(f"127.0.0.{SHADOW_HOST + i}", 0),
            # any free port: host replication asks each shadow where it listens (not the default 48879)
            data_bind=(f"127.0.0.{SHADOW_HOST + i}", 0),
            snapshots=SnapshotPolicy(directory / "ckpt", every_iterations=1, keep=2),
        )
        nodes.append(ShadowNode(config).start())
    return nodes


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.is_floating_point():
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
    return t


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal values, tensors bit for bit (dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {a!r} vs {b!r}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert torch.equal(_bits(a), _bits(b)), f"{where}: tensors differ"
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping) and set(a) == set(b), f"{where}: keys {set(a)} vs {set(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, f"{where}: {a!r} vs {b!r}"
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} vs {b!r}"


def _dumps(out: Path) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _run(
    script: str, argv: list[str], nodes: list[ShadowNode], timeout: float, env: dict[str, str] | None = None
) -> None:
    codes = Job(script, argv, nodes, env).wait(timeout)
    assert codes == [0, 0], f"{script} {argv}: exit codes {codes}"


def assert_shadows_hold(nodes: list[ShadowNode], dump: dict[str, Any], iteration: int) -> None:
    """The shadows' merged state after ``iteration`` equals a worker's final state bit for bit."""
    state = fetch_state([n.control_address for n in nodes], timeout=20)
    assert state["iteration"] == iteration
    model = dump["model"]
    for name, value in state["parameters"].items():
        assert_same(value, model[name], f"shadow parameter {name}")
    by_index = dump["optimizer"]["state"]
    for index, name in enumerate(dump["optimizer_names"]):
        assert_same(state["optimizer_state"].get(name, {}), by_index.get(index, {}), f"shadow {name} state")
    job_state = state["job_state"]
    assert job_state is not None, "the shadows hold no job state"
    buffers = job_state.buffers
    assert set(buffers) == set(dump["buffer_names"]), sorted(buffers)
    for name, value in buffers.items():
        assert_same(value, model[name], f"shadow buffer {name}")
    assert_same(job_state.stateful, dump["stateful"], "shadow stateful")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in dump["optimizer"]["param_groups"]]
    assert_same(job_state.param_groups, groups, "shadow param groups")


def run_case(
    script: str, option: str = "", iterations: int = 8, kill_at: int = 4, from_disk: bool = False
) -> None:
    """Uninterrupted vs killed-and-resumed; shadows against workers in both.

    ``from_disk``: the shadows die with the workers; the job resumes from their newest
    complete checkpoint on disk (new, empty shadows answer no state).
    """
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="gallery-"))
    extra = ["--option", option] if option else []
    nodes = _shadows(tmp / "a")
    try:
        _run(script, ["--iterations", str(iterations), "--out", str(tmp / "a" / "out"), *extra], nodes, 120)
        ref, other = _dumps(tmp / "a" / "out")
        assert ref["certified"] and not ref["divergences"], (ref["certified"], ref["divergences"])
        assert ref["start_iteration"] == 0
        # parameters only: DDP broadcasts rank 0's buffers before each forward pass, then every
        # rank updates its own from its batch; rank 0's are the ones checkpointed and restored
        params = set(ref["model"]) - set(ref["buffer_names"])
        assert_same(
            {k: ref["model"][k] for k in params}, {k: other["model"][k] for k in params}, "rank 1 vs rank 0"
        )
        assert_same(ref["optimizer"], other["optimizer"], "rank 1 vs rank 0 optimizer")
        assert_shadows_hold(nodes, ref, iterations - 1)
        # the disk tier caught up: with a snapshot due every iteration, the newest state is on disk
        for n in nodes:
            assert n.snapshotter is not None and n.snapshotter.flush(30)
        assert fmt.complete_steps(tmp / "a" / "ckpt")[-1] == iterations - 1
        assert all(n.status()["disk"]["age_iterations"] == 0 for n in nodes)
    finally:
        for n in nodes:
            n.close()

    nodes = _shadows(tmp / "b")
    try:
        argv = ["--iterations", str(iterations), "--out", str(tmp / "b" / "out"), *extra]
        job = Job(script, [*argv, "--hang-at", str(kill_at)], nodes)
        try:
            for n in nodes:  # the commit of kill_at - 1 goes out at kill_at's forward pass
                assert n.wait_applied(kill_at - 1, 60), n.status()
        finally:
            job.kill()
        assert all(n.applied_iteration == kill_at - 1 for n in nodes), [n.status() for n in nodes]
        # the loss a restore reports is measured from the shadows' live answers: killed after
        # kill_at's forward pass, the workers had finished kill_at - 1, which the shadows hold
        finished = workers_finished({n.name: n.control_address for n in nodes}, 10.0, JOB_ID)
        assert finished == kill_at - 1, finished
        env = None
        resume_at = kill_at
        if from_disk:
            for n in nodes:
                n.close()  # the shadows are lost too; their snapshots and status files stay
            on_disk = from_snapshots(tmp / "b" / "ckpt")
            assert on_disk.lost_iterations == kill_at - 1 - on_disk.iteration, on_disk.lost_iterations
            resume_at = on_disk.iteration + 1
            nodes = _shadows(tmp / "c")
            env = {"CHECKMATE_SNAPSHOT_DIR": str(tmp / "b" / "ckpt")}
        _run(script, argv, nodes, 120, env)
        resumed, _ = _dumps(tmp / "b" / "out")
        assert resumed["certified"] and not resumed["divergences"]
        assert resumed["start_iteration"] == resume_at, "the job did not resume where the state was"
        assert_same(resumed["model"], ref["model"], "resumed model")
        assert_same(resumed["optimizer"], ref["optimizer"], "resumed optimizer")
        assert_same(resumed["stateful"], ref["stateful"], "resumed stateful")
        assert_shadows_hold(nodes, resumed, iterations - 1)
    finally:
        for n in nodes:
            n.close()


# Each case starts 3 two-rank jobs (about 13 s on an idle 2-core machine, 3x that under load):
# the cases that exercise the most (buffers, stateful objects, scaler skips, grad-None, bf16)
# run in make test, the rest with the slow marker.
SLOW = pytest.mark.slow
CASES = [
    pytest.param("mlp_sgd_nesterov.py", "", id="mlp-sgd-nesterov", marks=SLOW),
    pytest.param("cnn_batchnorm.py", "", id="cnn-batchnorm-steplr"),
    pytest.param("frozen_unused.py", "", id="frozen-and-unused"),
    pytest.param("tied_weights.py", "", id="tied-weights", marks=SLOW),
    pytest.param("two_groups_scheduler.py", "", id="two-groups-scheduler", marks=SLOW),
    pytest.param("accumulation_no_sync.py", "", id="accumulation-no-sync", marks=SLOW),
    pytest.param("clip_attribute.py", "", id="clip-attribute", marks=SLOW),
    pytest.param("clip_by_name.py", "", id="clip-by-name", marks=SLOW),
    pytest.param("amp_gradscaler_fp16.py", "", id="amp-gradscaler-fp16"),
    pytest.param("bf16_buckets.py", "", id="bf16-buckets"),
    pytest.param("transformer_lm.py", "", id="transformer-lm"),
]
OPTIMIZERS = [
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Adagrad",
    "Adadelta",
    "ASGD",
    "Rprop",
]


@pytest.mark.parametrize("script,option", CASES)
def test_gallery_script(script: str, option: str) -> None:
    run_case(script, option)


@pytest.mark.slow
def test_gallery_resume_from_disk_when_the_shadows_are_lost_too() -> None:
    run_case("cnn_batchnorm.py", from_disk=True)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_gallery_every_optimizer(optimizer: str) -> None:
    run_case("every_optimizer.py", optimizer, iterations=6, kill_at=3)


SCHEDULERS = [
    "LambdaLR",
    "MultiplicativeLR",
    "StepLR",
    "MultiStepLR",
    "ConstantLR",
    "LinearLR",
    "ExponentialLR",
    "PolynomialLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "CyclicLR",
    "OneCycleLR",
    "OneCycleLR-Adam",
    "ReduceLROnPlateau",
    "SequentialLR",
    "ChainedScheduler",
    "named-groups",
]
FAST_SCHEDULERS = {"OneCycleLR", "named-groups"}
"""In make test: the scheduler keys and the user keys a param group gains (the rest: slow)."""


@pytest.mark.parametrize(
    "option", [pytest.param(s, marks=() if s in FAST_SCHEDULERS else SLOW, id=s) for s in SCHEDULERS]
)
def test_gallery_every_scheduler(option: str) -> None:
    """Every torch.optim.lr_scheduler scheduler and named groups: killed and resumed bit-identically."""
    run_case("every_scheduler.py", option)
