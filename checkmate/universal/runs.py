"""Multi-rank CPU runs of the tiny transformer: train under one layout, resume under another.

:func:`run_layout` forks one process per rank (gloo, one thread each), loads
a universal checkpoint into the layout's model and optimizer, optionally
re-saves it at once (to check the round trip element for element), trains
``steps`` iterations on the same global batches whatever the layout, saves
universal checkpoints at the requested steps and returns the loss per step.
Layouts: ``tp`` x ``dp`` (torch tensor parallelism + data-parallel gradient
all-reduce), ``fsdp=1`` (FSDP2 ``fully_shard``), ``pp=2`` (two pipeline
stages, activations and their gradients sent between them), ``zero=1``
(:class:`~checkmate.universal.zero.FlatZeroAdam` over padded flat partitions).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from checkmate import checkpoint as fmt
from checkmate.universal.layout import Layout
from checkmate.universal.load import _local, load_module
from checkmate.universal.save import save_records, save_universal
from checkmate.universal.tiny import TinyConfig, batch, build, initial_atoms, logical_shapes, tiny_spec
from checkmate.universal.zero import FlatZeroAdam

logger = logging.getLogger(__name__)


@dataclass
class RunJob:
    layout: str
    load_root: str
    first_step: int
    last_step: int
    """Train steps first_step+1 .. last_step (a checkpoint of step s holds s optimizer steps)."""
    save_root: str | None = None
    save_steps: list[int] = field(default_factory=list)
    resave_root: str | None = None
    dcp_root: str | None = None
    """Also save torch DCP checkpoints (``get_state_dict``) at ``save_steps`` under ``dcp_root/step-N``."""
    results: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    """TinyConfig fields (``tied``, sizes); defaults where absent."""
    lr: float = 1e-2


def write_initial(root: Path, config: TinyConfig, seed: int = 0) -> Path:
    """Step 0 of the tiny model (no optimizer state yet), the start of every run."""
    atoms = initial_atoms(config, seed)
    extra = {"universal": {"spec": tiny_spec(config).to_json(), "source_layout": "tp=1,pp=1,dp=1"}}
    fmt.write_global(root, 0, fmt.parameters_of(atoms.items()), {"kind": "Adam"}, extra)
    fmt.write_shard(root, 0, 0, 1, {n: {"param": t} for n, t in atoms.items()})
    fmt.update_latest(root, 0)
    return root


def _grads_over_dp(model: torch.nn.Module, group: object, dp: int) -> None:
    from torch.distributed.tensor import DTensor

    for parameter in model.parameters():
        grad = parameter.grad
        if grad is None:
            continue
        if (
            isinstance(grad, DTensor)
            and isinstance(parameter, DTensor)
            and grad.placements != parameter.placements
        ):
            grad = grad.redistribute(placements=parameter.placements)
            parameter.grad = grad
        local = _local(grad)
        dist.all_reduce(local, group=group)
        local.div_(dp)


def _step(
    job: RunJob,
    config: TinyConfig,
    layout: Layout,
    rank: int,
    model: torch.nn.Module,
    dp_group: object,
    step: int,
) -> float:
    pp_index, dp_index, _ = layout.coords(rank)
    tokens = batch(config, step)
    rows = config.batch // layout.dp
    mine = tokens[dp_index * rows : (dp_index + 1) * rows]
    inputs, targets = mine[:, :-1], mine[:, 1:]
    if layout.pp == 1:
        loss = F.cross_entropy(model(inputs).reshape(-1, config.vocab), targets.reshape(-1))
        loss.backward()
    else:
        shape = (rows, config.seq, config.dim)
        if pp_index == 0:
            hidden = model(inputs)
            dist.send(hidden.detach().contiguous(), dst=rank + layout.dp * layout.tp)
            grad = torch.empty(shape)
            dist.recv(grad, src=rank + layout.dp * layout.tp)
            hidden.backward(grad)
            loss = torch.zeros(())
        else:
            hidden = torch.empty(shape)
            dist.recv(hidden, src=rank - layout.dp * layout.tp)
            hidden.requires_grad_()
            loss = F.cross_entropy(model(hidden).reshape(-1, config.vocab), targets.reshape(-1))
            loss.backward()
            if hidden.grad is None:
                raise RuntimeError("stage 1 computed no gradient for its input activations")
            dist.send(hidden.grad.contiguous(), dst=rank - layout.dp * layout.tp)
    if layout.dp > 1 and not layout.fsdp and not layout.zero:
        _grads_over_dp(model, dp_group, layout.dp)
    value = loss.detach().clone()
    dist.all_reduce(value)  # sum over every rank: dp copies differ, tp copies equal, pp stage 0 adds 0
    return float(value) / (layout.dp * layout.tp)


def _save_dcp(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: Any, vocab: int
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from checkmate.universal.interop import record_dcp_layout

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))
    record_dcp_layout(folder, model, spec, vocab=vocab)  # what DCP does not say: TP degree, spec


def rank_main(rank: int, job_dict: dict[str, object], store: str) -> None:
    torch.set_num_threads(1)
    job = RunJob(**job_dict)  # type: ignore[arg-type]
    config = TinyConfig(**job.config)
    layout = Layout.parse(job.layout)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=layout.world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        model = build(config, layout, rank)
        spec, shapes = tiny_spec(config), logical_shapes(config)
        reader = fmt.CheckpointReader(Path(job.load_root), job.first_step)
        zero = FlatZeroAdam(model, layout, rank, spec, shapes, job.lr) if layout.zero else None
        optimizer = torch.optim.Adam(model.parameters(), lr=job.lr)
        if zero is not None:
            zero.load(reader, spec)
        else:
            load_module(reader, model, optimizer, layout, rank, spec)

        def save(root: Path, step: int) -> None:
            if zero is not None:
                save_records(root, step, zero.records(), zero.meta(), layout, spec, shapes)
            else:
                save_universal(root, step, model, optimizer, layout, spec, shapes)

        if job.resave_root:
            save(Path(job.resave_root), job.first_step)
        dp_group = None
        if layout.dp > 1 and not layout.fsdp and not layout.zero:
            # one group per (stage, tp index); every rank creates every group, in the same order
            for stage in range(layout.pp):
                for tp_index in range(layout.tp):
                    members = [(stage * layout.dp + d) * layout.tp + tp_index for d in range(layout.dp)]
                    group = dist.new_group(members)
                    if rank in members:
                        dp_group = group
        losses = {}
        for step in range(job.first_step + 1, job.last_step + 1):
            losses[step] = _step(job, config, layout, rank, model, dp_group, step)
            if zero is not None:
                zero.step()
            else:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if job.save_root and step in job.save_steps:
                save(Path(job.save_root), step)
            if job.dcp_root and step in job.save_steps:
                _save_dcp(Path(job.dcp_root) / f"step-{step}", model, optimizer, spec, config.vocab)
        if rank == 0 and job.results:
            Path(job.results).write_text(json.dumps({"layout": job.layout, "losses": losses}))
    finally:
        dist.destroy_process_group()


def run_layout(job: RunJob, timeout: float = 300.0) -> dict[int, float]:
    """Run ``job`` on as many forked ranks as its layout has; returns the loss of each step."""
    layout = Layout.parse(job.layout)
    with tempfile.TemporaryDirectory(prefix="checkmate-run-") as scratch:
        store = os.path.join(scratch, "store")
        if not job.results:
            job.results = os.path.join(scratch, "results.json")
        context = mp.start_processes(
            rank_main, args=(asdict(job), store), nprocs=layout.world_size, join=False, start_method="fork"
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"layout {job.layout}: ranks still running after {timeout} s")
        document = json.loads(Path(job.results).read_text())
    return {int(k): float(v) for k, v in document["losses"].items()}
