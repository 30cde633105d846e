"""A pipeline push deletes the switch's multicast groups first (BMv2 keeps their replicas otherwise)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from p4.v1 import p4runtime_pb2

from checkmate.job import JobSpec
from controller.controller import Controller
from controller.entities import MulticastGroup
from controller.errors import ControllerError, UpdateError
from controller.pipeline import PipelineConfig, delete_multicast_groups
from controller.switch_connection import SwitchConnection
from embedded_switch.p4runtime_server import P4RuntimeServer
from tests.controller.conftest import TIMEOUT_S, Fabric, gradient

JOB = JobSpec(7, ("h1", "h2", "h3", "h4"), ("sh1", "sh2"))


def with_a_job(fabric: Callable[..., Fabric], topology: str) -> tuple[Fabric, Controller]:
    """Forwarding and JOB installed by a fresh controller."""
    f = fabric(topology)
    ctl = f.controller()
    ctl.install_forwarding()
    ctl.add_job(JOB)
    return f, ctl


def test_push_deletes_every_group_before_the_pipeline_and_reconcile_puts_them_back(
    fabric: Callable[..., Fabric], monkeypatch: pytest.MonkeyPatch
) -> None:
    f, ctl = with_a_job(fabric, "leafspine")
    installed = f.snapshot()
    groups_before = {
        s: sorted(k for k, e in ctl.read_installed(s).items() if isinstance(e, MulticastGroup))
        for s in f.network.switches
    }
    assert sum(len(g) for g in groups_before.values()) > 0

    groups_at_push: dict[str, int] = {}
    original = SwitchConnection.set_pipeline

    def spy(self: SwitchConnection, *args: object, **kwargs: object) -> None:
        state = f.servers[self.name].state
        assert state is not None
        groups_at_push[self.name] = len(state.multicast_groups)
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SwitchConnection, "set_pipeline", spy)
    report = ctl.push_pipeline(PipelineConfig.embedded())
    assert groups_at_push == {s: 0 for s in f.network.switches}
    assert report is not None and sum(report.inserted.values()) > 0
    assert f.snapshot() == installed  # routes, the job's entries and groups, counters back as before

    # A replicated gradient reaches its next hop and its shadow exactly once.
    src, dst = "h1", "h2"
    delivered = f.send(src, gradient(src, dst, f.network))
    assert {h: len(p) for h, p in delivered.items()} == {dst: 1, "sh1": 1}


def test_a_switch_without_a_pipeline_has_no_groups_to_delete() -> None:
    server = P4RuntimeServer(0, "127.0.0.1:0")
    port = server.start()
    try:
        with SwitchConnection("s1", f"127.0.0.1:{port}", 0, timeout=TIMEOUT_S) as connection:
            assert delete_multicast_groups(connection) == 0
    finally:
        server.stop(grace=0.1)


def test_a_refused_group_delete_stops_the_push_with_a_clear_error(
    fabric: Callable[..., Fabric], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, ctl = with_a_job(fabric, "single")
    pushed: list[str] = []
    monkeypatch.setattr(SwitchConnection, "set_pipeline", lambda self, *a, **k: pushed.append(self.name))
    real_write = SwitchConnection.write

    def refuse_deletes(
        self: SwitchConnection, updates: list[p4runtime_pb2.Update]
    ) -> list[UpdateError | None]:
        if updates and all(u.type == p4runtime_pb2.Update.DELETE for u in updates):
            return [UpdateError(i, "PERMISSION_DENIED", "read-only group") for i in range(len(updates))]
        return real_write(self, updates)

    monkeypatch.setattr(SwitchConnection, "write", refuse_deletes)
    with pytest.raises(ControllerError, match=r"deleting its multicast groups before a pipeline push failed"):
        ctl.push_pipeline(PipelineConfig.embedded())
    assert pushed == []
