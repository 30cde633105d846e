"""Recovery: restore a data-parallel job's model and optimizer from the shadows' certified state.

A restarting job asks, in this order:

1. the shadows' memory (:func:`shadow.restore.fetch_state`): the latest
   iteration every shadow has applied, merged, every parameter exactly once;
2. when no shadow answers (or they hold no state), the shadows' snapshot
   directory on disk: the latest *complete* universal checkpoint
   (:class:`checkmate.checkpoint_format.CheckpointReader`);
3. when neither exists, nothing: the job starts from iteration 0.

The state after iteration ``t`` is resumed at ``t + 1``. Batches of the demo's
model are a pure function of the iteration, so the iteration is the whole data
position.

Also here: digests that compare states bit for bit across processes
(:func:`parameters_digest`, :func:`optimizer_digest`), fetching one exact
iteration from every shadow (:func:`fetch_iteration`), and the command run in
a host's namespace to report the shadows' state::

    python -m topologies.recovery digest --shadow sh1=10.0.9.1:48880 --shadow sh2=10.0.9.2:48880 \
        --iteration 99 --out FILE
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkmate.checkpoint_format import PARAM_STATE, CheckpointError, CheckpointReader
from checkmate.control import DEFAULT_CONTROL_PORT, ControlProtocolError, JobStart
from shadow.restore import RestoreError, fetch_shard, fetch_state, merge_shards

logger = logging.getLogger(__name__)

Addr = tuple[str, int]

SOURCE_SHADOW_MEMORY = "shadow-memory"
SOURCE_SNAPSHOT = "snapshot"


class RecoveryError(RuntimeError):
    """A certified state could not be fetched or does not fit the model; the message says why."""


@dataclass
class RestoredState:
    """A certified state: the model and optimizer after ``iteration``."""

    iteration: int
    """The last iteration applied; training resumes at ``iteration + 1``."""
    source: str
    """:data:`SOURCE_SHADOW_MEMORY` or :data:`SOURCE_SNAPSHOT`."""
    parameters: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Parameter name -> its optimizer state (``exp_avg``, ``step``, ...)."""
    optimizer_step: int = 0
    data_position: Any = None
    """Where to resume the data after ``iteration`` (``agent.set_data_position``); None: the iteration."""
    detail: str = ""
    """Where exactly it came from (shadow names, snapshot directory)."""

    @property
    def next_iteration(self) -> int:
        return self.iteration + 1


