"""A real nfs-ganesha for tests: in a network namespace of its own, exporting a small tmpfs.

The server runs in a namespace the fixture makes (a veth pair to the test's own namespace,
addresses in 10.254.0.0/29), exporting a tmpfs of ``EXPORT_MIB`` so that "full" is reachable;
clients are libnfs through :mod:`checkmate.nfs`. ``needs_server`` skips with the reason when not
root or when nfs-ganesha, its VFS backend or libnfs is not installed (``make setup`` installs them).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from checkmate import nfs
from experiments.bench import storage_host
from experiments.bench.storage_host import EXPORT_PSEUDO, NFSServer

UNREACHABLE = "10.254.0.3"
"""In the link's subnet, nobody there."""
EXPORT_MIB = 48
"""The export's tmpfs: a write larger than this fills it."""


def missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a network namespace, a tmpfs mount)"
    return storage_host.ganesha_missing() or nfs.available()


needs_server = pytest.mark.skipif(missing() is not None, reason=str(missing()))


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=15)


@dataclass
class Served:
    server: NFSServer
    address: str
    export_dir: Path
    namespace: str

    def url(self, path: str) -> str:
        return f"nfs://{self.address}{EXPORT_PSEUDO}/{path.lstrip('/')}"

    def client(self, timeout: float = 20.0) -> nfs.NFSClient:
        return nfs.NFSClient(self.address, EXPORT_PSEUDO, timeout)


def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Start the server (a module fixture's body: ``yield from serve(tmp_path_factory)``)."""
    if missing():
        pytest.skip(str(missing()))
    work = tmp_path_factory.mktemp("nfs")
    tag = f"cmnfs{os.getpid() % 100000}"
    namespace, outside, inside = tag, f"{tag}a", f"{tag}b"
    export_dir = work / "export"
    export_dir.mkdir()
    created: list[list[str]] = []
    server = NFSServer(export_dir, work / "state", prefix=("ip", "netns", "exec", namespace))
    try:
        _run("mount", "-t", "tmpfs", "-o", f"size={EXPORT_MIB}m,mode=0755", "tmpfs", str(export_dir))
        created.append(["umount", "-l", str(export_dir)])
        _run("ip", "netns", "add", namespace)
        created.append(["ip", "netns", "del", namespace])
        _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        created.append(["ip", "link", "del", outside])
        _run("ip", "link", "set", inside, "netns", namespace)
        _run("ip", "addr", "add", "10.254.0.1/29", "dev", outside)
        _run("ip", "link", "set", outside, "up")
        for argv in (["addr", "add", "10.254.0.2/29", "dev", inside], ["link", "set", inside, "up"],
                     ["link", "set", "lo", "up"]):  # fmt: skip
            _run("ip", "netns", "exec", namespace, "ip", *argv)
        server.start()
        yield Served(server, "10.254.0.2", export_dir, namespace)
    finally:
        server.stop()
        for argv in reversed(created):
            subprocess.run(argv, capture_output=True, timeout=15, check=False)
