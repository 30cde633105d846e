"""Attack suite: packets and connections from outside a job, each row "nothing lost, nobody let in".

docs/security.md is the threat model. Every row counts what it compared: for each
forged, spoofed, replayed, oversized or slow message, whether it was let in (a drop
or refusal counted by the target, no state handed out) and whether the state it
aimed at still equals the reference (the shadow's parameters == torch.optim.SGD's,
the worker's unacknowledged data still outstanding). ``lost`` is the number that
differed. Spoofing a job member's exact source address needs a raw socket (root).
"""

from __future__ import annotations

import os
import resource
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from checkmate.admission import ControlLimits
from checkmate.auth import DatagramAuth, secret_from_env
from checkmate.control import (
    BucketLayout,
    Commit,
    JobStart,
    RestoreRequest,
    StatusReport,
    StatusRequest,
    encode_message,
    recv_message,
    send_message,
)
from checkmate.control_frame import HEAD_BYTES, HELLO, MAGIC, PREFIX, ControlAuth, bind
from checkmate.wire import CheckmateHeader, DType, MessageType, encode
from hosts.transport import Transport, TransportConfig
from shadow.node import ShadowConfig, ShadowNode
from shadow.repair import RepairPolicy
from tests.reliability.record import Recorder
from tests.shadow.test_node import (
    GRAD,
    INITIAL,
    JOB,
    LAYOUT,
    Rank0,
    datagram,
    job_start,
    join,
    reference,
    wait_for,
    worker_socket,
)

TRIALS = 40
WRONG_SECRET = bytes.fromhex("77" * 32)
"""Another job's secret: a member of another job knows its own secret, not this one's."""
SHADOW_HOST = "127.0.0.50"
OUTSIDER = "127.0.0.99"
"""A host that is not a member of the job."""


@pytest.fixture
def node(tmp_path: Path) -> Iterator[ShadowNode]:
    torch.set_num_threads(1)
    shadow = ShadowNode(
        ShadowConfig(
            name="s0",
            control_bind=(SHADOW_HOST, 0),
            data_bind=(SHADOW_HOST, 0),
            status_file=tmp_path / "status.json",
            horizon=4,
            io_timeout=2.0,
            repair=RepairPolicy(grace=5.0),  # every genuine copy is sent: no repairs
        )
    ).start()
    yield shadow
    shadow.close()


def _drops(node: ShadowNode, reason: str) -> int:
    return int(node.status()["drops"].get(reason, 0))


def _state_differs(node: ShadowNode, steps: int) -> int:
    """1 if the shadow's parameters differ from torch.optim.SGD's after ``steps`` steps, else 0."""
    want = reference(steps)
    got = node.parameters()
    return int(not all(torch.equal(got[n], want[n]) for n in want))


def _genuine_iteration(node: ShadowNode, rank0: object, iteration: int) -> list[bytes]:
    copies = [datagram(iteration, 0, GRAD[:8]), datagram(iteration, 8, GRAD[8:])]
    rank0.send(Commit(JOB, iteration, [0.1]))  # type: ignore[attr-defined]
    with worker_socket() as sender:
        for data in copies:
            sender.sendto(data, node.data_address)
    assert node.wait_applied(iteration, 10), node.status()
    return copies


def spoof(source: tuple[str, int], target: tuple[str, int], payload: bytes) -> None:
    """One UDP datagram with ``source`` as its IP source address and port (raw socket, root)."""
    udp = struct.pack("!HHHH", source[1], target[1], 8 + len(payload), 0) + payload
    ip = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        20 + len(udp),
        0,
        0,
        64,
        socket.IPPROTO_UDP,
        0,
        socket.inet_aton(source[0]),
        socket.inet_aton(target[0]),
    )
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as raw:
        raw.sendto(ip + udp, (target[0], 0))


