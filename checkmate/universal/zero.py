"""A minimal ZeRO-1 data-parallel Adam over flat partitions, for the CPU layout runs.

Each of ``dp`` ranks keeps the whole model, and an fp32 *master* copy and the
Adam state of one contiguous range of the flat concatenation of all
parameters (sorted by name, padded to a multiple of ``dp * align``: the
partition :func:`checkmate.universal.layout.rank_holdings` describes). A step
all-reduces the flat gradient, runs Adam on the rank's range and all-gathers
the updated ranges into the parameters. It exists to show universal
checkpoints leaving and entering a real flat-partitioned optimizer (the layout
of DeepSpeed ZeRO-1/2), not as a production optimizer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from checkmate.checkpoint import PARAM_STATE, CheckpointReader
from checkmate.universal.extract import Record, records_of_flat, records_of_tensor
from checkmate.universal.layout import Layout, rank_holdings
from checkmate.universal.load import load_rank
from checkmate.universal.spec import LayoutError, ReshapeSpec

logger = logging.getLogger(__name__)


class FlatZeroAdam:
    """ZeRO-1 Adam for ``model`` on ``rank`` of ``layout`` (``zero`` 1 or 2, ``tp = pp = 1``)."""

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        rank: int,
        spec: ReshapeSpec,
        shapes: Mapping[str, Sequence[int]],
        lr: float,
    ) -> None:
        if layout.zero not in (1, 2) or layout.tp != 1 or layout.pp != 1:
            raise LayoutError(f"FlatZeroAdam runs zero=1/2 with tp=pp=1, not {layout.describe()}")
        self.model, self.layout, self.rank = model, layout, rank
        self.holdings = rank_holdings(layout, spec, shapes, rank)
        if self.holdings.state_flat is None:
            raise LayoutError(f"{layout.describe()} has no flat partition")
        self.partition = self.holdings.state_flat
        named = dict(model.named_parameters())
        self.order = [named[local] for local in sorted(self.holdings.tensors)]
        self.total = sum(p.numel() for p in self.order)
        self.padded = self.partition.numel * layout.dp
        self.master = nn.Parameter(self._flat([p.detach() for p in self.order])[self._range()].clone())
        self.inner = torch.optim.Adam([self.master], lr=lr)

    def _range(self) -> slice:
        return slice(self.partition.start, self.partition.start + self.partition.numel)

    def _flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.padded)
        flat[: self.total] = torch.cat([t.reshape(-1) for t in tensors])
        return flat

    def step(self) -> None:
        grads = self._flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.order])
        dist.all_reduce(grads)
        self.master.grad = grads[self._range()].div_(self.layout.dp)
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        gathered = [torch.empty(self.partition.numel) for _ in range(self.layout.dp)]
        dist.all_gather(gathered, self.master.detach().contiguous())
        flat = torch.cat(gathered)
        cursor = 0
        with torch.no_grad():
            for parameter in self.order:
                parameter.copy_(flat[cursor : cursor + parameter.numel()].view_as(parameter))
                cursor += parameter.numel()
                parameter.grad = None

    def records(self) -> list[Record]:
        """This rank's records: its flat range of every Adam state; the parameters from DP rank 0."""
        out: list[Record] = []
        named = dict(self.model.named_parameters())
        if self.layout.coords(self.rank)[1] == 0:
            for local, tensor in self.holdings.tensors.items():
                out += records_of_tensor(tensor, PARAM_STATE, named[local].detach())
        state = self.inner.state.get(self.master, {})
        for key, value in state.items():
            if value.dim() == 0:
                out += [Record(t.name, key, None, value.clone()) for t in self.holdings.tensors.values()]
            else:
                out += records_of_flat(self.partition, key, value)
        return out

    def meta(self) -> dict[str, object]:
        hyper = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"}
        names = sorted(t.name for t in self.holdings.tensors.values())
        return {"kind": "Adam", "param_groups": [{**hyper, "params": names}]}

    def load(self, reader: CheckpointReader, spec: ReshapeSpec) -> None:
        """Parameters (whole) and this rank's flat range of the Adam state, reading only those bytes."""
        state = load_rank(reader, self.layout, self.rank, spec)
        named = dict(self.model.named_parameters())
        with torch.no_grad():
            for local, value in state.params.items():
                named[local].copy_(value)
        self.master.data.copy_(self._flat([p.detach() for p in self.order])[self._range()])
        steps = {float(v["step"]) for v in state.scalars.values() if "step" in v}
        if len(steps) > 1:
            raise LayoutError(
                f"parameters were saved at different Adam steps {sorted(steps)}; one flat Adam holds one"
            )
        adam: dict[str, torch.Tensor] = {k: v.clone() for k, v in state.state_flat.items()}
        if steps and adam:
            adam["step"] = torch.tensor(steps.pop())
            self.inner.state[self.master] = adam
