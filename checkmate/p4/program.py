"""Where the Checkmate P4 program lives (package data), and the switch targets that run it.

``p4src/`` of the source tree is installed as the data package :mod:`checkmate.p4.p4src`
(setup.py maps it), so the library finds the P4 sources and the committed P4Info through
:mod:`importlib.resources` in a checkout, an editable install and a wheel alike.
``p4src/checkmate.p4info.txtpb`` is the committed P4Info of ``p4src/v1model/checkmate.p4``.
BMv2's JSON is compiled by ``make p4`` into the checkout's ``build/v1model/checkmate.json``;
a wheel built after ``make p4`` carries it as ``checkmate/p4/p4src/v1model/checkmate.json``.
"""

from __future__ import annotations

import enum
from importlib.resources import files
from pathlib import Path


def _p4src() -> Path:
    try:
        return Path(str(files("checkmate.p4.p4src")))
    except ModuleNotFoundError:  # a source tree run without installing (make setup installs it)
        return Path(__file__).resolve().parents[2] / "p4src"


P4SRC = _p4src()
"""The P4 sources and the committed P4Info (``p4src/`` of the checkout, installed as package data)."""
P4INFO_PATH = P4SRC / "checkmate.p4info.txtpb"
"""The committed P4Info of the Checkmate program."""
_PACKAGED_BMV2_JSON = P4SRC / "v1model" / "checkmate.json"
_CHECKOUT_BMV2_JSON = P4SRC.parent / "build" / "v1model" / "checkmate.json"
BMV2_JSON_PATH = _PACKAGED_BMV2_JSON if _PACKAGED_BMV2_JSON.is_file() else _CHECKOUT_BMV2_JSON
"""BMv2's compiled program: the wheel's copy when it carries one, else what ``make p4`` writes in the
checkout (absent until it has run)."""


class Target(enum.Enum):
    """A switch implementation of the Checkmate program."""

    EMBEDDED = "embedded"
    """``checkmate-switch``: the Checkmate pipeline in software (always available)."""
    BMV2 = "bmv2"
    """``simple_switch_grpc`` from p4lang/behavioral-model (optional)."""
    TOFINO = "tofino"
    """A Tofino switch (Stratum or bf_switchd's P4Runtime server); the controller can push to one,
    the emulated network cannot run one."""
