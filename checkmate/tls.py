"""TLS for P4Runtime between the controller and a switch: certificate files, their checks, a test CA.

Both ends take PEM files, as ``simple_switch_grpc`` does
(``--grpc-server-ssl --grpc-server-cacert CA --grpc-server-cert CERT
--grpc-server-key KEY [--grpc-server-with-client-auth]``): the switch presents
CERT (signed by a CA the controller trusts) and, with client auth, accepts only
controllers whose certificate the switch's CA signed (mutual TLS). Without TLS,
P4Runtime is plaintext: the tutorial workflow, which says so in its log.

:func:`check_files` reads a side's files before anything starts and raises
:class:`TlsConfigError` naming the file for a missing or unreadable file, a
certificate that has expired or is not yet valid, or a key that does not belong
to the certificate; a handshake that fails at run time (the peer's certificate is
not signed by our CA, does not name the address, or ours is refused) is reported
by the caller naming the peer.

``python -m checkmate.tls make-test-pki DIR [--host NAME ...]`` writes a test CA,
a switch (server) certificate naming ``localhost``, ``127.0.0.1`` and each NAME,
and a controller (client) certificate: for tests and demos, not for production.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkmate.address import AddressError, parse_host_port

logger = logging.getLogger(__name__)


class TlsConfigError(ValueError):
    """A TLS file that will not do; the message names it."""


@dataclass(frozen=True)
class TlsFiles:
    """One side's PEM files: the CA that signs the peer, and this side's certificate and key."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def read(self) -> tuple[bytes, bytes | None, bytes | None]:
        """``(ca, cert, key)`` bytes, after :func:`check_files`."""
        check_files(self)
        cert = self.cert.read_bytes() if self.cert is not None else None
        key = self.key.read_bytes() if self.key is not None else None
        return self.ca.read_bytes(), cert, key


DEFAULT_P4RUNTIME_ADDRESS = "127.0.0.1:9559"
"""Loopback: a controller elsewhere needs an explicit address (and should use mutual TLS)."""


class InsecureServerError(TlsConfigError):
    """A P4Runtime server that anyone who reaches it could program, without ``insecure=True``."""


def is_local_address(address: str) -> bool:
    """A unix socket or a loopback host (``127.x``, ``::1``, ``localhost``)."""
    if address.startswith("unix:"):
        return True
    try:
        host = parse_host_port(address, allow_zero=True)[0]
    except AddressError:
        return False
    return host == "localhost" or host == "::1" or host.startswith("127.")


def exposure(address: str, tls: bool, client_auth: bool) -> str | None:
    """Why a server on ``address`` would let in anyone who reaches it, or None."""
    if tls and not client_auth:
        return "TLS without client certificates: any TLS client could arbitrate and write"
    if not tls and not is_local_address(address):
        return (
            f"plaintext on {address}, which is not loopback: anyone on the network could program the switch"
        )
    return None


