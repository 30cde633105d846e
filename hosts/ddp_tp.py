"""DDP over a tensor-parallel model: each TP index's DP group all-reduces that TP shard's gradients.

torch tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel``) makes parameters DTensors, which DDP does not take. torch's
own ``_pre_dp_module_transform`` swaps them for local tensors but, for parameters
of nested modules, leaves DTensors in place of the parameters after the first
forward pass (its forward hook looks for them among the parameters, where they
no longer are), so the model's parameters change under the optimizer and under
:func:`hosts.enable_checkmate`'s checks. :func:`localize_tensor_parallel` keeps
one local ``nn.Parameter`` per DTensor parameter, for good: DDP, the optimizer
and Checkmate see those, every step. During each forward pass a DTensor view of
each (``DTensor.from_local``, differentiable) stands in its place, so the TP
styles compute as before and the gradient lands on the local parameter.

Typical use (rank = dp_index * tp + tp_index, the ``("dp", "tp")`` mesh)::

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan)
    localize_tensor_parallel(model)
    ddp = DDP(model, process_group=mesh["dp"].get_group())
    hosts.enable_checkmate(ddp, optimizer)     # with CHECKMATE_TP_DEGREE=tp

Runs on the training thread (module hooks); no lock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass
class _Localized:
    owner: nn.Module
    leaf: str
    local: nn.Parameter
    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]


def localize_tensor_parallel(module: nn.Module) -> list[str]:
    """Replace ``module``'s DTensor parameters with local ones (re-wrapped during forward).

    Returns the names of the parameters localized (empty: nothing was tensor parallel).
    Call it after ``parallelize_module`` and loading the state, before building DDP and
    the optimizer. Raises ValueError if called twice on the same module.
    """
    from torch.distributed.tensor import DTensor

    if getattr(module, "_checkmate_localized", None) is not None:
        raise ValueError("localize_tensor_parallel was already applied to this module")
    entries: list[_Localized] = []
    for name, parameter in list(module.named_parameters()):
        if not isinstance(parameter, DTensor):
            continue
        path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(path) if path else module
        local = nn.Parameter(parameter.to_local().detach(), requires_grad=parameter.requires_grad)
        entries.append(
            _Localized(
                owner,
                leaf,
                local,
                parameter.device_mesh,
                tuple(parameter.placements),
                parameter.shape,
                tuple(parameter.stride()),
            )
        )
        owner._parameters[leaf] = local

    def as_dtensors(_module: nn.Module, _args: Any) -> None:
        for e in entries:
            e.owner._parameters[e.leaf] = DTensor.from_local(  # type: ignore[assignment]
                e.local, e.mesh, e.placements, run_check=False, shape=e.shape, stride=e.stride
            )

    def as_locals(_module: nn.Module, _args: Any, _output: Any) -> None:
        for e in entries:
            e.owner._parameters[e.leaf] = e.local

    module.register_forward_pre_hook(as_dtensors)
    module.register_forward_hook(as_locals, always_call=True)
    module._checkmate_localized = entries  # type: ignore[assignment]
    names = [name for name, p in module.named_parameters() if any(p is e.local for e in entries)]
    logger.info("tensor parallel parameters kept local for DDP: %d of them", len(names))
    return names
