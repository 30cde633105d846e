"""``make demo --tp 2`` end to end: a TP=2 x DP=2 job on the emulated switch, one Checkmate lane per TP index.

:class:`experiments.tp_demo.TpDemo` on ``single`` (embedded target, its switch renamed
so the test can run next to another network): lanes 0 (h1, h3 -> sh1) and 1 (h2, h4 ->
sh2) are two jobs at the switch; each lane's shadow must hold its workers' final state
bit for bit, the switch must have copied packets of both jobs, and the merged
checkpoint must load as TP=1 with the TP job's loss and back as TP=2 bit for bit.
Everything is torn down, also on failure.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.job import JobConfig
from experiments.tp_demo import run_tp_demo
from tests.topologies.harness import root_interfaces

pytestmark = [pytest.mark.root, pytest.mark.slow]

ITERATIONS = 6


def test_tp_demo_lanes_equal_their_workers_and_merge_into_tp1_and_back(tmp_path: Path) -> None:
    before = root_interfaces()
    config = JobConfig(
        iterations=ITERATIONS,
        work_dir=tmp_path / "demo",
        results_dir=tmp_path / "results",
        rename_switches=(("s1", "tp1"),),
        train_timeout=240.0,
    )
    summary, ok = run_tp_demo(config, 2)
    assert not {i for i in root_interfaces() - before if i.startswith("tp1-")}, "interfaces left behind"
    lanes = summary["lanes"]
    assert [(lane["job_id"], lane["workers"], lane["shadows"]) for lane in lanes] == [
        (1, ["h1", "h3"], ["sh1"]),
        (2, ["h2", "h4"], ["sh2"]),
    ]
    for lane in lanes:
        assert lane["shadow_equals_workers"], lane
        assert lane["shadow_copies_packets"] > 0, lane  # the switch copied this lane's ring
    assert lanes[0]["shadow_params_sha256"] != lanes[1]["shadow_params_sha256"]  # different TP shards
    assert summary["merged_step"] == ITERATIONS - 1
    assert summary["back_to_tp_equals_workers"]
    assert summary["tp1_loss_relative_difference"] < 1e-5, summary
    assert ok
    assert json.loads((tmp_path / "results" / "demo-tp.json").read_text())["ok"] is True
