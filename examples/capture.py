"""A stand-in shadow that only records what arrives on its port: coverage of each reduced bucket.

    checkmate-net exec sh1 -- python -m examples.capture --port 48879 --out sh1.json [--ready FILE]

Binds a UDP socket on ``--port`` (the job's ``shadow_port``) in the host it
runs in, decodes every datagram with :mod:`checkmate.wire`, and on SIGTERM or
SIGINT (or after ``--max-seconds``) writes a JSON summary to ``--out``:

* ``datagrams``, ``bytes``, ``malformed`` (not a Checkmate datagram), and by
  message type, flags seen (``replicate_set``: copies that still carry
  REPLICATE, which the switch must clear; ``retransmit``: copies of
  retransmissions);
* per job, iteration and bucket: ``datagrams``, ``elements`` (sum of element
  counts), ``distinct`` (elements covered at least once), ``duplicates``
  (``elements - distinct``), ``ranges`` (the merged covered ranges),
  ``shard_keys``, ``senders``, ``conflicting`` (elements that arrived twice
  with different bytes; a retransmission must repeat its original exactly)
  and, when the coverage is one range from 0, ``sha256`` of the bucket's bytes
  in element order (compare it with the workers' reduced bucket);
* ``kernel``: the namespace's UDP ``RcvbufErrors``/``InErrors`` during the
  capture, so a receiver that fell behind is told apart from packets that
  never arrived.

``--ready FILE`` is created once the socket is bound. Nothing is answered: no
control channel, no repair requests (workers tolerate an absent shadow).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from checkmate.sockets import bind
from checkmate.wire import CHECKMATE_UDP_PORT, HEADER_BYTES, MAX_PAYLOAD_BYTES, Flags, WireFormatError, decode

RECEIVE_BUFFER_BYTES = 64 << 20
"""Socket receive buffer (set with SO_RCVBUFFORCE as root): copies arrive in bursts."""


@dataclass
class BucketCoverage:
    """What arrived for one (job, iteration, bucket)."""

    itemsize: int
    pieces: dict[int, bytes] = field(default_factory=dict)
    """Element offset -> payload of the first datagram at that offset."""
    ranges: list[tuple[int, int]] = field(default_factory=list)
    """Every (offset, count) received, duplicates included."""
    datagrams: int = 0
    conflicting: int = 0
    shard_keys: set[int] = field(default_factory=set)
    senders: set[int] = field(default_factory=set)

    def add(self, offset: int, count: int, payload: bytes, shard_key: int, sender: int) -> None:
        self.datagrams += 1
        self.ranges.append((offset, count))
        self.shard_keys.add(shard_key)
        self.senders.add(sender)
        known = self.pieces.get(offset)
        if known is None:
            self.pieces[offset] = payload
        elif known != payload:
            self.conflicting += count

    def summary(self) -> dict[str, Any]:
        merged: list[list[int]] = []
        for offset, count in sorted(self.ranges):
            end = offset + count
            if merged and offset <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([offset, end])
        elements = sum(count for _, count in self.ranges)
        distinct = sum(end - start for start, end in merged)
        out: dict[str, Any] = {
            "datagrams": self.datagrams,
            "elements": elements,
            "distinct": distinct,
            "duplicates": elements - distinct,
            "ranges": merged,
            "shard_keys": sorted(self.shard_keys),
            "senders": sorted(self.senders),
            "conflicting": self.conflicting,
        }
        if len(merged) == 1 and merged[0][0] == 0:
            digest = hashlib.sha256()
            position = 0
            for offset in sorted(self.pieces):
                payload = self.pieces[offset]
                end = offset + len(payload) // self.itemsize
                if end <= position:
                    continue
                skip = (position - offset) * self.itemsize if offset < position else 0
                digest.update(payload[skip:])
                position = end
            out["sha256"] = digest.hexdigest()
        return out


def udp_errors() -> dict[str, int]:
    """This network namespace's UDP error counters from /proc/net/snmp (empty if unreadable)."""
    try:
        lines = [
            line.split()
            for line in Path("/proc/net/snmp").read_text().splitlines()
            if line.startswith("Udp:")
        ]
    except OSError:
        return {}
    if len(lines) < 2:
        return {}
    values = dict(zip(lines[0][1:], lines[1][1:], strict=False))
    return {key: int(values[key]) for key in ("RcvbufErrors", "InErrors") if key in values}


