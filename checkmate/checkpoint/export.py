"""Exports of a universal checkpoint into the formats other tools load.

* ``export_dcp``: a torch distributed checkpoint (``torch.distributed.checkpoint.save``)
  of ``{"model": ..., "optim": ...}`` in the FQN-keyed layout of
  ``torch.distributed.checkpoint.state_dict.get_state_dict``, so ``dcp.load`` +
  ``set_state_dict`` restore model and optimizer.
* ``export_safetensors``: model weights as ``model-0000k-of-0000n.safetensors``
  with a ``model.safetensors.index.json`` weight map (the Hugging Face layout).
* ``export_deepspeed_universal``: DeepSpeed's universal checkpoint layout,
  ``<tag>/zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`` (each ``{"param": tensor}``),
  ``<tag>/zero/optimizer_state.pt`` (param groups) and ``latest_universal``.
* ``reshard``: the same checkpoint rewritten by K' shard writers.

Every export reads only through :class:`~checkmate.checkpoint.reader.CheckpointReader`, so it is
validated first; ``reshard`` writes through :mod:`checkmate.checkpoint.storage`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from checkmate.checkpoint import storage
from checkmate.checkpoint.format import PARAM_STATE, CheckpointError, step_dir
from checkmate.checkpoint.reader import CheckpointReader

logger = logging.getLogger(__name__)

DEEPSPEED_STATE_FILES = {PARAM_STATE: "fp32"}


def _optimizer_states(reader: CheckpointReader) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: {
            state: reader.parameter(name, state) for state in reader.states_of(name) if state != PARAM_STATE
        }
        for name in reader.parameters
    }


def _param_groups(reader: CheckpointReader) -> list[dict[str, Any]]:
    groups = reader.global_state.get("optimizer", {}).get("param_groups", [])
    return [dict(g) for g in groups]


def export_dcp(reader: CheckpointReader, output: Path) -> Path:
    """Write a torch distributed checkpoint of model and optimizer to ``output``."""
    import torch.distributed.checkpoint as dcp

    model = {name: reader.parameter(name) for name in reader.parameters}
    optim = {"state": _optimizer_states(reader), "param_groups": _param_groups(reader)}
    output.mkdir(parents=True, exist_ok=True)
    dcp.save({"model": model, "optim": optim}, checkpoint_id=str(output), no_dist=True)
    from checkmate.universal.interop import record_dcp_layout
    from checkmate.universal.spec import spec_of_checkpoint

    record_dcp_layout(output, None, spec_of_checkpoint(reader.global_state))  # whole tensors: tp=1
    return output


def export_safetensors(reader: CheckpointReader, output: Path, max_shard_bytes: int = 2 << 30) -> Path:
    """Write the model weights as safetensors shards plus an index; returns the index path."""
    output.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for name in sorted(reader.parameters):
        tensor = reader.parameter(name).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and sizes[-1] + nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor
        sizes[-1] += nbytes
    weight_map = {}
    for index, tensors in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(output / file), metadata={"format": "pt", "step": str(reader.step)})
        weight_map.update({name: file for name in tensors})
    index_path = output / "model.safetensors.index.json"
    index_path.write_text(
        json.dumps(
            {"metadata": {"total_size": sum(sizes), "step": reader.step}, "weight_map": weight_map},
            indent=1,
            sort_keys=True,
        )
    )
    return index_path


def export_deepspeed_universal(reader: CheckpointReader, output: Path, tag: str | None = None) -> Path:
    """Write DeepSpeed's universal checkpoint layout under ``output/<tag>``; returns that folder.

    Each file carries the TP re-slicing keys DeepSpeed's loader reads (``cat_dim``,
    ``vocab_tensor``, ``param_n_sub_params``) from the checkpoint's reshape spec, if any.
    """
    from checkmate.universal.interop import deepspeed_metadata
    from checkmate.universal.spec import spec_of_checkpoint

    spec = spec_of_checkpoint(reader.global_state)
    metadata = {name: deepspeed_metadata(spec, name) for name in reader.parameters}  # refuse before writing
    tag = tag or f"global_step{reader.step}_universal"
    folder = output / tag
    zero = folder / "zero"
    for name in reader.parameters:
        directory = zero / name
        directory.mkdir(parents=True, exist_ok=True)
        for state in reader.states_of(name):
            file = DEEPSPEED_STATE_FILES.get(state, state)
            value = reader.parameter(name, state)
            keys = metadata[name] if value.dim() else {}
            torch.save({"param": value, **keys}, directory / f"{file}.pt")
    torch.save(
        {"optimizer_state_dict": {"param_groups": _param_groups(reader)}, "step": reader.step},
        zero / "optimizer_state.pt",
    )
    (output / "latest_universal").write_text(tag)
    return folder


def reshard(reader: CheckpointReader, output: Path, num_shards: int) -> Path:
    """Rewrite the checkpoint with ``num_shards`` writers, whole parameters balanced by size."""
    if num_shards < 1:
        raise CheckpointError("reshard needs at least one shard")
    loads = [0] * num_shards
    owners: list[list[str]] = [[] for _ in range(num_shards)]
    by_size = sorted(reader.parameters, key=lambda n: (-_numel(reader, n), n))
    for name in by_size:
        target = loads.index(min(loads))
        owners[target].append(name)
        loads[target] += _numel(reader, name)
    parameters = {n: (list(m["shape"]), m["dtype"]) for n, m in reader.parameters.items()}
    storage.write_global(
        output,
        reader.step,
        parameters,
        reader.global_state.get("optimizer", {}),
        reader.global_state.get("extra", {}),
    )
    for shard, names in enumerate(owners):
        states = {n: {s: reader.parameter(n, s) for s in reader.states_of(n)} for n in names}
        storage.write_shard(output, reader.step, shard, num_shards, states)
    storage.update_latest(output, reader.step)
    return step_dir(output, reader.step)


def _numel(reader: CheckpointReader, name: str) -> int:
    numel = 1
    for dim in reader.parameters[name]["shape"]:
        numel *= dim
    return numel
