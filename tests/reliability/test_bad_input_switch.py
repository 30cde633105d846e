"""Bad input into the switch: fuzzed frames and spoofed tagged packets through the embedded pipeline.

The switch is programmed by a real controller over P4Runtime (two jobs on
topologies/single.json, see tests/reliability/fuzz_switch.py). Every frame goes
through ``Pipeline.process`` twice (cold, then from the decision cache) and is
compared with an independent model of the P4 program built from the controller's
planned entities: the same frames out of the same ports, or a drop counted under
the same reason. Nothing reaches a shadow port unless the model says the frame
is a well-formed tagged DATA packet from a port enrolled in its job.
"""

from __future__ import annotations

import collections
import random
from pathlib import Path

import pytest

from checkmate import wire
from checkmate.p4.p4info import load_p4info
from embedded_switch import native
from embedded_switch.pipeline import DropReason, Pipeline
from embedded_switch.program import build_state
from tests import switch_cases as sc
from tests.reliability.fuzz_frames import (
    Verdict,
    checkmate_datagram,
    frame,
    mutate_frame,
    tally,
)
from tests.reliability.fuzz_switch import JOB_A, JOB_B, ProgrammedSwitch, programmed_switch
from tests.reliability.record import Recorder

DATAPATHS = [
    "python",
    pytest.param("native", marks=pytest.mark.skipif(not native.available(), reason="native path not built")),
]

QUICK_CASES = 6000
SOAK_CASES = 100_000
SPOOF_CASES = 3000


def _base_frames(sw: ProgrammedSwitch, rng: random.Random) -> tuple[bytes, int]:
    """A valid frame (tagged, untagged, control or plain UDP) and the port it arrives on."""
    net = sw.network
    kind = rng.randrange(7)
    if kind <= 2:  # tagged gradient of job 7 or 8 to the ring neighbour
        spec = JOB_A if kind < 2 else JOB_B
        src = rng.choice(spec.workers)
        dst = spec.ring_next(src)
        datagram = checkmate_datagram(rng, spec.job_id, rng.choice(spec.shard_keys))
    elif kind == 3:  # untagged DATA, or a control message
        src, dst = rng.sample(JOB_A.workers, 2)
        msg = rng.choice([wire.MessageType.DATA, wire.MessageType.ACK, wire.MessageType.NACK])
        if msg is wire.MessageType.DATA:
            datagram = checkmate_datagram(rng, 7, 0, flags=wire.Flags.LAST)
        else:
            datagram = wire.CheckmateHeader(msg, 7, 0, 0, 1, 0, 0, rng.randrange(99), wire.DType.NONE).pack()
    elif kind == 4:  # a shadow's repair request to a worker
        src, dst = rng.choice(["sh1", "sh2"]), rng.choice(JOB_A.workers)
        header = wire.CheckmateHeader(wire.MessageType.REPAIR_REQUEST, 7, 3, 1, 0, 0, 8, 5, wire.DType.NONE)
        datagram = header.pack()
    elif kind == 5:  # tagged, any host to any host
        src, dst = rng.sample(sorted(net.hosts), 2)
        datagram = checkmate_datagram(rng, rng.choice([7, 8, 9]), rng.randrange(4))
    else:  # plain UDP
        src, dst = rng.sample(sorted(net.hosts), 2)
        data = frame(
            sw.host_mac(src),
            sw.switch_mac(src),
            sw.host_ip(src),
            sw.host_ip(dst),
            rng.randbytes(64),
            dport=5000,
        )
        return data, sw.host_port(src)
    data = frame(sw.host_mac(src), sw.switch_mac(src), sw.host_ip(src), sw.host_ip(dst), datagram)
    return data, sw.host_port(src)


