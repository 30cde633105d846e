"""A minimal ZeRO-1/2/3 data-parallel Adam over flat partitions, for the CPU layout runs.

Each of ``dp`` ranks (of each TP rank's data-parallel group) keeps an fp32
*master* copy and the Adam state of one contiguous range of the flat
concatenation of its (TP-local) parameters (sorted by name, padded to a
multiple of ``dp * align``: the partition
:func:`checkmate.universal.layout.rank_holdings` describes). A step
all-reduces the flat gradient over the DP group, runs Adam on the rank's
range and all-gathers the updated ranges into the parameters. With ``zero=3``
the rank's checkpoint holds the parameters as that flat range too (what a
ZeRO-3 rank owns; the whole parameters are only gathered to compute). It
exists to show universal checkpoints leaving and entering a real
flat-partitioned optimizer (the layout of DeepSpeed ZeRO-1/2/3), not as a
production optimizer: it all-reduces gradients instead of reduce-scattering
them, so ZeRO-2 differs from ZeRO-1 only in the layout it declares.
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
from checkmate.universal.load import _local, load_rank
from checkmate.universal.spec import LayoutError, ReshapeSpec

logger = logging.getLogger(__name__)


class FlatZeroAdam:
    """ZeRO Adam for ``model`` on ``rank`` of ``layout`` (``zero`` 1, 2 or 3, any ``tp``, ``pp = 1``)."""

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        rank: int,
        spec: ReshapeSpec,
        shapes: Mapping[str, Sequence[int]],
        lr: float,
    ) -> None:
        if not layout.zero or layout.pp != 1:
            raise LayoutError(f"FlatZeroAdam runs zero=1/2/3 with pp=1, not {layout.describe()}")
        self.model, self.layout, self.rank, self.spec = model, layout, rank, spec
        _, self.dp_index, self.tp_index = layout.coords(rank)
        self.group = None  # one DP group per TP index; every rank creates every group, in order
        for tp_index in range(layout.tp):
            group = dist.new_group([d * layout.tp + tp_index for d in range(layout.dp)])
            if tp_index == self.tp_index:
                self.group = group
        self.holdings = rank_holdings(layout, spec, shapes, rank)
        if self.holdings.state_flat is None:
            raise LayoutError(f"{layout.describe()} has no flat partition")
        self.partition = self.holdings.state_flat
        named = dict(model.named_parameters())
        self.params = [named[local] for local in sorted(self.holdings.tensors)]
        self.order = [_local(p) for p in self.params]
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

    def _grad(self, parameter: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        grad = parameter.grad
        if grad is None:
            return torch.zeros_like(_local(parameter))
        if (
            isinstance(grad, DTensor)
            and isinstance(parameter, DTensor)
            and grad.placements != parameter.placements
        ):
            grad = grad.redistribute(placements=parameter.placements)
        return _local(grad)

    def step(self) -> None:
        grads = self._flat([self._grad(p) for p in self.params])
        dist.all_reduce(grads, group=self.group)
        self.master.grad = grads[self._range()].div_(self.layout.dp)
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        self._gather()
        for parameter in self.params:
            parameter.grad = None

    def _gather(self) -> None:
        """Every rank's updated range into the (TP-local) parameters."""
        gathered = [torch.empty(self.partition.numel) for _ in range(self.layout.dp)]
        dist.all_gather(gathered, self.master.detach().contiguous(), group=self.group)
        flat = torch.cat(gathered)
        cursor = 0
        with torch.no_grad():
            for parameter in self.order:
                parameter.copy_(flat[cursor : cursor + parameter.numel()].view_as(parameter))
                cursor += parameter.numel()

    def _written_once(self, records: list[Record]) -> list[Record]:
        """TP-replicated parameters are written by TP index 0 only (unless their rule averages)."""
        if self.tp_index == 0:
            return records
        return [
            r for r in records if self.spec.rule(r.name).cat_dim is not None or self.spec.rule(r.name).average
        ]

    def records(self) -> list[Record]:
        """This rank's records: its flat range of every Adam state; the parameters whole from DP
        rank 0 (ZeRO-1/2) or as every rank's flat range (ZeRO-3)."""
        out: list[Record] = []
        named = dict(self.model.named_parameters())
        if self.layout.zero == 3:
            out += records_of_flat(self.partition, PARAM_STATE, self.master.detach())
        elif self.dp_index == 0:
            for local, tensor in self.holdings.tensors.items():
                out += records_of_tensor(tensor, PARAM_STATE, _local(named[local]).detach())
        state = self.inner.state.get(self.master, {})
        for key, value in state.items():
            if value.dim() == 0:
                out += [Record(t.name, key, None, value.clone()) for t in self.holdings.tensors.values()]
            else:
                out += records_of_flat(self.partition, key, value)
        return self._written_once(out)

    def meta(self) -> dict[str, object]:
        hyper = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"}
        names = sorted(t.name for t in self.holdings.tensors.values())
        return {"kind": "Adam", "param_groups": [{**hyper, "params": names}]}

    def load(self, reader: CheckpointReader, spec: ReshapeSpec) -> None:
        """Parameters (whole, or ZeRO-3's flat range then gathered) and this rank's flat range of
        the Adam state, reading only those bytes."""
        state = load_rank(reader, self.layout, self.rank, spec)
        named = dict(self.model.named_parameters())
        if state.param_flat is not None:
            self.master.data.copy_(state.param_flat)
            self._gather()
        else:
            with torch.no_grad():
                for local, value in state.params.items():
                    _local(named[local]).copy_(value)
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
