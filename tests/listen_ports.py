"""A port a test's server can listen on later (torch's TCPStore at ``MASTER_PORT``, an exporter).

A port found free by binding to port 0 comes from the kernel's ephemeral range, and nothing
holds it between the probe and the server's own bind: any ``connect()`` in between (a rank to a
shadow, gloo between ranks) may be given the same port, and the server then fails with
EADDRINUSE (seen in CI: ``The server socket has failed to listen ... EADDRINUSE``). Ports below
the ephemeral range are never handed out that way, so one found free there stays free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def listen_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host`` below the kernel's ephemeral range (random, so that tests in
    parallel rarely meet)."""
    high = min(_ephemeral_low(), 65536) - 1
    low = max(10000, high - 12000)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(low, high)
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}..{high} on {host}")
