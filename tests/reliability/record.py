"""Rows of the reliability table, recorded by the tests that establish them.

A test asks for the ``reliability`` fixture and calls :meth:`Recorder.record`
once per fault or input class it exercised, after its assertions held. When the
environment names a file in ``CHECKMATE_RELIABILITY_OUT``, each row is appended
to it as one JSON line (several pytest processes may append to the same file);
otherwise rows are kept only in memory, so ``make test`` writes nothing.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

OUT_ENV = "CHECKMATE_RELIABILITY_OUT"


@dataclass(frozen=True)
class Row:
    """One line of the table: what was injected, how often, and what held."""

    area: str
    """``fault`` (injected into a running job) or ``bad input`` (fed to an entry point)."""
    case: str
    """The fault or input class, e.g. ``1% of copies dropped on the shadow links``."""
    target: str
    """What received it: ``switch``, ``shadow``, ``host agent``, ``controller``, ``job``, ..."""
    trials: int
    """Independent trials (runs, packets, files, writes)."""
    lost: int
    """Wrong or lost items: certified iterations that differ from the workers, packets that
    leaked to a shadow, entries lost, ... Every row must say 0."""
    held: str
    """What was checked and held, in words (with the figures: repairs, retransmissions, ...)."""
    recovery_s: float | None = None
    """Worst time to recover where there is a recovery, else None."""
    test: str = ""
    """The pytest node id (filled in by the fixture)."""
    command: str = ""
    """How to reproduce the row (filled in by the fixture)."""
    marker: str = "quick"
    """``quick`` (runs in make test) or ``soak``."""
    recorded: float = field(default_factory=time.time)


class Recorder:
    """What the ``reliability`` fixture hands a test."""

    def __init__(self, nodeid: str, marker: str) -> None:
        self.nodeid = nodeid
        self.marker = marker
        self.rows: list[Row] = []

    def record(
        self,
        *,
        area: str,
        case: str,
        target: str,
        trials: int,
        lost: int,
        held: str,
        recovery_s: float | None = None,
    ) -> Row:
        if area not in ("fault", "bad input"):
            raise ValueError(f"area must be 'fault' or 'bad input', not {area!r}")
        if trials < 1:
            raise ValueError(f"a row needs at least one trial, not {trials}")
        marker_args = " -m soak" if self.marker == "soak" else ""
        row = Row(
            area=area,
            case=case,
            target=target,
            trials=trials,
            lost=lost,
            held=held,
            recovery_s=None if recovery_s is None else round(recovery_s, 2),
            test=self.nodeid,
            command=f".venv/bin/pytest{marker_args} {shlex.quote(self.nodeid)}",
            marker=self.marker,
        )
        self.rows.append(row)
        out = os.environ.get(OUT_ENV)
        if out:
            path = Path(out)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(asdict(row)) + "\n")
        return row


def load_rows(path: Path) -> list[Row]:
    """Rows from a JSON-lines file written by :class:`Recorder` (the last row per test and case wins)."""
    rows: dict[tuple[str, str], Row] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = Row(**json.loads(line))
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a reliability row: {exc}") from None
        rows[(row.test, row.case)] = row
    return list(rows.values())
