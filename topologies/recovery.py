"""Recovery tools for the emulated topologies: a command that reports the shadows' state.

The worker-side logic (restore from the shadows' memory, else the newest complete
checkpoint on disk; load parameters, optimizer, buffers, stateful objects) lives in
:mod:`hosts.recovery` — a training script calls ``hosts.resume``. The names it used
to import from here are re-exported for the tools and tests that still do.

The command run in a host's namespace to report the shadows' state::

    python -m topologies.recovery digest --shadow sh1=10.0.9.1:48880 --shadow sh2=10.0.9.2:48880 \
        --iteration 99 --out FILE
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from checkmate.control import DEFAULT_CONTROL_PORT
from hosts.recovery import SOURCE_SHADOW_MEMORY as SOURCE_SHADOW_MEMORY
from hosts.recovery import SOURCE_SNAPSHOT as SOURCE_SNAPSHOT
from hosts.recovery import RestoredState as RestoredState
from hosts.recovery import ResumeError as RecoveryError
from hosts.recovery import fetch_iteration as fetch_iteration
from hosts.recovery import from_shadows as from_shadows
from hosts.recovery import from_snapshots as from_snapshots
from hosts.recovery import load_state as load_state
from hosts.recovery import optimizer_digest as optimizer_digest
from hosts.recovery import optimizer_states_by_name as optimizer_states_by_name
from hosts.recovery import parameters_digest as parameters_digest
from hosts.recovery import restore_latest as restore_latest

logger = logging.getLogger(__name__)

Addr = tuple[str, int]
__all__ = [
    "SOURCE_SHADOW_MEMORY",
    "SOURCE_SNAPSHOT",
    "RecoveryError",
    "RestoredState",
    "fetch_iteration",
    "from_shadows",
    "from_snapshots",
    "load_state",
    "optimizer_digest",
    "optimizer_states_by_name",
    "parameters_digest",
    "restore_latest",
    "main",
]


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
