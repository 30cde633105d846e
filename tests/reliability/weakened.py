"""A pytest plugin that switches two defences off, to show the reliability table reporting a loss.

    CHECKMATE_RELIABILITY_OUT=/tmp/rows.jsonl .venv/bin/python -m pytest -p tests.reliability.weakened \
        tests/reliability/test_attacks.py
    .venv/bin/python -m tests.reliability.report /tmp/rows.jsonl --out /tmp/weakened.md   # exits 1

It makes a shadow take gradient copies from any host and makes every datagram MAC
check pass (the tag is stripped unchecked). The attack rows then record how many
spoofed and forged datagrams got in (docs/reliability.md, "Can the table show a loss?").
Never load it outside that demonstration.
"""

from __future__ import annotations

from typing import Any

import pytest

import checkmate.auth
import shadow.node_receive
from checkmate.auth import DATAGRAM_TAG_BYTES


def _open_unchecked(self: Any, datagram: memoryview) -> memoryview:
    return datagram[:-DATAGRAM_TAG_BYTES] if len(datagram) > 32 + DATAGRAM_TAG_BYTES else datagram


def pytest_configure(config: pytest.Config) -> None:
    shadow.node_receive._from_worker = lambda job, addr: True  # type: ignore[assignment]
    checkmate.auth.DatagramAuth.open = _open_unchecked  # type: ignore[method-assign]
