"""Throughput of a switch target in network namespaces (a benchmark, not a test).

    sudo .venv/bin/python -m embedded_switch.benchmark            # embedded target
    sudo .venv/bin/python -m embedded_switch.benchmark --target bmv2 --json results/switch_bench_bmv2.json

Three ports: 1 (a worker sending), 2 (its next hop), 3 (a shadow). For unicast
and for 2-way replication (next hop + rewritten shadow copy), at 1514 and 9014
byte frames (IP MTU 1500 and 9000), a generator process in the host namespace
sends tagged Checkmate frames into port 1 at a fixed rate for a few seconds.
Rates rise by 1.4x from ``--start-rate`` until frames are lost, then are
bisected (RFC 2544 style). Per case the table shows

* ``lossless``: the highest rate at which every frame came out (all copies);
* ``saturated``: the lowest rate that lost frames, with what the switch still
  forwarded — its saturation throughput.

``in`` is frames per second the switch forwarded (counted on the next hop),
``out`` all frames leaving it. Counts come from the veth interfaces' own
counters (what the switch received on port 1, what arrived on the host ends of
ports 2 and 3), so no receiver process competes for the two CPUs; a sender
running flat out would starve the switch instead of measuring it, which is why
every run is paced. Results go to results/switch_bench.json and a table.
``--profile`` then runs the 2-way 1514-byte case just above its lossless rate
with the I/O thread under cProfile and prints where the time goes; the
switch's user/system CPU seconds are reported for every run.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from checkmate import wire
from checkmate.wire import CHECKMATE_UDP_PORT, CheckmateHeader, DType, Flags, MessageType
from embedded_switch import testbed
from embedded_switch.pipeline import ipv4_checksum

SENDER, NEXT_HOP, SHADOW = 1, 2, 3
SWITCH_MAC, SENDER_MAC, NEXT_HOP_MAC, SHADOW_MAC = (
    "02:00:00:00:00:fe", "02:00:00:00:00:01", "02:00:00:00:00:02", "02:00:00:00:00:03",
)  # fmt: skip
SENDER_IP, NEXT_HOP_IP, SHADOW_IP = "10.0.1.1", "10.0.2.1", "10.0.3.1"
JOB_ID, JOB_SLOT, GROUP, RID, SHADOW_UDP_PORT = 7, 1, 1, 1, 50001
RESULTS = testbed.REPO_ROOT / "results" / "switch_bench.json"
_FRAME_VARIANTS = 64


@dataclass(frozen=True)
class Scenario:
    name: str
    replicate: bool
    frame_bytes: int

    @property
    def copies(self) -> int:
        return 2 if self.replicate else 1


@dataclass
class RunResult:
    target: str
    scenario: str
    frame_bytes: int
    mode: str
    offered_pps: float
    duration_s: float
    sent: int
    switch_rx: int
    out_packets: int
    expected_out: int
    lost: int
    in_pps: float
    out_pps: float
    in_mbps: float
    out_mbps: float
    switch_cpu_user_s: float
    switch_cpu_sys_s: float


# ---- frames ---------------------------------------------------------------------------------------------
def _mac(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


def _ip(text: str) -> bytes:
    return socket.inet_aton(text)


def make_frames(scenario: Scenario, variants: int = _FRAME_VARIANTS) -> list[bytes]:
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
    send = sock.send
    batch = 16
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
        for _ in range(batch):
            try:
                send(frames[i])
                sent += 1
            except OSError:
                errors += 1
            i = (i + 1) % nframes
    elapsed = time.perf_counter() - start
    print(json.dumps({"sent": sent, "errors": errors, "elapsed": elapsed}), flush=True)


# ---- measuring ------------------------------------------------------------------------------------------
def link_counters(namespace: str) -> dict[str, tuple[int, int]]:
    """Interface -> (rx_packets, rx_bytes) in ``namespace``."""
    result = subprocess.run(
        ["ip", "-n", namespace, "-s", "-j", "link", "show"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    out = {}
    for link in json.loads(result.stdout):
        rx = link.get("stats64", {}).get("rx", {})
        out[link["ifname"]] = (int(rx.get("packets", 0)), int(rx.get("bytes", 0)))
    return out


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid`` and its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def program_switch(address: str, device_config: Path) -> None:
    """Install routes, the job and the shadow with p4runtime-shell."""
    from p4runtime_sh import shell as sh

    from checkmate.p4.program import P4INFO_PATH

    sh.setup(device_id=0, grpc_addr=address, election_id=(0, 1),
             config=sh.FwdPipeConfig(str(P4INFO_PATH), str(device_config)), verbose=False)  # fmt: skip
    try:
        for prefix, port, mac in (
            (f"{NEXT_HOP_IP}/32", NEXT_HOP, NEXT_HOP_MAC),
            (f"{SHADOW_IP}/32", SHADOW, SHADOW_MAC),
            (f"{SENDER_IP}/32", SENDER, SENDER_MAC),
        ):
            te = sh.TableEntry("route_ipv4")(action="forward")
            te.match["dst_addr"] = prefix
            te.action["port"], te.action["src_mac"], te.action["dst_mac"] = str(port), SWITCH_MAC, mac
            te.insert()
        te = sh.TableEntry("lookup_job")(action="set_job_slot")
        te.match["job_id"], te.action["slot"] = str(JOB_ID), str(JOB_SLOT)
        te.insert()
        te = sh.TableEntry("replicate_to_shadow")(action="set_multicast_group")
        te.match["job_id"], te.match["ingress_port"] = str(JOB_ID), str(SENDER)
        te.match["shard_key"], te.match["next_hop_port"] = "0", str(NEXT_HOP)
        te.action["group"] = str(GROUP)
        te.insert()
        sh.MulticastGroupEntry(GROUP).add(NEXT_HOP, 0).add(SHADOW, RID).insert()
        te = sh.TableEntry("rewrite_shadow_copy")(action="set_shadow_destination")
        te.match["egress_rid"] = str(RID)
        te.action["src_mac"], te.action["dst_mac"] = SWITCH_MAC, SHADOW_MAC
        te.action["dst_addr"], te.action["dst_port"] = SHADOW_IP, str(SHADOW_UDP_PORT)
        te.insert()
    finally:
        sh.teardown()


def drained(
    bed: testbed.Testbed, outs: Sequence[str], timeout: float = 3.0
) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    """Counters once the switch has emptied its queues (no output for 0.3 s)."""
    deadline = time.monotonic() + timeout
    last = link_counters(bed.host_ns)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = link_counters(bed.host_ns)
        if all(now[i] == last[i] for i in outs):
            break
        last = now
    return link_counters(bed.switch_ns), last


def run_once(
    bed: testbed.Testbed,
    switch: testbed.SwitchProcess,
    scenario: Scenario,
    mode: str,
    rate: float,
    duration: float,
) -> RunResult:
    frames_path = bed.workdir / f"frames-{scenario.frame_bytes}-{int(scenario.replicate)}.bin"
    frames_path.write_bytes(b"".join(struct.pack("!I", len(f)) + f for f in make_frames(scenario)))
    command = [
        "ip", "netns", "exec", bed.host_ns, sys.executable, "-m", "embedded_switch.benchmark",
        "--generate", bed.host_ifaces[SENDER], "--frames", str(frames_path),
        "--duration", str(duration), "--rate", str(rate),
    ]  # fmt: skip
    switch_in = bed.switch_ifaces[SENDER]
    outs = [bed.host_ifaces[NEXT_HOP], bed.host_ifaces[SHADOW]]
    base_switch, base_host = link_counters(bed.switch_ns), link_counters(bed.host_ns)  # the loss baseline
    generator = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=testbed.REPO_ROOT)
    assert generator.stdout is not None
    watchdog = threading.Timer(duration + 30.0, generator.kill)  # the reads below then see EOF
    watchdog.start()
    try:
        if generator.stdout.readline().strip() != "start":
            raise RuntimeError("generator did not start")
        # Rates over the steady middle of the run, away from start-up and the final drain.
        time.sleep(min(0.3, duration / 4))
        h0, c0, t0 = link_counters(bed.host_ns), cpu_seconds(switch.process.pid), time.perf_counter()
        time.sleep(max(0.1, duration - 2 * min(0.3, duration / 4)))
        h1, c1, t1 = link_counters(bed.host_ns), cpu_seconds(switch.process.pid), time.perf_counter()
        report = json.loads(generator.stdout.readline())
        generator.wait(timeout=10)
    finally:
        watchdog.cancel()
        if generator.poll() is None:
            generator.kill()
            generator.wait(timeout=10)
    s2, h2 = drained(bed, outs)
    window = t1 - t0
    out_window = sum(h1[i][0] - h0[i][0] for i in outs)
    out_bytes_window = sum(h1[i][1] - h0[i][1] for i in outs)
    primary_window = h1[outs[0]][0] - h0[outs[0]][0]
    rx_total = s2[switch_in][0] - base_switch[switch_in][0]
    out_total = sum(h2[i][0] - base_host[i][0] for i in outs)
    expected = rx_total * scenario.copies
    return RunResult(
        target=switch.kind,
        scenario=scenario.name,
        frame_bytes=scenario.frame_bytes,
        mode=mode,
        offered_pps=report["sent"] / report["elapsed"],
        duration_s=window,
        sent=report["sent"],
        switch_rx=rx_total,
        out_packets=out_total,
        expected_out=expected,
        lost=expected - out_total,
        in_pps=primary_window / window,
        out_pps=out_window / window,
        in_mbps=primary_window * scenario.frame_bytes / window / 1e6,
        out_mbps=out_bytes_window / window / 1e6,
        switch_cpu_user_s=c1[0] - c0[0],
        switch_cpu_sys_s=c1[1] - c0[1],
    )


def print_table(results: Sequence[RunResult], header: bool = True) -> None:
    head = (
        f"{'target':8} {'case':9} {'bytes':>5} {'mode':6} {'offered/s':>10} {'in pkt/s':>9} {'in MB/s':>8} "
        f"{'out pkt/s':>9} {'out MB/s':>8} {'lost':>7} {'loss%':>6} {'cpu u/s':>9}"
    )
    if header:
        print(head)
        print("-" * len(head))
    for r in results:
        loss = 100.0 * r.lost / r.expected_out if r.expected_out else 0.0
        print(
            f"{r.target:8} {r.scenario:9} {r.frame_bytes:>5} {r.mode:6} {r.offered_pps:>10.0f} "
            f"{r.in_pps:>9.0f} {r.in_mbps:>8.1f} {r.out_pps:>9.0f} {r.out_mbps:>8.1f} "
            f"{r.lost:>7} {loss:>6.2f} "
            f"{r.switch_cpu_user_s:>4.1f}/{r.switch_cpu_sys_s:<4.1f}"
        )


def print_profile(path: Path, top: int = 18) -> None:
    stats = pstats.Stats(str(path))
    total = stats.total_tt  # type: ignore[attr-defined]
    print(f"\nI/O thread profile (2-way replication, 1514 B, just above the lossless rate): {total:.2f} s")
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
    print(f"{'tottime':>8} {'share':>6} {'calls':>9}  function")
    for (filename, line, name), (_cc, calls, tottime, _cum, _callers) in rows[:top]:
        where = f"{Path(filename).name}:{line}" if line else filename
        print(f"{tottime:>8.2f} {100 * tottime / total:>5.1f}% {calls:>9}  {name} ({where})")


def default_start_rate(target: str, frame_bytes: int) -> float:
    """First rate tried (pkt/s): well below each target's lossless rate, so the search rises to it.

    BMv2 forwards a few thousand frames per second here, the embedded target tens of thousands.
    """
    if target == "bmv2":
        return 2_000.0 if frame_bytes <= 1600 else 1_500.0
    return 40_000.0 if frame_bytes <= 1600 else 15_000.0


def search(
    bed: testbed.Testbed,
    switch: testbed.SwitchProcess,
    scenario: Scenario,
    duration: float,
    start: float,
    bisections: int = 4,
) -> list[RunResult]:
    """Runs at rising, then bisected rates: the highest rate without loss and the saturated throughput.

    Returns every run; the caller picks the best lossless and the lowest lossy one.
    """
    runs: list[RunResult] = []
    lo, hi, rate = 0.0, 0.0, start
    while not hi and len(runs) < 8:
        r = run_once(bed, switch, scenario, "paced", rate, duration)
        runs.append(r)
        if r.offered_pps < 0.95 * rate:  # the generator is the limit: stop here
            return runs
        if r.lost == 0:
            lo, rate = rate, rate * 1.4
        else:
            hi = rate
    for _ in range(bisections if hi else 0):
        rate = (lo + hi) / 2
        r = run_once(bed, switch, scenario, "paced", rate, duration)
        runs.append(r)
        lo, hi = (rate, hi) if r.lost == 0 else (lo, rate)
    return runs


def summarize(runs: Sequence[RunResult]) -> list[RunResult]:
    """The best lossless run (mode "lossless") and the lowest-rate lossy one (mode "saturated")."""
    clean = [r for r in runs if r.lost == 0]
    lossy = [r for r in runs if r.lost > 0]
    out = []
    if clean:
        out.append(replace(max(clean, key=lambda r: r.offered_pps), mode="lossless"))
    if lossy:
        out.append(replace(min(lossy, key=lambda r: r.offered_pps), mode="saturated"))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m embedded_switch.benchmark", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--target", choices=["embedded", "bmv2"], default="embedded")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per run")
    parser.add_argument("--sizes", default="1514,9014", help="frame sizes in bytes")
    parser.add_argument("--cases", default="unicast,2-way", help="unicast and/or 2-way")
    parser.add_argument("--start-rate", type=float, default=0.0, help="first rate tried (pkt/s)")
    parser.add_argument("--profile", action="store_true", help="also profile the 2-way 1514 B case")
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--generate", metavar="IFACE", help=argparse.SUPPRESS)
    parser.add_argument("--frames", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.generate:
        generate(args.generate, args.frames, args.duration, args.rate)
        return 0
    if os.geteuid() != 0:
        print("the benchmark needs root (network namespaces)", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        print(f"note: load average {load_before[0]:.2f} before the run: other work competes for the CPUs")
    sizes = [int(s) for s in args.sizes.split(",")]
    cases = args.cases.split(",")
    scenarios = [
        Scenario(c, c == "2-way", size) for size in sizes for c in ("unicast", "2-way") if c in cases
    ]
    results: list[RunResult] = []
    every_run: list[RunResult] = []
    profile_path: Path | None = None
    with testbed.testbed([SENDER, NEXT_HOP, SHADOW], prefix="cmb") as bed:
        passes: list[tuple[str, list[str]]] = [("plain", [])]
        if args.profile and args.target == "embedded":
            profile_path = bed.workdir / "io-thread.prof"
            passes.append(("profile", ["--profile", str(profile_path)]))
        for label, extra in passes:
            extra_args = ["--log-level", "warn", *extra] if args.target == "embedded" else []
            switch = testbed.start_switch(args.target, bed, extra_args)
            try:
                device_config = testbed.REPO_ROOT / "build" / "v1model" / "checkmate.json"
                if args.target == "embedded":
                    device_config = bed.workdir / "embedded.bin"
                    device_config.write_bytes(b"")
                program_switch(switch.address, device_config)
                if label == "profile":
                    best = [r for r in results if r.scenario == "2-way" and r.frame_bytes == 1514]
                    rate = best[0].offered_pps * 1.1 if best else 100_000.0
                    run_once(bed, switch, Scenario("2-way", True, 1514), "profile", rate, args.duration)
                    continue
                for scenario in scenarios:
                    start = args.start_rate or default_start_rate(args.target, scenario.frame_bytes)
                    runs = search(bed, switch, scenario, args.duration, start)
                    every_run += runs
                    results += summarize(runs)
                    print_table(summarize(runs), header=scenario is scenarios[0])
            finally:
                switch.stop(timeout=10)
        if profile_path is not None and profile_path.exists():
            saved = args.json.parent / "switch_profile.prof"
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_bytes(profile_path.read_bytes())
            profile_path = saved
    print()
    print_table(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "summary": [asdict(r) for r in results],
        "runs": [asdict(r) for r in every_run],
    }
    args.json.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    if profile_path is not None and profile_path.exists():
        print_profile(profile_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