class Tally:
    """Frames in, and what became of them, checked against the pipeline's own counters."""

    def __init__(self, sw: ProgrammedSwitch) -> None:
        self.sw = sw
        self.frames = 0
        self.verdicts: collections.Counter[str] = collections.Counter()
        self.reasons: collections.Counter[str] = collections.Counter()
        self.copies: collections.Counter[int] = collections.Counter()
        self.rejected: collections.Counter[int] = collections.Counter()
        self.mutations: collections.Counter[str] = collections.Counter()
        self._drops0 = sw.pipeline.drops.total()
        self._counters0 = {
            name: list(sw.state.counter(name).packets)
            for name in ("shadow_copies", "rejected_replications", "ingress_drops")
        }

    def run(self, data: bytes, port: int) -> Verdict:
        """Run ``data`` cold and cached; both must match the model exactly."""
        sw = self.sw
        want = sw.model.run(data, port)
        for _ in range(2):
            before = sw.pipeline.drops.by_reason()
            got = sorted((p, bytes(f)) for p, f in sw.pipeline.process(data, port))
            after = sw.pipeline.drops.by_reason()
            assert got == sorted(want.outputs), (want, data.hex())
            delta = {
                r.name: after.get(r, 0) - before.get(r, 0)
                for r in after
                if after.get(r, 0) != before.get(r, 0)
            }
            assert delta == ({want.reason: 1} if want.kind == "drop" else {}), (want, delta, data.hex())
            shadow_ports = sw.shadow_ports()
            leaked = [p for p, _ in got if p in shadow_ports and want.kind != "replicate"]
            # a frame addressed to a shadow is routed there; nothing else may reach a shadow port
            routed_to_shadow = want.kind == "forward" and all(p in shadow_ports for p, _ in want.outputs)
            assert not leaked or routed_to_shadow, (want, data.hex())
            self.frames += 1
            self.verdicts[want.kind] += 1
            if want.kind == "drop":
                self.reasons[want.reason] += 1
            if want.copy_slot is not None:
                self.copies[want.copy_slot] += want.copies
            if want.rejected_slot is not None:
                self.rejected[want.rejected_slot] += 1
        return want

    def check_counters(self) -> None:
        sw = self.sw
        assert self.frames == sum(self.verdicts.values())
        assert sw.pipeline.drops.total() - self._drops0 == self.verdicts["drop"]
        for name, expected in (("shadow_copies", self.copies), ("rejected_replications", self.rejected)):
            now = sw.state.counter(name).packets
            delta = {i: now[i] - v for i, v in enumerate(self._counters0[name]) if now[i] != v}
            assert delta == {k: v for k, v in expected.items() if v}, name
        now = sw.state.counter("ingress_drops").packets
        p4_drops = sum(now) - sum(self._counters0["ingress_drops"])
        assert p4_drops == self.verdicts["drop"]  # every drop here is a P4 ingress drop

    def held(self) -> str:
        return (
            f"{self.frames} frames in = {self.verdicts['forward']} forwarded + "
            f"{self.verdicts['replicate']} replicated + {self.verdicts['drop']} dropped "
            f"({tally(self.reasons)}); every output bit-equal to the reference model of the P4 program, "
            f"cold and cached; shadow copies only of well-formed tagged DATA from enrolled ports "
            f"({sum(self.copies.values())}), {sum(self.rejected.values())} counted in rejected_replications"
        )


def _valid_frames_still_replicate(sw: ProgrammedSwitch, tally_: Tally, rng: random.Random) -> int:
    """Every worker's tagged packet of every shard reaches exactly its shadow after the fuzz."""
    checked = 0
    for spec in (JOB_A, JOB_B):
        for worker in spec.workers:
            for shard in spec.shard_keys:
                nxt = spec.ring_next(worker)
                datagram = checkmate_datagram(rng, spec.job_id, shard)
                data = frame(
                    sw.host_mac(worker), sw.switch_mac(worker), sw.host_ip(worker), sw.host_ip(nxt), datagram
                )
                verdict = tally_.run(data, sw.host_port(worker))
                assert verdict.kind == "replicate" and verdict.copies == 1
                shadow = spec.shard_to_shadow[shard]
                ports = sorted(p for p, _ in verdict.outputs)
                assert ports == sorted([sw.host_port(nxt), sw.host_port(shadow)])
                copy = dict(verdict.outputs)[sw.host_port(shadow)]
                header, payload = wire.decode(copy[42:])
                assert header.flags & wire.Flags.REPLICATE == 0 and bytes(payload) == datagram[32:]
                assert int.from_bytes(copy[30:34], "big") == sw.host_ip(shadow)
                checked += 1
    return checked


def _fuzz(tmp_path: Path, cases: int, seed: int, datapath: str = "python") -> tuple[Tally, int]:
    rng = random.Random(seed)
    with programmed_switch(tmp_path, datapath) as sw:
        t = Tally(sw)
        for _ in range(cases):
            base, port = _base_frames(sw, rng)
            if rng.random() < 0.08:
                name, data = "none", base
            else:
                name, data = mutate_frame(base, rng)
            if rng.random() < 0.1:
                port = rng.randrange(0, 12)
            t.mutations[name.split("+")[0]] += 1
            t.run(data, port)
        t.check_counters()
        checked = _valid_frames_still_replicate(sw, t, rng)
        t.check_counters()
    return t, checked


