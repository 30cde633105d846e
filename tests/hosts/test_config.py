"""CheckmateConfig from the environment: a resumed job's start iteration, and bad values refused."""

from __future__ import annotations

import pytest

from hosts.ddp import CheckmateConfig, CheckmateConfigError

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