# ---- gradient data into a shadow ----------------------------------------------------------
def test_spoofed_other_job_and_replayed_data_never_change_a_shadow(
    node: ShadowNode, reliability: Recorder
) -> None:
    reliability.begin(
        area="bad input",
        case="gradient DATA from a host not enrolled in the job, of another job, and replayed from "
        "an earlier iteration",
        target="shadow node",
        compared="per datagram: dropped (counted by reason) or placed; the shadow's parameters after "
        "each iteration == torch.optim.SGD on the genuine gradients",
        trials=3 * TRIALS,
    )
    rank0 = join(node)
    wrong = GRAD * 7
    comparisons = differed = 0
    outsider = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    outsider.bind((OUTSIDER, 0))
    before = _drops(node, "not_from_a_worker"), _drops(node, "other_job"), _drops(node, "stale_iteration")
    rank0.send(Commit(JOB, 0, [0.1]))
    with worker_socket() as member:
        for i in range(TRIALS):
            offset = (i * 4) % 12
            # an outsider with wrong values for the iteration being placed
            outsider.sendto(datagram(0, offset, wrong[offset : offset + 4]), node.data_address)
            # another job's copy, from a job member's host
            member.sendto(datagram(0, offset, wrong[offset : offset + 4], job_id=JOB + 1), node.data_address)
        time.sleep(0.2)
        for data in (datagram(0, 0, GRAD[:8]), datagram(0, 8, GRAD[8:])):
            member.sendto(data, node.data_address)
    assert node.wait_applied(0, 10), node.status()
    outside = _drops(node, "not_from_a_worker") - before[0]
    other = _drops(node, "other_job") - before[1]
    comparisons += 2 * TRIALS + 1
    differed += (TRIALS - outside) + (TRIALS - other) + _state_differs(node, 1)
    # the genuine copies of iteration 0, replayed during iteration 1
    rank0.send(Commit(JOB, 1, [0.1]))
    with worker_socket() as member:
        for _ in range(TRIALS // 2):
            member.sendto(datagram(0, 0, wrong[:8]), node.data_address)
            member.sendto(datagram(0, 8, GRAD[8:]), node.data_address)
        for data in (datagram(1, 0, GRAD[:8]), datagram(1, 8, GRAD[8:])):
            member.sendto(data, node.data_address)
    assert node.wait_applied(1, 10), node.status()
    stale = _drops(node, "stale_iteration") - before[2]
    comparisons += TRIALS + 1
    differed += max(0, TRIALS - stale) + _state_differs(node, 2)
    reliability.compare(comparisons, differed)
    outsider.close()
    rank0.close()  # type: ignore[attr-defined]
    assert differed == 0, (outside, other, stale, node.status()["drops"])
    reliability.record(
        area="bad input",
        case="gradient DATA from a host not enrolled in the job, of another job, and replayed from "
        "an earlier iteration",
        target="shadow node",
        trials=3 * TRIALS,
        compared="per datagram: dropped (counted by reason) or placed; the shadow's parameters after "
        "each iteration == torch.optim.SGD on the genuine gradients",
        comparisons=comparisons,
        differed=differed,
        held=f"{outside}/{TRIALS} from outside the job dropped (not_from_a_worker), {other}/{TRIALS} of "
        f"job {JOB + 1} dropped (other_job), {stale}/{TRIALS} replayed from iteration 0 dropped "
        "(stale_iteration); both iterations applied bit-equal to torch.optim.SGD",
    )


# ---- forged transport control datagrams --------------------------------------------------
@pytest.mark.root
@pytest.mark.parametrize("datapath", ["native", "python"])
def test_forged_ack_nack_and_repair_requests_are_not_let_in(reliability: Recorder, datapath: str) -> None:
    case = (
        "forged ACK, NACK and REPAIR_REQUEST with a job member's exact source address (raw socket): "
        f"no MAC, or another job's MAC ({datapath} data path)"
    )
    compared = (
        "per datagram: dropped as unauthenticated or acted on; the sender's unacknowledged data and "
        "retransmissions, and the repair service's calls, before and after"
    )
    reliability.begin(area="bad input", case=case, target="host agent transport", compared=compared)
    a_addr, b_addr, shadow_addr = ("127.0.0.70", 47001), ("127.0.0.71", 47002), ("127.0.0.72", 47003)
    requests: list[int] = []
    a = Transport(
        TransportConfig(
            bind=a_addr, peer_timeout=60.0, initial_rto=5.0, min_rto=5.0, max_rto=5.0, datapath=datapath
        )
    )
    try:
        if datapath == "native" and a.datapath != "native":
            pytest.skip("hosts.native._datapath is not built")
        a.add_job(JOB, 0, {0: a_addr, 1: b_addr}, lambda *_: None, on_request=lambda *_: requests.append(1))
        payload = bytes(16)
        for i in range(8):  # nobody listens at b: these stay unacknowledged
            a.send(b_addr, CheckmateHeader(MessageType.DATA, JOB, 0, 0, 0, 4 * i, 4, 0), payload)
        assert wait_for(lambda: a.stats()["unacked"] == 8)
        other_job = DatagramAuth(WRONG_SECRET, JOB)
        forged = 0
        for i in range(TRIALS):
            kind = (MessageType.ACK, MessageType.NACK, MessageType.REPAIR_REQUEST)[i % 3]
            count = 4 if kind is MessageType.REPAIR_REQUEST else 1
            header = CheckmateHeader(kind, JOB, 0, 0, 1, 1024, count, 8, dtype=DType.NONE)
            body = encode(header) + (
                struct.pack("!II", 0, 8) if kind is not MessageType.REPAIR_REQUEST else b""
            )
            signed = body + other_job.tag([body]) if i % 2 else body
            spoof(b_addr if kind is not MessageType.REPAIR_REQUEST else shadow_addr, a_addr, signed)
            forged += 1
        time.sleep(0.5)
        stats = a.stats()
        unauthenticated = stats.get("drop.unauthenticated", 0)
        differed = (
            (forged - unauthenticated)
            + int(stats["unacked"] != 8)  # a forged cumulative ACK released data
            + int(stats.get("retransmit.nack", 0) > 0)  # a forged NACK was acted on
            + int(bool(requests))  # a forged repair request reached the repair service
        )
        comparisons = forged + 3
        reliability.compare(comparisons, differed)
        assert differed == 0, stats
    finally:
        a.close()
    reliability.record(
        area="bad input",
        case=case,
        target="host agent transport",
        trials=forged,
        compared=compared,
        comparisons=comparisons,
        differed=differed,
        held=f"{unauthenticated}/{forged} forged datagrams dropped as unauthenticated before parsing; "
        "the 8 unacknowledged DATA datagrams stayed outstanding (a forged cumulative ACK would have "
        "released them), no NACK retransmission, the repair service was never called",
    )


@pytest.mark.root
def test_forged_repair_answers_never_change_a_shadow(node: ShadowNode, reliability: Recorder) -> None:
    case = "forged REPAIR_DATA and NACK into a shadow, with a worker's exact source address (raw socket)"
    compared = (
        "per datagram: dropped as unauthenticated or placed; the shadow's parameters == torch.optim.SGD"
    )
    reliability.begin(area="bad input", case=case, target="shadow node", compared=compared)
    worker = ("127.0.0.60", 9)
    rank0 = join(node, [worker, ("127.0.0.61", 9)])
    before = _drops(node, "unauthenticated")
    other_job = DatagramAuth(WRONG_SECRET, JOB)
    rank0.send(Commit(JOB, 0, [0.1]))
    for i in range(TRIALS):
        if i % 2:
            forged = datagram(0, 0, GRAD[:8] * 9, msg_type=MessageType.REPAIR_DATA)
        else:
            forged = CheckmateHeader(MessageType.NACK, JOB, 0, 0, 0, 0, 8, 1, DType.NONE).pack()
        spoof(worker, node.data_address, forged + (other_job.tag([forged]) if i % 4 < 2 else b""))
    time.sleep(0.3)
    with worker_socket() as member:
        for data in (datagram(0, 0, GRAD[:8]), datagram(0, 8, GRAD[8:])):
            member.sendto(data, node.data_address)
    assert node.wait_applied(0, 10), node.status()
    dropped = _drops(node, "unauthenticated") - before
    differed = (TRIALS - dropped) + _state_differs(node, 1)
    comparisons = TRIALS + 1
    reliability.compare(comparisons, differed)
    rank0.close()
    assert differed == 0, node.status()["drops"]
    reliability.record(
        area="bad input",
        case=case,
        target="shadow node",
        trials=TRIALS,
        compared=compared,
        comparisons=comparisons,
        differed=differed,
        held=f"{dropped}/{TRIALS} dropped as unauthenticated (half without a MAC, half with another job's); "
        "iteration 0 applied bit-equal to torch.optim.SGD",
    )


# ---- the control port --------------------------------------------------------------------
class Tap:
    """A TCP relay in front of a shadow's control port that records what clients send through it
    (an attacker on the path, or with a copy of the traffic)."""

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.98") -> None:
        self.target = target
        self.recorded: list[bytearray] = []
        self._server = socket.create_server((host, 0))
        self._server.settimeout(0.1)
        self.address = self._server.getsockname()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=5)
            record = bytearray()
            self.recorded.append(record)
            for src, dst, keep in ((client, upstream, record), (upstream, client, None)):
                thread = threading.Thread(target=self._pump, args=(src, dst, keep), daemon=True)
                thread.start()
                self._threads.append(thread)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, keep: bytearray | None) -> None:
        src.settimeout(None)
        try:
            while chunk := src.recv(1 << 16):
                if keep is not None:
                    keep += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._server.close()


