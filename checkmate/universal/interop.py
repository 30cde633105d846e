"""Universal checkpoints to and from the tools users have: DeepSpeed and torch DCP.

* :func:`deepspeed_metadata` — the keys DeepSpeed's universal loader
  (``deepspeed.checkpoint.universal_checkpoint.load_hp_checkpoint_state``)
  reads next to each ``{"param": tensor}`` to re-slice it for a TP degree:
  ``cat_dim``, ``vocab_tensor``, ``param_n_sub_params`` (equal fused parts).
* :func:`import_deepspeed_universal` — a DeepSpeed universal folder
  (``<tag>/zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``) into our format,
  its per-parameter keys turned into reshape rules.
* :func:`import_dcp` — a torch distributed checkpoint of an FSDP2 or TP model
  (``dcp.save({"model": ..., "optim": ...})`` of ``get_state_dict``): DCP keeps
  each DTensor's whole *stored* tensor, so a TP model's fused weights arrive
  rank-interleaved and its vocabulary padded; the spec and the TP degree that
  wrote it undo both.

Files are read with ``torch.load(weights_only=True)``: no code from a
checkpoint runs.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checkmate import checkpoint as fmt
from checkmate.checkpoint import PARAM_STATE, CheckpointError
from checkmate.universal.convert import staged_output
from checkmate.universal.extract import AtomMerger, records_of_tensor
from checkmate.universal.layout import Layout, LocalTensor, storage_pieces
from checkmate.universal.live import describe_module
from checkmate.universal.save import assign_owners, provenance
from checkmate.universal.spec import LayoutError, ReshapeRule, ReshapeSpec, check_fused

logger = logging.getLogger(__name__)

DEEPSPEED_PARAM_FILE = "fp32"


def deepspeed_metadata(spec: ReshapeSpec | None, name: str) -> dict[str, Any]:
    """DeepSpeed's universal-checkpoint keys for ``name`` under ``spec`` (empty: replicated)."""
    if spec is None:
        return {}
    rule = spec.rule(name)
    if rule.cat_dim is None:
        return {}
    out: dict[str, Any] = {"cat_dim": rule.cat_dim}
    if rule.vocab:
        out["vocab_tensor"] = True
    if rule.parts:
        if len(set(rule.parts)) != 1:
            raise LayoutError(
                f"{name}: {rule.describe()}: DeepSpeed's param_n_sub_params needs equal parts; "
                "unequal ones (grouped-query QKV) have no portable encoding"
            )
        out["param_n_sub_params"] = len(rule.parts)
    return out


def _load_pt(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many types for a bad file
        raise CheckpointError(f"{path}: not a loadable tensor file ({type(exc).__name__}: {exc})") from None


def import_deepspeed_universal(folder: Path, output: Path, num_shards: int = 1) -> Path:
    """A DeepSpeed universal checkpoint folder (the one holding ``zero/``) into ``output``."""
    zero = Path(folder) / "zero"
    if not zero.is_dir():
        raise CheckpointError(f"{folder}: no zero/ folder; not a DeepSpeed universal checkpoint")
    atoms: dict[str, dict[str, torch.Tensor]] = {}
    rules: list[ReshapeRule] = []
    for directory in sorted(p for p in zero.iterdir() if p.is_dir()):
        name = directory.name
        states: dict[str, torch.Tensor] = {}
        meta: dict[str, Any] = {}
        for file in sorted(directory.glob("*.pt")):
            content = _load_deepspeed_pickle(file)
            value = content.get("param") if isinstance(content, Mapping) else content
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"{file}: holds no 'param' tensor")
            state = PARAM_STATE if file.stem == DEEPSPEED_PARAM_FILE else file.stem
            states[state] = value.detach().clone()
            if state == PARAM_STATE and isinstance(content, Mapping):
                meta = {k: v for k, v in content.items() if k != "param"}
        if PARAM_STATE not in states:
            raise CheckpointError(f"{directory}: no {DEEPSPEED_PARAM_FILE}.pt")
        atoms[name] = states
        rules.append(_rule_from_deepspeed(name, meta, tuple(states[PARAM_STATE].shape)))
    if not atoms:
        raise CheckpointError(f"{zero}: no parameter folders")
    step, groups, zero3_step = _deepspeed_optimizer(zero, sorted(atoms))
    if zero3_step is not None:  # ZeRO-3's converter keeps Adam's step once, not per parameter
        for states in atoms.values():
            if len(states) > 1:
                states.setdefault("step", zero3_step.clone())
    spec = ReshapeSpec(tuple(r for r in rules if r.cat_dim is not None))
    with staged_output(output) as staging:
        for shard, owned in enumerate(
            assign_owners({n: atoms[n][PARAM_STATE].shape for n in atoms}, num_shards)
        ):
            fmt.write_shard(staging, step, shard, num_shards, {n: atoms[n] for n in owned})
        extra = {"universal": {"spec": spec.to_json(), "source_layout": "deepspeed-universal"}}
        optimizer = {"param_groups": groups} if groups else {}  # DeepSpeed records no optimizer class
        fmt.write_global(
            staging, step, fmt.parameters_of((n, s[PARAM_STATE]) for n, s in atoms.items()), optimizer, extra
        )
        fmt.update_latest(staging, step)
    return fmt.step_dir(Path(output), step)


