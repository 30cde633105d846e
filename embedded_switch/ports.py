"""The switch's ports: network interfaces bound with AF_PACKET, and the I/O loop.

Each port number (``-i PORT@IFACE``) owns one raw ``AF_PACKET`` socket on its
interface: promiscuous, receiving every frame that arrives and none that the
switch itself sends (``PACKET_IGNORE_OUTGOING``). One I/O thread waits on all
sockets with epoll, drains up to ``batch`` frames from a ready port into
preallocated buffers, runs them through the :class:`Pipeline` and sends what
comes out. Frames up to :data:`MAX_FRAME_BYTES` (MTU 9000 jumbo frames plus
Ethernet and VLAN headers) pass whole.

Two data paths do this (``PortsConfig.datapath``, ``checkmate-switch --datapath``):
``python``, the reference loop below (one ``recv_into`` and one ``send`` per frame),
and ``native`` (:mod:`embedded_switch.native`): the same loop in C with ``recvmmsg``
and ``sendmmsg`` per batch and the pipeline's cached flows compiled; frames to the
CPU port, to fault-injected or missing ports, packet-outs and port errors still come
back here. ``native`` falls back to ``python`` (one warning) when the extension is not
built, and pcap capture (``pcap_dir``) always runs the Python path.

Nothing is dropped silently: frames received while no pipeline is loaded,
sent to a port without an interface, refused by the kernel, truncated, or
dropped on purpose by fault injection are counted in the pipeline's
:class:`DropStats` under their own reasons, with the port; so are, once a
second, the frames the kernel dropped because the switch's receive queue was
full (``PACKET_STATISTICS``) and those an interface dropped on transmit.

Fault injection (``--drop-egress PORT:FRACTION``, ``--drop-seed N``): each
listed port drops that fraction of the frames leaving it, decided by a random
generator seeded from (seed, port) so a run is reproducible.

Optional pcap capture writes ``<iface>_in.pcap`` and ``<iface>_out.pcap`` per
port (as ``simple_switch --pcap`` does), flushed whenever the loop is idle.

Packets the pipeline sends to the CPU port go to ``on_packet_in``; frames the
controller sends (packet-out) enter through :meth:`SwitchPorts.inject`.
"""

from __future__ import annotations

import cProfile
import errno
import logging
import os
import random
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from embedded_switch import native
from embedded_switch.pipeline import Buffer, DropReason, DropStats, Pipeline
from embedded_switch.state import SwitchState

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = 9000 + 14 + 4
"""Largest frame a port carries: a 9000-byte jumbo IP packet, Ethernet and one VLAN tag."""
_RX_BUFFER_BYTES = 9216  # room above MAX_FRAME_BYTES: a larger frame shows as truncated
MAX_PORT = 510
"""Highest port number; 511 is v1model's drop port."""

# <linux/if_packet.h>, <asm/socket.h>
SOL_PACKET = 263
PACKET_ADD_MEMBERSHIP = 1
PACKET_MR_PROMISC = 1
PACKET_IGNORE_OUTGOING = 23
PACKET_OUTGOING = 4
PACKET_STATISTICS = 6
ETH_P_ALL = 0x0003
SO_SNDBUFFORCE = 32
SO_RCVBUFFORCE = 33
_SOCKET_BUFFER_BYTES = 32 << 20
_KERNEL_STATS_INTERVAL_S = 1.0
_SEND_TIMEOUT_S = 0.5

_PCAP_GLOBAL = struct.Struct("<IHHiIII")
_PCAP_RECORD = struct.Struct("<IIII")


class PortError(ValueError):
    """A port binding that cannot be made; the message names the port and interface."""


@dataclass(frozen=True)
class PortBinding:
    port: int
    iface: str


