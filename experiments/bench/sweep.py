"""Frequency at equal overhead: the checkpoint-interval sweep of ``make bench``, as arithmetic.

For each peer (``torch-save``, ``checkfreq``, ``dcp-process``, ...) the benchmark runs the
job with a checkpoint after every k-th iteration for each k of the sweep
(``--sweep-k``, systems named ``<peer>-<k>``). From those figures (pure functions, no
runs here):

* ``k_within_5pct_of_ideal``: the smallest swept k from which on the peer stays within
  5 % of its same-transport ideal (this k and every larger swept k reach >= 0.95x the
  ideal's iterations/s);
* ``k_matching_checkmate``: the smallest swept k from which on the peer is at least as
  fast as Checkmate (which certifies every iteration);
* ``checkmate_more_often_*``: those k divided by Checkmate's interval (1): "Checkmate
  checkpoints k times more often at the same cost";
* the expected repeated iterations per failure at those settings (``k/2 + d``, d the
  mean delay until the checkpoint is complete, see ``experiments.bench``).

When no swept k qualifies, the k is None and ``reached`` is False: the ratio is then
at least the largest swept k (``at_least``), never a made-up figure.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

WITHIN = 0.05
"""Throughput within 5 % of the ideal counts as 'no measurable cost'."""

SWEEP_PEERS = ("torch-save", "checkfreq", "dcp-process")
"""The peers whose interval is swept (host replication has no interval: it copies every iteration)."""

MAX_SWEEP_K = 1000


class SweepError(ValueError):
    """A k list that cannot be swept; the message says why."""


def sweep_system_names(ks: Sequence[int]) -> tuple[str, ...]:
    """The systems a sweep over ``ks`` runs: ``<peer>-<k>`` for each swept peer and k."""
    return tuple(f"{peer}-{k}" for peer in SWEEP_PEERS for k in ks)


def parse_k_list(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> (1, 2, 4, 8): positive, distinct, at most MAX_SWEEP_K; sorted."""
    values: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            k = int(part)
        except ValueError:
            raise SweepError(f"--sweep-k: {part!r} is not a whole number (expected e.g. 1,2,4,8)") from None
        if not 1 <= k <= MAX_SWEEP_K:
            raise SweepError(f"--sweep-k: {k} is out of range (1 to {MAX_SWEEP_K})")
        values.append(k)
    if len(set(values)) != len(values):
        raise SweepError(f"--sweep-k: repeated values in {text!r}")
    return tuple(sorted(values))


def sweep_name(peer: str, k: int) -> str:
    return f"{peer}-{k}"


_NAME = re.compile(r"^(?P<peer>.+)-(?P<k>\d+)$")


def split_name(name: str) -> tuple[str, int] | None:
    """``"torch-save-8"`` -> ("torch-save", 8); None for names without an interval."""
    match = _NAME.match(name)
    if not match:
        return None
    return match.group("peer"), int(match.group("k"))


@dataclass(frozen=True)
class Point:
    """One swept setting's figures."""

    k: int
    iterations_per_s: float
    repeated: float | None
    """Expected repeated iterations per failure at this k."""


def smallest_k_from(points: Sequence[Point], threshold: float) -> int | None:
    """The smallest k such that it and every larger swept k reach ``threshold`` iterations/s."""
    found: int | None = None
    for point in sorted(points, key=lambda p: p.k, reverse=True):
        if point.iterations_per_s >= threshold:
            found = point.k
        else:
            break
    return found


def _ratio(k: int | None, points: Sequence[Point], checkmate_every: int) -> dict[str, Any]:
    if k is not None:
        return {"k": k, "reached": True, "times_more_often": round(k / checkmate_every, 3)}
    largest = max(p.k for p in points)
    return {"k": None, "reached": False, "at_least": round(largest / checkmate_every, 3)}


