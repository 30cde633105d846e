"""One rank of an FSDP2 job on the ``checkmate`` backend with ``enable_checkmate_fsdp``, run in a worker host.

``python -m tests.topologies.fsdp_switch_worker --steps N --out DIR`` (torchrun's variables,
``CHECKMATE_JOB_FILE`` and ``CHECKMATE_BACKEND_BIND`` in the environment) trains the model of
tests/hosts/test_c10d_fsdp2_protected.py and writes ``DIR/rank<r>.json``: the tags this rank sent,
the SHA-256 of every reduced bucket (the bytes the shadows must receive), each bucket's size, and
the SHA-256 of the gathered final parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import hosts.c10d_backend  # noqa: F401  (registers "checkmate")
from checkmate.tensors import tensor_payload
from hosts.c10d_fsdp import enable_checkmate_fsdp


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("checkmate")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 7), torch.nn.Linear(7, 4)
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    agent = enable_checkmate_fsdp(model, optimizer)
    reduced: dict[str, str] = {}
    tagged_reduce_scatter = agent.group.tagged_reduce_scatter

    def recording(
        output: Any, input: Any, op: Any, iteration: int, bucket: int, on_reduced: Any = None
    ) -> Any:
        def record(value: torch.Tensor) -> None:
            reduced[f"{iteration}/{bucket}"] = hashlib.sha256(tensor_payload(value.contiguous())).hexdigest()
            if on_reduced is not None:
                on_reduced(value)

        return tagged_reduce_scatter(output, input, op, iteration, bucket, record)

    agent.group.tagged_reduce_scatter = recording  # type: ignore[method-assign]  # a probe of this test
    for step in range(args.steps):
        data = torch.Generator().manual_seed(1000 * rank + step)
        model(torch.randn(8, 16, generator=data)).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        optimizer.zero_grad()
    params = hashlib.sha256()
    for _, param in model.named_parameters():
        params.update(tensor_payload(param.full_tensor().detach().contiguous()))  # type: ignore[attr-defined]
    report = {
        "tags": [list(t) for t in agent.ring.tag_log],
        "reduced_sha256": reduced,
        "bucket_numels": [comm.numel for comm in agent.comms],
        "params_sha256": params.hexdigest(),
        "stats": {"transport": agent.group.transport.stats() if agent.group.transport else {}},
    }
    agent.close()
    dist.destroy_process_group()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
