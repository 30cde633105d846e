"""Render recorded reliability rows as the table in ``docs/reliability.md``.

    python -m tests.reliability.report ROWS.jsonl --out docs/reliability.md

Exits 1 (after writing the document) when any row lost something, so a
``make`` target that produces the table fails on a bad row.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tests.reliability import long_runs
from tests.reliability.record import Row, load_rows

HEADER = """# Reliability

What Checkmate survives, as measured by the reliability suite (`tests/reliability/`).
Every row is written by the test that establishes it, whether it passed or failed.

How the numbers are obtained:

* **Compared** says what the row's test compared with what (e.g. each certified
  snapshot step's SHA-256 with the workers' digest of the same iteration), and
  **Comparisons / differed** how many such comparisons it made and how many came out
  different. For these rows **Lost** *is* the number that differed: it is counted,
  not written down.
* A row whose Compared cell is "—" comes from a test that asserts its checks and
  records `lost` 0 only when they all held (the older form; its What-held cell says
  what was checked). Such a test that fails is still recorded (below).
* A trial whose test fails for any reason is recorded as **failed**, with the
  differences it had counted (at least 1) and the failure in What held.
* `make reliability` and `make soak` exit non-zero when any row lost anything.

Can the table show a loss? `tests/reliability/weakened.py` switches two defences off
(a shadow takes copies from any host; datagram MACs are not checked). With it,
`CHECKMATE_RELIABILITY_OUT=/tmp/rows.jsonl .venv/bin/python -m pytest -p tests.reliability.weakened
tests/reliability/test_attacks.py` and `python -m tests.reliability.report /tmp/rows.jsonl --out
/tmp/weakened.md` recorded 3 failed rows, 85 of 257 comparisons differed, and the report
exited 1 (2026-12-01).

"Lost" counts wrong or missing results: a certified iteration whose state differs
from the workers', a copy that reached a shadow it should not have, a table
entry or checkpoint that went missing, a forged message that was let in, a process
that stopped answering.

Regenerate with `make reliability` (quick cases, also run by `make test`) or
`make soak` (quick and soak cases, then the 2,000-iteration soak and the slow-shadow
run, whose figures fill the last section). Each row's command reruns just that case.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(rows: Sequence[Row], command: str) -> str:
    ordered = sorted(rows, key=lambda r: (r.area != "fault", r.target, r.case))
    lines = [HEADER]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    machine = f"{platform.machine()}, {platform.system()} {platform.release()}, {os.cpu_count()} CPUs"
    lines.append(f"Produced {when} ({machine}, Python {platform.python_version()}) by `{command}`.\n")
    total = sum(r.trials for r in ordered)
    bad = [r for r in ordered if r.lost]
    measured = [r for r in ordered if r.comparisons is not None]
    failed = [r for r in ordered if r.outcome != "passed"]
    lines.append(
        f"{len(ordered)} fault and input classes, {total} trials; {len(measured)} rows count their "
        f"comparisons ({sum(r.comparisons or 0 for r in measured)} comparisons, "
        f"{sum(r.differed or 0 for r in measured)} differed); {len(failed)} failed trials; "
        + ("**nothing was lost in any of them.**\n" if not bad else f"**{len(bad)} rows lost something.**\n")
    )
    lines.append(
        "| Area | Target | Fault or input | Trials | Compared | Comparisons / differed | Lost | Outcome "
        "| Recovery | What held | Command |"
    )
    lines.append("|---|---|---|---:|---|---:|---:|---|---:|---|---|")
    for r in ordered:
        recovery = "—" if r.recovery_s is None else f"{r.recovery_s:.1f} s"
        kind = r.area + (" (soak)" if r.marker == "soak" else "")
        counted = "—" if r.comparisons is None else f"{r.comparisons} / {r.differed}"
        lines.append(
            f"| {kind} | {_cell(r.target)} | {_cell(r.case)} | {r.trials} | {_cell(r.compared) or '—'} "
            f"| {counted} | {r.lost} | {r.outcome} | {recovery} | {_cell(r.held)} | `{_cell(r.command)}` |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=Path, help="JSON lines written with CHECKMATE_RELIABILITY_OUT")
    parser.add_argument("--out", type=Path, required=True, help="the Markdown file to write")
    parser.add_argument("--command", default="make reliability", help="the command that produced the rows")
    parser.add_argument(
        "--results",
        type=Path,
        default=Path("results"),
        help="where the soak and slow-shadow runs wrote their JSON (the last section; absent: left out)",
    )
    args = parser.parse_args(argv)
    try:
        rows = load_rows(args.rows)
        long_section = long_runs.render(args.results)
        soak_lost = long_runs.soak_lost(args.results)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    if not rows:
        print(f"report: {args.rows} holds no rows (did the suite run?)", file=sys.stderr)
        return 2
    args.out.write_text(render(rows, args.command) + long_section, encoding="utf-8")
    bad = [r for r in rows if r.lost]
    for r in bad:
        print(f"report: {r.case} ({r.test}) lost {r.lost}", file=sys.stderr)
    if soak_lost:
        print(f"report: the soak in {args.results} ended unequal to the workers", file=sys.stderr)
    print(f"report: wrote {args.out} ({len(rows)} rows)")
    return 1 if bad or soak_lost else 0


if __name__ == "__main__":
    sys.exit(main())
