"""Train your own model under TP=2, save a universal checkpoint, resume it under FSDP2.

Run: ``python examples/universal_checkpoint.py [FOLDER]`` (2 CPU ranks, gloo, ~20 s).
The same code is the example at the top of docs/checkpoint-format.md and in
README.md; tests/universal/test_readme_example.py runs it and checks that the
two copies are this file.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from checkmate.checkpoint import CheckpointReader
from checkmate.universal import ReshapeRule, ReshapeSpec, load_module, save_universal

DIM, HEADS, VOCAB = 32, 4, 64
# What tensors cannot say: qkv fuses three [32, 32] matrices of 8-wide heads.
SPEC = ReshapeSpec(
    (ReshapeRule(r"block\.qkv\.(weight|bias)", cat_dim=0, parts=(DIM,) * 3, head_dim=DIM // HEADS),)
)


class _Block(nn.Module):
    """The attention block's projections (parameter names ``block.qkv.*``, ``block.out.*``)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)  # fused q, k, v
        self.out = nn.Linear(DIM, DIM)


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = _Block()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        q, k, v = self.block.qkv(x).chunk(3, dim=-1)  # under TP: this rank's heads of each
        b, s, width = q.shape
        q, k, v = (t.reshape(b, s, width // (DIM // HEADS), DIM // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, width)
        return self.head(x + self.block.out(y))


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (8, 9), generator=torch.Generator().manual_seed(step))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, rows: slice) -> dict[int, float]:
    losses = {}
    for step in steps:
        tokens = batch(step)[rows]
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses[step] = mean.item() / dist.get_world_size()
    return losses


def rank_main(rank: int, folder: str, phase: str) -> None:
    torch.set_num_threads(1)
    root = Path(folder)
    dist.init_process_group("gloo", init_method=f"file://{root}/store-{phase}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = TinyGPT()
    if phase == "tp":  # TP=2: every rank sees the whole batch, holds half of each matrix
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("model",))
        plan = {
            "block.qkv": ColwiseParallel(),
            "block.out": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Replicate()),  # vocabulary-parallel head, whole logits
        }
        parallelize_module(model, mesh, plan)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = train(model, optimizer, range(1, 4), slice(None))
        save_universal(root / "ckpt", 3, model, optimizer, spec=SPEC)  # collective
        losses.update(train(model, optimizer, range(4, 6), slice(None)))
    else:  # FSDP2 on 2 ranks: each rank takes half the batch, holds half of each parameter
        fully_shard(model, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)  # the checkpoint's lr wins
        step = load_module(CheckpointReader(root / "ckpt"), model, optimizer)
        losses = train(model, optimizer, range(step + 1, 6), slice(rank * 4, rank * 4 + 4))
    if rank == 0:
        (root / f"{phase}.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    folder = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="universal-example-")
    for phase in ("tp", "fsdp2"):
        mp.start_processes(rank_main, args=(folder, phase), nprocs=2, start_method="fork")
    tp, fsdp2 = (json.loads((Path(folder) / f"{p}.json").read_text()) for p in ("tp", "fsdp2"))
    for step in ("4", "5"):
        print(f"step {step}: TP=2 loss {tp[step]:.6f}, resumed under FSDP2 {fsdp2[step]:.6f}")
        assert abs(tp[step] - fsdp2[step]) < 1e-5
