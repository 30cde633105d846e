"""P4Runtime over TLS between the controller and the embedded switch: mutual TLS, bad certificates."""

from __future__ import annotations

import datetime
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkmate.p4.program import P4INFO_PATH
from checkmate.tls import PkiFiles, TlsConfigError, TlsFiles, check_files, make_test_pki, server_args
from controller.errors import ControllerError, SwitchUnreachableError
from controller.switch_connection import SwitchConnection
from embedded_switch.cli import parse_config
from embedded_switch.p4runtime_server import P4RuntimeServer
from topologies.targets import SwitchConfig

DEVICE = 1


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PkiFiles:
    return make_test_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> PkiFiles:
    return make_test_pki(tmp_path_factory.mktemp("other-pki"))


@pytest.fixture
def mtls_switch(pki: PkiFiles) -> Iterator[str]:
    server = P4RuntimeServer(
        DEVICE, "127.0.0.1:0", tls=TlsFiles(pki.ca, pki.server_cert, pki.server_key), client_auth=True
    )
    server.load_pipeline(P4INFO_PATH)
    port = server.start()
    yield f"127.0.0.1:{port}"
    server.stop()


def test_mutual_tls_session_reads_the_pipeline(mtls_switch: str, pki: PkiFiles) -> None:
    tls = TlsFiles(pki.ca, pki.client_cert, pki.client_key)
    with SwitchConnection("s1", mtls_switch, DEVICE, timeout=5, tls=tls) as conn:
        assert conn.is_primary
        assert conn.get_p4info().tables  # a real RPC over the TLS session


@pytest.mark.parametrize(
    "who", ["plaintext", "no client certificate", "another CA's client", "trusts another CA"]
)
def test_a_client_without_the_right_certificate_gets_no_session(
    mtls_switch: str, pki: PkiFiles, other_pki: PkiFiles, who: str
) -> None:
    tls = {
        "plaintext": None,
        "no client certificate": TlsFiles(pki.ca),
        "another CA's client": TlsFiles(pki.ca, other_pki.client_cert, other_pki.client_key),
        "trusts another CA": TlsFiles(other_pki.ca, pki.client_cert, pki.client_key),
    }[who]
    with pytest.raises(SwitchUnreachableError, match=r"switch s1 \(127\.0\.0\.1:\d+"):
        SwitchConnection("s1", mtls_switch, DEVICE, timeout=1.5, tls=tls)


def test_expired_and_mismatched_files_are_named(tmp_path: Path, pki: PkiFiles) -> None:
    old = make_test_pki(
        tmp_path / "old", days=1, valid_from=datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
    )
    with pytest.raises(TlsConfigError, match=rf"CA certificate {old.ca} expired on 2020-01-02"):
        check_files(TlsFiles(old.ca))
    with pytest.raises(TlsConfigError, match=rf"certificate {old.client_cert} expired"):
        check_files(TlsFiles(pki.ca, old.client_cert, old.client_key))
    with pytest.raises(
        TlsConfigError, match=rf"key {pki.server_key} does not belong to certificate {pki.client_cert}"
    ):
        check_files(TlsFiles(pki.ca, pki.client_cert, pki.server_key))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(TlsConfigError, match=rf"CA certificate {garbage}: not a PEM certificate"):
        check_files(TlsFiles(garbage))
    with pytest.raises(
        ControllerError, match=rf"switch s9: CA certificate {tmp_path / 'missing.pem'}: cannot read"
    ):
        SwitchConnection("s9", "127.0.0.1:1", DEVICE, timeout=1, tls=TlsFiles(tmp_path / "missing.pem"))


def test_checkmate_switch_takes_simple_switch_grpc_tls_options(tmp_path: Path, pki: PkiFiles) -> None:
    base = ["--no-p4", "--", "--grpc-server-addr", "127.0.0.1:0"]
    switch = SwitchConfig(
        "s1",
        1,
        "127.0.0.1:0",
        grpc_args=tuple(server_args(TlsFiles(pki.ca, pki.server_cert, pki.server_key))),
    )
    argv = switch.command(
        "checkmate-switch"
    )  # the command line both targets get (simple_switch_grpc's flags)
    assert argv[argv.index("--") + 1 :][-8:] == [
        "--grpc-server-ssl", "--grpc-server-cacert", str(pki.ca), "--grpc-server-cert", str(pki.server_cert),
        "--grpc-server-key", str(pki.server_key), "--grpc-server-with-client-auth",
    ]  # fmt: skip
    config = parse_config([*base, *argv[argv.index("--") + 1 :][-8:]])
    assert config.tls == TlsFiles(pki.ca, pki.server_cert, pki.server_key) and config.client_auth
    assert parse_config(base).tls is None  # plaintext unless asked
    expired = make_test_pki(
        tmp_path / "old", days=1, valid_from=datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
    )
    shutil.copy(expired.server_cert, tmp_path / "expired.pem")
    with pytest.raises(SystemExit):
        parse_config([*base, "--grpc-server-ssl", "--grpc-server-cert", str(tmp_path / "expired.pem"),
                      "--grpc-server-key", str(expired.server_key)])  # fmt: skip
