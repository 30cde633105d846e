"""Run inside one host: exchange UDP datagrams with every peer, both ways (stdlib only).

    python udp_mesh.py --me 10.0.1.1 --peers 10.0.1.2,10.0.1.3 --port 40000 --timeout 10

Sends HELLO to every peer until that peer ACKs it, ACKs every HELLO it gets,
and exits 0 once it has heard a HELLO from every peer and had every HELLO
acknowledged (lingering a moment to answer late HELLOs); prints a JSON line
with what it heard. Exit 1 on timeout.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--me", required=True)
    parser.add_argument("--peers", required=True)
    parser.add_argument("--port", type=int, default=40000)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    peers = [p for p in args.peers.split(",") if p]
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((args.me, args.port))
    sock.settimeout(0.05)
    heard: set[str] = set()
    acked: set[str] = set()
    deadline = time.monotonic() + args.timeout
    done_at: float | None = None
    next_send = 0.0
    while time.monotonic() < deadline:
        now = time.monotonic()
        if done_at is None and heard >= set(peers) and acked >= set(peers):
            done_at = now
        if done_at is not None and now - done_at > 0.5:
            break
        if now >= next_send:
            for peer in peers:
                if peer not in acked:
                    try:
                        sock.sendto(f"HELLO {args.me}".encode(), (peer, args.port))
                    except ConnectionRefusedError:
                        pass  # ICMP port unreachable from a peer that has not bound yet
            next_send = now + 0.1
        try:
            data, (source, _) = sock.recvfrom(2048)
        except (TimeoutError, ConnectionRefusedError):
            continue
        kind, _, sender = data.decode().partition(" ")
        if kind == "HELLO" and sender == source:
            heard.add(source)
            sock.sendto(f"ACK {args.me}".encode(), (source, args.port))
        elif kind == "ACK" and sender == source:
            acked.add(source)
    print(json.dumps({"me": args.me, "heard": sorted(heard), "acked": sorted(acked)}))
    return 0 if heard >= set(peers) and acked >= set(peers) else 1


if __name__ == "__main__":
    sys.exit(main())