def _rule_from_deepspeed(name: str, meta: Mapping[str, Any], shape: tuple[int, ...]) -> ReshapeRule:
    if "cat_dim" not in meta:
        return ReshapeRule(re.escape(name))
    dim = int(meta["cat_dim"])
    n_sub = int(meta.get("param_n_sub_params", 1) or 1)
    parts = None
    if n_sub > 1:
        if shape[dim] % n_sub:
            raise LayoutError(f"{name}: {n_sub} sub-parameters do not divide dim {dim} of {shape}")
        parts = (shape[dim] // n_sub,) * n_sub
    return ReshapeRule(re.escape(name), cat_dim=dim, parts=parts, vocab=bool(meta.get("vocab_tensor", False)))


def _load_deepspeed_pickle(path: Path) -> Any:
    """A DeepSpeed-written file: weights-only, allowing DeepSpeed's own plain state classes.

    DeepSpeed's ``ds_to_universal`` pickles its ``LossScaler`` and ``ZeroStageEnum``
    into ``optimizer_state.pt``; those (and nothing else) are allowed, when
    DeepSpeed is importable to name them.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as first:  # noqa: BLE001 - torch.load raises many types for a bad file
        try:
            from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
            from deepspeed.runtime.zero.config import ZeroStageEnum
        except ImportError:
            raise CheckpointError(
                f"{path}: not loadable weights-only ({type(first).__name__}: {first}); "
                "DeepSpeed's own classes in it need deepspeed installed to be named"
            ) from None
        try:
            with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum]):
                return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - as above
            raise CheckpointError(
                f"{path}: not a loadable tensor file ({type(exc).__name__}: {exc})"
            ) from None


def _deepspeed_optimizer(
    zero: Path, names: list[str]
) -> tuple[int, list[dict[str, Any]], torch.Tensor | None]:
    """(step, param groups, the ZeRO-3 optimizer step) of a DeepSpeed universal folder's zero/."""
    path = zero / "optimizer_state.pt"
    model_states = [
        zero.parent / f for f in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
    ]
    step = 0
    for candidate in model_states:
        if candidate.is_file():
            states = _load_deepspeed_pickle(candidate)
            if isinstance(states, Mapping) and isinstance(states.get("global_steps"), int):
                step = states["global_steps"]
            break
    if not path.is_file():
        return step, [], None
    content = _load_deepspeed_pickle(path)
    if not isinstance(content, Mapping):
        return step, [], None
    if isinstance(content.get("step"), int):
        step = content["step"]
    inner = content.get("optimizer_state_dict")
    inner = inner if isinstance(inner, Mapping) else {}
    zero3_step = None
    state = inner.get("state")
    if isinstance(state, Mapping) and isinstance(state.get(0), Mapping):
        value = state[0].get("step")
        if value is not None:
            zero3_step = torch.as_tensor(value, dtype=torch.float32).clone()
    saved = (
        content.get("checkmate_param_groups")
        or content.get("param_groups")
        or inner.get("param_groups")
        or []
    )
    groups = []
    for group in saved:
        hyper = {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in group.items()
            if k != "params" and isinstance(v, (int, float, bool, str, list, tuple))
        }
        params = group.get("params", [])
        groups.append({**hyper, "params": list(params) if all(isinstance(p, str) for p in params) else []})
    if groups and not any(g["params"] for g in groups):
        groups = [{**groups[0], "params": names}]  # DeepSpeed numbers parameters; one group holds all
    return step, groups, zero3_step


DCP_RECORD = "checkmate-layout.json"
"""How a DCP checkpoint was made (TP degree, mesh, spec and its hash, real vocabulary), beside its files."""


def record_dcp_layout(
    folder: Path,
    module: nn.Module | None = None,
    spec: ReshapeSpec | None = None,
    layout: Layout | None = None,
    vocab: int | None = None,
) -> Path | None:
    """Write :data:`DCP_RECORD` into a DCP folder after ``dcp.save`` (every rank calls; rank 0 writes).

    The layout comes from the live ``module`` (:func:`~checkmate.universal.live.describe_module`);
    ``layout`` alone (no module) for a checkpoint of whole tensors; ``vocab`` is
    the real vocabulary size when it is padded.
    """
    spec = spec or ReshapeSpec()
    if module is not None:
        live = describe_module(module, layout)
        layout, mesh = live.layout, live.mesh
    else:
        layout, mesh = layout or Layout(), {}
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    document = provenance(spec, layout.describe(), layout, mesh)
    if vocab is not None:
        document["vocab"] = vocab
    path = Path(folder) / DCP_RECORD
    fmt.atomic_write_json(path, document)
    return path


def read_dcp_record(folder: Path) -> dict[str, Any] | None:
    """The :data:`DCP_RECORD` of a DCP folder, or None when the folder has none."""
    path = Path(folder) / DCP_RECORD
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(document, dict) or not all(k in document for k in ("spec", "spec_sha256", "tp")):
        raise CheckpointError(f"{path}: not a layout record (needs spec, spec_sha256 and tp)")
    return document


def dcp_failure(exc: BaseException) -> str:
    """One line for torch DCP's ``CheckpointException`` (its ``str`` is a traceback per rank)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        rank, (inner, _) = next(iter(sorted(failures.items())))
        text = str(inner).strip().splitlines()
        return f"rank {rank}: {type(inner).__name__}: {text[0] if text else ''}".rstrip(": ")
    lines = str(exc).strip().splitlines()
    return lines[-1] if lines else type(exc).__name__


def import_dcp(
    folder: Path,
    output: Path,
    spec: ReshapeSpec | None = None,
    tp: int | None = None,
    vocab: int | None = None,
    step: int = 0,
    num_shards: int = 1,
) -> Path:
    """A torch DCP checkpoint ``{"model": ..., "optim": ...}`` (FQN keys) into ``output``.

    ``tp``: the tensor-parallel degree of the job that wrote it (fused parts are
    interleaved per TP rank in DCP's stored tensors); ``vocab``: the real
    vocabulary size, to trim padded rows (kept when None). DCP itself records
    neither, nor the spec: a folder with :data:`DCP_RECORD` (written by
    :func:`record_dcp_layout` after ``dcp.save``) supplies them, and a ``tp`` or
    ``spec`` that disagrees with it is refused; without it ``tp`` is required.
    """
    record = read_dcp_record(Path(folder))
    if record is not None:
        recorded = ReshapeSpec.from_json(record["spec"], f"{folder}/{DCP_RECORD} spec")
        where = f"{folder}/{DCP_RECORD}"
        if recorded.to_hash() != record.get("spec_sha256"):
            raise CheckpointError(f"{where}: its spec does not match its spec_sha256 (edited by hand?)")
        if tp is not None and tp != record["tp"]:
            raise CheckpointError(
                f"{folder}: --tp {tp}, but the job that saved it recorded tp={record['tp']} "
                f"({record.get('source_layout')}); drop --tp (the record is used) or fix it"
            )
        if spec is not None and spec.to_hash() != recorded.to_hash():
            raise CheckpointError(
                f"{folder}: the spec given (sha256 {spec.to_hash()[:12]}) is not the one the job saved with "
                f"({record['spec_sha256'][:12]}, in {where}); drop --spec (the recorded one is used) or "
                f"give that one"
            )
        spec, tp = recorded, int(record["tp"])
        if vocab is None and isinstance(record.get("vocab"), int):
            vocab = record["vocab"]
    if tp is None:
        raise CheckpointError(
            f"{folder}: a DCP checkpoint does not record the TP degree that saved it (no {DCP_RECORD}); "
            f"pass --tp N (1 for DDP/FSDP-only jobs) and --spec with the model's fused 'parts', or write "
            f"the record with checkmate.universal.interop.record_dcp_layout after dcp.save"
        )
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    spec = spec or ReshapeSpec()
    if not (Path(folder) / ".metadata").is_file():
        raise CheckpointError(f"{folder}: no .metadata file; not a torch DCP checkpoint folder")
    try:  # read first: DCP's loader logs a traceback per failed metadata read before raising
        FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - unpickling a bad file raises many types
        raise CheckpointError(
            f"{folder}: its .metadata cannot be read ({type(exc).__name__}: {exc}); not a DCP checkpoint"
        ) from None
    with tempfile.TemporaryDirectory(prefix="checkmate-dcp-") as scratch:
        flat_file = Path(scratch) / "state.pt"
        try:
            dcp_to_torch_save(str(folder), str(flat_file))
        except CheckpointException as exc:  # derives from BaseException, not Exception
            raise CheckpointError(f"{folder}: not a readable DCP checkpoint ({dcp_failure(exc)})") from None
        except Exception as exc:  # noqa: BLE001 - DCP raises many types for a bad folder
            raise CheckpointError(
                f"{folder}: not a readable DCP checkpoint ({type(exc).__name__}: {exc})"
            ) from None
        state = _load_pt(flat_file)
    model = state.get("model") if isinstance(state, Mapping) else None
    if not isinstance(model, Mapping) or not model:
        raise CheckpointError(f"{folder}: no 'model' state dict (save {{'model': ..., 'optim': ...}})")
    optim = state.get("optim", {}) if isinstance(state, Mapping) else {}
    per_param = optim.get("state", {}) if isinstance(optim, Mapping) else {}
    shapes: dict[str, tuple[int, ...]] = {}
    holdings: dict[str, LocalTensor] = {}
    for name, tensor in model.items():
        stored = tuple(tensor.shape)
        rule = spec.check_rule(name, stored)
        check_fused(name, rule, tp, rule.cat_dim if rule.cat_dim is not None else 0)
        logical = list(stored)
        if rule.vocab and vocab is not None:
            logical[rule.cat_dim or 0] = vocab
        shapes[name] = tuple(logical)
        holdings[name] = LocalTensor(name, stored, storage_pieces(name, rule, logical, stored, tp))
    merger = AtomMerger(shapes, spec)
    for name, tensor in model.items():
        merger.add_all(records_of_tensor(holdings[name], PARAM_STATE, tensor))
        for key, value in (per_param.get(name) or {}).items():
            if isinstance(value, torch.Tensor):
                merger.add_all(records_of_tensor(holdings[name], key, value))
    atoms = merger.atoms()
    step = step or int(
        max((float(s.get("step", 0)) for s in per_param.values() if isinstance(s, Mapping)), default=0)
    )
    groups = []
    for group in optim.get("param_groups", []) if isinstance(optim, Mapping) else []:
        hyper = {
            k: v
            for k, v in group.items()
            if k != "params" and isinstance(v, (int, float, bool, str, list, tuple))
        }
        groups.append({**hyper, "params": [p for p in group.get("params", []) if isinstance(p, str)]})
    with staged_output(output) as staging:
        for shard, owned in enumerate(assign_owners(shapes, num_shards)):
            fmt.write_shard(staging, step, shard, num_shards, {n: atoms[n] for n in owned})
        universal = provenance(spec, f"dcp,tp={tp}")
        universal.update(tp=tp, imported_from=str(folder))
        if record is not None:
            universal.update({k: record[k] for k in ("source_layout", "dp", "fsdp", "mesh") if k in record})
            universal["source_layout"] = f"dcp,{record.get('source_layout', f'tp={tp}')}"
        extra = {"universal": universal}
        fmt.write_global(
            staging,
            step,
            {n: (list(s), "torch.float32") for n, s in shapes.items()},
            {"param_groups": groups} if groups else {},  # DCP records no optimizer class
            extra,
        )
        fmt.update_latest(staging, step)
    return fmt.step_dir(Path(output), step)
