"""A tiny DeepSpeed (or FSDP2) training job on one CPU rank, run as its own process by the tests.

``python -m tests.universal.deepspeed_job MODE OUT [ARGS]`` writes ``{"losses": {step: loss}}``
to OUT (JSON):

* ``reference STAGE CKPT``: DeepSpeed ZeRO-STAGE trains steps 1-4, saving its own
  checkpoint after step 2 under CKPT (tag ``step2``);
* ``resume-deepspeed STAGE FOLDER TAG``: a fresh engine with
  ``"checkpoint": {"load_universal": true}`` loads FOLDER/TAG and trains steps 3-4;
* ``resume-fsdp2 ROOT``: the same model under FSDP2 (``fully_shard``, one rank)
  loads the universal checkpoint at ROOT with ``checkmate.universal.load_module``
  and trains steps 3-4 with torch's Adam (hyperparameters from the checkpoint).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch


def model() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)


def _engine(stage: int, universal: bool) -> Any:
    import deepspeed

    config: dict[str, Any] = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # (DeepSpeed 0.19 ZeRO clips at 1.0 unless told; torch does not)
    }
    if universal:
        config["checkpoint"] = {"load_universal": True}
    deepspeed.init_distributed(dist_backend="gloo")
    net = model()
    net.universal_checkpoint_info = {"universal_checkpoint_version": 0.2}  # ds_to_universal needs it
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    return engine


def _train(step_fn: Any, steps: range) -> dict[int, float]:
    return {step: step_fn(step) for step in steps}


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    mode, out = argv[0], Path(argv[1])
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    losses: dict[int, float] = {}
    if mode in ("reference", "resume-deepspeed"):
        engine = _engine(int(argv[2]), universal=mode == "resume-deepspeed")

        def step_fn(step: int) -> float:
            x, y = batch(step)
            loss = ((engine(x) - y) ** 2).mean()
            engine.backward(loss)
            engine.step()
            return float(loss.detach())

        if mode == "reference":
            losses = _train(step_fn, range(1, 3))
            engine.save_checkpoint(argv[3], tag="step2")
            losses.update(_train(step_fn, range(3, 5)))
        else:
            engine.load_checkpoint(argv[3], tag=argv[4])
            losses = _train(step_fn, range(3, 5))
    elif mode == "resume-fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        from checkmate.checkpoint import CheckpointReader
        from checkmate.universal.load import load_module

        dist.init_process_group("gloo", rank=0, world_size=1)
        net = model()
        fully_shard(net)
        optimizer = torch.optim.Adam(net.parameters())
        load_module(CheckpointReader(Path(argv[2])), net, optimizer)

        def fsdp_step(step: int) -> float:
            x, y = batch(step)
            loss = ((net(x) - y) ** 2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return float(loss.detach())

        losses = _train(fsdp_step, range(3, 5))
        dist.destroy_process_group()
    else:
        raise SystemExit(f"unknown mode {mode}")
    out.write_text(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main(sys.argv[1:])
