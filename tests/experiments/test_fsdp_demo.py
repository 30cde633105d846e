"""``make demo DEMO_ARGS=--fsdp`` end to end: an FSDP2 job on the ``checkmate`` backend through the emulated
switch, real shadows, a worker killed and the job resumed from the shadows (issue 32, item 2).

:class:`experiments.job.JobRun` with the workers running :mod:`examples.train_fsdp` (TinyLM, every
block and the root under ``fully_shard``, AdamW, clipping, cosine LR) on ``single`` (embedded
target, its switch renamed so the test can run next to another network): the switch copies each
reduce-scatter's fully reduced shards to shadows sh1 and sh2 (``checkmate-shadow``, certifying
every iteration against rank 0's fingerprint of the gathered state). Rank 1 is killed during
iteration 4; every rank restarts with ``hosts.resume_fsdp`` from the shadows' memory. The
shadows must hold the workers' final full state bit for bit, no finished iteration may be lost,
and the recovered run must end bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.demo import write_results
from experiments.job import JobConfig, JobRun
from tests.topologies.harness import root_interfaces

pytestmark = pytest.mark.root

ITERATIONS = 8
KILL_AT = 4


@pytest.mark.slow  # about 2 minutes: network, two runs, teardown
def test_fsdp2_demo_kills_a_worker_and_resumes_from_the_shadows_bit_identical(tmp_path: Path) -> None:
    before = root_interfaces()
    config = JobConfig(
        iterations=ITERATIONS,
        work_dir=tmp_path / "demo",
        results_dir=tmp_path / "results",
        rename_switches=(("s1", "fs1"),),
        train_timeout=300.0,
        kill_iteration=KILL_AT,
        kill_rank=1,
        worker_module="examples.train_fsdp",
    )
    result = JobRun(config).run()
    assert not {i for i in root_interfaces() - before if i.startswith("fs1-")}, "interfaces left behind"
    summary = result.summary()
    assert summary["restarts"] == 1 and summary["failed_worker"] == "rank 1 (h2)", summary
    restored = summary["restored_checkpoint_iteration"]
    assert KILL_AT - 1 <= restored < ITERATIONS - 1, summary
    assert summary["resumed_from_iteration"] == restored + 1
    assert summary["restore_source"] == "shadow-memory", summary
    assert summary["lost_iterations"] == 0, summary
    assert summary["certified_iterations"] == ITERATIONS, summary  # every iteration's fingerprint matched
    assert summary["shadow_copies_packets"] > 0, summary  # the switch copied the tagged shards
    assert summary["shadow_equals_workers"] is True, summary  # full parameters and optimizer state
    assert summary["recovered_equals_uninterrupted"] is True, summary
    assert summary["workers_agree"] is True
    json_path, _ = write_results(result, tmp_path / "results", "demo-fsdp")
    assert json.loads(json_path.read_text())["shadow_equals_workers"] is True


@pytest.mark.parametrize("other", [["--tp", "2"], ["--elastic"]])
def test_fsdp_does_not_combine_with_tp_or_elastic(
    other: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from experiments.demo import main

    assert main(["--fsdp", *other, "--work-dir", str(tmp_path / "demo")]) == 2
    assert (
        "--fsdp runs one FSDP2 job on h1-h3: it does not combine with --tp or --elastic"
        in capsys.readouterr().out
    )
    assert not (tmp_path / "demo").exists()  # refused before anything started
