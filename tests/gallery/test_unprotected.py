"""Never silently unprotected: a real 2-rank job its shadows do not protect fails on every rank.

``refused``: the optimizer is a user's class the shadows cannot import, so they refuse the
job; ``silent``: the shadows serve another job and never certify (CHECKMATE_CERTIFY_TIMEOUT
short). Both ranks raise :class:`hosts.UnprotectedError` at the same iteration, with the
shadow's reason; with ``CHECKMATE_UNPROTECTED=log`` the job trains to the end instead.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from checkmate.wire import CHECKMATE_UDP_PORT
from shadow.node import ShadowConfig, ShadowNode
from tests.gallery.test_gallery import SHADOW_HOST, Job, _shadows


def _other_jobs_shadows() -> list[ShadowNode]:
    return [
        ShadowNode(
            ShadowConfig(
                name=f"s{i}",
                control_bind=(f"127.0.0.{SHADOW_HOST + i}", 0),
                data_bind=(f"127.0.0.{SHADOW_HOST + i}", CHECKMATE_UDP_PORT),
                job_id=999,
            )
        ).start()
        for i in range(2)
    ]


def _run(option: str, nodes: list[ShadowNode], env: dict[str, str], iterations: int = 40) -> Path:
    out = Path(tempfile.mkdtemp(prefix=f"unprotected-{option}-")) / "out"
    job = Job(
        "unprotected.py", ["--iterations", str(iterations), "--out", str(out), "--option", option], nodes, env
    )
    try:
        assert job.wait(120) == [0, 0]
    finally:
        job.kill()
        for n in nodes:
            n.close()
    return out


@pytest.mark.parametrize(
    "option, reason",
    [
        ("refused", "cannot import module 'user_optimizer'"),
        ("silent", "no shadow certified an iteration within 3 s of the start"),
    ],
)
def test_every_rank_raises_with_the_shadows_reason_at_the_same_iteration(option: str, reason: str) -> None:
    nodes = (
        _shadows(Path(tempfile.mkdtemp(prefix="unprotected-")))
        if option == "refused"
        else _other_jobs_shadows()
    )
    out = _run(option, nodes, {"CHECKMATE_CERTIFY_TIMEOUT": "3"}, iterations=400)
    errors = [(out / f"rank{rank}.err").read_text() for rank in range(2)]
    assert not list(out.glob("*.done")), "a rank trained to the end unprotected"
    iterations = {e.split(" ", 1)[0] for e in errors}
    assert len(iterations) == 1, errors  # the same iteration on every rank: none left in an all-reduce
    for error in errors:
        assert error.split(" ", 1)[1].startswith("UnprotectedError: checkmate: the job is not protected"), (
            error
        )
        assert reason in error, error


def test_the_log_policy_trains_to_the_end_and_says_so_once() -> None:
    out = _run(
        "silent", _other_jobs_shadows(), {"CHECKMATE_CERTIFY_TIMEOUT": "1", "CHECKMATE_UNPROTECTED": "log"}
    )
    assert not list(out.glob("*.err"))
    status = (out / "rank0.done").read_text()
    assert "'protected': False" in status and "'unprotected_episodes': 1" in status, status
    assert (out / "rank1.done").read_text() == "None"
