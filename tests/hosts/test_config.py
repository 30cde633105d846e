"""CheckmateConfig from the environment: a resumed job's start iteration, and bad values refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from hosts.ddp import CheckmateConfig, CheckmateConfigError, read_job_file

ENV = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}


def test_start_iteration_and_optimizer_step_from_the_environment() -> None:
    assert (CheckmateConfig.from_env(ENV).start_iteration, CheckmateConfig.from_env(ENV).optimizer_step) == (
        0,
        0,
    )
    config = CheckmateConfig.from_env(
        {**ENV, "CHECKMATE_START_ITERATION": "41", "CHECKMATE_OPTIMIZER_STEP": "41"}
    )
    assert (config.start_iteration, config.optimizer_step) == (41, 41)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("CHECKMATE_START_ITERATION", "forty", "CHECKMATE_START_ITERATION='forty' is not an integer"),
        ("CHECKMATE_OPTIMIZER_STEP", "1.5", "CHECKMATE_OPTIMIZER_STEP='1.5' is not an integer"),
        ("CHECKMATE_START_ITERATION", "-1", "must not be negative"),
    ],
)
def test_bad_start_values_are_refused_by_name(name: str, value: str, message: str) -> None:
    with pytest.raises(CheckmateConfigError, match=message):
        CheckmateConfig.from_env({**ENV, name: value})


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "Expecting property name"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"worker_addresses": []}', "'job'"),
        ('{"job": {"job_id": 0, "workers": ["h1", "h2"], "shadows": ["sh1"]}}', "job_id 0 is outside"),
    ],
)
def test_a_bad_job_file_is_refused_naming_the_file(tmp_path: Path, content: str, problem: str) -> None:
    path = tmp_path / "job.json"
    path.write_text(content)
    with pytest.raises(CheckmateConfigError, match=f"cannot read CHECKMATE_JOB_FILE {path}: .*{problem}"):
        read_job_file(str(path))
    with pytest.raises(CheckmateConfigError, match="cannot read CHECKMATE_JOB_FILE"):
        read_job_file(str(tmp_path / "missing.json"))
