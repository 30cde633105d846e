"""A tiny transformer for universal-checkpoint runs, and its layouts.

Pre-norm decoder with fused QKV (``attn.qkv``, parts ``[d, d, d]``), a fused
gated MLP (``mlp.gate_up``, parts ``[f, f]``), a vocabulary padded for tensor
parallelism (``embed``, ``head``) and replicated norms and biases: every kind
of reshaping rule in one small model. :func:`build` makes the model of a
layout: ``tp`` x ``dp`` with torch tensor parallelism (``ColwiseParallel`` /
``RowwiseParallel``, vocabulary-parallel embedding) on a ``("dp", "tp")``
mesh, FSDP2 (``fully_shard``) on the ``dp`` mesh (over TP: 2-D), or one pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from checkmate.universal.layout import Layout, stage_names
from checkmate.universal.spec import ReshapeRule, ReshapeSpec


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 49
    dim: int = 16
    heads: int = 4
    layers: int = 2
    ffn: int = 24
    seq: int = 8
    batch: int = 12
    tied: bool = False
    """The LM head shares the input embedding's tensor (``ties: head.weight -> embed.weight``)."""


def tiny_spec(config: TinyConfig) -> ReshapeSpec:
    d, f, h = config.dim, config.ffn, config.dim // config.heads
    return ReshapeSpec(
        rules=(
            ReshapeRule(r"embed\.weight", cat_dim=0, vocab=True),
            ReshapeRule(r"head\.weight", cat_dim=0, vocab=True),
            ReshapeRule(r"layers\.\d+\.attn\.qkv\.(weight|bias)", cat_dim=0, parts=(d, d, d), head_dim=h),
            ReshapeRule(r"layers\.\d+\.attn\.out\.weight", cat_dim=1, head_dim=h),
            ReshapeRule(r"layers\.\d+\.mlp\.gate_up\.weight", cat_dim=0, parts=(f, f)),
            ReshapeRule(r"layers\.\d+\.mlp\.down\.weight", cat_dim=1),
        ),
        first_stage=(r"embed\.weight",),
        ties=(("head.weight", "embed.weight"),) if config.tied else (),
    )


def logical_shapes(config: TinyConfig) -> dict[str, tuple[int, ...]]:
    d, f, v = config.dim, config.ffn, config.vocab
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (v, d), "norm.weight": (d,)}
    if not config.tied:
        shapes["head.weight"] = (v, d)
    for i in range(config.layers):
        shapes.update(
            {
                f"layers.{i}.attn_norm.weight": (d,),
                f"layers.{i}.attn.qkv.weight": (3 * d, d),
                f"layers.{i}.attn.qkv.bias": (3 * d,),
                f"layers.{i}.attn.out.weight": (d, d),
                f"layers.{i}.attn.out.bias": (d,),
                f"layers.{i}.mlp_norm.weight": (d,),
                f"layers.{i}.mlp.gate_up.weight": (2 * f, d),
                f"layers.{i}.mlp.down.weight": (d, f),
            }
        )
    return shapes


def initial_atoms(config: TinyConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    atoms = {}
    for name, shape in sorted(logical_shapes(config).items()):
        if name.endswith("norm.weight"):
            atoms[name] = torch.ones(shape)
        elif name.endswith("bias"):
            atoms[name] = torch.zeros(shape)
        else:
            atoms[name] = torch.randn(shape, generator=generator) * (0.3 if name.startswith("embed") else 0.2)
    return atoms


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # TP-local: this rank's heads of each
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.reshape(batch, seq, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim)
        self.attn = Attention(config.dim, config.heads)
        self.mlp_norm = nn.RMSNorm(config.dim)
        self.mlp = MLP(config.dim, config.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    """Whole model (``first`` and ``last``) or one pipeline stage's part of it."""

    def __init__(
        self, config: TinyConfig, padded_vocab: int, layers: int, first: bool = True, last: bool = True
    ) -> None:
        super().__init__()
        self.vocab = config.vocab
        self.first, self.last, self.tied = first, last, config.tied
        if first:
            self.embed = nn.Embedding(padded_vocab, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(layers))
        if last:
            self.norm = nn.RMSNorm(config.dim)
            self.head = nn.Linear(config.dim, padded_vocab, bias=False)
        self.tie()

    def tie(self) -> None:
        """With ``config.tied``, the head uses the embedding's tensor (when this part holds both)."""
        if self.tied and self.first and self.last:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        if self.last:
            x = self.head(self.norm(x))
            if x.shape[-1] != self.vocab:
                x = x[..., : self.vocab].contiguous()  # padded vocabulary rows never score
        return x


def build(config: TinyConfig, layout: Layout, rank: int) -> TinyLM:
    """The model of ``layout`` on ``rank`` (parameters uninitialised: load a checkpoint into it)."""
    pp_index, _, _ = layout.coords(rank)
    padded = -(-config.vocab // layout.tp) * layout.tp
    per_stage = config.layers // layout.pp
    model = TinyLM(config, padded, per_stage, first=pp_index == 0, last=pp_index == layout.pp - 1)
    if layout.pp > 1 and (layout.tp > 1 or layout.fsdp):
        raise ValueError("the tiny model's pipeline runs use plain tensors (tp=1, no fsdp)")
    if layout.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        plan = {
            "embed": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate()),
        }
        for i in range(per_stage):
            plan.update(
                {
                    f"layers.{i}.attn.qkv": ColwiseParallel(),
                    f"layers.{i}.attn.out": RowwiseParallel(),
                    f"layers.{i}.mlp.gate_up": ColwiseParallel(),
                    f"layers.{i}.mlp.down": RowwiseParallel(),
                }
            )
        parallelize_module(model, mesh["tp"], plan)
        model.tie()  # parallelize_module gave each module its own DTensor; both are Shard(0) of one tensor
    if layout.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dp_mesh = (
            mesh["dp"] if layout.tp > 1 else init_device_mesh("cpu", (layout.dp,), mesh_dim_names=("dp",))
        )
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def global_names(config: TinyConfig, layout: Layout, rank: int) -> dict[str, str]:
    """The model's local parameter names -> checkpoint names on ``rank``."""
    return stage_names(tiny_spec(config), sorted(logical_shapes(config)), layout.pp)[layout.coords(rank)[0]]


EVAL_STEP = 10_000
"""The evaluation batch (``batch(config, EVAL_STEP)``): a step index no run trains on."""


def batch(config: TinyConfig, step: int) -> torch.Tensor:
    """Global batch of step ``step``: each row t, m*t+1, ... mod vocab (m in 1..3), from a random start."""
    generator = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, config.vocab, (config.batch, 1), generator=generator)
    mult = torch.randint(1, 4, (config.batch, 1), generator=generator)
    tokens = [start]
    for _ in range(config.seq):
        tokens.append((tokens[-1] * mult + 1) % config.vocab)
    return torch.cat(tokens, dim=1)
