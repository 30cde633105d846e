"""Throughput of a switch target in network namespaces (a benchmark, not a test).

    sudo .venv/bin/python -m experiments.bench.switch            # both data paths, and BMv2 if installed
    sudo .venv/bin/python -m experiments.bench.switch --target embedded --datapath native
    sudo .venv/bin/python -m experiments.bench.switch --target bmv2 --json results/switch_bench_bmv2.json

Targets, one after the other in one run: the embedded switch with each data path
(``--datapath native`` and ``python``, :mod:`embedded_switch.native`), then
``simple_switch_grpc`` when it is on PATH and build/v1model/checkmate.json exists
(``make p4``); ``--target`` and ``--datapath`` pick some of them.

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
every run is paced. The generator sends with ``sendmmsg`` (the native extension's
``send_frames``) when it is built, else one ``send`` per frame, which tops out
near 200k frames/s here; a run whose generator fell short of its rate ends the
search and says so. Results go to results/switch_bench.json and a table, with
the switch's CPU time per frame forwarded (user + system, microseconds).
``--profile`` then runs the 2-way 1514-byte case just above its lossless rate
with the I/O thread under cProfile and prints where the time goes; the
switch's user/system CPU seconds are reported for every run.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import resource
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from embedded_switch import native, testbed
from experiments.bench.switch_traffic import (
    GROUP,
    JOB_ID,
    JOB_SLOT,
    NEXT_HOP,
    NEXT_HOP_IP,
    NEXT_HOP_MAC,
    RID,
    SENDER,
    SENDER_IP,
    SENDER_MAC,
    SHADOW,
    SHADOW_IP,
    SHADOW_MAC,
    SHADOW_UDP_PORT,
    SWITCH_MAC,
    Scenario,
    make_frames,
    native_sender,
)
from experiments.commands import REPO

RESULTS = REPO / "results" / "switch_bench.json"
BMV2_JSON = REPO / "build" / "v1model" / "checkmate.json"


@dataclass
class RunResult:
    target: str
    datapath: str
    """The embedded switch's data path (native or python); empty for BMv2."""
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
    generator_limited: bool = False
    """The generator sent less than 95 % of the rate asked for (the figure is the generator's limit)."""

    @property
    def label(self) -> str:
        return f"{self.target}-{self.datapath}" if self.datapath else self.target

    @property
    def cpu_us_per_packet(self) -> float:
        """The switch's user + system CPU time per frame it forwarded (in), in the measured window."""
        forwarded = self.in_pps * self.duration_s
        return 1e6 * (self.switch_cpu_user_s + self.switch_cpu_sys_s) / forwarded if forwarded else 0.0


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

    from checkmate.p4.names import (
        Forward,
        LookupJob,
        ReplicateToShadow,
        RewriteShadowCopy,
        RouteIpv4,
        SetJobSlot,
        SetMulticastGroup,
        SetShadowDestination,
    )
    from checkmate.p4.program import P4INFO_PATH

    sh.setup(device_id=0, grpc_addr=address, election_id=(0, 1),
             config=sh.FwdPipeConfig(str(P4INFO_PATH), str(device_config)), verbose=False)  # fmt: skip
    try:
        for prefix, port, mac in (
            (f"{NEXT_HOP_IP}/32", NEXT_HOP, NEXT_HOP_MAC),
            (f"{SHADOW_IP}/32", SHADOW, SHADOW_MAC),
            (f"{SENDER_IP}/32", SENDER, SENDER_MAC),
        ):
            te = sh.TableEntry(RouteIpv4.NAME)(action=Forward.NAME)
            te.match["dst_addr"] = prefix
            te.action["port"], te.action["src_mac"], te.action["dst_mac"] = str(port), SWITCH_MAC, mac
            te.insert()
        te = sh.TableEntry(LookupJob.NAME)(action=SetJobSlot.NAME)
        te.match["job_id"], te.action["slot"] = str(JOB_ID), str(JOB_SLOT)
        te.insert()
        te = sh.TableEntry(ReplicateToShadow.NAME)(action=SetMulticastGroup.NAME)
        te.match["job_id"], te.match["ingress_port"] = str(JOB_ID), str(SENDER)
        te.match["shard_key"], te.match["next_hop_port"] = "0", str(NEXT_HOP)
        te.action["group"] = str(GROUP)
        te.insert()
        sh.MulticastGroupEntry(GROUP).add(NEXT_HOP, 0).add(SHADOW, RID).insert()
        te = sh.TableEntry(RewriteShadowCopy.NAME)(action=SetShadowDestination.NAME)
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
    datapath: str = "",
) -> RunResult:
    frames_path = bed.workdir / f"frames-{scenario.frame_bytes}-{int(scenario.replicate)}.bin"
    frames_path.write_bytes(b"".join(struct.pack("!I", len(f)) + f for f in make_frames(scenario)))
    command = [
        "ip", "netns", "exec", bed.host_ns, sys.executable, "-m", "experiments.bench.switch_traffic",
        bed.host_ifaces[SENDER], str(frames_path), str(duration), str(rate),
    ]  # fmt: skip
    switch_in = bed.switch_ifaces[SENDER]
    outs = [bed.host_ifaces[NEXT_HOP], bed.host_ifaces[SHADOW]]
    base_switch, base_host = link_counters(bed.switch_ns), link_counters(bed.host_ns)  # the loss baseline
    generator = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=REPO)
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
        datapath=datapath,
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
        generator_limited=report["sent"] / report["elapsed"] < 0.95 * rate,
    )