# ---- digests ------------------------------------------------------------------------------
def parameters_digest(parameters: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over every parameter's name, shape, dtype and bytes, in name order."""
    items = dict(parameters.items() if isinstance(parameters, Mapping) else parameters)
    digest = hashlib.sha256()
    for name in sorted(items):
        tensor = items[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def optimizer_digest(states: Mapping[str, Mapping[str, Any]]) -> str:
    """SHA-256 over every parameter's optimizer state (name, key, value bytes), in name order."""
    digest = hashlib.sha256()
    for name in sorted(states):
        for key in sorted(states[name]):
            value = torch.as_tensor(states[name][key]).detach().to("cpu").contiguous()
            digest.update(f"{name}/{key}:{tuple(value.shape)}:{value.dtype};".encode())
            digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def optimizer_states_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer's per-parameter state keyed by the parameter's fully-qualified name."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: dict(s) for p, s in optimizer.state.items() if id(p) in names}


# ---- fetching -----------------------------------------------------------------------------
def from_shadows(shadows: Mapping[str, Addr], timeout: float, job_id: int = 0) -> RestoredState:
    """The latest state every shadow can serve, from their memory; RecoveryError if there is none."""
    if not shadows:
        raise RecoveryError("no shadow addresses")
    try:
        state = fetch_state(list(shadows.values()), timeout=timeout, job_id=job_id)
    except (RestoreError, OSError, ControlProtocolError) as exc:
        raise RecoveryError(f"the shadows cannot serve a state: {exc}") from None
    return RestoredState(
        iteration=int(state["iteration"]),
        source=SOURCE_SHADOW_MEMORY,
        parameters=dict(state["parameters"]),
        optimizer_state={n: dict(s) for n, s in state["optimizer_state"].items()},
        optimizer_step=int(state.get("optimizer_step") or 0),
        data_position=state.get("data_position"),
        detail=", ".join(f"{name}@{it}" for name, it in sorted(state["shadows"].items())),
    )


def from_snapshots(directory: Path) -> RestoredState:
    """The latest complete checkpoint in the shadows' snapshot directory; RecoveryError if none."""
    try:
        reader = CheckpointReader(Path(directory))
        parameters = {name: reader.parameter(name) for name in reader.parameters}
        states = {
            name: {s: reader.parameter(name, s) for s in reader.states_of(name) if s != PARAM_STATE}
            for name in reader.parameters
        }
    except (CheckpointError, OSError, KeyError) as exc:
        raise RecoveryError(f"no usable checkpoint in {directory}: {exc}") from None
    extra = reader.global_state.get("extra", {})
    return RestoredState(
        iteration=reader.step,
        source=SOURCE_SNAPSHOT,
        parameters=parameters,
        optimizer_state=states,
        optimizer_step=int(extra.get("optimizer_step", 0) or 0),
        data_position=extra.get("data_position"),
        detail=str(reader.directory),
    )


def restore_latest(
    shadows: Mapping[str, Addr], snapshot_dir: Path | None, timeout: float = 20.0, job_id: int = 0
) -> RestoredState | None:
    """Shadow memory first, then the snapshot directory; None when neither holds a state."""
    reasons = []
    try:
        return from_shadows(shadows, timeout, job_id)
    except RecoveryError as exc:
        reasons.append(str(exc))
        logger.warning("restore from shadow memory failed (%s); trying the snapshots on disk", exc)
    if snapshot_dir is not None:
        try:
            return from_snapshots(snapshot_dir)
        except RecoveryError as exc:
            reasons.append(str(exc))
    logger.warning("no certified state anywhere (%s): starting from iteration 0", "; ".join(reasons))
    return None


def fetch_iteration(
    shadows: Mapping[str, Addr], iteration: int, timeout: float = 30.0, job_id: int = 0
) -> RestoredState:
    """Every shadow's shard of exactly the state after ``iteration`` (waiting up to ``timeout``), merged."""
    if not shadows:
        raise RecoveryError("no shadow addresses")
    names = list(shadows)
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        try:
            replies = list(
                pool.map(lambda n: fetch_shard(shadows[n], iteration, timeout, timeout, job_id), names)
            )
        except (RestoreError, OSError, ControlProtocolError) as exc:
            raise RecoveryError(f"cannot fetch iteration {iteration} from the shadows: {exc}") from None
    refused = [f"{n}: {r.reason}" for n, r in zip(names, replies, strict=True) if not isinstance(r, JobStart)]
    if refused:
        raise RecoveryError(f"shadows refused iteration {iteration}: {'; '.join(refused)}")
    try:
        state = merge_shards([r for r in replies if isinstance(r, JobStart)])
    except RestoreError as exc:
        raise RecoveryError(str(exc)) from None
    return RestoredState(
        iteration=int(state["iteration"]),
        source=SOURCE_SHADOW_MEMORY,
        parameters=dict(state["parameters"]),
        optimizer_state={n: dict(s) for n, s in state["optimizer_state"].items()},
        optimizer_step=int(state.get("optimizer_step") or 0),
        data_position=state.get("data_position"),
        detail=", ".join(names),
    )


# ---- applying -----------------------------------------------------------------------------
def load_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: RestoredState) -> None:
    """Copy ``state`` into ``model`` and ``optimizer``; strict about names and shapes."""
    named = dict(model.named_parameters())
    missing = sorted(set(named) - set(state.parameters))
    extra = sorted(set(state.parameters) - set(named))
    if missing or extra:
        raise RecoveryError(f"the state does not fit this model: missing {missing[:5]}, unknown {extra[:5]}")
    with torch.no_grad():
        for name, parameter in named.items():
            value = state.parameters[name]
            if tuple(value.shape) != tuple(parameter.shape):
                raise RecoveryError(
                    f"{name}: state shape {tuple(value.shape)}, model {tuple(parameter.shape)}"
                )
            parameter.copy_(value.to(parameter.dtype))
    names = {id(p): n for n, p in named.items()}
    saved = optimizer.state_dict()
    per_index: dict[int, dict[str, Any]] = {}
    index = 0
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            entry = state.optimizer_state.get(names[id(parameter)])
            if entry:
                per_index[index] = {
                    k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()
                }
            index += 1
    optimizer.load_state_dict({"state": per_index, "param_groups": saved["param_groups"]})


# ---- the digest command (run inside a host that reaches the shadows) ----------------------
def _address(text: str) -> tuple[str, Addr]:
    name, sep, rest = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=HOST[:PORT]")
    host, colon, port = rest.rpartition(":")
    try:
        return name, ((host, int(port)) if colon else (rest, DEFAULT_CONTROL_PORT))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=HOST[:PORT]") from None


def _digest_command(args: argparse.Namespace) -> int:
    shadows = dict(args.shadow)
    started = time.monotonic()
    document: dict[str, Any] = {"shadows": sorted(shadows), "iteration": args.iteration}
    try:
        if args.iteration is None:
            state = from_shadows(shadows, args.timeout)
        else:
            state = fetch_iteration(shadows, args.iteration, args.timeout)
        document.update(
            ok=True,
            iteration=state.iteration,
            optimizer_step=state.optimizer_step,
            params_sha256=parameters_digest(state.parameters),
            optimizer_sha256=optimizer_digest(state.optimizer_state),
            parameters=len(state.parameters),
        )
    except RecoveryError as exc:
        document.update(ok=False, error=str(exc))
    document["seconds"] = round(time.monotonic() - started, 3)
    text = json.dumps(document, indent=1, sort_keys=True)
    if args.out is not None:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.out)
    else:
        sys.stdout.write(text + "\n")
    return 0 if document["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m topologies.recovery", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    digest = commands.add_parser("digest", help="digests of the shadows' state (parameters, optimizer)")
    digest.add_argument("--shadow", type=_address, action="append", required=True, help="NAME=HOST[:PORT]")
    digest.add_argument(
        "--iteration", type=int, default=None, help="exactly this iteration (default: latest)"
    )
    digest.add_argument("--timeout", type=float, default=30.0)
    digest.add_argument("--out", type=Path, default=None, help="write the JSON here (default stdout)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    return _digest_command(args)


if __name__ == "__main__":
    sys.exit(main())
