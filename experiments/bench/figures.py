"""The benchmark's figures from the workers' logs: rates, checkpoint delays, ratios, targets (pure).

:func:`figures` reads one run's rank-0 log (:func:`read_log`) into
:class:`LogFigures`: iterations/s over the steady-state iterations, the
delay until a checkpoint is complete (baselines: their ``checkpoint``
records; Checkmate: rank 0's ``certified`` view) and the shadows' lag.
:func:`summarize` turns a system's rounds into its entry of ``bench.json``
(ratios to both ideals, expected repeated iterations per failure ``k/2 + d``);
:func:`targets` and :func:`frequency_targets` check issue 19's targets.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.bench.config import BASELINE_KINDS, System


def read_log(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a worker log (torn last lines skipped)."""
    records = []
    try:
        text = path.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


@dataclass
class LogFigures:
    """What one run's rank-0 log says."""

    iterations_per_s: float
    seconds: float
    """Wall time of the measured (steady-state) iterations."""
    iterations_measured: int
    mean_step_s: float
    median_step_s: float
    durable_delay_iterations: float | None
    """Mean delay between the end of an iteration a checkpoint captures and that checkpoint being
    complete, in iterations (None: no checkpoints)."""
    checkpoints: int
    shadow_lag: dict[str, float] | None = None


def steady_times(records: Iterable[Mapping[str, Any]], warmup: int) -> dict[int, float]:
    """Iteration -> the time rank 0 logged it, for the first start, without the first ``warmup``."""
    times: dict[int, float] = {}
    starts = 0
    for record in records:
        if record.get("event") == "start":
            starts += 1
            if starts > 1:
                break
        elif "loss" in record and "iteration" in record:
            times[int(record["iteration"])] = float(record["time"])
    return {i: t for i, t in sorted(times.items()) if i >= warmup}


def iteration_rate(times: Mapping[int, float]) -> tuple[float, float, int]:
    """(iterations/s, seconds, intervals): finished iterations over the time between the first and last."""
    if len(times) < 2:
        raise ValueError(f"need at least 2 logged iterations to measure a rate, got {len(times)}")
    ordered = sorted(times)
    first, last = ordered[0], ordered[-1]
    seconds = times[last] - times[first]
    if seconds <= 0:
        raise ValueError("the logged times do not increase")
    return (last - first) / seconds, seconds, last - first


def expected_repeated_iterations(every: int | None, durable_delay: float | None) -> float | None:
    """Expected iterations redone after a failure at a uniformly random moment of steady training.

    Checkpoints after every ``every``-th iteration, each complete ``durable_delay`` iterations
    after the end of the iteration it captures: the progress since the last complete checkpoint
    is uniform over [d, every + d), so its mean is (every - 1)/2 finished iterations + 1/2 of the
    interrupted one + d = every/2 + d. None: no checkpoints (the whole run so far is redone).
    """
    if every is None:
        return None
    return every / 2 + max(0.0, durable_delay or 0.0)


def checkpoint_delays(
    records: Iterable[Mapping[str, Any]], times: Mapping[int, float], step: float
) -> list[float]:
    """Per baseline checkpoint of a steady iteration: (durable - iteration logged) / step, >= 0.

    train_lm logs an iteration after its checkpoint call returns, so a synchronous save is
    complete by then (0); an asynchronous one completes later.
    """
    delays = []
    for record in records:
        if record.get("event") != "checkpoint":
            continue
        iteration = int(record["iteration"])
        if iteration in times:
            delays.append(max(0.0, (float(record["durable"]) - times[iteration]) / step))
    return delays


def certification_delays(
    records: Iterable[Mapping[str, Any]], times: Mapping[int, float], step: float
) -> tuple[list[float], list[int]]:
    """Checkmate: (per steady iteration i, an upper bound of the delay until the shadows held it, in
    iterations; the lag ``i - certified`` rank 0 saw right after each step).

    Rank 0 logs after each step the last iteration every shadow certified; iteration i is
    certified at the latest when the first log whose ``certified`` >= i is written.
    """
    certified: dict[int, int] = {}
    for record in records:
        if record.get("event") == "start" and certified:
            break
        if "loss" in record and record.get("certified") is not None:
            certified[int(record["iteration"])] = int(record["certified"])
    order = sorted(i for i in certified if i in times)
    lags = [i - certified[i] for i in order]
    delays: list[float] = []
    for position, i in enumerate(order):
        for j in order[position:]:
            if certified[j] >= i:
                delays.append(max(0.0, (times[j] - times[i]) / step))
                break
    return delays, lags


def figures(records: Sequence[Mapping[str, Any]], system: System, warmup: int) -> LogFigures:
    times = steady_times(records, warmup)
    rate, seconds, intervals = iteration_rate(times)
    step = 1.0 / rate
    delay: float | None = None
    count = 0
    lag: dict[str, float] | None = None
    if system.checkpoint in BASELINE_KINDS:
        delays = checkpoint_delays(records, times, step)
        count = len(delays)
        delay = statistics.fmean(delays) if delays else None
    elif system.shadows:
        delays, lags = certification_delays(records, times, step)
        count = len(delays)
        delay = statistics.fmean(delays) if delays else None
        if lags:
            lag = {
                "mean": round(statistics.fmean(lags), 3),
                "max": max(lags),
                "certified_share": round(len(delays) / len(times), 3),
            }
    ordered = [times[i] for i in sorted(times)]
    median = statistics.median(b - a for a, b in zip(ordered, ordered[1:], strict=False))
    return LogFigures(rate, seconds, intervals, step, median, delay, count, lag)


