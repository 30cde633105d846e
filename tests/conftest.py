"""Shared pytest set-up: markers that skip with a reason when the machine lacks something."""

from __future__ import annotations

import os
import shutil

import pytest

TEST_JOB_SECRET = "5e" * 32
"""Every component a test starts in this process or its children authenticates with this job
secret (checkmate.auth), unless the test gives one; the demo and the launcher pass their job's."""
os.environ.setdefault("CHECKMATE_JOB_SECRET", TEST_JOB_SECRET)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    is_root = os.geteuid() == 0
    have_bmv2 = shutil.which("simple_switch_grpc") is not None
    have_p4c = shutil.which("p4c") is not None
    have_tofino = shutil.which("p4c-barefoot") is not None and shutil.which("bfas") is not None
    have_cuda = _cuda_available()
    for item in items:
        if "root" in item.keywords and not is_root:
            item.add_marker(pytest.mark.skip(reason="needs root (network namespaces, AF_PACKET)"))
        if "bmv2" in item.keywords and not have_bmv2:
            item.add_marker(pytest.mark.skip(reason="simple_switch_grpc (BMv2) is not installed"))
        if "p4c" in item.keywords and not have_p4c:
            item.add_marker(pytest.mark.skip(reason="p4c is not installed"))
        if "tofino" in item.keywords and not have_tofino:
            item.add_marker(
                pytest.mark.skip(
                    reason="the Tofino compiler (p4c-barefoot, bfas) is not on PATH: "
                    "bash ../shared/p4-tofino/install.sh (docs/tofino.md)"
                )
            )
        if "cuda" in item.keywords and not have_cuda:
            item.add_marker(pytest.mark.skip(reason="no CUDA GPU (torch.cuda.is_available() is False)"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
