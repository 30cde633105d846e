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
    from torch.distributed.checkpoint.api import CheckpointException

    output.mkdir(parents=True, exist_ok=True)
    try:
        dcp.save({"model": model, "optim": optim}, checkpoint_id=str(output), no_dist=True)
    except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
        from checkmate.universal.interop import dcp_failure

        raise CheckpointError(f"{output}: torch DCP could not write it ({dcp_failure(exc)})") from None
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


DEEPSPEED_VERSION_WRITTEN = "0.19.0"
"""The ``ds_version`` our DeepSpeed export claims (its loaders check a version is present and >= 0.3.17)."""
DEEPSPEED_UNIVERSAL_INFO = {"universal_checkpoint_version": 0.2}


def export_deepspeed_universal(reader: CheckpointReader, output: Path, tag: str | None = None) -> Path:
    """Write DeepSpeed's universal checkpoint under ``output/<tag>``; returns that folder.

    The layout is what DeepSpeed's own ``ds_to_universal`` writes, so a running
    engine with ``"checkpoint": {"load_universal": true}`` resumes from it
    (``engine.load_checkpoint(output, tag)``, ZeRO-1/2 and ZeRO-3):

    * ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``: ``{"param": tensor}`` plus the
      TP re-slicing keys (``cat_dim``, ``vocab_tensor``, ``param_n_sub_params``)
      from the checkpoint's reshape spec; ``step.pt``: the bare 0-d tensor;
    * ``zero/optimizer_state.pt``: ``ds_version``, ``param_groups`` (ZeRO-1/2),
      ``optimizer_state_dict`` with the step and groups (ZeRO-3), ``step`` (our import);
    * ``mp_rank_00_model_states.pt`` and ``zero_pp_rank_0_mp_rank_00_model_states.pt``:
      ``module`` (weights and the job state's buffers), ``param_shapes``,
      ``global_steps`` and the engine's bookkeeping keys;
    * ``output/latest_universal`` names the tag.

    Only plain types and tensors are written (``torch.load(weights_only=True)`` reads them).
    """
    from checkmate.universal.interop import deepspeed_metadata
    from checkmate.universal.spec import spec_of_checkpoint

    reader.check_optimizer_states()
    spec = spec_of_checkpoint(reader.global_state)
    metadata = {name: deepspeed_metadata(spec, name) for name in reader.parameters}  # refuse before writing
    tag = tag or f"global_step{reader.step}_universal"
    folder = output / tag
    zero = folder / "zero"
    module: dict[str, torch.Tensor] = {}
    adam_step: torch.Tensor | None = None
    for name in reader.parameters:
        directory = zero / name
        directory.mkdir(parents=True, exist_ok=True)
        for state in reader.states_of(name):
            file = DEEPSPEED_STATE_FILES.get(state, state)
            value = reader.parameter(name, state)
            if value.dim() == 0:
                torch.save(value.clone(), directory / f"{file}.pt")  # DeepSpeed keeps 0-d states bare
                if state == "step" and adam_step is None:
                    adam_step = value.detach().clone().float()
                continue
            torch.save({"param": value, **metadata[name]}, directory / f"{file}.pt")
            if state == PARAM_STATE:
                module[name] = value
    job_state = reader.job_state()
    if job_state is not None:
        module.update({name: value.clone() for name, value in job_state.buffers.items()})
    groups = [
        {**{k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k != "params"}, "params": [i]}
        for i, g in enumerate(_param_groups(reader))
    ] or [{"params": [0]}]
    step = adam_step if adam_step is not None else torch.tensor(float(reader.step))
    torch.save(
        {
            "ds_version": DEEPSPEED_VERSION_WRITTEN,
            "param_groups": groups,
            "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": groups},
            "step": reader.step,
            "checkmate_param_groups": _param_groups(reader),
        },
        zero / "optimizer_state.pt",
    )
    model_states = {
        "module": module,
        "buffer_names": sorted(job_state.buffers) if job_state is not None else [],
        "optimizer": None,
        "param_shapes": [{n: torch.Size(reader.parameters[n]["shape"]) for n in reader.parameters}],
        "frozen_param_shapes": None,
        "shared_params": {},
        "frozen_param_fragments": None,
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": reader.step,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_version": DEEPSPEED_VERSION_WRITTEN,
        "universal_checkpoint_info": dict(DEEPSPEED_UNIVERSAL_INFO),
    }
    for file in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        torch.save(model_states, folder / file)
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