def _load_cert(path: Path, what: str) -> object:
    from cryptography import x509

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{what} {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise TlsConfigError(f"{what} {path}: not a PEM certificate ({exc})") from None


def _check_validity(cert: object, path: Path, what: str) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    not_before = cert.not_valid_before_utc  # type: ignore[attr-defined]
    not_after = cert.not_valid_after_utc  # type: ignore[attr-defined]
    if now > not_after:
        raise TlsConfigError(f"{what} {path} expired on {not_after:%Y-%m-%d %H:%M} UTC")
    if now < not_before:
        raise TlsConfigError(f"{what} {path} is not valid before {not_before:%Y-%m-%d %H:%M} UTC")


def check_files(files: TlsFiles) -> None:
    """TlsConfigError naming the file if the CA, certificate or key will not do."""
    from cryptography.hazmat.primitives import serialization

    ca = _load_cert(files.ca, "CA certificate")
    _check_validity(ca, files.ca, "CA certificate")
    if (files.cert is None) != (files.key is None):
        raise TlsConfigError("a certificate needs its key and a key its certificate (give both or neither)")
    if files.cert is None or files.key is None:
        return
    cert = _load_cert(files.cert, "certificate")
    _check_validity(cert, files.cert, "certificate")
    try:
        key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    except OSError as exc:
        raise TlsConfigError(f"key {files.key}: cannot read it: {exc.strerror or exc}") from None
    except (ValueError, TypeError) as exc:
        raise TlsConfigError(f"key {files.key}: not an unencrypted PEM private key ({exc})") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    pem = serialization.Encoding.PEM
    if key.public_key().public_bytes(pem, public) != cert.public_key().public_bytes(pem, public):  # type: ignore[attr-defined]
        raise TlsConfigError(f"key {files.key} does not belong to certificate {files.cert}")


def pki_in(directory: str | Path) -> PkiFiles:
    """The PKI a directory holds in :func:`make_test_pki`'s layout (``ca.pem``, ``switch.pem``,
    ``switch.key``, ``controller.pem``, ``controller.key``), checked: TlsConfigError naming the
    file that is missing or will not do. Users bring their own PKI in this layout."""
    pki = PkiFiles.layout(directory)
    check_files(pki.switch)
    check_files(pki.controller)
    return pki


def server_args(files: TlsFiles, client_auth: bool = True) -> list[str]:
    """The gRPC server options (after ``--``) of ``simple_switch_grpc`` and ``checkmate-switch``."""
    if files.cert is None or files.key is None:
        raise TlsConfigError("a switch serving TLS needs its certificate and key")
    argv = ["--grpc-server-ssl", "--grpc-server-cacert", str(files.ca)]
    argv += ["--grpc-server-cert", str(files.cert), "--grpc-server-key", str(files.key)]
    return argv + (["--grpc-server-with-client-auth"] if client_auth else [])


def channel_credentials(files: TlsFiles) -> Any:
    """gRPC channel credentials of a P4Runtime client: trust ``files.ca``; present ``files.cert``/``key``
    when both are given (mutual TLS). Files are checked first (TlsConfigError naming the one at fault)."""
    import grpc

    check_files(files)
    return grpc.ssl_channel_credentials(
        root_certificates=files.ca.read_bytes(),
        private_key=files.key.read_bytes() if files.key is not None else None,
        certificate_chain=files.cert.read_bytes() if files.cert is not None else None,
    )


# ---- a test CA ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PkiFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def layout(cls, directory: str | Path) -> PkiFiles:
        """The file names :func:`make_test_pki` writes and :func:`pki_in` reads."""
        out = Path(directory)
        return cls(
            ca=out / "ca.pem",
            server_cert=out / "switch.pem",
            server_key=out / "switch.key",
            client_cert=out / "controller.pem",
            client_key=out / "controller.key",
        )

    @property
    def switch(self) -> TlsFiles:
        """The switch's side: the CA that signs controllers, its certificate and key."""
        return TlsFiles(self.ca, self.server_cert, self.server_key)

    @property
    def controller(self) -> TlsFiles:
        """The controller's side: the CA that signs switches, its client certificate and key."""
        return TlsFiles(self.ca, self.client_cert, self.client_key)


def make_test_pki(
    directory: str | Path,
    hosts: Sequence[str] = (),
    days: float = 30.0,
    valid_from: datetime.datetime | None = None,
) -> PkiFiles:
    """Write a test CA, a switch certificate and a controller certificate (PEM) into ``directory``.

    The switch certificate names ``localhost``, ``127.0.0.1`` and ``hosts`` (DNS names or IP
    addresses); ``valid_from`` (default now) and ``days`` set every certificate's validity.
    Keys are written with mode 0600.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    start = valid_from or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    end = start + datetime.timedelta(days=days)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        data = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("Checkmate test CA"))
        .issuer_name(name("Checkmate test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(common: str, san: list[x509.GeneralName], usage: x509.ObjectIdentifier) -> tuple[bytes, object]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(common))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), key

    names: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    pki = PkiFiles.layout(out)
    pki.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    server_pem, server_key = leaf("checkmate switch", names, ExtendedKeyUsageOID.SERVER_AUTH)
    pki.server_cert.write_bytes(server_pem)
    write_key(pki.server_key, server_key)  # type: ignore[arg-type]
    client_pem, client_key = leaf("checkmate controller", [], ExtendedKeyUsageOID.CLIENT_AUTH)
    pki.client_cert.write_bytes(client_pem)
    write_key(pki.client_key, client_key)  # type: ignore[arg-type]
    logger.info("test PKI written to %s (valid %s .. %s)", out, start, end)
    return pki


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkmate.tls", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make-test-pki", help="write a test CA, a switch and a controller certificate")
    make.add_argument("directory", type=Path)
    make.add_argument(
        "--host", action="append", default=[], help="another name or IP for the switch certificate"
    )
    make.add_argument("--days", type=float, default=30.0, help="validity in days (default 30)")
    args = parser.parse_args(argv)
    try:
        pki = make_test_pki(args.directory, args.host, args.days)
    except OSError as exc:
        print(f"checkmate.tls: cannot write {args.directory}: {exc}", file=sys.stderr)
        return 1
    print(f"CA {pki.ca}\nswitch {pki.server_cert} {pki.server_key}")
    print(f"controller {pki.client_cert} {pki.client_key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