def summarize(
    system: System, per_round: Sequence[LogFigures], ideals: Mapping[str, float | None]
) -> dict[str, Any]:
    """One system's entry in bench.json (rounds averaged)."""
    rate = statistics.fmean(f.iterations_per_s for f in per_round)
    delays = [f.durable_delay_iterations for f in per_round if f.durable_delay_iterations is not None]
    delay = statistics.fmean(delays) if delays else (None if system.every is None else 0.0)
    same = ideals.get(system.ideal)
    gloo = ideals.get("ideal-gloo")
    cm = ideals.get("ideal-cm-transport")
    entry: dict[str, Any] = {
        "name": system.name,
        "description": system.description,
        "transport": system.transport,
        "iterations_per_s": round(rate, 3),
        "iterations_per_s_per_round": [round(f.iterations_per_s, 3) for f in per_round],
        "mean_iteration_ms": round(1000 / rate, 2),
        "median_iteration_ms": round(1000 * statistics.median(f.median_step_s for f in per_round), 2),
        "checkpoint_every": system.every,
        "durable_delay_iterations": None if delay is None else round(delay, 3),
        "expected_repeated_iterations_per_failure": (
            None if system.every is None else round(expected_repeated_iterations(system.every, delay) or 0, 3)
        ),
        "ideal": system.ideal,
        "ratio_to_ideal": round(rate / same, 3) if same else None,
        "ratio_to_gloo_ideal": round(rate / gloo, 3) if gloo else None,
        "ratio_to_cm_transport_ideal": round(rate / cm, 3) if cm else None,
        "seconds": round(sum(f.seconds for f in per_round), 2),
        "iterations_measured": sum(f.iterations_measured for f in per_round),
        "checkpoints_measured": sum(f.checkpoints for f in per_round),
    }
    lags = [f.shadow_lag for f in per_round if f.shadow_lag]
    if lags:
        entry["shadow_lag_iterations"] = {
            "mean": round(statistics.fmean(lag["mean"] for lag in lags), 3),
            "max": max(lag["max"] for lag in lags),
            "certified_share": round(statistics.fmean(lag["certified_share"] for lag in lags), 3),
        }
    return entry


def targets(entries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The targets (issue 19), checked: Checkmate >= 0.97 of its same-transport ideal and >= 0.95 of
    gloo's; >= 1.3x each every-iteration system (see :func:`frequency_targets` for the sweep's)."""
    out: dict[str, Any] = {}
    checkmate = entries.get("checkmate")
    if checkmate is None:
        return out
    for key, ideal, target in (
        ("vs_same_transport_ideal", "ideal-cm-transport", 0.97),
        ("vs_gloo_ideal", "ideal-gloo", 0.95),
    ):
        if ideal in entries:
            ratio = checkmate["iterations_per_s"] / entries[ideal]["iterations_per_s"]
            out[key] = {"ideal": ideal, "ratio": round(ratio, 3), "target": target, "met": ratio >= target}
    speedups = {}
    for name, entry in entries.items():
        if not name.startswith("checkmate") and entry.get("checkpoint_every") == 1:
            ratio = checkmate["iterations_per_s"] / entry["iterations_per_s"]
            speedups[name] = {"speedup": round(ratio, 3), "target": 1.3, "met": ratio >= 1.3}
            own_ideal = entries.get(checkmate.get("ideal") or "")
            if own_ideal is not None:
                # the speedup a Checkmate that cost nothing (at its same-transport ideal) would show
                speedups[name]["at_zero_cost"] = round(
                    own_ideal["iterations_per_s"] / entry["iterations_per_s"], 3
                )
    out["vs_every_iteration_systems"] = speedups
    return out


FREQUENCY_TARGET = 5.0


def frequency_targets(sweep: Mapping[str, Any]) -> dict[str, Any]:
    """Checkmate >= 5x more frequent than each swept peer at equal overhead (matching its throughput).

    A peer that never matched Checkmate within the sweep counts as met when the largest swept k
    already is >= 5 (the true k is larger); otherwise it is undecided (None), never guessed.
    """
    out: dict[str, Any] = {}
    for peer, result in sweep.items():
        match = result.get("matching_checkmate") if isinstance(result, Mapping) else None
        if match is None:
            continue
        if match["reached"]:
            times, met = match["times_more_often"], match["times_more_often"] >= FREQUENCY_TARGET
        else:
            times = None
            met = True if match["at_least"] >= FREQUENCY_TARGET else None
        out[peer] = {"times_more_often": times, "target": FREQUENCY_TARGET, "met": met, **match}
    return out
