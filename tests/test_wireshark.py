"""The Wireshark dissector (checkmate/wireshark/checkmate.lua), run by tshark on real Checkmate frames.

Two captures: frames built by checkmate.wire (every message type, dtype and flag, a shadow
copy whose destination port the switch rewrote, malformed ones) written to a pcap with
scapy; and (root) a tcpdump capture of a real 2-rank ring all-reduce over the project's
transport on loopback, with injected loss so retransmissions and NACKs appear. tshark's
fields must equal the headers that were sent. Skipped, with the reason, without tshark
(Debian: ``apt-get install tshark``; not in ``make setup``, it pulls in libwireshark).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from checkmate.auth import DatagramAuth
from checkmate.wire import CHECKMATE_UDP_PORT, CheckmateHeader, DType, Flags, MessageType, encode

REPO = Path(__file__).resolve().parents[1]
LUA = REPO / "checkmate" / "wireshark" / "checkmate.lua"
TSHARK = shutil.which("tshark")
pytestmark = pytest.mark.skipif(TSHARK is None, reason="tshark is not installed (apt-get install tshark)")

FIELDS = (
    "version", "msg_type", "flags", "dtype", "job_id", "iteration", "bucket_id", "sender_rank",
    "shard_key", "element_offset", "element_count", "sequence",
)  # fmt: skip


def tshark(pcap: Path, *extra: str) -> list[dict[str, Any]]:
    """One dict per frame: checkmate.* fields (lists of strings), plus the expert messages."""
    args = [
        TSHARK or "tshark",
        "-X",
        f"lua_script:{LUA}",
        "-r",
        str(pcap),
        "-T",
        "fields",
        "-E",
        "separator=|",
    ]
    columns = [f"checkmate.{name}" for name in FIELDS] + [
        "checkmate.first_element", "checkmate.range.start", "checkmate.range.end", "checkmate.tag",
        "_ws.expert.message", "udp.dstport",
    ]  # fmt: skip
    for c in columns:
        args += ["-e", c]
    done = subprocess.run([*args, *extra], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Lua: Error" not in done.stderr, done.stderr
    rows = []
    for line in done.stdout.splitlines():
        values = line.split("|")
        rows.append({c.removeprefix("checkmate."): v for c, v in zip(columns, values, strict=True)})
    return rows


def _frame(
    header: CheckmateHeader, payload: bytes = b"", dport: int = CHECKMATE_UDP_PORT, tag: bool = False
) -> Any:
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    datagram = bytes(encode(header, payload)) if not tag else b""
    if tag:
        parts = (header.pack(), payload)
        datagram = b"".join(bytes(p) for p in DatagramAuth(b"\x5e" * 32, header.job_id).seal(parts))
    return (
        Ether() / IP(src="10.0.0.1", dst="10.0.0.2") / UDP(sport=CHECKMATE_UDP_PORT, dport=dport) / datagram
    )


def _header(msg: MessageType, **kw: Any) -> CheckmateHeader:
    base: dict[str, Any] = dict(
        msg_type=msg, job_id=7, iteration=41, bucket_id=3, sender_rank=2,
        element_offset=4470, element_count=0, sequence=99, dtype=DType.NONE,
    )  # fmt: skip
    base.update(kw)
    return CheckmateHeader(**base)


def test_frames_built_by_checkmate_wire() -> None:
    from scapy.utils import wrpcap

    fp32 = struct.pack("<3f", 1.5, -2.25, 3.0)
    frames = [
        # DATA, tagged and last, fp32: the switch's input
        (_header(MessageType.DATA, element_count=3, dtype=DType.FP32, flags=Flags.REPLICATE | Flags.LAST,
                 shard_key=1), fp32, CHECKMATE_UDP_PORT, False),
        # its shadow copy: REPLICATE cleared, destination port rewritten (source port still 48879)
        (_header(MessageType.DATA, element_count=3, dtype=DType.FP32, flags=Flags.LAST, shard_key=1),
         fp32, 50123, False),
        (_header(MessageType.DATA, element_count=2, dtype=DType.BF16, flags=Flags.RETRANSMIT),
         b"\x80\x3f\x00\x40", CHECKMATE_UDP_PORT, False),
        (_header(MessageType.ACK, element_count=2), struct.pack("!4I", 10, 12, 15, 20),
         CHECKMATE_UDP_PORT, True),
        (_header(MessageType.NACK, element_count=1), struct.pack("!2I", 3, 5), CHECKMATE_UDP_PORT, True),
        (_header(MessageType.REPAIR_REQUEST, element_count=100), b"", CHECKMATE_UDP_PORT, True),
        (_header(MessageType.REPAIR_DATA, element_count=1, dtype=DType.FP16), b"\x00\x3c",
         CHECKMATE_UDP_PORT, True),
    ]  # fmt: skip
    packets = [_frame(h, p, d, t) for h, p, d, t in frames]
    # malformed: wrong version, payload shorter than announced, a truncated header
    bad_version = bytearray(encode(frames[0][0], fp32))
    bad_version[0] = 2
    short = bytearray(encode(frames[0][0], fp32))[:-4]
    for raw in (bytes(bad_version), bytes(short), b"\x01\x01\x00"):
        packets.append(packets[0].copy())
        packets[-1]["UDP"].remove_payload()
        packets[-1]["UDP"].add_payload(raw)
    with tempfile.TemporaryDirectory() as tmp:
        pcap = Path(tmp) / "wire.pcap"
        wrpcap(str(pcap), packets)
        rows = tshark(pcap)
    assert len(rows) == len(packets)
    for row, (header, _, dport, tagged) in zip(rows, frames, strict=False):
        for name in FIELDS:
            want = int(getattr(header, name))
            assert int(row[name], 0) == want, (name, row, header)
        assert row["udp.dstport"] == str(dport)
        assert row["_ws.expert.message"] == "", row
        assert (row["tag"] != "") == tagged
    assert float(rows[0]["first_element"]) == 1.5
    assert rows[3]["range.start"].split(",") == ["10", "15"]
    assert rows[3]["range.end"].split(",") == ["12", "20"]
    assert rows[4]["range.start"] == "3"
    assert "wire version 2" in rows[-3]["_ws.expert.message"]
    assert "payload is 8 bytes but the header announces 12 (3 x fp32)" in rows[-2]["_ws.expert.message"]
    assert "truncated: 3 bytes" in rows[-1]["_ws.expert.message"]


def _ring(rank: int, world: int, store: str) -> list[tuple[int, int, int, int, int]]:
    import torch
    import torch.distributed as dist

    from hosts.faults import FaultConfig
    from hosts.ring_allreduce import RingAllReduce
    from hosts.ring_config import RingConfig
    from hosts.transport import Transport, TransportConfig

    workers = tuple((f"127.0.0.{96 + r}", CHECKMATE_UDP_PORT) for r in range(world))
    transport = Transport(
        # gso=False: a capture on the sending host sees a UDP GSO write as one oversized frame
        # (the kernel splits it after the tap); the datagrams on the wire are what is checked here
        TransportConfig(
            bind=workers[rank], faults=FaultConfig(seed=5 + rank, send_drop=0.05), peer_timeout=5.0, gso=False
        )
    )
    engine = RingAllReduce(
        transport,
        RingConfig(job_id=31, rank=rank, workers=workers, shard_key_for_bucket=lambda b: b % 2, timeout=20),
    )
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    for iteration in range(3):
        futures = [
            engine.allreduce_async(iteration, b, torch.full((5000 + 1000 * b,), float(rank + b)))
            for b in range(2)
        ]
        for future in futures:
            future.wait()
    tags = [
        (t.iteration, t.bucket_id, t.element_offset, t.element_count, t.shard_key) for t in engine.tag_log
    ]
    transport.wait_idle(5.0)
    dist.barrier()
    engine.close()
    transport.close()
    dist.destroy_process_group()
    return tags


@pytest.mark.root
def test_capture_of_a_real_ring_all_reduce() -> None:
    from tests.hosts.harness import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        pcap = Path(tmp) / "ring.pcap"
        dump = subprocess.Popen(
            ["tcpdump", "-i", "lo", "--immediate-mode", "-U", "-B", "131072", "-w", str(pcap),
             "udp port 48879 and src net 127.0.0.96/31"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            time.sleep(1.0)  # tcpdump is listening
            logs = run_ranks(_ring, 2, f"{tmp}/store", timeout=120)
            time.sleep(1.0)  # (immediate mode: every frame reaches the file at once, none waits in a block)
        finally:
            dump.send_signal(signal.SIGINT)
            _, report = dump.communicate(timeout=10)
        # a frame the capture itself lost would make the comparison below meaningless
        assert re.search(r"\b0 packets dropped by kernel", report), report
        rows = tshark(pcap, "-Y", "checkmate")
    sent = {tag for log in logs for tag in log}
    assert sent, "the all-reduce tagged nothing"
    assert all(r["_ws.expert.message"] == "" for r in rows), [r for r in rows if r["_ws.expert.message"]][:3]
    types = {int(r["msg_type"]) for r in rows}
    assert {int(MessageType.DATA), int(MessageType.ACK)} <= types
    tagged = {
        (
            int(r["iteration"]),
            int(r["bucket_id"]),
            int(r["element_offset"]),
            int(r["element_count"]),
            int(r["shard_key"]),
        )
        for r in rows
        if int(r["msg_type"]) == int(MessageType.DATA) and int(r["flags"], 0) & int(Flags.REPLICATE)
    }
    # every first transmission the engines logged is on the wire, tagged, with the same fields
    # (a dropped first send shows up as its RETRANSMIT copy, which keeps REPLICATE)
    assert tagged == sent
    retransmitted = [r for r in rows if int(r["flags"], 0) & int(Flags.RETRANSMIT)]
    assert retransmitted, "5% loss must cause retransmissions"
    assert all(int(r["job_id"]) == 31 for r in rows)
    json.dumps(rows[:1])  # rows are plain strings
