"""The switch as users run it: p4runtime-shell, repeated pushes, fault injection, pcap files, clean shutdown.

p4runtime-shell (the client users have) programs the switch end to end on every
target, and the controller's push path re-programs it again and again without
multiplying copies. The rest exercises options only ``checkmate-switch`` has (fault
injection) or checks its process behaviour (SIGTERM, pcap, log file).
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from p4runtime_sh import shell as sh
from scapy.utils import rdpcap

from checkmate.p4.p4info import load_p4info
from checkmate.p4.program import P4INFO_PATH, Target
from controller.pipeline import PipelineConfig, push_pipeline
from controller.switch_connection import SwitchConnection
from embedded_switch import testbed
from tests import switch_cases as sc
from tests.packet.conftest import BMV2_JSON, DATAPATHS, REPO_ROOT, Rig, open_rig, skip_reason
from tests.packet.p4rt import P4RuntimeTestClient, device_config_for, entry_inserts, group_inserts

pytestmark = pytest.mark.root

DROP_PORT, DROP_FRACTION, DROP_SEED = sc.W1_PORT, 0.3, 11


def test_p4runtime_shell_installs_a_job_and_a_packet_is_replicated(switch: Rig, tmp_path: Path) -> None:
    """The "done when" of issue 3, with p4runtime-shell as the controller."""
    device_config = BMV2_JSON if switch.kind == "bmv2" else tmp_path / "embedded.bin"
    if switch.kind != "bmv2":
        device_config.write_bytes(b"")
    cleaner = P4RuntimeTestClient(switch.switch.address)
    try:
        cleaner.delete_groups()  # sh.setup pushes the pipeline; no old group may survive it
    finally:
        cleaner.close()
    sh.setup(
        device_id=0,
        grpc_addr=switch.switch.address,
        election_id=(0, 50),
        config=sh.FwdPipeConfig(str(P4INFO_PATH), str(device_config)),
        verbose=False,
    )
    try:
        for prefix, port, mac in (
            ("10.0.2.0/24", sc.W1_PORT, sc.W1_MAC),
            ("10.0.3.1/32", sc.SH1_PORT, sc.SH1_MAC),
        ):
            te = sh.TableEntry("route_ipv4")(action="forward")
            te.match["dst_addr"] = prefix
            te.action["port"] = str(port)
            te.action["src_mac"] = sc.SWITCH_MAC
            te.action["dst_mac"] = mac
            te.insert()
        te = sh.TableEntry("lookup_job")(action="set_job_slot")
        te.match["job_id"] = str(sc.JOB_ID)
        te.action["slot"] = str(sc.JOB_SLOT)
        te.insert()
        te = sh.TableEntry("replicate_to_shadow")(action="set_multicast_group")
        te.match["job_id"] = str(sc.JOB_ID)
        te.match["ingress_port"] = str(sc.W0_PORT)
        te.match["shard_key"] = str(sc.SHARD_SHADOW1)
        te.match["next_hop_port"] = str(sc.W1_PORT)
        te.action["group"] = str(sc.GROUP_SHADOW1)
        te.insert()
        sh.MulticastGroupEntry(sc.GROUP_SHADOW1).add(sc.W1_PORT, 0).add(sc.SH1_PORT, sc.RID_SHADOW1).insert()
        te = sh.TableEntry("rewrite_shadow_copy")(action="set_shadow_destination")
        te.match["egress_rid"] = str(sc.RID_SHADOW1)
        te.action["src_mac"] = sc.SWITCH_MAC
        te.action["dst_mac"] = sc.SH1_MAC
        te.action["dst_addr"] = sc.SH1_IP
        te.action["dst_port"] = str(sc.SH1_UDP_PORT)
        te.insert()

        switch.drain()
        pkt = sc.checkmate_packet()
        switch.send(sc.W0_PORT, pkt)
        switch.expect({sc.W1_PORT: [sc.primary_copy(pkt)], sc.SH1_PORT: [sc.shadow1_copy(pkt)]})

        counter = sh.CounterEntry("shadow_copies")
        counter.index = sc.JOB_SLOT
        [cell] = list(counter.read())
        assert (cell.data.packet_count, cell.data.byte_count) == (1, len(bytes(pkt)))
    finally:
        sh.teardown()


PUSHES = 5


def test_repeated_pipeline_pushes_copy_a_frame_exactly_once(switch: Rig) -> None:
    """The controller's push path, PUSHES times on one running switch, each time with the groups
    installed again: a replicated frame still comes out once per replica. Without the group
    deletion before each push, BMv2 1.15.5 sent it PUSHES times to every port (docs/controller.md)."""
    target = Target.BMV2 if switch.kind == "bmv2" else Target.EMBEDDED
    config = PipelineConfig(target, load_p4info(), device_config_for(switch.kind, REPO_ROOT))
    for _ in range(PUSHES):
        with SwitchConnection("s1", switch.switch.address, 0, 20, timeout=10.0) as connection:
            push_pipeline(connection, config, timeout=30.0)
            errors = connection.write([*entry_inserts(config.p4info, sc.ENTRIES), *group_inserts(sc.GROUPS)])
            assert errors == [None] * len(errors)
    switch.drain()
    pkt = sc.checkmate_packet(shard_key=sc.SHARD_BOTH)
    switch.send(sc.W0_PORT, pkt)
    switch.expect(
        {
            sc.W1_PORT: [sc.primary_copy(pkt)],
            sc.SH1_PORT: [sc.shadow1_copy(pkt)],
            sc.SH2_PORT: [sc.shadow2_copy(pkt)],
        }
    )


# ---- embedded-only options ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=DATAPATHS)
def faulty_switch(request: pytest.FixtureRequest) -> Iterator[Rig]:
    """checkmate-switch with fault injection on port 2 and a log file, per data path; pcap
    capture on the Python one (capture always runs the Python data path)."""
    datapath: str = request.param
    reason = skip_reason("embedded")
    if reason is not None:
        pytest.skip(reason)
    with testbed.testbed(sc.PORTS) as bed:
        extra = [
            "--drop-egress", f"{DROP_PORT}:{DROP_FRACTION}", "--drop-seed", str(DROP_SEED),
            "--log-file", str(bed.workdir / "switch.log"), "--datapath", datapath,
        ]  # fmt: skip
        if datapath == "python":
            extra += ["--pcap", str(bed.workdir / "pcap")]
        process = testbed.start_switch("embedded", bed, extra)
        try:
            rig = open_rig("embedded", bed, process, datapath)
            try:
                client = P4RuntimeTestClient(process.address)
                try:
                    client.push_pipeline()
                    client.insert(*sc.ENTRIES)
                    client.insert_group(*sc.GROUPS)
                finally:
                    client.close()
                yield rig
            finally:
                for s in rig.sockets.values():
                    s.close()
        finally:
            process.stop()


def test_fault_injection_drops_the_seeded_fraction(faulty_switch: Rig) -> None:
    total = 1000
    rng = random.Random(f"{DROP_SEED}:{DROP_PORT}")
    expected_drops = sum(rng.random() < DROP_FRACTION for _ in range(total))
    packets = [bytes(sc.udp_packet(size=64 + i % 7)) for i in range(total)]
    for start in range(0, total, 100):
        faulty_switch.send(sc.W0_PORT, *packets[start : start + 100])
        time.sleep(0.005)
    got = faulty_switch.collect(total - expected_drops, timeout=10.0)
    assert len(got[DROP_PORT]) == total - expected_drops
    assert (
        abs(expected_drops - total * DROP_FRACTION) < 4 * (total * DROP_FRACTION * (1 - DROP_FRACTION)) ** 0.5
    )
    assert all(not frames for port, frames in got.items() if port != DROP_PORT)


def test_sigterm_stops_cleanly_with_pcaps_and_log(faulty_switch: Rig) -> None:
    packets = [sc.udp_packet(dst_ip=sc.W0_IP, size=100 + i) for i in range(5)]
    for p in packets:
        p.src = sc.SH1_MAC
    faulty_switch.send(sc.SH1_PORT, *packets)
    faulty_switch.expect({sc.W0_PORT: [sc.routed(p, sc.W0_MAC) for p in packets]})
    process = faulty_switch.switch.process
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=10) == 0
    bed = faulty_switch.bed
    log = (bed.workdir / "switch.log").read_text()
    assert "shutting down" in log and "final counts" in log and f"FAULT_INJECTION@{DROP_PORT}=" in log
    assert f"data path: {faulty_switch.datapath}" in log
    if faulty_switch.datapath == "python":
        pcap = bed.workdir / "pcap"
        sent_in = [bytes(p) for p in rdpcap(str(pcap / f"{bed.switch_ifaces[sc.SH1_PORT]}_in.pcap"))]
        sent_out = [bytes(p) for p in rdpcap(str(pcap / f"{bed.switch_ifaces[sc.W0_PORT]}_out.pcap"))]
        assert sent_in == [bytes(p) for p in packets]
        assert sent_out == [sc.routed(p, sc.W0_MAC) for p in packets]
