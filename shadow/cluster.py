"""Cluster-wide certification: the latest iteration every shard of the model has applied.

A checkpoint of iteration t exists for the whole model once every shadow has
applied t. Three ways to tell which t that is:

* rank 0's :meth:`hosts.control_channel.ControlChannel.certified_through` (from
  the shadows' Certified messages);
* :func:`certified_through` over the shadows' status (their control ports);
* :func:`snapshot_certified_through` over the snapshot directory: a step there
  is complete only when every shard file is written (the universal format's
  ``complete_steps``), i.e. the latest *persisted* cluster-wide checkpoint.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from checkmate import checkpoint as fmt
from checkmate.control import query_status
from checkmate.network import Addr

logger = logging.getLogger(__name__)


def certified_from_statuses(statuses: Sequence[Mapping[str, Any]]) -> int | None:
    """min over shadows of the last applied iteration; None if any shadow holds no state."""
    if not statuses:
        return None
    applied = [int(s.get("applied_iteration", -1)) for s in statuses]
    return min(applied) if min(applied) >= 0 else None


def certified_through(addresses: Sequence[Addr], timeout: float = 5.0) -> int | None:
    """The latest iteration every shadow (given by control address) has applied, or None."""
    return certified_from_statuses([query_status(a, timeout) for a in addresses])


def read_status_files(directory: Path) -> dict[str, dict[str, Any]]:
    """The status documents the shadows rewrite once a second in a shared snapshot directory."""
    out = {}
    for path in sorted(Path(directory).glob("status-*.json")):
        try:
            out[path.stem.removeprefix("status-")] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            logger.warning("cannot read %s: %s", path, exc)
    return out


def snapshot_certified_through(directory: Path) -> int | None:
    """The latest step with every shard on disk (a complete universal checkpoint), or None."""
    steps = fmt.complete_steps(Path(directory))
    return steps[-1] if steps else None