def _hello_bytes(node: ShadowNode) -> int:
    """What a shadow says first on every connection (its hello; protocol version 3)."""
    return HELLO.size + len(node.name.encode())


def _replay(node: ShadowNode, recorded: bytes, timeout: float = 3.0) -> int:
    """Bytes a shadow sends back, beyond its hello, to a recorded connection replayed to it."""
    with socket.create_connection(node.control_address, timeout=2) as conn:
        try:
            conn.sendall(recorded)
        except OSError:
            pass  # closed after the first head: that is the refusal
        return max(0, _answer_bytes(conn, timeout) - _hello_bytes(node))


def _answer_bytes(conn: socket.socket, timeout: float = 3.0) -> int:
    """Bytes the shadow sent back before closing (or before ``timeout``)."""
    conn.settimeout(timeout)
    got = 0
    try:
        while chunk := conn.recv(1 << 16):
            got += len(chunk)
    except (TimeoutError, ConnectionResetError):
        pass
    return got


def _rogue_start() -> JobStart:
    return JobStart(
        job_id=JOB,
        world_size=2,
        workers=[(OUTSIDER, 9), (OUTSIDER, 10)],
        parameters=[],
        optimizer={"kind": "SGD", "param_groups": []},
        start_iteration=0,
        tensors={f"param/{n}": torch.full_like(t, 666.0) for n, t in INITIAL.items()},
    )