def analyse_peer(
    points: Sequence[Point],
    ideal_rate: float,
    checkmate_rate: float | None,
    checkmate_every: int = 1,
    within: float = WITHIN,
) -> dict[str, Any]:
    """One peer's sweep: the smallest k within ``within`` of the ideal and matching Checkmate."""
    if not points:
        raise SweepError("no swept points")
    if ideal_rate <= 0:
        raise SweepError(f"the ideal's rate must be positive, got {ideal_rate}")
    by_k = {p.k: p for p in points}
    k_ideal = smallest_k_from(points, (1 - within) * ideal_rate)
    out: dict[str, Any] = {
        "points": [
            {
                "k": p.k,
                "iterations_per_s": p.iterations_per_s,
                "ratio_to_ideal": round(p.iterations_per_s / ideal_rate, 3),
                "expected_repeated_iterations_per_failure": p.repeated,
            }
            for p in sorted(points, key=lambda p: p.k)
        ],
        "ideal_iterations_per_s": ideal_rate,
        "within_5pct_of_ideal": _ratio(k_ideal, points, checkmate_every),
        "repeated_at_k_within_5pct": by_k[k_ideal].repeated if k_ideal is not None else None,
    }
    if checkmate_rate is not None:
        k_match = smallest_k_from(points, checkmate_rate)
        out["matching_checkmate"] = _ratio(k_match, points, checkmate_every)
        out["repeated_at_k_matching_checkmate"] = by_k[k_match].repeated if k_match is not None else None
    return out


def analyse(entries: Iterable[Mapping[str, Any]], peers: Sequence[str] = SWEEP_PEERS) -> dict[str, Any]:
    """The sweep of every peer found in ``entries`` (bench.json system entries of one workload/placement)."""
    by_name = {e["name"]: e for e in entries}
    checkmate = by_name.get("checkmate")
    out: dict[str, Any] = {}
    for peer in peers:
        points: list[Point] = []
        ideal_name = None
        for name, entry in by_name.items():
            split = split_name(name)
            if split is None or split[0] != peer:
                continue
            points.append(
                Point(
                    split[1], entry["iterations_per_s"], entry.get("expected_repeated_iterations_per_failure")
                )
            )
            ideal_name = entry.get("ideal")
        if not points or ideal_name not in by_name:
            continue
        result = analyse_peer(
            points,
            by_name[ideal_name]["iterations_per_s"],
            checkmate["iterations_per_s"] if checkmate else None,
            checkmate.get("checkpoint_every") or 1 if checkmate else 1,
        )
        result["ideal"] = ideal_name
        out[peer] = result
    if checkmate is not None and out:
        out["checkmate"] = {
            "iterations_per_s": checkmate["iterations_per_s"],
            "checkpoint_every": checkmate.get("checkpoint_every"),
            "expected_repeated_iterations_per_failure": checkmate.get(
                "expected_repeated_iterations_per_failure"
            ),
            "ratio_to_ideal": checkmate.get("ratio_to_ideal"),
            "within_5pct_of_ideal": (checkmate.get("ratio_to_ideal") or 0) >= 1 - WITHIN,
        }
    return out


def markdown(sweep: Mapping[str, Any]) -> str:
    """The sweep as a Markdown table (one row per peer)."""

    def k_text(r: Mapping[str, Any] | None) -> str:
        if r is None:
            return "—"
        return str(r["k"]) if r["reached"] else f"> {r['at_least']:g} (not reached)"

    def times(r: Mapping[str, Any] | None) -> str:
        if r is None:
            return "—"
        return f"{r['times_more_often']:g}x" if r["reached"] else f">= {r['at_least']:g}x"

    def num(value: Any) -> str:
        return "—" if value is None else f"{value:.2f}"

    checkmate = sweep.get("checkmate")
    checkmate_within = checkmate is None or bool(checkmate.get("within_5pct_of_ideal"))

    def times_within(r: Mapping[str, Any] | None) -> str:
        # "k times more often at <= 5 % cost" holds only when Checkmate itself costs <= 5 %.
        if checkmate_within or checkmate is None:
            return times(r)
        return f"n/a: Checkmate at {checkmate.get('ratio_to_ideal')}x its ideal"

    lines = [
        "| peer | smallest k within 5 % of ideal | Checkmate more often (5 %) | "
        "repeated iterations at that k | smallest k matching Checkmate | "
        "Checkmate more often (equal throughput) | repeated iterations at that k |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for peer, result in sweep.items():
        if peer == "checkmate":
            continue
        ideal = result["within_5pct_of_ideal"]
        match = result.get("matching_checkmate")
        lines.append(
            f"| {peer} | {k_text(ideal)} | {times_within(ideal)} | "
            f"{num(result['repeated_at_k_within_5pct'])} | "
            f"{k_text(match)} | {times(match)} | {num(result.get('repeated_at_k_matching_checkmate'))} |"
        )
    return "\n".join(lines) + "\n"