@dataclass(frozen=True)
class PortsConfig:
    """What the I/O layer needs to know besides the pipeline."""

    bindings: tuple[PortBinding, ...]
    cpu_port: int | None = None
    pcap_dir: Path | None = None
    drop_egress: Mapping[int, float] = field(default_factory=dict)
    """Port -> fraction of frames leaving it to drop (fault injection)."""
    drop_seed: int = 0
    batch: int = 64
    """Frames taken from one port before the loop looks at the others."""
    profile_path: Path | None = None
    """Write cProfile statistics of the I/O thread here when it stops (a development aid)."""
    datapath: str = native.DATAPATHS[0]
    """``native`` (C, when built) or ``python`` (the reference); see the module docstring."""


@dataclass
class PortStats:
    rx_packets: int = 0
    rx_bytes: int = 0
    tx_packets: int = 0
    tx_bytes: int = 0


class PcapWriter:
    """A minimal libpcap file writer (Ethernet link type, microsecond timestamps)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO = open(path, "wb")  # closed in close()
        self._file.write(_PCAP_GLOBAL.pack(0xA1B2C3D4, 2, 4, 0, 0, 65535, 1))

    def write(self, frame: Buffer, timestamp: float) -> None:
        sec = int(timestamp)
        self._file.write(_PCAP_RECORD.pack(sec, int((timestamp - sec) * 1e6), len(frame), len(frame)))
        self._file.write(frame)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class PacketPort:
    """One switch port: a raw AF_PACKET socket on one interface."""

    def __init__(self, binding: PortBinding, pcap_dir: Path | None = None, batch: int = 64) -> None:
        self.port = binding.port
        self.iface = binding.iface
        self.stats = PortStats()
        try:
            ifindex = socket.if_nametoindex(binding.iface)
        except OSError:
            raise PortError(f"port {binding.port}: no interface named {binding.iface!r}") from None
        try:
            # Protocol 0 until bound: receive nothing from other interfaces in between.
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        except OSError as exc:
            raise PortError(
                f"port {binding.port}: cannot open a raw socket for {binding.iface!r} "
                f"(needs root or CAP_NET_RAW): {exc}"
            ) from exc
        try:
            self.sock.bind((binding.iface, ETH_P_ALL))
            mreq = struct.pack("iHH8s", ifindex, PACKET_MR_PROMISC, 0, b"")
            self.sock.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP, mreq)
            self.sees_outgoing = False
            try:
                self.sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
            except OSError:
                self.sees_outgoing = True  # kernel < 4.20: filter by packet type on receive
            for force, plain in ((SO_RCVBUFFORCE, socket.SO_RCVBUF), (SO_SNDBUFFORCE, socket.SO_SNDBUF)):
                try:
                    self.sock.setsockopt(socket.SOL_SOCKET, force, _SOCKET_BUFFER_BYTES)
                except OSError:
                    self.sock.setsockopt(socket.SOL_SOCKET, plain, _SOCKET_BUFFER_BYTES)
            # Sends block at most this long (kernel-side timeout; the Python socket stays blocking
            # so that receives with MSG_DONTWAIT cost one system call each).
            seconds = int(_SEND_TIMEOUT_S)
            micros = int((_SEND_TIMEOUT_S - seconds) * 1e6)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, micros))
        except OSError as exc:
            self.sock.close()
            raise PortError(f"port {binding.port}: cannot bind {binding.iface!r}: {exc}") from exc
        self.buffers = [memoryview(bytearray(_RX_BUFFER_BYTES)) for _ in range(batch)]
        self.pcap_in: PcapWriter | None = None
        self.pcap_out: PcapWriter | None = None
        if pcap_dir is not None:
            self.pcap_in = PcapWriter(pcap_dir / f"{binding.iface}_in.pcap")
            self.pcap_out = PcapWriter(pcap_dir / f"{binding.iface}_out.pcap")
        self.drop_fraction = 0.0
        self.rng = random.Random(0)

        self._tx_dropped_path = Path(f"/sys/class/net/{binding.iface}/statistics/tx_dropped")
        self._tx_dropped = self._read_tx_dropped()

    def _read_tx_dropped(self) -> int:
        try:
            return int(self._tx_dropped_path.read_text())
        except (OSError, ValueError):
            return 0

    def kernel_drops(self) -> tuple[int, int]:
        """Frames the kernel dropped since the last call: (receive queue full, interface TX drops)."""
        try:
            _packets, rx_drops = struct.unpack("II", self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
        except OSError:
            rx_drops = 0
        tx_dropped = self._read_tx_dropped()
        tx_drops, self._tx_dropped = max(0, tx_dropped - self._tx_dropped), tx_dropped
        return rx_drops, tx_drops

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()
        for writer in (self.pcap_in, self.pcap_out):
            if writer is not None:
                writer.close()


PacketInCallback = Callable[[bytes, int], None]


class SwitchPorts:
    """All ports, the I/O thread, and the pipeline they feed."""

    def __init__(
        self,
        config: PortsConfig,
        state: SwitchState | None = None,
        drops: DropStats | None = None,
        on_packet_in: PacketInCallback | None = None,
    ) -> None:
        self.config = config
        self.drops = drops if drops is not None else DropStats()
        self.on_packet_in = on_packet_in
        self.datapath = native.resolve_datapath(config.datapath)
        """The data path that runs: ``native`` or ``python``."""
        if self.datapath == "native" and config.pcap_dir is not None:
            logger.info("pcap capture runs on the Python data path")
            self.datapath = "python"
        self._pipeline: Pipeline | None = self._make_pipeline(state)
        if config.pcap_dir is not None:
            config.pcap_dir.mkdir(parents=True, exist_ok=True)
        self.ports: dict[int, PacketPort] = {}
        try:
            for binding in config.bindings:
                if binding.port in self.ports:
                    raise PortError(f"port {binding.port} is bound twice")
                self.ports[binding.port] = PacketPort(binding, config.pcap_dir, config.batch)
        except Exception:
            for p in self.ports.values():
                p.close()
            raise
        for port, fraction in config.drop_egress.items():
            if port not in self.ports:
                raise PortError(f"--drop-egress names port {port}, which no interface is bound to")
            self.ports[port].drop_fraction = fraction
            self.ports[port].rng = random.Random(f"{config.drop_seed}:{port}")
        self._by_fd = {p.fileno(): p for p in self.ports.values()}
        self._plain_ports = {
            n: p for n, p in self.ports.items() if not p.drop_fraction and p.pcap_out is None
        }
        """Ports whose frames just go out: no fault injection, no capture."""
        self._injected: deque[tuple[bytes, int]] = deque()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- control --------------------------------------------------------------------------------
    def _make_pipeline(self, state: SwitchState | None) -> Pipeline | None:
        if state is None:
            return None
        return native.make_pipeline(self.datapath, state, self.drops)

    def set_state(self, state: SwitchState | None) -> None:
        """Run the pipeline over ``state`` from the next packet on (None: drop everything)."""
        # A new Pipeline object, swapped in whole: the I/O thread reads the reference once per batch.
        self._pipeline = self._make_pipeline(state)
        logger.info("pipeline %s", "loaded" if state is not None else "removed")

    def inject(self, frame: bytes, port: int) -> None:
        """A packet-out: thread-safe; handled by the I/O thread.

        For ``port == cpu_port`` the frame enters the pipeline as if received on the
        CPU port (what BMv2 does with a packet-out when the program declares no
        packet_out header, as ours does not). Any other port is an egress port chosen
        by packet_out metadata: the frame is sent out of it unchanged.
        """
        self._injected.append((bytes(frame), port))
        os.eventfd_write(self._wake_fd, 1)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="switch-io", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        os.eventfd_write(self._wake_fd, 1)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("I/O thread did not stop within %.1f s", timeout)
        for p in self.ports.values():
            p.close()
        os.close(self._wake_fd)

    def port_stats(self) -> dict[int, PortStats]:
        return {n: p.stats for n, p in self.ports.items()}

    def describe(self) -> str:
        parts = []
        for n, p in sorted(self.ports.items()):
            s = p.stats
            parts.append(f"{n}@{p.iface} rx={s.rx_packets}/{s.rx_bytes}B tx={s.tx_packets}/{s.tx_bytes}B")
        return "; ".join(parts) + f"; drops: {self.drops.describe()}"

    # ---- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        logger.info("data path: %s", self.datapath)
        loop = self._loop if self.datapath == "python" else self._loop_native
        if self.config.profile_path is None:
            loop()
            return
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            loop()
        finally:
            profiler.disable()
            profiler.dump_stats(self.config.profile_path)
            logger.info("I/O thread profile written to %s", self.config.profile_path)

    def _loop(self) -> None:
        poller = select.epoll()
        poller.register(self._wake_fd, select.EPOLLIN)
        for fd in self._by_fd:
            poller.register(fd, select.EPOLLIN)
        next_stats = time.monotonic() + _KERNEL_STATS_INTERVAL_S
        try:
            while not self._stop.is_set():
                events = poller.poll(0.25)
                if not events:
                    self._flush_pcaps()
                if time.monotonic() >= next_stats:
                    self._collect_kernel_drops()
                    next_stats = time.monotonic() + _KERNEL_STATS_INTERVAL_S
                for fd, mask in events:
                    if fd == self._wake_fd:
                        self._drain_injected()
                        continue
                    port = self._by_fd[fd]
                    if mask & (select.EPOLLERR | select.EPOLLHUP):
                        logger.error("port %d (%s): interface error, port disabled", port.port, port.iface)
                        poller.unregister(fd)
                        continue
                    self._receive(port)
        except Exception:
            logger.exception("I/O loop failed")
            raise
        finally:
            poller.close()
            self._flush_pcaps()
            self._collect_kernel_drops()

    def _loop_native(self) -> None:
        """The loop of :meth:`_loop` with receiving, cached flows and sending in C (``PortIO.poll``,
        which reads ``self._pipeline`` once per ready port, as :meth:`_receive` does)."""
        io = native.extension().PortIO(
            [
                (p.port, p.fileno(), p.sees_outgoing, n in self._plain_ports, p.stats)
                for n, p in self.ports.items()
            ],
            self._wake_fd,
            self,
            self.drops,
            (DropReason.RX_TRUNCATED, DropReason.NO_PIPELINE, DropReason.TX_ERROR),
            self.config.batch,
            _RX_BUFFER_BYTES,
        )
        next_stats = time.monotonic() + _KERNEL_STATS_INTERVAL_S
        try:
            while not self._stop.is_set():
                woken, specials, errors = io.poll(250)
                for egress_port, frame, ingress_port in specials:
                    self._transmit_special(egress_port, frame, ingress_port)
                for port_number, code, what in errors:
                    port = self.ports[port_number]
                    if what == "interface":
                        logger.error("port %d (%s): interface error, port disabled", port.port, port.iface)
                    elif what == "receive":
                        logger.warning("port %d (%s): %s", port.port, port.iface, os.strerror(code))
                    else:
                        logger.debug(
                            "port %d (%s): send failed: %s", port.port, port.iface, os.strerror(code)
                        )
                if woken:
                    self._drain_injected()
                if time.monotonic() >= next_stats:
                    self._collect_kernel_drops()
                    next_stats = time.monotonic() + _KERNEL_STATS_INTERVAL_S
        except Exception:
            logger.exception("I/O loop failed")
            raise
        finally:
            io.close()
            self._collect_kernel_drops()
            pipeline = self._pipeline
            flows = pipeline.flow_stats() if isinstance(pipeline, native.NativePipeline) else {}
            logger.info("native data path: %s; flow cache: %s", io.stats(), flows)

    def _collect_kernel_drops(self) -> None:
        for p in self.ports.values():
            rx_drops, tx_drops = p.kernel_drops()
            if rx_drops:
                self.drops.count(DropReason.KERNEL_RX_OVERFLOW, p.port, rx_drops)
            if tx_drops:
                self.drops.count(DropReason.KERNEL_TX_DROPPED, p.port, tx_drops)

    def _drain_injected(self) -> None:
        try:
            os.eventfd_read(self._wake_fd)
        except BlockingIOError:
            pass
        cpu_port = self.config.cpu_port
        while self._injected:
            frame, port = self._injected.popleft()
            if port != cpu_port:
                self._transmit([(port, bytearray(frame))], port)
                continue
            pipeline = self._pipeline
            if pipeline is None:
                self.drops.count(DropReason.NO_PIPELINE, port)
                continue
            self._transmit(pipeline.process(frame, port), port)

    def _receive(self, port: PacketPort) -> None:
        frames: list[memoryview] = []
        nbytes = 0
        flags = socket.MSG_DONTWAIT | socket.MSG_TRUNC
        recv_into = port.sock.recv_into
        recvfrom_into = port.sock.recvfrom_into
        sees_outgoing = port.sees_outgoing
        for view in port.buffers:
            try:
                if sees_outgoing:
                    n, address = recvfrom_into(view, 0, flags)
                    if address[2] == PACKET_OUTGOING:
                        continue
                else:
                    n = recv_into(view, 0, flags)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in (errno.ENETDOWN, errno.ENXIO):
                    logger.warning("port %d (%s): %s", port.port, port.iface, exc)
                    break
                raise
            if n > _RX_BUFFER_BYTES:
                self.drops.count(DropReason.RX_TRUNCATED, port.port)
                continue
            frames.append(view[:n])
            nbytes += n
        if not frames:
            return
        stats = port.stats
        stats.rx_packets += len(frames)
        stats.rx_bytes += nbytes
        if port.pcap_in is not None:
            now = time.time()
            for frame in frames:
                port.pcap_in.write(frame, now)
        pipeline = self._pipeline
        if pipeline is None:
            self.drops.count(DropReason.NO_PIPELINE, port.port, len(frames))
            return
        self._transmit(pipeline.process_batch(frames, port.port), port.port)

    def _transmit(self, outputs: list[tuple[int, bytearray]], ingress_port: int) -> None:
        plain = self._plain_ports
        for egress_port, frame in outputs:
            port = plain.get(egress_port)
            if port is None:  # no such port, the CPU port, fault injection or pcap: the long way
                self._transmit_special(egress_port, frame, ingress_port)
                continue
            try:
                port.sock.send(frame)
            except OSError as exc:
                self.drops.count(DropReason.TX_ERROR, egress_port)
                logger.debug("port %d (%s): send failed: %s", egress_port, port.iface, exc)
                continue
            stats = port.stats
            stats.tx_packets += 1
            stats.tx_bytes += len(frame)

    def _transmit_special(self, egress_port: int, frame: bytearray, ingress_port: int) -> None:
        port = self.ports.get(egress_port)
        if port is None:
            if egress_port == self.config.cpu_port and self.on_packet_in is not None:
                self.on_packet_in(bytes(frame), ingress_port)
            else:
                self.drops.count(DropReason.NO_SUCH_PORT, egress_port)
            return
        if port.drop_fraction and port.rng.random() < port.drop_fraction:
            self.drops.count(DropReason.FAULT_INJECTION, egress_port)
            return
        try:
            port.sock.send(frame)
        except OSError as exc:
            self.drops.count(DropReason.TX_ERROR, egress_port)
            logger.debug("port %d (%s): send failed: %s", egress_port, port.iface, exc)
            return
        port.stats.tx_packets += 1
        port.stats.tx_bytes += len(frame)
        if port.pcap_out is not None:
            port.pcap_out.write(frame, time.time())

    def _flush_pcaps(self) -> None:
        for p in self.ports.values():
            for writer in (p.pcap_in, p.pcap_out):
                if writer is not None:
                    writer.flush()