def test_rogue_job_start_and_restore_requests_without_the_secret(
    node: ShadowNode, reliability: Recorder
) -> None:
    case = (
        "rogue JobStart and restore requests: no secret (protocol v1 frame), another job's secret, and a "
        "replay of a genuine restore request (recorded on the wire) on a new connection"
    )
    compared = (
        "per connection: bytes of state the shadow sent back (must be 0) and whether its job, applied "
        "iteration or parameters changed"
    )
    reliability.begin(area="bad input", case=case, target="shadow node (control port)", compared=compared)
    rank0 = join(node)
    _genuine_iteration(node, rank0, 0)
    wrong = ControlAuth(WRONG_SECRET)
    comparisons = differed = answered = 0
    for i in range(TRIALS):
        message = _rogue_start() if i % 2 else RestoreRequest(JOB, None, 0.0)
        with socket.create_connection(node.control_address, timeout=2) as conn:
            try:
                if i % 4 < 2:  # another job's key
                    bind(conn, wrong, JOB)
                    send_message(conn, message, timeout=2)
                else:  # version 1 framing: no MAC at all
                    parts = encode_message(message)
                    text, blobs = bytes(parts[1]), b"".join(bytes(p) for p in parts[2:])
                    conn.sendall(b"CMC1" + struct.pack("!IQ", len(text), len(blobs)) + text + blobs)
            except OSError:
                pass  # the shadow closed the connection after the head: that is the refusal
            got = _answer_bytes(conn) - (0 if i % 4 < 2 else _hello_bytes(node))  # bind() read the hello
        answered += got > 0
        comparisons += 1
        differed += got > 0
    # a genuine restore request, recorded on its way to the shadow, then replayed on new connections
    tap = Tap(node.control_address)
    with socket.create_connection(tap.address, timeout=2) as conn:
        send_message(conn, RestoreRequest(JOB, None, 0.0), timeout=2)
        genuine = isinstance(recv_message(conn, timeout=5), JobStart)  # the shadow's state
    tap.close()
    recorded = bytes(tap.recorded[0])
    replays = 0
    for _ in range(TRIALS // 4):
        got = _replay(node, recorded)
        replays += 1
        comparisons += 1
        differed += got > 0
    status = node.status()
    comparisons += 1
    differed += int(status["job_id"] != JOB or status["applied_iteration"] != 0) + _state_differs(node, 1)
    reliability.compare(comparisons, differed)
    rank0.close()
    assert genuine, "the genuine restore request got no state: the test proves nothing"
    assert differed == 0, (answered, status)
    reliability.record(
        area="bad input",
        case=case,
        target="shadow node (control port)",
        trials=TRIALS + replays,
        compared=compared,
        comparisons=comparisons,
        differed=differed,
        held=f"{TRIALS} rogue connections ({TRIALS // 2} JobStarts of other tensors, {TRIALS // 2} restore "
        f"requests; half v1 frames, half another job's key) and {replays} replays of a genuine restore "
        "request on new connections: every connection closed with 0 bytes of state sent beyond the shadow's "
        "hello (the genuine request got the state); job, applied iteration and parameters unchanged "
        "(bit-equal to torch.optim.SGD)",
    )


def _second_shadow(tmp_path: Path, name: str = "s1", host: str = "127.0.0.51") -> ShadowNode:
    return ShadowNode(
        ShadowConfig(
            name=name,
            control_bind=(host, 0),
            data_bind=(host, 0),
            status_file=tmp_path / f"status-{name}.json",
            horizon=4,
            io_timeout=2.0,
            repair=RepairPolicy(grace=5.0),
        )
    ).start()


def _join_through(node: ShadowNode, tap: Tap) -> Rank0:
    """Rank 0 joining ``node`` through ``tap`` (which records the whole genuine stream)."""
    rank0 = Rank0(SimpleNamespace(control_address=tap.address))  # type: ignore[arg-type]
    rank0.send(job_start([("127.0.0.60", 9), ("127.0.0.61", 9)]))
    rank0.send(BucketLayout(JOB, 0, LAYOUT))
    assert wait_for(lambda: node.status()["state"] == "running", timeout=60), node.status()
    return rank0


def test_connections_recorded_at_one_shadow_are_useless_at_another_and_later(
    node: ShadowNode, tmp_path: Path, reliability: Recorder
) -> None:
    case = (
        "control connections recorded on the wire (rank 0's whole stream: job_start, layout, commit; a "
        "restore request) replayed to the job's other shadow and to the same shadow later"
    )
    compared = (
        "per replayed connection: bytes the shadow sent back beyond its hello (must be 0); per shadow: job, "
        "applied iteration and parameters before and after"
    )
    reliability.begin(area="bad input", case=case, target="shadow node (control port)", compared=compared)
    other = _second_shadow(tmp_path)
    taps = {n.name: Tap(n.control_address) for n in (node, other)}
    try:
        links = {n.name: _join_through(n, taps[n.name]) for n in (node, other)}
        for n in (node, other):
            links[n.name].send(Commit(JOB, 0, [0.1]))
        with worker_socket() as sender:
            for data in (datagram(0, 0, GRAD[:8]), datagram(0, 8, GRAD[8:])):
                sender.sendto(data, node.data_address)
            # s1 owns bucket 1 (shard key 1)
            sender.sendto(datagram(0, 0, GRAD[:6], bucket_id=1, shard_key=1), other.data_address)
        assert node.wait_applied(0, 10) and other.wait_applied(0, 10), (node.status(), other.status())
        restores = {}
        for n in (node, other):
            with socket.create_connection(taps[n.name].address, timeout=2) as conn:
                send_message(conn, RestoreRequest(JOB, None, 0.0), timeout=2)
                restores[n.name] = isinstance(recv_message(conn, timeout=5), JobStart)
        for n in (node, other):
            links[n.name].close()  # rank 0 gone: a replay would be the shadow's only control connection
        time.sleep(0.3)
        before = {n.name: (n.status()["applied_iteration"], n.parameters()) for n in (node, other)}
        recordings = {n: [bytes(r) for r in tap.recorded] for n, tap in taps.items()}
        comparisons = differed = answered = 0
        for _ in range(TRIALS // 8):
            for source, target in (("s0", other), ("s1", node), ("s0", node), ("s1", other)):
                for recorded in recordings[source]:  # the rank-0 stream, then the restore request
                    got = _replay(target, recorded, timeout=1.0)
                    comparisons += 1
                    answered += got > 0
                    differed += got > 0
        for n in (node, other):
            applied, params = before[n.name]
            now = n.status()
            comparisons += 1
            differed += int(
                now["applied_iteration"] != applied
                or now["job_id"] != JOB
                or any(not torch.equal(n.parameters()[k], v) for k, v in params.items())
            )
        refused = sum(_drops(n, "control_unauthenticated") for n in (node, other))
    finally:
        for tap in taps.values():
            tap.close()
        other.close()
    reliability.compare(comparisons, differed)
    assert all(restores.values()), "a genuine restore request got no state: the test proves nothing"
    assert differed == 0, (answered, node.status()["drops"])
    reliability.record(
        area="bad input",
        case=case,
        target="shadow node (control port)",
        trials=comparisons - 2,
        compared=compared,
        comparisons=comparisons,
        differed=differed,
        held=f"{comparisons - 2} replays (each recording to the other shadow and to the same shadow after "
        f"rank 0 left): {answered} answered, {refused} refused at the first frame as not authenticated "
        "with the connection's key (counted control_unauthenticated); both shadows' job, applied iteration "
        "and parameters unchanged",
    )


def test_idle_connection_floods_and_descriptors_past_1024_block_nobody(
    tmp_path: Path, reliability: Recorder
) -> None:
    case = (
        "idle TCP connections that never authenticate (from 4 hosts, 8x the per-source cap) while the "
        "shadow's descriptors are past 1024 (select()'s limit)"
    )
    compared = (
        "per idle connection: closed by the shadow (counted by cause); per genuine status request and "
        "rank 0 reconnect meanwhile: answered"
    )
    reliability.begin(area="bad input", case=case, target="shadow node (control port)", compared=compared)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048 and (hard == resource.RLIM_INFINITY or hard >= 2048):
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    elif soft < 2048:
        pytest.skip(f"needs 2048 file descriptors (hard limit {hard})")
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # later sockets get fds > 1024
    limits = ControlLimits(auth_timeout=1.0, max_pending_per_source=4, max_pending=12)
    shadow = ShadowNode(
        ShadowConfig(
            name="s0",
            control_bind=(SHADOW_HOST, 0),
            data_bind=(SHADOW_HOST, 0),
            status_file=tmp_path / "status.json",
            horizon=4,
            io_timeout=2.0,
            control_limits=limits,
        )
    ).start()
    idle: list[socket.socket] = []
    try:
        sources = [f"127.0.0.{91 + i}" for i in range(4)]
        for i in range(8 * limits.max_pending_per_source * len(sources)):
            sock = socket.socket()
            sock.bind((sources[i % 4], 0))
            sock.connect(shadow.control_address)
            idle.append(sock)
        assert min(s.fileno() for s in idle) > 1024
        answered = 0
        for _ in range(5):
            try:
                _status_latency(shadow)
                answered += 1
            except (OSError, AssertionError, ValueError):
                pass
        rank0 = join(shadow)  # rank 0's connection, made while the flood holds its slots
        rank0.close()
        rank0 = join(shadow)  # and its reconnect
        rank0.close()
        closed = 0
        for sock in idle:
            sock.settimeout(30)
            try:
                while sock.recv(1 << 10):
                    pass
                closed += 1
            except (TimeoutError, OSError):
                pass
        drops = shadow.status()["drops"]
        causes = {k: v for k, v in drops.items() if k.startswith("control_")}
    finally:
        for sock in idle:
            sock.close()
        shadow.close()
        for fd in filler:
            os.close(fd)
    comparisons = len(idle) + 5 + 2
    differed = (len(idle) - closed) + (5 - answered)
    reliability.compare(comparisons, differed)
    by_cause = ", ".join(f"{k} {v}" for k, v in sorted(causes.items()))
    assert differed == 0, (closed, answered, causes)
    assert sum(causes.values()) >= len(idle), causes
    reliability.record(
        area="bad input",
        case=case,
        target="shadow node (control port)",
        trials=len(idle),
        compared=compared,
        comparisons=comparisons,
        differed=differed,
        held=f"{closed}/{len(idle)} idle connections closed by the shadow ({by_cause}); {answered}/5 "
        "status requests answered and rank 0 joined twice meanwhile, all on descriptors > 1024",
    )


def _status_latency(node: ShadowNode) -> float:
    began = time.monotonic()
    with socket.create_connection(node.control_address, timeout=2) as conn:
        send_message(conn, StatusRequest(JOB), timeout=2)
        reply = recv_message(conn, timeout=2)
    assert isinstance(reply, StatusReport)
    return time.monotonic() - began


def test_oversized_and_slow_drip_control_messages_block_nobody(
    node: ShadowNode, reliability: Recorder
) -> None:
    case = (
        "oversized control frames (64 MiB JSON / 1 TiB blob announced) and slow-drip clients (1 byte a "
        "second) on a shadow's control port"
    )
    compared = (
        "per hostile connection: closed by the shadow within its I/O timeout (2 s) without an answer; per "
        "genuine status request sent meanwhile: answered within 1 s"
    )
    reliability.begin(area="bad input", case=case, target="shadow node (control port)", compared=compared)
    rank0 = join(node)
    comparisons = differed = 0
    # oversized: a head announcing a huge frame, with a made-up tag
    for i in range(TRIALS // 2):
        with socket.create_connection(node.control_address, timeout=2) as conn:
            head = PREFIX.pack(MAGIC, 64 << 20, (1 << 40) if i % 2 else 0)
            conn.sendall(head + os.urandom(HEAD_BYTES - PREFIX.size) + b"x" * 1024)
            got = _answer_bytes(conn) - _hello_bytes(node)
        comparisons += 1
        differed += got > 0
    # slow drip: clients that send one byte a second, all at once
    drips = 10
    closed_after: list[float] = []
    stop = threading.Event()

    def drip() -> None:
        with socket.create_connection(node.control_address, timeout=5) as conn:
            began = time.monotonic()
            conn.settimeout(1.0)
            for byte in MAGIC + bytes(200):
                try:
                    conn.sendall(bytes([byte]))
                    if conn.recv(1) == b"":  # waits up to 1 s: the drip's pace
                        break  # closed by the shadow
                except TimeoutError:
                    pass
                except OSError:
                    break
                if stop.is_set():
                    break
            closed_after.append(time.monotonic() - began)

    threads = [threading.Thread(target=drip, daemon=True) for _ in range(drips)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    latencies = [_status_latency(node) for _ in range(5)]
    time.sleep(0.5)
    latencies += [_status_latency(node) for _ in range(5)]
    for thread in threads:
        thread.join(10)
    stop.set()
    comparisons += len(latencies) + drips
    slow = sum(1 for t in latencies if t > 1.0)
    held_open = drips - sum(1 for t in closed_after if t < 2.0 + 1.5)  # I/O timeout + the drip's pace
    differed += slow + held_open
    reliability.compare(comparisons, differed)
    rank0.close()
    assert differed == 0, (latencies, closed_after)
    reliability.record(
        area="bad input",
        case=case,
        target="shadow node (control port)",
        trials=TRIALS // 2 + drips,
        compared=compared,
        comparisons=comparisons,
        differed=differed,
        held=f"{TRIALS // 2} oversized frames refused after their 60-byte head (nothing allocated, no "
        f"answer); {drips} slow-drip clients cut off after "
        f"{min(closed_after):.1f}-{max(closed_after):.1f} s; {len(latencies)} genuine status requests "
        f"meanwhile answered in at most {max(latencies) * 1000:.0f} ms",
    )


# ---- P4Runtime ---------------------------------------------------------------------------
def test_p4runtime_clients_without_the_right_certificate_get_no_session(
    tmp_path: Path, reliability: Recorder
) -> None:
    from checkmate.p4.program import P4INFO_PATH
    from checkmate.tls import TlsFiles, make_test_pki
    from controller.errors import SwitchUnreachableError
    from controller.switch_connection import SwitchConnection
    from embedded_switch.p4runtime_server import P4RuntimeServer

    case = (
        "P4Runtime clients without the right certificate against a switch serving mutual TLS: plaintext, "
        "no client certificate, another CA's client certificate, a client trusting another CA"
    )
    compared = "per connection attempt: a P4Runtime session (arbitration answered) or none"
    reliability.begin(
        area="bad input", case=case, target="switch (embedded P4Runtime server)", compared=compared
    )
    pki, other = make_test_pki(tmp_path / "pki"), make_test_pki(tmp_path / "other")
    server = P4RuntimeServer(
        1, "127.0.0.1:0", tls=TlsFiles(pki.ca, pki.server_cert, pki.server_key), client_auth=True
    )
    server.load_pipeline(P4INFO_PATH)
    address = f"127.0.0.1:{server.start()}"
    attempts = {
        "plaintext": None,
        "no client certificate": TlsFiles(pki.ca),
        "another CA's client certificate": TlsFiles(pki.ca, other.client_cert, other.client_key),
        "a client trusting another CA": TlsFiles(other.ca, pki.client_cert, pki.client_key),
    }
    comparisons = differed = 0
    try:
        for _ in range(2):
            for tls in attempts.values():
                comparisons += 1
                try:
                    SwitchConnection("s1", address, 1, timeout=1.0, tls=tls).close()
                    differed += 1  # let in
                except SwitchUnreachableError:
                    pass
        with SwitchConnection(
            "s1", address, 1, timeout=5, tls=TlsFiles(pki.ca, pki.client_cert, pki.client_key)
        ) as ok:
            genuine = ok.is_primary and bool(ok.get_p4info().tables)
    finally:
        server.stop()
    reliability.compare(comparisons, differed)
    assert genuine, "the controller with the right certificate got no session: the test proves nothing"
    assert differed == 0
    reliability.record(
        area="bad input",
        case=case,
        target="switch (embedded P4Runtime server)",
        trials=comparisons,
        compared=compared,
        comparisons=comparisons,
        differed=differed,
        held=f"{comparisons} attempts ({', '.join(attempts)}; twice each), each refused at the TLS handshake "
        "(SwitchUnreachableError naming the switch and its address); the controller with the test CA's "
        "certificate got a primary session and read the P4Info",
    )


def test_idle_p4runtime_streams_cannot_starve_real_calls(reliability: Recorder) -> None:
    import grpc
    from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc

    from checkmate.p4.program import P4INFO_PATH
    from embedded_switch.p4runtime_limits import StreamLimits
    from embedded_switch.p4runtime_server import P4RuntimeServer

    case = "60 idle P4Runtime StreamChannels (never a message) from one host, then a real Capabilities call"
    compared = (
        "per idle stream: refused (RESOURCE_EXHAUSTED) or cancelled as idle, counted; per real call made "
        "meanwhile: answered within 5 s"
    )
    reliability.begin(
        area="bad input", case=case, target="switch (embedded P4Runtime server)", compared=compared
    )
    limits = StreamLimits(first_message_timeout=2.0)
    server = P4RuntimeServer(1, "127.0.0.1:0", limits=limits)
    server.load_pipeline(P4INFO_PATH)
    address = f"127.0.0.1:{server.start()}"
    hold = threading.Event()

    def silence() -> Iterator[p4runtime_pb2.StreamMessageRequest]:
        hold.wait(60)
        return
        yield  # a generator that sends nothing

    idle = 60
    channel = grpc.insecure_channel(address)
    streams = [p4runtime_pb2_grpc.P4RuntimeStub(channel).StreamChannel(silence()) for _ in range(idle)]
    answered = 0
    try:
        time.sleep(1.0)  # the streams are open (or refused) before the real calls
        for _ in range(3):
            with grpc.insecure_channel(address) as real:
                try:
                    reply = p4runtime_pb2_grpc.P4RuntimeStub(real).Capabilities(
                        p4runtime_pb2.CapabilitiesRequest(), timeout=5
                    )
                    answered += bool(reply.p4runtime_api_version)
                except grpc.RpcError:
                    pass
        ended = 0
        for stream in streams:
            try:
                for _ in stream:
                    pass
            except grpc.RpcError as exc:
                ended += exc.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED)
        refusals = server.refusals
    finally:
        hold.set()
        channel.close()
        server.stop(grace=0)
    comparisons = idle + 3
    differed = (idle - ended) + (3 - answered)
    reliability.compare(comparisons, differed)
    assert differed == 0, (ended, answered, refusals)
    assert sum(refusals.values()) == idle, refusals
    reliability.record(
        area="bad input",
        case=case,
        target="switch (embedded P4Runtime server)",
        trials=idle,
        compared=compared,
        comparisons=comparisons,
        differed=differed,
        held=f"{ended}/{idle} idle streams ended by the switch "
        f"({', '.join(f'{k} {v}' for k, v in sorted(refusals.items()))}); {answered}/3 Capabilities "
        "calls answered meanwhile",
    )


def test_defaults_let_nobody_in(tmp_path: Path, reliability: Recorder) -> None:
    from checkmate.auth import AuthConfigError, read_secret_file
    from checkmate.metrics import DEFAULT_BIND
    from checkmate.tls import InsecureServerError, TlsFiles, make_test_pki
    from embedded_switch.cli import parse_config
    from embedded_switch.p4runtime_server import P4RuntimeServer
    from shadow.cli import _parser as shadow_parser
    from shadow.snapshots import SnapshotPolicy

    case = (
        "defaults: P4Runtime and metrics addresses, TLS without client certificates, plaintext off "
        "loopback, a group/world-readable secret file, the modes of a shadow's snapshot and status files"
    )
    compared = "per default: open to others (differed) or closed"
    reliability.begin(area="bad input", case=case, target="switch, shadow, job secret", compared=compared)
    pki = make_test_pki(tmp_path / "pki")
    checks: dict[str, bool] = {}  # name -> closed
    switch = parse_config(["--no-p4"])
    checks["P4Runtime address is loopback"] = switch.grpc_address.startswith("127.")
    checks["switch metrics address is loopback"] = switch.metrics_address == "127.0.0.1"
    shadow_args = shadow_parser().parse_args(["run", "--name", "s0"])
    checks["shadow metrics address is loopback"] = shadow_args.metrics_address == "127.0.0.1"
    checks["rank 0 metrics address is loopback"] = DEFAULT_BIND == "127.0.0.1"
    for name, argv in {
        "TLS without client certificates refused (CLI)": [
            "--no-p4", "--grpc-server-ssl", "--grpc-server-cert", str(pki.server_cert),
            "--grpc-server-key", str(pki.server_key),
        ],
        "plaintext on 0.0.0.0 refused (CLI)": ["--no-p4", "--grpc-server-addr", "0.0.0.0:9559"],
    }.items():  # fmt: skip
        try:
            parse_config(argv)
            checks[name] = False
        except SystemExit as exc:
            checks[name] = exc.code == 2
    try:
        P4RuntimeServer(1, "127.0.0.1:0", tls=TlsFiles(pki.ca, pki.server_cert, pki.server_key))
        checks["TLS without client certificates refused (server)"] = False
    except InsecureServerError:
        checks["TLS without client certificates refused (server)"] = True
    secret_file = tmp_path / "secret"
    secret_file.write_text("ab" * 32)
    for mode in (0o644, 0o640):
        os.chmod(secret_file, mode)
        try:
            read_secret_file(secret_file)
            checks[f"secret file mode {mode:04o} refused"] = False
        except AuthConfigError:
            checks[f"secret file mode {mode:04o} refused"] = True
    node = ShadowNode(
        ShadowConfig(
            name="s0",
            control_bind=(SHADOW_HOST, 0),
            data_bind=(SHADOW_HOST, 0),
            status_file=tmp_path / "status.json",
            snapshots=SnapshotPolicy(tmp_path / "snapshots", every_iterations=1),
            horizon=4,
            io_timeout=2.0,
            repair=RepairPolicy(grace=5.0),
        )
    ).start()
    try:
        rank0 = join(node)
        _genuine_iteration(node, rank0, 0)
        snapshotter = node.snapshotter
        assert snapshotter is not None
        assert wait_for(lambda: snapshotter.stats.written >= 1, 30), node.status()
        rank0.close()
    finally:
        node.close()
    loose = [
        f"{p.relative_to(tmp_path)} {stat.S_IMODE(p.stat().st_mode):04o}"
        for p in [tmp_path / "snapshots", *(tmp_path / "snapshots").rglob("*")]
        if stat.S_IMODE(p.stat().st_mode) & 0o077
    ]
    written = sum(1 for _ in (tmp_path / "snapshots").rglob("*"))
    checks[f"snapshot files and directories private ({written} written)"] = not loose and written > 0
    checks["status file private"] = stat.S_IMODE((tmp_path / "status.json").stat().st_mode) == 0o600
    comparisons = len(checks)
    differed = sum(not closed for closed in checks.values())
    reliability.compare(comparisons, differed)
    assert differed == 0, ({k: v for k, v in checks.items() if not v}, loose)
    reliability.record(
        area="bad input",
        case=case,
        target="switch, shadow, job secret",
        trials=comparisons,
        compared=compared,
        comparisons=comparisons,
        differed=differed,
        held="; ".join(checks),
    )


def test_spoofed_gradient_copies_are_never_applied_without_fingerprints(
    node: ShadowNode, reliability: Recorder
) -> None:
    """A steady injector: forged copies before the genuine ones, every iteration, fingerprints off.

    Each forged bucket fails rank 0's gradient tag, is thrown away and repaired from the
    worker's (authenticated) repair answers; the shadow never asks rank 0 for its state, so
    the injector slows the shadow by a repair round trip per iteration and changes nothing.
    """
    from checkmate.auth import GradientDigests
    from checkmate.tensors import tensor_payload
    from tests.shadow.test_node import FakeWorker

    case = (
        "gradient DATA injected from a job worker's host (an ordinary process there, no root) before the "
        "genuine copies of every iteration, with fingerprints off (CHECKMATE_FINGERPRINT_EVERY=0, the GPU "
        "default)"
    )
    compared = (
        "per iteration: applied or not, the shadow's parameters bit-equal to torch.optim.SGD on the "
        "genuine gradients; whether the shadow asked rank 0 for fresh state (a re-seed per forged "
        "iteration would let a steady injector keep the shadows re-seeding)"
    )
    reliability.begin(area="bad input", case=case, target="shadow node", compared=compared)
    tags = GradientDigests(secret_from_env(), JOB)  # rank 0's, over the genuine reduced bucket
    iterations = 6
    comparisons = differed = 0
    gate = threading.Event()
    worker = FakeWorker("127.0.0.60", nack=False, gate=gate)  # answers repairs with the genuine GRAD
    try:
        rank0 = join(node, [worker.address, worker.address])
        refused_before = _drops(node, "forged_gradient")
        resyncs_before = node.status()["resync_requests"]
        with worker_socket() as attacker, worker_socket() as member:
            for iteration in range(iterations):
                forged = GRAD * (iteration + 3)
                for data in (datagram(iteration, 0, forged[:8]), datagram(iteration, 8, forged[8:])):
                    attacker.sendto(data, node.data_address)
                tags.record(iteration, 0, tensor_payload(GRAD.contiguous()))
                rank0.send(Commit(JOB, iteration, [0.1], gradient_digests=tags.take(iteration)))
                # The genuine copies arrive after the commit's verdict on the forged bucket and
                # before its repair is answered (the worker holds its answer until then): timing
                # alone let them reach the full bucket first on a loaded machine (duplicates), or
                # arrive after the repaired iteration was applied (stale).
                refused_now = refused_before + iteration + 1
                assert wait_for(lambda n=refused_now: _drops(node, "forged_gradient") >= n, 10.0)
                assert wait_for(lambda n=iteration: len(worker.requests) > n, 10.0), worker.requests
                for data in (datagram(iteration, 0, GRAD[:8]), datagram(iteration, 8, GRAD[8:])):
                    member.sendto(data, node.data_address)
                assert wait_for(lambda n=iteration: _drops(node, "copy_of_refused_bucket") >= 2 * (n + 1))
                gate.set()
                applied = node.wait_applied(iteration, 10)
                gate.clear()
                comparisons += 1
                differed += int(not applied) + (_state_differs(node, iteration + 1) if applied else 0)
        status = node.status()
        refused = _drops(node, "forged_gradient") - refused_before
        resyncs = status["resync_requests"] - resyncs_before
        comparisons += 1
        differed += int(resyncs != 0)
        rank0.close()
    finally:
        worker.close()
    reliability.compare(comparisons, differed)
    assert differed == 0, status
    assert refused == iterations, status["drops"]
    assert status["repairs"]["elements_repaired"] >= 10 * iterations, status["repairs"]
    assert status["drops"].get("copy_of_refused_bucket", 0) == 2 * iterations, status["drops"]
    reliability.record(
        area="bad input",
        case=case,
        target="shadow node",
        trials=iterations,
        compared=compared,
        comparisons=comparisons,
        differed=differed,
        held=f"{refused}/{iterations} forged iterations refused before the apply (forged_gradient: the "
        "bucket's GMAC tag in rank 0's commit did not match); each bucket repaired from the worker "
        f"({status['repairs']['elements_repaired']} elements) and then applied bit-equal to "
        f"torch.optim.SGD; {resyncs} requests for fresh state (before: one re-seed per forged "
        "iteration); never a forged value applied",
    )


@pytest.mark.parametrize("datapath", ["native", "python"])
def test_ring_data_under_a_workers_address_is_dropped_by_the_switch(
    tmp_path: Path, reliability: Recorder, datapath: str
) -> None:
    """Issue 29's ring injection (84 datagrams: loss 1.9e9, the job hung), through the switch.

    Workers accept ring DATA from their peer's exact address and port without a MAC, so the
    defence is the switch's source check (``check_source``, installed by the controller from
    the routes): a Checkmate packet from a known host's address is accepted only on the port
    that host is on. Every other host of topologies/single.json forges worker h1's address and
    port toward its ring successor h2 (job 7), tagged and untagged DATA and an ACK/NACK each;
    the same datagrams from h1's own port, and the forgeries with the check removed (today's
    main before the check), show that the count would see a datagram that got through.
    """
    import random

    from checkmate.wire import Flags
    from embedded_switch.native import NativePipeline
    from embedded_switch.pipeline import DropReason
    from tests.reliability.fuzz_frames import checkmate_datagram, frame
    from tests.reliability.fuzz_switch import JOB_A, programmed_switch

    spoofed_count = 3000
    case = (
        "ring DATA injected under a worker's exact source address and port (a raw socket on any other "
        f"host of the fabric, to that worker's ring successor), through the switch ({datapath} data path)"
    )
    target = f"switch (embedded pipeline, {datapath} data path, programmed by the controller)"
    compared = (
        "per datagram: whether it reached the victim worker's port (or any port); the switch's "
        "ingress_drops[SPOOFED_SOURCE] against the number sent; the same datagrams from the real "
        "peer's port, and the forgeries with check_source emptied, all reach the victim"
    )
    reliability.begin(area="bad input", case=case, target=target, compared=compared, trials=spoofed_count)
    rng = random.Random(29)
    with programmed_switch(tmp_path, datapath) as sw:
        if datapath == "native" and not isinstance(sw.pipeline, NativePipeline):
            pytest.skip("embedded_switch.native._datapath is not built")
        peer, victim = "h1", JOB_A.ring_next("h1")
        liars = [h for h in sorted(sw.network.hosts) if h != peer]
        kinds = (
            (Flags.NONE, MessageType.DATA),
            (Flags.LAST, MessageType.DATA),
            (Flags.REPLICATE, MessageType.DATA),
            (Flags.NONE, MessageType.ACK),
            (Flags.NONE, MessageType.NACK),
        )
        forged: list[tuple[int, bytes]] = []
        for i in range(spoofed_count):
            liar = liars[i % len(liars)]
            flags, msg = kinds[(i // len(liars)) % len(kinds)]
            if msg is MessageType.DATA:
                datagram = checkmate_datagram(rng, JOB_A.job_id, i % 2, flags=flags)
            else:  # a cumulative ACK or a NACK (no payload), as the peer would send it
                datagram = CheckmateHeader(msg, JOB_A.job_id, 0, 0, 0, 0, 0, i, DType.NONE).pack()
            data = frame(
                sw.host_mac(liar), sw.switch_mac(liar), sw.host_ip(peer), sw.host_ip(victim), datagram
            )
            forged.append((sw.host_port(liar), data))
        victim_port = sw.host_port(victim)
        drops = sw.state.counter("ingress_drops")

        def run(frames: list[tuple[int, bytes]], port: int | None = None) -> tuple[int, int]:
            """Frames in; (reaching the victim's port, leaving by any port)."""
            to_victim = out = 0
            for in_port, data in frames:
                for out_port, _ in sw.pipeline.process(data, in_port if port is None else port):
                    out += 1
                    to_victim += out_port == victim_port
            return to_victim, out

        entries = len(sw.state.table("check_source"))
        before = drops.read(DropReason.SPOOFED_SOURCE)[0]
        reached, left = run(forged)
        counted = drops.read(DropReason.SPOOFED_SOURCE)[0] - before
        genuine, _ = run(forged, sw.host_port(peer))  # the same datagrams from the real peer's port
        with sw.state.write_lock:
            sw.state.table("check_source").clear()
        unchecked, _ = run(forged)  # without the check: what got in before it
        differed = reached + left + int(counted != spoofed_count)
        comparisons = spoofed_count + 1
        reliability.compare(comparisons, differed)
    assert entries == len(sw.network.hosts)
    assert genuine == spoofed_count and unchecked == spoofed_count  # the count sees what gets through
    assert differed == 0, (reached, left, counted)
    reliability.record(
        area="bad input",
        case=case,
        target=target,
        trials=spoofed_count,
        compared=compared,
        comparisons=comparisons,
        differed=differed,
        held=f"{reached}/{spoofed_count} forged datagrams reached the victim ({left} left by any port); "
        f"{counted} counted in ingress_drops[SPOOFED_SOURCE], from {len(liars)} other hosts' ports "
        f"(untagged, LAST and tagged DATA, ACK, NACK); check_source held {entries} entries, one per host, "
        f"installed by the controller with the routes. Controls: the same datagrams from the real peer's "
        f"port {genuine}/{spoofed_count} delivered; with check_source emptied {unchecked}/{spoofed_count} "
        "forgeries reached the victim (what issue 29's injection did)",
    )
