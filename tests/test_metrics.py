"""Prometheus endpoints, scraped while a real job runs: two shadows and rank 0's agent.

Two DDP ranks train on loopback with ``hosts.enable_checkmate``; the switch's copies are
emulated by tests/shadow/copy_tap.py with loss and duplicates, so drops and repairs
happen. A thread scrapes the shadows' and rank 0's endpoints over HTTP during the run;
the figures must move during the run and, at the end, equal the components' own status.
Also: a port in use (shadow CLI: refuses to start with one line; agent: logs, trains on),
the embedded switch's collector over its real P4 state, and its command line (root: a veth pair).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from checkmate.metrics import MetricsPortError, MetricsServer, start_or_log
from shadow.metrics import shadow_collector
from shadow.node import ShadowConfig, ShadowNode
from shadow.repair import RepairPolicy
from tests.hosts.harness import run_ranks
from tests.listen_ports import listen_port
from tests.shadow.copy_tap import CopyFaults

JOB_ID = 23
STEPS = 30  # long enough (>= 3 s) that the shadows apply while the job runs, not only after it
REPO = Path(__file__).resolve().parents[1]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` from one scrape of 127.0.0.1:port."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict[Any, float], name: str, **labels: str) -> float | None:
    for (sample, got), v in samples.items():
        if sample == name and all(dict(got).get(k) == want for k, want in labels.items()):
            return v
    return None


def _train(
    rank: int, world: int, store: str, env: dict[str, str], copies: dict[int, Any], pause: float
) -> Any:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hosts
    from hosts.ddp import CheckmateConfig
    from tests.shadow.copy_tap import CopyTap

    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    os.environ["CHECKMATE_BIND"] = f"127.0.0.{80 + rank}:48879"  # not the default .10/.11 other tests use
    if rank != 0:
        os.environ.pop("CHECKMATE_METRICS_PORT", None)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    )
    ddp = DDP(model, bucket_cap_mb=0.002)  # several buckets: each shadow owns some
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    agent = hosts.enable_checkmate(
        ddp, opt, dataclasses.replace(CheckmateConfig.from_env(), keep_iterations=64)
    )
    metrics_port = agent._metrics.port if agent._metrics is not None else None
    tap = CopyTap(agent.transport, copies, CopyFaults(loss=0.05, duplicate=0.05, seed=5), rank)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(
            ddp(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(pause)
    tap.flush()
    if agent.channel is not None:
        agent.wait_certified(STEPS - 1, timeout=30.0)
    time.sleep(0.5)  # the parent scrapes the finished agent once more
    out = {"stats": agent.stats(), "metrics_port": metrics_port, "iteration": agent.iteration}
    if agent.channel is not None:
        out["certified"] = agent.channel.certified_through()
    dist.barrier()
    agent.close()
    dist.destroy_process_group()
    return out


def test_shadow_and_agent_metrics_during_a_run() -> None:
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="metrics-"))
    nodes = [
        ShadowNode(
            ShadowConfig(
                name=f"s{i}",
                control_bind=(f"127.0.0.{50 + i}", 0),
                data_bind=(f"127.0.0.{50 + i}", 0),
                repair=RepairPolicy(grace=0.01, timeout=0.05),
            )
        ).start()
        for i in range(2)
    ]
    servers = [MetricsServer(shadow_collector(n.status), 0, "127.0.0.1") for n in nodes]
    agent_port = listen_port()
    shadows = ",".join(f"{n.name}={n.control_address[0]}:{n.control_address[1]}" for n in nodes)
    env = {
        "CHECKMATE_JOB_ID": str(JOB_ID),
        "CHECKMATE_SHADOWS": shadows,
        "CHECKMATE_METRICS_PORT": str(agent_port),
    }
    copies = {i: n.data_address for i, n in enumerate(nodes)}
    seen: dict[str, list[Any]] = {"agent": [], "s0": [], "s1": []}
    stop = threading.Event()

    def scraper(key: str, port: int) -> None:
        while not stop.is_set():
            try:
                seen[key].append(scrape(port))
            except OSError:
                pass  # the agent's endpoint is not up yet / gone
            time.sleep(0.02)

    threads = [
        threading.Thread(target=scraper, args=(key, port), daemon=True)
        for key, port in (("agent", agent_port), ("s0", servers[0].port), ("s1", servers[1].port))
    ]
    for thread in threads:
        thread.start()
    try:
        r0, _r1 = run_ranks(_train, 2, f"{tmp}/store", env, copies, 0.1, timeout=120)
        stop.set()
        for thread in threads:
            thread.join(10)
        assert r0["metrics_port"] == agent_port
        # rank 0's agent: seen during the run, iteration and certified moving forward
        assert len(seen["agent"]) >= 5, "the agent's endpoint was never scraped during the run"
        iterations = [value(s, "checkmate_agent_iteration", job=str(JOB_ID), rank="0") for s in seen["agent"]]
        certified = [value(s, "checkmate_agent_certified_iteration") for s in seen["agent"]]
        assert (
            min(i for i in iterations if i is not None)
            < STEPS - 1
            <= max(i for i in iterations if i is not None)
        )
        assert max(c for c in certified if c is not None) == STEPS - 1 == r0["certified"]
        last = seen["agent"][-1]
        sent = value(last, "checkmate_agent_transport_events_total", event="data_sent")
        assert sent is not None and sent > 0
        tagged = value(last, "checkmate_agent_ring_events_total", event="tagged_datagrams")
        assert tagged == r0["stats"]["ring"]["tagged_datagrams"]
        # the shadows: figures change during the run and end equal to their status
        for node, server in zip(nodes, servers, strict=True):
            assert node.wait_applied(STEPS - 1, 10.0), node.status()
            during = [value(s, "checkmate_shadow_applied_iteration") for s in seen[node.name]]
            assert len({d for d in during if d is not None}) >= 3, (
                f"{node.name}: applied iteration did not move",
                len(seen[node.name]),
                during,
            )
            status = node.status()
            final = scrape(server.port)
            labels = {"shadow": node.name, "job": str(JOB_ID)}
            assert value(final, "checkmate_shadow_applied_iteration", **labels) == STEPS - 1
            assert (
                value(final, "checkmate_shadow_certified_iteration", **labels)
                == status["certified_iteration"]
            )
            assert (
                value(final, "checkmate_shadow_packets_received_total", **labels)
                == status["packets_received"]
                > 0
            )
            assert (
                value(final, "checkmate_shadow_received_bytes_total", **labels)
                == status["bytes_received"]
                > 0
            )
            assert (
                value(final, "checkmate_shadow_applied_iterations_total", **labels)
                == status["apply"]["iterations"]
            )
            apply_seconds = value(final, "checkmate_shadow_apply_seconds_total", **labels)
            assert apply_seconds is not None and apply_seconds > 0
            for reason, n in status["drops"].items():
                assert value(final, "checkmate_shadow_drops_total", reason=reason, **labels) == n
        finals = [node.status() for node in nodes]
        assert sum(s["drops"].get("duplicate", 0) for s in finals) > 0, "the copy tap duplicated nothing"
        repaired = sum(s["repairs"].get("elements_repaired", 0) for s in finals)
        scraped = sum(
            value(scrape(sv.port), "checkmate_shadow_repair_events_total", event="elements_repaired") or 0
            for sv in servers
        )
        assert repaired > 0 and scraped == repaired
    finally:
        stop.set()
        for server in servers:
            server.close()
        for node in nodes:
            node.close()


def test_port_in_use_is_a_clear_error(caplog: pytest.LogCaptureFixture) -> None:
    holder = MetricsServer(shadow_collector(lambda: {"shadow": "x"}), 0, "127.0.0.1")
    try:
        with pytest.raises(MetricsPortError, match=rf"127.0.0.1:{holder.port}: .*in use"):
            MetricsServer(shadow_collector(lambda: {"shadow": "y"}), holder.port, "127.0.0.1")
        with caplog.at_level(logging.ERROR, logger="checkmate.metrics"):
            assert start_or_log(shadow_collector(lambda: {"shadow": "y"}), holder.port, "127.0.0.1") is None
        assert "running without metrics" in caplog.text
        # the shadow's command line refuses to start, with one line and no traceback
        done = subprocess.run(
            [sys.executable, "-m", "shadow.cli", "run", "--name", "s", "--control", "127.0.0.1:0",
             "--data", "127.0.0.1:0", "--metrics-port", str(holder.port), "--metrics-address", "127.0.0.1"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 1
        assert f"cannot serve metrics on 127.0.0.1:{holder.port}" in done.stderr
        assert "Traceback" not in done.stderr
        assert value(scrape(holder.port), "checkmate_shadow_metrics_errors_total") == 0
    finally:
        holder.close()


def test_a_failing_status_read_does_not_break_the_endpoint() -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("status exploded")

    server = MetricsServer(shadow_collector(broken), 0, "127.0.0.1")
    try:
        assert value(scrape(server.port), "checkmate_shadow_metrics_errors_total") == 1
        assert value(scrape(server.port), "checkmate_shadow_metrics_errors_total") == 2
    finally:
        server.close()


def test_switch_metrics_read_the_p4_state() -> None:
    from checkmate.p4.p4info import load_p4info
    from checkmate.p4.program import P4INFO_PATH
    from embedded_switch.metrics import switch_collector
    from embedded_switch.pipeline import DropReason
    from embedded_switch.ports import PortsConfig, SwitchPorts
    from embedded_switch.program import build_state
    from embedded_switch.state import ActionCall, FieldMatch, MatchKind, Replica, TableEntry

    state = build_state(load_p4info(P4INFO_PATH))
    ports = SwitchPorts(PortsConfig(bindings=()), state=state)
    state.table("lookup_job").insert(
        TableEntry((FieldMatch(MatchKind.EXACT, 7),), ActionCall("set_job_slot", (3,)))
    )
    state.multicast_groups[1] = (Replica(2, 0), Replica(4, 1))
    state.counter("shadow_copies").count(3, 1000)
    state.counter("shadow_copies").count(3, 500)
    state.counter("rejected_replications").count(0, 90)
    ports.drops.count(int(DropReason.NO_ROUTE), 1, 5)
    server = MetricsServer(switch_collector(0, ports, lambda: state), 0, "127.0.0.1")
    try:
        s = scrape(server.port)
        assert value(s, "checkmate_switch_shadow_copies_total", job="7", slot="3") == 2
        assert value(s, "checkmate_switch_shadow_copies_bytes_total", job="7", slot="3") == 1500
        assert value(s, "checkmate_switch_rejected_replications_total", job="unknown", slot="0") == 1
        assert value(s, "checkmate_switch_drops_total", reason="NO_ROUTE", port="1") == 5
        assert value(s, "checkmate_switch_table_entries", table="lookup_job") == 1
        assert value(s, "checkmate_switch_multicast_groups") == 1
        assert value(s, "checkmate_switch_multicast_replicas") == 2
        assert value(s, "checkmate_switch_pipeline_loaded") == 1
        state.counter("shadow_copies").count(3, 10)  # read at scrape time, not cached
        assert value(scrape(server.port), "checkmate_switch_shadow_copies_total", job="7") == 3
    finally:
        server.close()


def test_agent_metrics_port_from_the_environment() -> None:
    from hosts.ddp import CheckmateConfig, CheckmateConfigError

    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    assert CheckmateConfig.from_env({**base, "CHECKMATE_METRICS_PORT": "9102"}).metrics_port == 9102
    assert CheckmateConfig.from_env(base).metrics_port is None
    for bad in ("abc", "70000"):
        with pytest.raises(CheckmateConfigError, match="CHECKMATE_METRICS_PORT"):
            CheckmateConfig.from_env({**base, "CHECKMATE_METRICS_PORT": bad})


@pytest.mark.root
def test_switch_command_line_serves_metrics_and_refuses_a_taken_port() -> None:
    veth = f"cmm{os.getpid() % 100000}"
    subprocess.run(["ip", "link", "add", f"{veth}a", "type", "veth", "peer", "name", f"{veth}b"], check=True)
    switch = None
    try:
        for end in "ab":
            subprocess.run(["ip", "link", "set", f"{veth}{end}", "up"], check=True)
        port = listen_port()
        command = [sys.executable, "-m", "embedded_switch.cli", "--grpc-server-addr", "127.0.0.1:0"]
        switch = subprocess.Popen(
            [*command, "--p4info", "p4src/checkmate.p4info.txtpb", "-i", f"1@{veth}a",
             "--metrics-port", str(port), "--metrics-address", "127.0.0.1"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        samples = None
        while samples is None and time.monotonic() < deadline:
            try:
                samples = scrape(port)
            except OSError:
                time.sleep(0.2)
        assert samples is not None, "the switch's metrics endpoint never answered"
        assert value(samples, "checkmate_switch_pipeline_loaded", device="0") == 1
        assert value(samples, "checkmate_switch_table_entries", table="replicate_to_shadow") == 0
        second = subprocess.run(
            [*command, "--no-p4", "-i", f"1@{veth}b", "--metrics-port", str(port),
             "--metrics-address", "127.0.0.1"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 1
        assert f"cannot start: cannot serve metrics on 127.0.0.1:{port}" in second.stderr
        assert "Traceback" not in second.stderr
        assert switch.poll() is None, "the first switch must keep running"
    finally:
        if switch is not None:
            switch.terminate()
            switch.wait(timeout=15)
        subprocess.run(["ip", "link", "del", f"{veth}a"], check=False)
