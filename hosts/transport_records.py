"""The transport's records: its configuration, flows, jobs and errors (no behaviour, no thread).

What every layer of :class:`hosts.transport.Transport` names (:mod:`hosts.transport_io`,
:mod:`hosts.transport_flow`, :mod:`hosts.transport_native`, :mod:`hosts.transport`), kept
below them all so that none of them imports another upward: :class:`TransportConfig` (and
:func:`datapath_from_env` for the entry points that read ``CHECKMATE_TRANSPORT``), the flow
records (:class:`SendFlow`, :class:`RecvFlow`, :class:`Outstanding`), the job record
(:class:`Job`), the handlers' types and the errors a flow raises (:class:`PeerTimeoutError`,
:class:`TransportClosedError`). :mod:`hosts.transport` and :mod:`hosts.transport_flow`
re-export them, where they lived before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from checkmate.auth import DatagramAuth
from checkmate.network import Addr
from checkmate.wire import CHECKMATE_UDP_PORT, CheckmateHeader
from hosts.faults import FaultConfig

DataHandler = Callable[[CheckmateHeader, memoryview, Addr], None]
DataFieldsHandler = Callable[[tuple[int, ...], memoryview, Addr], None]
"""A DATA handler taking the header as :func:`checkmate.wire.decode_data`'s ints (no header object)."""
FailureHandler = Callable[["PeerTimeoutError"], None]


class PeerTimeoutError(TimeoutError):
    """A peer stopped answering: nothing acknowledged (or received) within the timeout."""

    def __init__(self, peer: Addr, job_id: int, rank: int | None, detail: str) -> None:
        self.peer = peer
        self.job_id = job_id
        self.rank = rank
        who = f"rank {rank} at {peer[0]}:{peer[1]}" if rank is not None else f"{peer[0]}:{peer[1]}"
        super().__init__(f"job {job_id}: peer {who} is not responding: {detail}")


class TransportClosedError(RuntimeError):
    """The transport was closed while an operation needed it."""


@dataclass(slots=True)
class Outstanding:
    """One DATA datagram sent (or queued) and not yet acknowledged."""

    seq: int
    header_bytes: bytearray
    """The bytes sent: ``header`` packed with ``seq`` (and RETRANSMIT once resent)."""
    payload: memoryview
    first_sent: float = 0.0
    last_sent: float = 0.0
    retransmits: int = 0


@dataclass
class SendFlow:
    """This side's sending half of one flow: window, RTT estimate, what is outstanding."""

    peer: Addr
    job_id: int
    peer_rank: int | None
    rto: float
    peer_window: int
    next_seq: int = 0
    cum_acked: int = 0
    unacked: dict[int, Outstanding] = field(default_factory=dict)
    """Ordered by last transmission time (a retransmitted entry moves to the end)."""
    pending: deque[Outstanding] = field(default_factory=deque)
    srtt: float | None = None
    rttvar: float = 0.0
    backoff: float = 1.0
    last_progress: float = 0.0
    failed: PeerTimeoutError | None = None


@dataclass
class RecvFlow:
    """This side's receiving half of one flow: what arrived, and what is owed an ACK or NACK."""

    peer: Addr
    job_id: int
    cum: int = 0
    ooo: set[int] = field(default_factory=set)
    since_ack: int = 0
    ack_due: bool = False
    gap_since: float = 0.0
    last_nack: float = 0.0


@dataclass
class Job:
    """A job registered with the transport: its peers, handlers and datagram key."""

    job_id: int
    rank: int
    peers: dict[int, Addr]
    by_addr: dict[Addr, int]
    on_data: DataHandler
    on_request: DataHandler | None
    on_failure: FailureHandler | None
    auth: DatagramAuth | None = None
    on_data_fields: DataFieldsHandler | None = None


@dataclass(frozen=True)
class TransportConfig:
    """Everything a transport needs; the defaults suit jumbo datagrams on one host or a LAN."""

    bind: Addr = ("127.0.0.1", CHECKMATE_UDP_PORT)
    window: int = 1024
    """Most unacknowledged datagrams per flow (also the window this side advertises)."""
    rcvbuf_bytes: int = 64 << 20
    sndbuf_bytes: int = 16 << 20
    initial_rto: float = 0.1
    min_rto: float = 0.2
    """Python receivers queue datagrams for milliseconds, and a loaded machine deschedules them for
    tens; losses are mostly repaired by SACK/NACK first, the RTO is for a silent peer or a lost tail."""
    max_rto: float = 0.5
    peer_timeout: float = 10.0
    """Seconds without any acknowledgement from a peer with data outstanding before it is declared dead."""
    ack_every: int = 32
    """Acknowledge at once after this many new datagrams; otherwise at the end of each receive burst."""
    dupthresh: int = 3
    """A datagram this far below the highest SACKed one is presumed lost and resent."""
    nack_delay: float = 0.004
    """How long a gap must persist before the receiver NACKs it."""
    nack_interval: float = 0.02
    """Least time between two NACKs of one flow."""
    timer_tick: float = 0.002
    """Deadlines closer than this are served in one wake-up (the timer sleeps until the next
    deadline, and while nothing is outstanding until woken), and the hold time of a reordered
    datagram."""
    max_reorder: int = 1 << 16
    """Datagrams further than this beyond the cumulative sequence are dropped (bounded memory)."""
    send_block_timeout: float = 0.5
    """Longest wait for socket buffer space before a datagram is counted as dropped."""
    gso: bool = True
    """Send batched runs of equal-sized DATA datagrams as one UDP GSO write where the route allows it."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    datapath: str = "native"
    """``"native"``: the compiled data path (:mod:`hosts.transport_native`) where it built, else the
    Python one with a warning; ``"python"``: the Python data path, the reference implementation.
    Entry points map ``CHECKMATE_TRANSPORT=python|native`` to it (:func:`datapath_from_env`)."""
    secret: bytes | None = field(default=None, repr=False)
    """The job secret the entry point read (its control datagrams' keys, :mod:`checkmate.auth`):
    :meth:`Transport.add_job` uses it for a job added without one of its own. None: each job's
    own, or this process's from the environment (:func:`checkmate.auth.secret_or_env`)."""

    def __post_init__(self) -> None:
        if self.datapath not in DATAPATHS:
            raise ValueError(f"datapath={self.datapath!r} is not one of {DATAPATHS}")


DATAPATHS = ("native", "python")
TRANSPORT_ENV = "CHECKMATE_TRANSPORT"


def datapath_from_env(environ: Mapping[str, str]) -> str:
    """``CHECKMATE_TRANSPORT`` (``native`` or ``python``; unset: ``native``) in the environment an entry
    point read (``CheckmateConfig.from_env``, the backend's creator) and passes here."""
    value = environ.get(TRANSPORT_ENV, "").strip().lower() or "native"
    if value not in DATAPATHS:
        raise ValueError(f"{TRANSPORT_ENV}={value!r}: expected one of {DATAPATHS}")
    return value
