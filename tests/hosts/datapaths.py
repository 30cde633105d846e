"""The transport's data paths for tests: every transport test runs on each one that is available.

``DATAPATHS`` lists ``"native"`` (when hosts.native built) and ``"python"``; ``datapath_params``
marks a missing native path as skipped instead of leaving it out, so a run says so.
"""

from __future__ import annotations

import pytest

from hosts import native

NATIVE_BUILT = native.available()
DATAPATHS = ("native", "python")
datapath_params = [
    pytest.param(
        "native",
        marks=pytest.mark.skipif(not NATIVE_BUILT, reason="hosts.native._datapath is not built"),
    ),
    pytest.param("python"),
]
