"""The TNA program compiles, clean, with the open-source Tofino compiler and p4c's front end.

``tofino``: p4c-barefoot (../shared/p4-tofino, docs/tofino.md) compiles
p4src/tna/checkmate.p4 for Tofino 1 (tna) and Tofino 2 (t2na) to ``.bfa`` and bfas
assembles it; the P4Info it writes for Tofino 1 is the committed one (the compiler lists
its two Snapshot extern instances in either order from run to run; nothing else varies).
``p4c``: p4test with the open-source tna.p4 checks the front and mid end (and p4test the
v1model program) without uninitialized-header warnings.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from p4.config.v1 import p4info_pb2

from checkmate.p4.p4info import load_p4info
from tests.p4_source import P4SRC
from tests.tofino_build import TARGETS, compile_tna

COMMITTED_TOFINO_P4INFO = P4SRC / "tna" / "checkmate.tofino.p4info.txtpb"

# What the compiler may still say about this program, and why it is not ours to fix:
KNOWN_WARNINGS = (
    # Tofino never counts DROP_BAD_IPV4_CHECKSUM: it does not verify the IPv4 checksum (docs/protocol.md).
    "'DROP_BAD_IPV4_CHECKSUM' is unused",
    # The compiler's own minimum-parse-depth padding state (Tofino 1), not a state of ours.
    "Parser state min_parse_depth_accept_loop will be unrolled",
)


def _canonical(path: Path) -> p4info_pb2.P4Info:
    """The P4Info with each extern's instances in id order (p4c-barefoot varies the Snapshot order)."""
    info = load_p4info(path)
    for extern in info.externs:
        instances = sorted(extern.instances, key=lambda instance: instance.preamble.id)
        del extern.instances[:]
        extern.instances.extend(instances)
    return info


def _unexpected(warnings: list[str]) -> list[str]:
    return [w for w in warnings if not any(known in w for known in KNOWN_WARNINGS)]


@pytest.mark.tofino
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_the_tofino_compiler_compiles_the_tna_program(target: str, tmp_path: Path) -> None:
    result = compile_tna(target, tmp_path)
    assert result.returncode == 0, result.messages + result.assembler_messages
    assert "error:" not in result.messages
    assert _unexpected(result.warnings()) == [], result.messages
    assert result.bfa.stat().st_size > 0
    assert result.binary.stat().st_size > 0
    assert (tmp_path / "pipe" / "context.json").stat().st_size > 0
    if target == "tofino":
        assert _canonical(result.p4info) == _canonical(COMMITTED_TOFINO_P4INFO), (
            "p4src/tna/checkmate.tofino.p4info.txtpb is stale: make p4-tofino and copy "
            "build/tofino/checkmate.p4info.txtpb over it"
        )


def _tna_include_dir() -> Path | None:
    """Where the open-source tna.p4 is: next to p4test (p4-toolchain) or p4c-barefoot (p4-tofino)."""
    for tool, relative in (("p4test", "share/p4c/p4include-tofino"), ("p4c-barefoot", "share/p4c/p4include")):
        found = shutil.which(tool)
        if found:
            candidate = Path(found).resolve().parent.parent / relative
            if (candidate / "tna.p4").is_file():
                return candidate
    return None


def _p4test(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["p4test", "--std", "p4-16", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.p4c
def test_p4test_front_end_passes_the_tna_program_without_uninitialized_headers() -> None:
    if shutil.which("p4test") is None:
        pytest.skip("p4test is not installed")
    include = _tna_include_dir()
    if include is None:
        pytest.skip("the open-source tna.p4 is not installed (p4-toolchain's p4include-tofino)")
    for tofino in ("1", "2"):
        arch = "tna.p4" if tofino == "1" else "t2na.p4"
        if not (include / arch).is_file():
            continue
        run = _p4test(
            "-I", str(include), f"-D__TARGET_TOFINO__={tofino}", str(P4SRC / "tna" / "checkmate.p4")
        )
        assert run.returncode == 0, run.stderr
        assert "uninitialized" not in run.stderr, run.stderr
        assert _unexpected([line for line in run.stderr.splitlines() if "warning:" in line]) == [], run.stderr


@pytest.mark.p4c
def test_p4test_passes_the_v1model_program_without_warnings() -> None:
    if shutil.which("p4test") is None:
        pytest.skip("p4test is not installed")
    run = _p4test(str(P4SRC / "v1model" / "checkmate.p4"))
    assert run.returncode == 0, run.stderr
    assert "warning" not in run.stderr, run.stderr
