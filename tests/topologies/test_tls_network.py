"""``checkmate-net up --tls``: the switches serve P4Runtime over mutual TLS and the controller uses it.

Brought up for real (root: namespaces, veth pairs, the embedded switch). The bring-up itself
pushes the pipeline and installs forwarding over TLS; afterwards ``checkmate-ctl`` works with
the exported client certificate and fails without it (plaintext against a TLS server).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkmate.network import Network
from checkmate.p4.program import Target
from checkmate.tls import make_test_pki
from tests.topologies.harness import CTL, ENV, REPO, RunningNetwork, root_interfaces, topology_copy
from topologies.preflight import PreflightError, make_plan

CLIENT_ENV = ("CHECKMATE_P4RT_CA", "CHECKMATE_P4RT_CERT", "CHECKMATE_P4RT_KEY")


def test_a_plan_with_a_pki_serves_mutual_tls_on_every_switch(tmp_path: Path) -> None:
    pki = make_test_pki(tmp_path / "pki")
    plan = make_plan(
        REPO / "topologies" / "leafspine.json", Target.EMBEDDED, tmp_path / "run", tls_dir=pki.ca.parent
    )
    assert plan.tls is not None
    for config in plan.switches.values():
        argv = config.command(plan.switch_binary)
        after = argv[argv.index("--") + 1 :]
        assert after[after.index("--grpc-server-cert") + 1] == str(pki.server_cert)
        assert after[after.index("--grpc-server-key") + 1] == str(pki.server_key)
        assert after[after.index("--grpc-server-cacert") + 1] == str(pki.ca)
        assert "--grpc-server-with-client-auth" in after
    assert plan.controller_env() == {
        "CHECKMATE_P4RT_CA": str(pki.ca),
        "CHECKMATE_P4RT_CERT": str(pki.client_cert),
        "CHECKMATE_P4RT_KEY": str(pki.client_key),
    }
    plain = make_plan(REPO / "topologies" / "single.json", Target.EMBEDDED, tmp_path / "run2")
    assert plain.tls is None and plain.controller_env() == {}
    assert all(not c.grpc_args for c in plain.switches.values())


def test_a_pki_directory_missing_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    pki = make_test_pki(tmp_path / "pki")
    pki.client_key.unlink()
    with pytest.raises(PreflightError, match="controller.key"):
        make_plan(
            REPO / "topologies" / "single.json", Target.EMBEDDED, tmp_path / "run", tls_dir=pki.ca.parent
        )


def _bmv2_ready() -> bool:
    return (
        shutil.which("simple_switch_grpc") is not None and (REPO / "build/v1model/checkmate.json").is_file()
    )


@pytest.fixture(
    scope="module",
    params=[pytest.param("embedded"), pytest.param("bmv2", marks=pytest.mark.bmv2)],
)
def tls_network(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningNetwork]:
    target = request.param
    if target == "bmv2" and not _bmv2_ready():
        pytest.skip("BMv2 is installed but build/v1model/checkmate.json is missing: run `make p4`")
    folder = tmp_path_factory.mktemp(f"net-tls-{target}")
    network_file = topology_copy("single", folder)
    net = RunningNetwork(
        name="single",
        target=target,
        network_file=network_file,
        run_dir=folder / "run",
        state_dir=folder / "ctl",
        network=Network.load(network_file),
        interfaces_before=root_interfaces(),
        up_args=("--tls",),
    )
    try:
        result = net.up()
        assert result.returncode == 0, f"up --tls failed:\n{result.stdout}\n{result.stderr}"
        assert "mutual TLS" in result.stdout, result.stdout
        yield net
    finally:
        net.finalize()


def _ctl(net: RunningNetwork, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    argv = [*CTL, "--network", str(net.network_file), "--state-dir", str(net.state_dir), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=REPO, check=False)


@pytest.mark.root
def test_the_controller_reaches_tls_switches_only_with_its_certificate(tls_network: RunningNetwork) -> None:
    pki_dir = tls_network.run_dir / "tls"
    assert (pki_dir / "ca.pem").is_file() and (pki_dir / "controller.key").is_file()
    assert os.stat(pki_dir / "controller.key").st_mode & 0o077 == 0
    with_cert = {
        **{k: v for k, v in ENV.items() if k not in CLIENT_ENV},
        "CHECKMATE_P4RT_CA": str(pki_dir / "ca.pem"),
        "CHECKMATE_P4RT_CERT": str(pki_dir / "controller.pem"),
        "CHECKMATE_P4RT_KEY": str(pki_dir / "controller.key"),
    }
    good = _ctl(tls_network, with_cert, "forwarding", "install")
    assert good.returncode == 0, good.stdout + good.stderr
    plaintext = {k: v for k, v in ENV.items() if k not in CLIENT_ENV}
    bad = _ctl(tls_network, plaintext, "forwarding", "install")
    assert bad.returncode != 0, "a plaintext controller reached a TLS switch"
    no_client_cert = {k: v for k, v in with_cert.items() if k not in CLIENT_ENV[1:]}
    refused = _ctl(tls_network, no_client_cert, "forwarding", "install")
    assert refused.returncode != 0, "a controller without a client certificate reached the switch"