def print_table(results: Sequence[RunResult], header: bool = True) -> None:
    head = (
        f"{'target':15} {'case':9} {'bytes':>5} {'mode':9} {'offered/s':>10} {'in pkt/s':>9} {'in MB/s':>8} "
        f"{'out pkt/s':>9} {'out MB/s':>8} {'lost':>7} {'loss%':>6} {'cpu u/s':>9} {'us/pkt':>6}"
    )
    if header:
        print(head)
        print("-" * len(head))
    for r in results:
        loss = 100.0 * r.lost / r.expected_out if r.expected_out else 0.0
        mode = r.mode + ("*" if r.generator_limited else "")
        print(
            f"{r.label:15} {r.scenario:9} {r.frame_bytes:>5} {mode:9} {r.offered_pps:>10.0f} "
            f"{r.in_pps:>9.0f} {r.in_mbps:>8.1f} {r.out_pps:>9.0f} {r.out_mbps:>8.1f} "
            f"{r.lost:>7} {loss:>6.2f} "
            f"{r.switch_cpu_user_s:>4.1f}/{r.switch_cpu_sys_s:<4.1f} {r.cpu_us_per_packet:>6.2f}"
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


def default_start_rate(target: str, frame_bytes: int, datapath: str = "python") -> float:
    """First rate tried (pkt/s): well below each target's lossless rate, so the search rises to it.

    BMv2 forwards a few thousand frames per second here, the embedded target's Python data
    path tens of thousands, its native one hundreds of thousands.
    """
    if target == "bmv2":
        return 2_000.0 if frame_bytes <= 1600 else 1_500.0
    if datapath == "native":
        return 50_000.0 if frame_bytes <= 1600 else 15_000.0
    return 40_000.0 if frame_bytes <= 1600 else 15_000.0


def search(
    bed: testbed.Testbed,
    switch: testbed.SwitchProcess,
    scenario: Scenario,
    duration: float,
    start: float,
    bisections: int = 4,
    datapath: str = "",
) -> list[RunResult]:
    """Runs at rising, then bisected rates: the highest rate without loss and the saturated throughput.

    Returns every run; the caller picks the best lossless and the lowest lossy one.
    """
    runs: list[RunResult] = []
    lo, hi, rate = 0.0, 0.0, start
    while not hi and len(runs) < 8:
        r = run_once(bed, switch, scenario, "paced", rate, duration, datapath)
        runs.append(r)
        if r.generator_limited:  # the generator is the limit: stop here
            return runs
        if r.lost == 0:
            lo, rate = rate, rate * 1.4
        else:
            hi = rate
    for _ in range(bisections if hi else 0):
        rate = (lo + hi) / 2
        r = run_once(bed, switch, scenario, "paced", rate, duration, datapath)
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


def send_floor(bed: testbed.Testbed, frame_bytes: int, seconds: float = 1.0) -> dict[str, float] | None:
    """The kernel's cost of one frame into a veth, with no switch: what each copy out costs at least.

    Sends with sendmmsg (batches of 32) from this process into the host end of the next
    hop's veth for ``seconds`` (before any switch runs: nothing reads the switch end, the
    frames die in its namespace's stack, as the switch's copies die in the host namespace)
    and returns frames/s and CPU microseconds per frame (user and system, getrusage). None
    without the native extension.
    """
    sender = native_sender()
    if sender is None:
        return None
    frames = make_frames(Scenario("unicast", False, frame_bytes))
    with testbed.in_namespace(bed.host_ns):
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
    try:
        sock.bind((bed.host_ifaces[NEXT_HOP], testbed.ETH_P_ALL))
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        sent = i = 0
        while time.perf_counter() - t0 < seconds:
            ok, _failed = sender(sock.fileno(), frames, i, 32)
            sent += ok
            i += 32
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    finally:
        sock.close()
    user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    return {
        "frame_bytes": frame_bytes,
        "frames_per_s": sent / (t1 - t0),
        "cpu_us_per_frame": 1e6 * (user + system) / max(sent, 1),
        "sys_us_per_frame": 1e6 * system / max(sent, 1),
        "cpu_share": (user + system) / (t1 - t0),
    }


def bmv2_missing() -> str | None:
    """Why BMv2 cannot run here, or None."""
    if shutil.which("simple_switch_grpc") is None:
        return "simple_switch_grpc is not on PATH"
    if not BMV2_JSON.exists():
        return f"{BMV2_JSON.relative_to(REPO)} does not exist (make p4)"
    return None


def targets_to_run(target: str, datapath: str) -> list[tuple[str, str]]:
    """(switch kind, data path) pairs to measure, in order; prints why any is left out."""
    out: list[tuple[str, str]] = []
    if target in ("all", "embedded"):
        for dp in native.DATAPATHS if datapath == "both" else (datapath,):
            if dp == "native" and not native.available():
                print(f"note: the native data path is not built ({native.IMPORT_ERROR}); not measured")
                continue
            out.append(("embedded", dp))
    if target in ("all", "bmv2"):
        why = bmv2_missing()
        if why is None:
            out.append(("bmv2", ""))
        else:
            print(f"note: BMv2 not measured: {why}")
    return out


def ratios(results: Sequence[RunResult]) -> list[dict[str, object]]:
    """Lossless input rate of each embedded data path over BMv2's, per case, where both were measured."""
    lossless = {(r.label, r.scenario, r.frame_bytes): r.in_pps for r in results if r.mode == "lossless"}
    out: list[dict[str, object]] = []
    for (label, scenario, size), pps in sorted(lossless.items()):
        bmv2 = lossless.get(("bmv2", scenario, size))
        if label != "bmv2" and bmv2:
            out.append({"target": label, "scenario": scenario, "frame_bytes": size, "over_bmv2": pps / bmv2})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench.switch", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--target",
        choices=["all", "embedded", "bmv2"],
        default="all",
        help="all: the embedded switch, then BMv2 when it is installed",
    )
    parser.add_argument(
        "--datapath", choices=[*native.DATAPATHS, "both"], default="both", help="the embedded switch's"
    )
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per run")
    parser.add_argument("--sizes", default="1514,9014", help="frame sizes in bytes")
    parser.add_argument("--cases", default="unicast,2-way", help="unicast and/or 2-way")
    parser.add_argument("--start-rate", type=float, default=0.0, help="first rate tried (pkt/s)")
    parser.add_argument(
        "--profile", action="store_true", help="also cProfile the Python data path's 2-way 1514 B case"
    )
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
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
    targets = targets_to_run(args.target, args.datapath)
    if not targets:
        print("nothing to measure", file=sys.stderr)
        return 2
    results: list[RunResult] = []
    every_run: list[RunResult] = []
    profile_path: Path | None = None
    floors: list[dict[str, float]] = []
    with testbed.testbed([SENDER, NEXT_HOP, SHADOW], prefix="cmb") as bed:
        for size in sizes:
            floor = send_floor(bed, size)
            if floor is not None:
                floors.append(floor)
                print(
                    f"kernel floor, {size} B into a veth with no switch: "
                    f"{floor['frames_per_s']:.0f} frames/s sent at {floor['cpu_share']:.2f} of a CPU, "
                    f"{floor['cpu_us_per_frame']:.2f} us CPU per frame"
                )
        passes: list[tuple[str, str, str, list[str]]] = [("plain", kind, dp, []) for kind, dp in targets]
        if args.profile and ("embedded", "python") in targets:
            profile_path = bed.workdir / "io-thread.prof"
            passes.append(("profile", "embedded", "python", ["--profile", str(profile_path)]))
        first = True
        for label, kind, datapath, extra in passes:
            extra_args = ["--log-level", "warn", "--datapath", datapath, *extra] if kind == "embedded" else []
            switch = testbed.start_switch(kind, bed, extra_args)
            try:
                device_config = BMV2_JSON
                if kind == "embedded":
                    device_config = bed.workdir / "embedded.bin"
                    device_config.write_bytes(b"")
                program_switch(switch.address, device_config)
                if label == "profile":
                    best = [
                        r
                        for r in results
                        if r.datapath == "python" and r.scenario == "2-way" and r.frame_bytes == 1514
                    ]
                    rate = best[0].offered_pps * 1.1 if best else 100_000.0
                    scenario = Scenario("2-way", True, 1514)
                    run_once(bed, switch, scenario, "profile", rate, args.duration, datapath)
                    continue
                for scenario in scenarios:
                    start = args.start_rate or default_start_rate(kind, scenario.frame_bytes, datapath)
                    runs = search(bed, switch, scenario, args.duration, start, datapath=datapath)
                    every_run += runs
                    results += summarize(runs)
                    print_table(summarize(runs), header=first)
                    first = False
            finally:
                switch.stop(timeout=10)
        if profile_path is not None and profile_path.exists():
            saved = args.json.parent / "switch_profile.prof"
            saved.parent.mkdir(parents=True, exist_ok=True)
            saved.write_bytes(profile_path.read_bytes())
            profile_path = saved
    print()
    print_table(results)
    print("(* the generator fell short of the rate asked for: the figure is its limit, not the switch's)")
    versus = ratios(results)
    for row in versus:
        print(f"{row['target']} / bmv2, {row['scenario']} {row['frame_bytes']} B: {row['over_bmv2']:.1f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "generator": "sendmmsg" if native.available() else "send",
        "summary": [{**asdict(r), "cpu_us_per_packet": r.cpu_us_per_packet} for r in results],
        "over_bmv2": versus,
        "kernel_send_floor": floors,
        "runs": [{**asdict(r), "cpu_us_per_packet": r.cpu_us_per_packet} for r in every_run],
    }
    args.json.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    if profile_path is not None and profile_path.exists():
        print_profile(profile_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
