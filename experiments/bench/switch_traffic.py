"""The switch benchmark's traffic: the test frames and the generator that sends them.

:func:`make_frames` builds valid tagged Checkmate frames for a :class:`Scenario` (unicast or
2-way replication, 1514 or 9014 bytes); :func:`generate` sends them, paced, out of an
interface. The generator runs as its own process in the host namespace, so the benchmark
(:mod:`experiments.bench.switch`) starts it as::

    python -m experiments.bench.switch_traffic IFACE FRAMES_FILE DURATION RATE

which prints ``start`` when it begins and one JSON line (sent, errors, elapsed) at the end.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from checkmate import wire
from checkmate.wire import CHECKMATE_UDP_PORT, CheckmateHeader, DType, Flags, MessageType
from embedded_switch import native, testbed
from embedded_switch.pipeline import ipv4_checksum

SENDER, NEXT_HOP, SHADOW = 1, 2, 3
SWITCH_MAC, SENDER_MAC, NEXT_HOP_MAC, SHADOW_MAC = (
    "02:00:00:00:00:fe", "02:00:00:00:00:01", "02:00:00:00:00:02", "02:00:00:00:00:03",
)  # fmt: skip
SENDER_IP, NEXT_HOP_IP, SHADOW_IP = "10.0.1.1", "10.0.2.1", "10.0.3.1"
JOB_ID, JOB_SLOT, GROUP, RID, SHADOW_UDP_PORT = 7, 1, 1, 1, 50001
FRAME_VARIANTS = 64


@dataclass(frozen=True)
class Scenario:
    name: str
    replicate: bool
    frame_bytes: int

    @property
    def copies(self) -> int:
        return 2 if self.replicate else 1


# ---- frames ---------------------------------------------------------------------------------------------
def _mac(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


def _ip(text: str) -> bytes:
    return socket.inet_aton(text)


def make_frames(scenario: Scenario, variants: int = FRAME_VARIANTS) -> list[bytes]:
    """``variants`` distinct valid frames (sequence, offset, IP id differ) of the scenario's size."""
    payload_bytes = scenario.frame_bytes - 14 - 20 - 8 - wire.HEADER_BYTES
    count = payload_bytes // 4
    payload = bytes(i & 0xFF for i in range(count * 4))
    frames = []
    for seq in range(variants):
        header = CheckmateHeader(
            msg_type=MessageType.DATA, job_id=JOB_ID, iteration=1, bucket_id=0, sender_rank=0,
            element_offset=seq * count, element_count=count, sequence=seq, dtype=DType.FP32,
            flags=Flags.REPLICATE if scenario.replicate else Flags.NONE, shard_key=0,
        )  # fmt: skip
        datagram = wire.encode(header, payload)
        udp = struct.pack("!HHHH", CHECKMATE_UDP_PORT, CHECKMATE_UDP_PORT, 8 + len(datagram), 0)
        ip_header = bytearray(
            struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp) + len(datagram), seq, 0x4000, 64, 17, 0,
                        _ip(SENDER_IP), _ip(NEXT_HOP_IP))
        )  # fmt: skip
        struct.pack_into("!H", ip_header, 10, ipv4_checksum(ip_header))
        frame = _mac(SWITCH_MAC) + _mac(SENDER_MAC) + b"\x08\x00" + bytes(ip_header) + udp + bytes(datagram)
        assert len(frame) == scenario.frame_bytes, (len(frame), scenario.frame_bytes)
        frames.append(frame)
    return frames


# ---- the generator (runs in the host namespace as its own process) -------------------------------------
def generate(iface: str, frames_path: Path, duration: float, rate: float) -> None:
    """Send the frames of ``frames_path`` round-robin out of ``iface``; print one JSON line at the end."""
    data = frames_path.read_bytes()
    frames = []
    offset = 0
    while offset < len(data):
        (n,) = struct.unpack_from("!I", data, offset)
        frames.append(data[offset + 4 : offset + 4 + n])
        offset += 4 + n
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(testbed.ETH_P_ALL))
    sock.bind((iface, testbed.ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, 32, 8 << 20)  # SO_SNDBUFFORCE
    send_frames = native_sender()
    send = sock.send
    fd = sock.fileno()
    batch = 32 if send_frames is not None else 16
    sent = errors = 0
    print("start", flush=True)
    start = time.perf_counter()
    end = start + duration
    i = 0
    nframes = len(frames)
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        if rate > 0:
            due = start + sent / rate
            if due > now:
                time.sleep(due - now)
        if send_frames is not None:
            ok, failed = send_frames(fd, frames, i, batch)
            sent += ok
            errors += failed
            i = (i + batch) % nframes
            continue
        for _ in range(batch):
            try:
                send(frames[i])
                sent += 1
            except OSError:
                errors += 1
            i = (i + 1) % nframes
    elapsed = time.perf_counter() - start
    print(json.dumps({"sent": sent, "errors": errors, "elapsed": elapsed}), flush=True)


def native_sender() -> Callable[[int, list[bytes], int, int], tuple[int, int]] | None:
    """The extension's sendmmsg sender, or None when it is not built."""
    if not native.available():
        return None
    sender: Callable[[int, list[bytes], int, int], tuple[int, int]] = native.extension().send_frames
    return sender


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench.switch_traffic", description=__doc__.split("\n")[0]
    )
    parser.add_argument("iface")
    parser.add_argument(
        "frames", type=Path, help="length-prefixed frames (experiments.bench.switch writes it)"
    )
    parser.add_argument("duration", type=float, help="seconds")
    parser.add_argument("rate", type=float, help="frames per second (0: as fast as it can)")
    args = parser.parse_args(argv)
    generate(args.iface, args.frames, args.duration, args.rate)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
