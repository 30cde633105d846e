"""The packet testbed over mutual TLS: the switch serves P4Runtime with a certificate and takes only
clients whose certificate its CA signed, and the packet checks run through it unchanged.

Per target (the embedded switch, BMv2 where installed), in namespaces as the packet suite runs:
a client with the test PKI's controller certificate pushes the pipeline, installs the scenario
and sees a gradient packet forwarded and copied to its shadow; a plaintext client and a TLS
client without a certificate get no session (issue 29: TLS wired into the packet testbed and
run against BMv2).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from checkmate.tls import PkiFiles, TlsFiles, make_test_pki
from embedded_switch import testbed
from tests import switch_cases as sc
from tests.packet.conftest import REPO_ROOT, Rig, open_rig, skip_reason
from tests.packet.p4rt import RPC_TIMEOUT_S, P4RuntimeTestClient, device_config_for

pytestmark = pytest.mark.root

KINDS = ["embedded", pytest.param("bmv2", marks=pytest.mark.bmv2)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PkiFiles:
    return make_test_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module", params=KINDS)
def tls_switch(request: pytest.FixtureRequest, pki: PkiFiles) -> Iterator[Rig]:
    kind = request.param
    reason = skip_reason(kind)
    if reason is not None:
        pytest.skip(reason)
    with testbed.testbed(sc.PORTS, prefix="ct") as bed:
        process = testbed.start_switch(kind, bed, tls=pki)
        try:
            rig = open_rig(kind, bed, process)
            try:
                yield rig
            finally:
                for s in rig.sockets.values():
                    s.close()
        finally:
            process.stop()


def _refused(address: str, tls: TlsFiles | None) -> bool:
    """Whether a client with ``tls`` (None: plaintext) fails to open a P4Runtime session.

    The channel is closed on every path: an open one keeps reconnecting on gRPC's threads, and a
    later test that forks this process (torch.multiprocessing) then aborts in gRPC's fork check.
    """
    from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc

    channel = testbed.open_channel(address, tls)
    try:
        try:
            grpc.channel_ready_future(channel).result(timeout=3.0)
        except grpc.FutureTimeoutError:
            return True
        try:  # connected at the TCP/TLS layer: an RPC is what mutual TLS refuses
            p4runtime_pb2_grpc.P4RuntimeStub(channel).Capabilities(
                p4runtime_pb2.CapabilitiesRequest(), timeout=RPC_TIMEOUT_S
            )
        except grpc.RpcError:
            return True
        return False
    finally:
        channel.close()


def test_a_client_with_the_ca_signed_certificate_programs_the_switch_over_tls(
    tls_switch: Rig, pki: PkiFiles
) -> None:
    client = P4RuntimeTestClient(tls_switch.switch.address, tls=pki.controller)
    try:
        client.push_pipeline(device_config_for(tls_switch.kind, REPO_ROOT))
        client.insert(*sc.ENTRIES)
        client.insert_group(*sc.GROUPS)
        tls_switch.drain()
        pkt = sc.checkmate_packet(shard_key=sc.SHARD_SHADOW1)
        tls_switch.send(sc.W0_PORT, pkt)
        tls_switch.expect({sc.W1_PORT: [sc.primary_copy(pkt)], sc.SH1_PORT: [sc.shadow1_copy(pkt)]})
        drops = client.read_counters("ingress_drops")  # a Read over TLS too: nothing was dropped
        assert drops and all(packets == 0 for packets, _ in drops.values()), drops
    finally:
        client.close()


def test_plaintext_and_certificateless_clients_get_no_session(
    tls_switch: Rig, pki: PkiFiles, tmp_path: Path
) -> None:
    address = tls_switch.switch.address
    assert _refused(address, None)  # plaintext against a TLS server
    assert _refused(address, TlsFiles(pki.ca, None, None))  # TLS, but no client certificate
    other = make_test_pki(tmp_path / "other")  # a certificate another CA signed
    assert _refused(address, TlsFiles(pki.ca, other.client_cert, other.client_key))
    assert not _refused(address, pki.controller)  # and the right one still gets in