class Recorder:
    """Everything received so far, by job, iteration and bucket."""

    def __init__(self) -> None:
        self.buckets: dict[tuple[int, int, int], BucketCoverage] = {}
        self.datagrams = 0
        self.bytes = 0
        self.malformed = 0
        self.by_type: dict[str, int] = {}
        self.replicate_set = 0
        self.retransmit = 0
        self.first: float | None = None
        self.last: float | None = None

    def receive(self, datagram: bytes) -> None:
        now = time.monotonic()
        self.first = now if self.first is None else self.first
        self.last = now
        self.datagrams += 1
        self.bytes += len(datagram)
        try:
            header, payload = decode(datagram)
        except WireFormatError:
            self.malformed += 1
            return
        kind = header.msg_type.name
        self.by_type[kind] = self.by_type.get(kind, 0) + 1
        if header.flags & Flags.REPLICATE:
            self.replicate_set += 1
        if header.flags & Flags.RETRANSMIT:
            self.retransmit += 1
        if header.element_count == 0:
            return
        key = (header.job_id, header.iteration, header.bucket_id)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = BucketCoverage(itemsize=header.dtype.itemsize)
        bucket.add(
            header.element_offset, header.element_count, bytes(payload), header.shard_key, header.sender_rank
        )

    def summary(self) -> dict[str, Any]:
        jobs: dict[str, dict[str, dict[str, Any]]] = {}
        for (job, iteration, bucket), coverage in sorted(self.buckets.items()):
            jobs.setdefault(str(job), {})[f"{iteration}/{bucket}"] = coverage.summary()
        return {
            "datagrams": self.datagrams,
            "bytes": self.bytes,
            "malformed": self.malformed,
            "by_type": self.by_type,
            "replicate_set": self.replicate_set,
            "retransmit": self.retransmit,
            "seconds": (self.last - self.first) if self.first is not None and self.last is not None else 0.0,
            "jobs": jobs,
        }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m examples.capture", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--port", type=int, default=CHECKMATE_UDP_PORT, help="UDP port (the job's shadow_port)"
    )
    parser.add_argument("--bind", default="0.0.0.0", help="address to bind (default all)")
    parser.add_argument("--out", type=Path, required=True, help="where the JSON summary goes")
    parser.add_argument("--ready", type=Path, default=None, help="file created once the socket is bound")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="stop on its own after this long")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    stopped_by = "max-seconds"
    stopping = False

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopped_by, stopping
        stopped_by, stopping = signal.Signals(signum).name, True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    recorder = Recorder()
    errors_before = udp_errors()
    buffer = bytearray(HEADER_BYTES + MAX_PAYLOAD_BYTES + 64)
    deadline = time.monotonic() + args.max_seconds
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.setsockopt(socket.SOL_SOCKET, 33, RECEIVE_BUFFER_BYTES)  # SO_RCVBUFFORCE (root)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        bind(sock, (args.bind, args.port), "the capture socket")
        sock.settimeout(0.2)
        if args.ready is not None:
            args.ready.write_text(f"{sock.getsockname()[0]}:{sock.getsockname()[1]}\n")
        while not stopping and time.monotonic() < deadline:
            try:
                n = sock.recv_into(buffer)
            except TimeoutError:
                continue
            recorder.receive(bytes(buffer[:n]))
        # Drain what the kernel already holds before summarising.
        sock.setblocking(False)
        while True:
            try:
                n = sock.recv_into(buffer)
            except (BlockingIOError, InterruptedError):
                break
            recorder.receive(bytes(buffer[:n]))
        receive_buffer = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    errors_after = udp_errors()
    summary = recorder.summary()
    summary["stopped_by"] = stopped_by
    summary["receive_buffer_bytes"] = receive_buffer
    summary["kernel"] = {key: errors_after[key] - errors_before.get(key, 0) for key in errors_after}
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary))
    tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
