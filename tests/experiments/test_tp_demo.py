"""``make demo --tp 2`` end to end: a TP=2 x DP=2 job on the emulated switch, one Checkmate lane per TP index.

:class:`experiments.tp_demo.TpDemo` on ``single`` (embedded target, its switch renamed
so the test can run next to another network): lanes 0 (h1, h3 -> sh1) and 1 (h2, h4 ->
sh2) are two jobs at the switch, each with its own secret; rank 1 (h2) is killed during
iteration 4 and every rank resumes from its own lane's shadows with no finished iteration
lost; each lane's shadow must hold its workers' final state bit for bit, the recovered run
must end bit-identical to an uninterrupted one, the switch must have copied packets of
both jobs, and the merged checkpoint must load as TP=1 with the TP job's loss and back as
TP=2 bit for bit. Everything is torn down, also on failure.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.job import JobConfig
from experiments.tp_demo import run_tp_demo
from tests.topologies.harness import root_interfaces

pytestmark = [pytest.mark.root, pytest.mark.slow]

ITERATIONS = 8
KILL_AT = 4


def test_tp_demo_kills_a_worker_resumes_every_lane_with_none_lost_and_bit_identical(tmp_path: Path) -> None:
    before = root_interfaces()
    config = JobConfig(
        iterations=ITERATIONS,
        work_dir=tmp_path / "demo",
        results_dir=tmp_path / "results",
        rename_switches=(("s1", "tp1"),),
        train_timeout=300.0,
        kill_iteration=KILL_AT,
        kill_rank=1,
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
    assert summary["killed"]["rank"] == 1 and summary["killed"]["host"] == "h2", summary["killed"]
    assert summary["restarts"] == 1
    restored = summary["restored_checkpoint_iteration"]
    assert KILL_AT - 1 <= restored == summary["completed_before_kill"] < ITERATIONS - 1, summary
    assert summary["resumed_from_iteration"] == restored + 1
    assert summary["lost_iterations"] == 0 and summary["lost_iterations_measured"] == 0, summary
    assert [(r["tp_index"], r["job_id"], r["source"]) for r in summary["lane_restores"]] == [
        (0, 1, "shadow-memory"),
        (1, 2, "shadow-memory"),
    ]
    assert summary["recovered_equals_uninterrupted"] is True
    assert summary["merged_step"] == ITERATIONS - 1
    assert summary["back_to_tp_equals_workers"]
    assert summary["tp1_loss_relative_difference"] < 1e-5, summary
    assert ok
    assert json.loads((tmp_path / "results" / "demo-tp.json").read_text())["ok"] is True
