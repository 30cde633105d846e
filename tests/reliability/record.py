"""Rows of the reliability table, recorded by the tests that establish them.

A test asks for the ``reliability`` fixture and calls :meth:`Recorder.record`
once per fault or input class it exercised. A row says what was compared
(``compared``), how many comparisons were made (``comparisons``) and how many
differed (``differed``, which is the row's ``lost``): the number is measured,
not written down. A test that fails before it records its row still gets one
(the fixture's finaliser, see conftest.py): ``outcome`` "failed", ``lost`` the
differences it had counted (at least 1), ``held`` the failure. When the
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
    leaked to a shadow, entries lost, ...: ``differed`` when the row counted its comparisons."""
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
    compared: str = ""
    """What was compared with what (empty: an older row that asserted instead of counting)."""
    comparisons: int | None = None
    """How many comparisons were made (None: not counted, the row's test asserted)."""
    differed: int | None = None
    """How many of them differed."""
    outcome: str = "passed"
    """``passed``, or ``failed`` for a trial whose test failed (still recorded)."""


class Recorder:
    """What the ``reliability`` fixture hands a test."""

    def __init__(self, nodeid: str, marker: str) -> None:
        self.nodeid = nodeid
        self.marker = marker
        self.rows: list[Row] = []
        self.pending: dict[str, object] | None = None
        """What :meth:`begin` announced: recorded as a failed row if the test fails before :meth:`record`."""
        self.comparisons = 0
        self.differed = 0

    def begin(self, *, area: str, case: str, target: str, compared: str, trials: int = 1) -> None:
        """Announce the row this test will record (so a failure is recorded too)."""
        self.pending = {"area": area, "case": case, "target": target, "compared": compared, "trials": trials}

    def compare(self, comparisons: int, differed: int) -> None:
        """Count comparisons made so far (what a failed row reports)."""
        self.comparisons += comparisons
        self.differed += differed

    def record_failure(self, reason: str) -> Row | None:
        """The announced row, as a failed trial (the fixture calls this when the test failed)."""
        if self.pending is None and self.rows:
            return None
        pending = self.pending or {
            "area": "fault" if "fault" in self.nodeid else "bad input",
            "case": self.nodeid.rsplit("::", 1)[-1],
            "target": "?",
            "compared": "",
            "trials": 1,
        }
        compared = str(pending["compared"]) or (
            "the state comparisons the test had counted when it failed" if self.comparisons else ""
        )
        return self.record(
            area=str(pending["area"]),
            case=str(pending["case"]),
            target=str(pending["target"]),
            trials=int(pending["trials"]),  # type: ignore[call-overload]
            compared=compared,
            comparisons=max(self.comparisons, self.differed, 1) if compared else None,
            differed=max(1, self.differed) if compared else None,
            lost=None if compared else max(1, self.differed),
            held=f"FAILED: {reason}",
            outcome="failed",
        )

    def record(
        self,
        *,
        area: str,
        case: str,
        target: str,
        trials: int,
        held: str,
        lost: int | None = None,
        compared: str = "",
        comparisons: int | None = None,
        differed: int | None = None,
        recovery_s: float | None = None,
        outcome: str = "passed",
    ) -> Row:
        """Record a row. Give ``compared``/``comparisons``/``differed`` (``lost`` is then ``differed``);
        ``lost`` alone is for rows whose test asserts rather than counts."""
        if comparisons is not None or differed is not None:
            if comparisons is None or differed is None or not compared:
                raise ValueError("a measured row gives compared, comparisons and differed together")
            if not 0 <= differed <= max(comparisons, 1):
                raise ValueError(f"{differed} of {comparisons} comparisons cannot differ")
            if lost is not None and lost != differed:
                raise ValueError(f"lost={lost} but {differed} comparisons differed")
            lost = differed
        elif lost is None:
            raise ValueError("a row gives either comparisons and differed, or lost")
        self.pending = None
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
            compared=compared,
            comparisons=comparisons,
            differed=differed,
            outcome=outcome,
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
    # A test that passed when rerun after a failure drops the failure's row; while its latest row
    # is a failure, every row of it stays (the table shows the loss).
    last: dict[str, Row] = {}
    for row in sorted(rows.values(), key=lambda r: r.recorded):
        last[row.test] = row
    return [r for r in rows.values() if r.outcome == "passed" or last[r.test].outcome != "passed"]
