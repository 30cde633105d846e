"""Send tagged Checkmate DATA datagrams from inside a host: a stand-in worker for trying the network.

    checkmate-net exec h1 -- python -m examples.send_tagged --job 1 --to 10.0.1.2 --count 10

Each datagram carries ``--elements`` fp32 values, ``REPLICATE`` set, the job
id and the shard key (``--shard``, default 0), so a switch with the job
installed forwards it to ``--to`` and copies it to the shadow of that shard.
It goes through an ordinary UDP socket (port 48879 both ends): the hosts'
TX checksum offload is off, so the switch sees complete frames.
"""

from __future__ import annotations

import argparse
import logging
import socket
import struct
import sys
import time

from checkmate.sockets import bind
from checkmate.wire import CHECKMATE_UDP_PORT, CheckmateHeader, Flags, MessageType, encode

logger = logging.getLogger(__name__)


def datagrams(job: int, shard: int, rank: int, count: int, elements: int) -> list[bytearray]:
    payload = struct.pack(f"<{elements}f", *(float(i) for i in range(elements)))
    return [
        encode(
            CheckmateHeader(
                msg_type=MessageType.DATA,
                job_id=job,
                iteration=0,
                bucket_id=shard,
                sender_rank=rank,
                element_offset=i * elements,
                element_count=elements,
                sequence=i,
                flags=Flags.REPLICATE,
                shard_key=shard,
            ),
            payload,
        )
        for i in range(count)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.send_tagged", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--job", type=int, required=True, help="job id")
    parser.add_argument("--to", required=True, help="IPv4 address of the ring neighbour")
    parser.add_argument("--shard", type=int, default=0, help="shard key (default 0)")
    parser.add_argument("--rank", type=int, default=0, help="sender rank to put in the header")
    parser.add_argument("--count", type=int, default=10, help="datagrams to send (default 10)")
    parser.add_argument("--elements", type=int, default=256, help="fp32 elements per datagram (default 256)")
    parser.add_argument("--interval", type=float, default=0.001, help="seconds between datagrams")
    args = parser.parse_args(argv)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    bind(sock, ("0.0.0.0", CHECKMATE_UDP_PORT), "the sender's socket")
    sent = 0
    for datagram in datagrams(args.job, args.shard, args.rank, args.count, args.elements):
        sock.sendto(datagram, (args.to, CHECKMATE_UDP_PORT))
        sent += 1
        time.sleep(args.interval)
    print(f"sent {sent} tagged datagrams (job {args.job}, shard {args.shard}) to {args.to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
