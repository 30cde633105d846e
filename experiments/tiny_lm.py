"""TinyLM, the reference workload: a small byte-level transformer, its corpus and training defaults.

The demo's and the benchmark's worker script (``examples/train_lm.py``), the
stage benchmarks (``experiments.bench.auth``, ``experiments.bench.shadow``) and the tests all
train this model, so it sits in the shared package below every stage.

The corpus is real text that every Python installation ships: the source of a
fixed list of standard-library modules, read from the interpreter's own
stdlib folder (no downloads). Batches are a pure function of (seed, global
sample index), so a job that restarts at iteration t — with the same or a
different number of workers — resumes at exactly the right samples: the data
position of a checkpoint is just the iteration.
"""

from __future__ import annotations

import hashlib
import logging
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

CORPUS_MODULES = (
    "textwrap.py",
    "json/decoder.py",
    "json/encoder.py",
    "heapq.py",
    "bisect.py",
    "fnmatch.py",
    "shlex.py",
    "string.py",
    "colorsys.py",
    "difflib.py",
)


def load_corpus(max_bytes: int = 400_000) -> torch.Tensor:
    """The training text as a uint8 tensor (the same bytes on every machine with this Python)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks = []
    for name in CORPUS_MODULES:
        path = stdlib / name
        if path.is_file():
            chunks.append(path.read_bytes())
        else:
            logger.warning("corpus module %s is missing from %s", name, stdlib)
    data = b"\n".join(chunks)[:max_bytes]
    if len(data) < 10_000:
        raise RuntimeError(f"the corpus in {stdlib} has only {len(data)} bytes")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def corpus_digest(corpus: torch.Tensor) -> str:
    return hashlib.sha256(corpus.numpy().tobytes()).hexdigest()[:16]


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    context: int = 64
    width: int = 64
    heads: int = 4
    layers: int = 2


class TinyLM(nn.Module):
    """A pre-norm decoder-only transformer over bytes."""

    def __init__(self, config: ModelConfig = ModelConfig()) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.width)
        self.position = nn.Embedding(config.context, config.width)
        layer = nn.TransformerEncoderLayer(
            config.width,
            config.heads,
            dim_feedforward=4 * config.width,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, config.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        mask = torch.triu(torch.full((config.context, config.context), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        hidden = self.embed(tokens) + self.position(positions)
        mask: torch.Tensor = self.causal_mask  # type: ignore[assignment]
        hidden = self.blocks(hidden, mask=mask[:length, :length], is_causal=True)
        return self.head(self.norm(hidden))


def batch_for(
    corpus: torch.Tensor,
    seed: int,
    iteration: int,
    rank: int,
    world_size: int,
    global_batch: int,
    context: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share of the global batch of ``iteration`` (inputs, next-byte targets).

    Sample ``s`` of the run starts at a position drawn from a generator seeded
    with (seed, s), so any worker count covers the same samples in the same order.
    """
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} does not split over {world_size} workers")
    per_rank = global_batch // world_size
    first = iteration * global_batch + rank * per_rank
    starts = []
    for sample in range(first, first + per_rank):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + sample)
        starts.append(int(torch.randint(0, corpus.numel() - context - 1, (1,), generator=generator)))
    index = torch.tensor(starts).unsqueeze(1) + torch.arange(context + 1)
    window = corpus[index].long()
    return window[:, :-1], window[:, 1:]


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def cosine_lr(iteration: int, total: int, peak: float = 3e-3, warmup: int = 5) -> float:
    """Warm-up then cosine decay; a pure function of the iteration (nothing to checkpoint)."""
    if iteration < warmup:
        return peak * (iteration + 1) / warmup
    progress = (iteration - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass(frozen=True)
class TrainConfig:
    """What one run trains: the schedule, batches, model size and optimizer."""

    iterations: int = 100
    global_batch: int = 48
    seed: int = 0
    peak_lr: float = 3e-3
    warmup: int = 5
    weight_decay: float = 0.01
    max_norm: float = 1.0
    bucket_cap_mb: float = 0.1
    """Small buckets: several per iteration, so every shadow owns some."""
    model: ModelConfig = ModelConfig()