@pytest.mark.parametrize("datapath", DATAPATHS)
def test_fuzzed_frames_into_the_switch(tmp_path: Path, reliability: Recorder, datapath: str) -> None:
    t, checked = _fuzz(tmp_path, QUICK_CASES, seed=10, datapath=datapath)
    assert t.verdicts["drop"] > QUICK_CASES // 4 and t.verdicts["replicate"] > 100  # the fuzz reached both
    reliability.record(
        area="bad input",
        case=f"fuzzed frames (random bytes and mutations: {tally(t.mutations)})",
        target=f"switch (embedded pipeline, {datapath} data path, programmed by the controller)",
        trials=QUICK_CASES,
        lost=0,
        held=t.held() + f"; afterwards {checked} valid tagged frames (every worker x shard) each copied "
        "once to the right shadow",
    )


@pytest.mark.soak
def test_fuzzed_frames_into_the_switch_soak(tmp_path: Path, reliability: Recorder) -> None:
    t, checked = _fuzz(tmp_path, SOAK_CASES, seed=11)
    reliability.record(
        area="bad input",
        case="fuzzed frames, 100k cases",
        target="switch (embedded pipeline, programmed by the controller)",
        trials=SOAK_CASES,
        lost=0,
        held=t.held() + f"; afterwards {checked} valid tagged frames each copied once to the right shadow",
    )


# ---- spoofed tagged packets -------------------------------------------------------------------------
def test_spoofed_tagged_packets_never_reach_a_shadow(tmp_path: Path, reliability: Recorder) -> None:
    """Well-formed tagged DATA with an enrolled job id, from ports / shard keys / next hops not enrolled."""
    rng = random.Random(20)
    spoofed = enrolled = leaked = 0
    why: collections.Counter[str] = collections.Counter()
    compared = (
        "per frame: the switch's outputs against the reference model (a known host's address on another "
        "port dropped as SPOOFED_SOURCE; another spoofed frame forwarded to its next hop only, uncopied, "
        "counted as rejected at its job's slot; an enrolled one replicated)"
    )
    reliability.begin(
        area="bad input",
        case="spoofed tagged packets: an enrolled job id from a port, shard key or next hop not enrolled",
        target="switch (embedded pipeline, programmed by the controller)",
        compared=compared,
        trials=SPOOF_CASES + len(sc.SPOOFED),
    )
    with programmed_switch(tmp_path) as sw:
        t = Tally(sw)
        workers = sorted(sw.network.hosts_with_role("worker"))
        for _ in range(SPOOF_CASES):
            job = rng.choice([7, 7, 8, 9, rng.randrange(1 << 32)])
            shard = rng.choice([0, 1, 2, 0xFFFF, rng.randrange(1 << 16)])
            port = rng.choice([*range(1, 7), rng.randrange(7, 512)])
            at_port = [h for h in sorted(sw.network.hosts) if sw.host_port(h) == port]
            # mostly the host on that port (its own address); else any host's address
            src = at_port[0] if at_port and rng.random() < 0.75 else rng.choice(sorted(sw.network.hosts))
            dst = rng.choice(workers)
            data = frame(
                sw.host_mac(src),
                sw.switch_mac(dst),
                sw.host_ip(src),
                sw.host_ip(dst),
                checkmate_datagram(rng, job, shard),
            )
            verdict = t.run(data, port)
            next_hop = sw.host_port(dst)
            if sw.host_port(src) != port:  # a known host's address on another port: check_source
                spoofed += 1
                leaked += not (verdict.kind == "drop" and verdict.reason == "SPOOFED_SOURCE")
                why["source address not on its host's port"] += 1
                continue
            if (job, port, shard, next_hop) in sw.model.replicate:
                enrolled += 1
                leaked += verdict.kind != "replicate"
                continue
            spoofed += 1
            leaked += not (
                verdict.kind == "forward"
                and verdict.rejected_slot == sw.model.jobs.get(job, 0)
                and [p for p, _ in verdict.outputs] == [next_hop]
            )
            if job not in (JOB_A.job_id, JOB_B.job_id):
                why["unknown job"] += 1
            elif port not in {sw.host_port(w) for w in (JOB_A if job == 7 else JOB_B).workers}:
                why["port not enrolled in the job"] += 1
            elif shard not in (JOB_A if job == 7 else JOB_B).shard_keys:
                why["unknown shard key"] += 1
            else:
                why["wrong next hop"] += 1
        t.check_counters()
        assert all(
            why[k] > 50
            for k in (
                "source address not on its host's port",
                "port not enrolled in the job",
                "unknown shard key",
                "wrong next hop",
            )
        )
        assert sum(t.copies.values()) == 2 * enrolled  # each frame ran cold and cached

    # the shared packet-test cases (tests/switch_cases.py SPOOFED; BMv2 runs them too)
    state = build_state(load_p4info())
    sc.install(state)
    pipeline = Pipeline(state)
    for case in sc.SPOOFED:
        out = pipeline.process(bytes(case.packet), case.ingress_port)
        leaked += [(p, bytes(f)) for p, f in out] != [(case.out_port, sc.routed(case.packet, case.out_mac))]
    reliability.compare(SPOOF_CASES + len(sc.SPOOFED), leaked)
    assert leaked == 0
    assert state.counter("shadow_copies").read(sc.JOB_SLOT) == (0, 0)
    assert sum(state.counter("rejected_replications").packets) == len(sc.SPOOFED)
    assert pipeline.drops.total() == 0

    reliability.record(
        area="bad input",
        case="spoofed tagged packets: an enrolled job id from a port, shard key or next hop not enrolled",
        target="switch (embedded pipeline, programmed by the controller)",
        trials=SPOOF_CASES + len(sc.SPOOFED),
        compared=compared,
        comparisons=SPOOF_CASES + len(sc.SPOOFED),
        differed=leaked,
        held=f"{spoofed} spoofed packets ({tally(why)}): those with a known host's address on another port "
        "dropped by check_source and counted as SPOOFED_SOURCE, the others forwarded uncopied and counted "
        f"in rejected_replications at their job's slot; none reached a shadow port; {enrolled} that were "
        "in fact enrolled "
        f"were copied once; plus the {len(sc.SPOOFED)} shared packet-test cases "
        "(tests/switch_cases.py SPOOFED, also run on BMv2 by tests/packet)",
    )


