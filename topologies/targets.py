"""Switch targets: which binary runs a switch, and its command line.

Both targets take ``simple_switch_grpc``'s command-line shape, so one
:class:`SwitchProcessConfig` describes a switch for either: ports as ``-i N@IFACE``,
``--device-id``, the P4Runtime address, an optional CPU port, a log and a pcap
folder. The only difference is that BMv2 reads its gRPC options after ``--``
(they belong to the ``simple_switch_grpc`` target, not the BMv2 core), and
``checkmate-switch`` accepts and ignores that ``--``: the command line is the
same for both, only the binary differs.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from checkmate.p4.program import BMV2_JSON_PATH, P4INFO_PATH, Target

logger = logging.getLogger(__name__)

BINARIES: dict[Target, str] = {Target.EMBEDDED: "checkmate-switch", Target.BMV2: "simple_switch_grpc"}
"""The switch program of each target a network can run (a Tofino cannot be emulated)."""


class TargetError(RuntimeError):
    """A target that cannot run here; the message says what is missing and how to get it."""


def find_tool(name: str, search_path: str | None = None) -> str | None:
    """``name`` on PATH, else next to this Python (``.venv/bin`` when PATH lacks it)."""
    found = shutil.which(name, path=search_path)
    if found is not None:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def find_binary(target: Target, search_path: str | None = None) -> str:
    """The absolute path of the target's binary, or TargetError naming what to install."""
    if target not in BINARIES:
        raise TargetError(
            f"--target {target.value}: an emulated network runs checkmate-switch (embedded) or "
            "simple_switch_grpc (bmv2) only"
        )
    found = find_tool(BINARIES[target], search_path)
    if found is not None:
        return found
    if target is Target.BMV2:
        raise TargetError(
            "--target bmv2: simple_switch_grpc is not on PATH. Build BMv2 with its gRPC server "
            "from p4lang/behavioral-model (it is not packaged for Debian 12), or use --target embedded"
        )
    raise TargetError(
        "checkmate-switch is not installed: run `make setup`, which installs the project into .venv"
    )


def pipeline_files(target: Target) -> tuple[Path, Path | None]:
    """P4Info and (for BMv2) the compiled JSON the controller pushes; TargetError if missing."""
    if not P4INFO_PATH.is_file():
        raise TargetError(f"the P4Info {P4INFO_PATH} is missing (package data of checkmate.p4.p4src)")
    if target is Target.BMV2:
        if not BMV2_JSON_PATH.is_file():
            raise TargetError(f"--target bmv2 needs the compiled program {BMV2_JSON_PATH}: run `make p4`")
        return P4INFO_PATH, BMV2_JSON_PATH
    return P4INFO_PATH, None


@dataclass(frozen=True)
class SwitchProcessConfig:
    """Everything needed to start one switch process."""

    name: str
    device_id: int
    grpc_address: str
    ports: dict[int, str] = field(default_factory=dict)
    """Switch port number -> interface name in the switch's (root) namespace."""
    cpu_port: int | None = None
    thrift_port: int | None = None
    """BMv2's runtime CLI port (every simple_switch_grpc needs its own); checkmate-switch ignores it."""
    log_file: Path | None = None
    pcap_dir: Path | None = None
    extra_args: tuple[str, ...] = ()
    """Target options passed through unchanged (``checkmate-net up --switch-args``), placed before
    the ``--``: e.g. checkmate-switch's ``--drop-egress 1:0.01 --drop-seed 7``."""
    grpc_args: tuple[str, ...] = ()
    """gRPC server options after the ``--``, the same for both targets: P4Runtime over TLS
    (:func:`checkmate.tls.server_args`); none: plaintext."""

    def command(self, binary: str) -> list[str]:
        """The command line that starts this switch (the same for both targets)."""
        argv = [binary]
        for port, interface in sorted(self.ports.items()):
            argv += ["-i", f"{port}@{interface}"]
        argv += ["--device-id", str(self.device_id)]
        if self.thrift_port is not None:
            argv += ["--thrift-port", str(self.thrift_port)]
        if self.pcap_dir is not None:
            argv += ["--pcap", str(self.pcap_dir)]
        # Logs go to stdout, which the runner sends to log_file: startup errors land there too.
        # simple_switch_grpc logs every packet at its default level (trace): far too slow.
        argv += ["--log-console", "--log-level", "info", "--no-p4"]
        argv += self.extra_args
        argv += ["--", "--grpc-server-addr", self.grpc_address]
        if self.cpu_port is not None:
            argv += ["--cpu-port", str(self.cpu_port)]
        argv += self.grpc_args
        return argv


SwitchConfig = SwitchProcessConfig
"""The old name (until scripts move; ``embedded_switch.cli.SwitchConfig`` is the switch's own)."""
