"""The ``reliability`` fixture: a :class:`~tests.reliability.record.Recorder` for the running test.

A test that fails (its assertions, or an exception) still leaves its row: the
fixture's teardown records what the test announced with ``Recorder.begin`` (or
the test's name) as a failed trial, so ``make reliability`` shows the loss and exits
non-zero instead of silently missing a row.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from tests.reliability.record import Recorder


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if report.when == "call":
        item.stash[_CALL_REPORT] = report
    return report


_CALL_REPORT = pytest.StashKey[pytest.TestReport]()


@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> Generator[Recorder, None, None]:
    marker = "soak" if request.node.get_closest_marker("soak") is not None else "quick"
    recorder = Recorder(request.node.nodeid, marker)
    yield recorder
    report = request.node.stash.get(_CALL_REPORT, None)
    if report is not None and report.failed:
        text = str(report.longrepr.reprcrash.message) if hasattr(report.longrepr, "reprcrash") else "failed"
        recorder.record_failure(text.splitlines()[0][:300] if text else "failed")