def test_drop_reasons_cover_the_model(tmp_path: Path) -> None:
    """One frame per drop reason of the model, through the programmed pipeline (cold, then cached).

    Each is dropped for that reason, as the model says (``Tally.run``), and counted once per pass
    in the P4 counter ``ingress_drops`` at that reason's index, nowhere else; together the frames
    cover every P4 ingress drop reason (NO_SHADOW_DESTINATION is egress's: test_pipeline.py).
    """
    with programmed_switch(tmp_path) as sw:
        src, dst = "h1", "h2"
        port = sw.host_port(src)

        def tagged(version: int = wire.WIRE_VERSION) -> bytes:
            header = wire.CheckmateHeader(
                msg_type=wire.MessageType.DATA,
                job_id=JOB_A.job_id,
                iteration=3,
                bucket_id=0,
                sender_rank=0,
                element_offset=0,
                element_count=2,
                sequence=0,
                dtype=wire.DType.FP32,
                flags=wire.Flags.REPLICATE,
            )
            return bytes([version]) + header.pack()[1:] + bytes(8)  # 2 fp32 elements

        def to(datagram: bytes, dst_ip: int | None = None, ttl: int = 64) -> bytes:
            ip = sw.host_ip(dst) if dst_ip is None else dst_ip
            return frame(sw.host_mac(src), sw.switch_mac(src), sw.host_ip(src), ip, datagram, ttl=ttl)

        good = to(tagged())
        bad_checksum = bytearray(good)
        bad_checksum[14 + 10] ^= 0xFF
        frames = {
            "MALFORMED_PACKET": good[: 14 + 12],  # the IPv4 header cut short
            "NOT_IPV4": good[:12] + b"\x86\xdd" + good[14:],
            "MALFORMED_CHECKMATE": to(tagged(version=wire.WIRE_VERSION + 1)),
            "BAD_IPV4_CHECKSUM": bytes(bad_checksum),
            "TTL_EXPIRED": to(tagged(), ttl=1),
            "NO_ROUTE": to(tagged(), dst_ip=0xC0000201),  # 192.0.2.1: in no route of the network
            # another known host's address on h1's port (check_source)
            "SPOOFED_SOURCE": frame(
                sw.host_mac(src), sw.switch_mac(src), sw.host_ip("h3"), sw.host_ip(dst), tagged()
            ),
        }
        assert set(frames) == {r.name for r in DropReason if r < 16} - {"NO_SHADOW_DESTINATION"}
        assert Tally(sw).run(good, port).kind == "replicate"  # the frames differ from a good one in one thing
        tally_ = Tally(sw)
        ingress_drops = sw.state.counter("ingress_drops")
        for reason, data in frames.items():
            before = list(ingress_drops.packets)
            verdict = tally_.run(data, port)
            assert (verdict.kind, verdict.reason) == ("drop", reason)
            after = ingress_drops.packets
            changed = {i: after[i] - before[i] for i in range(len(after)) if after[i] != before[i]}
            assert changed == {int(DropReason[reason]): 2}, reason
        tally_.check_counters()
        assert tally_.reasons == {reason: 2 for reason in frames}
