"""The ``reliability`` fixture: a :class:`~tests.reliability.record.Recorder` for the running test."""

from __future__ import annotations

import pytest

from tests.reliability.record import Recorder


@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> Recorder:
    marker = "soak" if request.node.get_closest_marker("soak") is not None else "quick"
    return Recorder(request.node.nodeid, marker)
