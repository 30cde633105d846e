"""Where the Checkmate P4 program lives in the checkout, and the switch targets that run it.

``p4src/checkmate.p4info.txtpb`` is the committed P4Info of ``p4src/v1model/checkmate.p4``;
``make p4`` writes BMv2's JSON to ``build/v1model/checkmate.json``.
"""

from __future__ import annotations

import enum
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root folder."""
P4INFO_PATH = REPO_ROOT / "p4src" / "checkmate.p4info.txtpb"
"""The committed P4Info of the Checkmate program."""
BMV2_JSON_PATH = REPO_ROOT / "build" / "v1model" / "checkmate.json"
"""What ``make p4`` compiles for BMv2 (absent until it has run)."""


class Target(enum.Enum):
    """A switch implementation of the Checkmate program."""

    EMBEDDED = "embedded"
    """``checkmate-switch``: the Checkmate pipeline in software (always available)."""
    BMV2 = "bmv2"
    """``simple_switch_grpc`` from p4lang/behavioral-model (optional)."""
    TOFINO = "tofino"
    """A Tofino switch (Stratum or bf_switchd's P4Runtime server); the controller can push to one,
    the emulated network cannot run one."""
