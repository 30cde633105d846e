"""Compile the TNA program with the open-source Tofino compiler and summarize its resources.

One command line for ``make p4-tofino``, the ``tofino``-marked tests and docs/tofino.md:
``p4c-barefoot`` (p4lang/p4c ``backends/tofino``) to ``.bfa``, P4Info and bf-rt.json, then
``bfas`` to ``tofino.bin``/``tofino2.bin`` and ``context.json``. With ``-g`` the compiler
also writes ``pipe/logs/resources.json`` and ``phv.json``, from which :func:`summarize`
takes what the program uses (stages, tables, memories, PHV containers).

    python -m tests.tofino_build [--target tofino|tofino2] [--out build/tofino] [--json FILE]

Standard library only, so it runs without the project's virtual environment.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
PROGRAM = REPO_ROOT / "p4src" / "tna" / "checkmate.p4"
COMPILER = "p4c-barefoot"
ASSEMBLER = "bfas"
COMPILE_TIMEOUT_S = 600.0

# target -> (architecture, __TARGET_TOFINO__, binary bfas writes)
TARGETS = {"tofino": ("tna", 1, "tofino.bin"), "tofino2": ("t2na", 2, "tofino2.bin")}


@dataclass
class Compiled:
    """What one compile produced: exit status, the compiler's messages and the files."""

    target: str
    out: Path
    returncode: int
    messages: str
    compile_s: float
    assemble_s: float = 0.0
    assembler_messages: str = ""

    @property
    def bfa(self) -> Path:
        return self.out / "pipe" / "checkmate.bfa"

    @property
    def binary(self) -> Path:
        return self.out / "pipe" / TARGETS[self.target][2]

    @property
    def p4info(self) -> Path:
        return self.out / "checkmate.p4info.txtpb"

    def warnings(self) -> list[str]:
        return [line for line in self.messages.splitlines() if "warning:" in line]


def compiler_version() -> str:
    """``9.13.4`` from ``p4c-barefoot --version``."""
    run = subprocess.run([COMPILER, "--version"], capture_output=True, text=True, check=True, timeout=60)
    text = run.stdout + run.stderr
    for word in text.split():
        if word[:1].isdigit():
            return word
    raise RuntimeError(f"cannot read a version in {COMPILER} --version output: {text!r}")


def command(target: str, out: Path, version: str, program: Path = PROGRAM) -> list[str]:
    """The p4c-barefoot command line (what the bf-p4c driver would run, with -g for resources.json)."""
    arch, number, _ = TARGETS[target]
    major, minor, patch = (version.split(".") + ["0", "0"])[:3]
    return [
        COMPILER,
        "--target",
        target,
        "--arch",
        arch,
        f"-D__TARGET_TOFINO__={number}",
        "-D__p4c__=1",
        f"-D__p4c_major__={major}",
        f"-D__p4c_minor__={minor}",
        f"-D__p4c_patchlevel__={patch}",
        f'-D__p4c_version__="{version}"',
        "-g",
        "--p4runtime-files",
        str(out / "checkmate.p4info.txtpb"),
        "--bf-rt-schema",
        str(out / "bf-rt.json"),
        "-o",
        str(out),
        str(program),
    ]


def compile_tna(
    target: str, out: Path, program: Path = PROGRAM, timeout: float = COMPILE_TIMEOUT_S
) -> Compiled:
    """Compile ``program`` for ``target`` into ``out``, then assemble it when the compile succeeded."""
    if target not in TARGETS:
        raise ValueError(f"unknown Tofino target {target!r}; choose one of {sorted(TARGETS)}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    run = subprocess.run(
        command(target, out, compiler_version(), program), capture_output=True, text=True, timeout=timeout
    )
    result = Compiled(target, out, run.returncode, run.stdout + run.stderr, time.monotonic() - started)
    if run.returncode != 0 or not result.bfa.is_file():
        return result
    started = time.monotonic()
    assemble = subprocess.run(
        [ASSEMBLER, "-o", str(out / "pipe"), str(result.bfa)], capture_output=True, text=True, timeout=timeout
    )
    result.assemble_s = time.monotonic() - started
    result.assembler_messages = assemble.stdout + assemble.stderr
    if assemble.returncode != 0:
        result.returncode = assemble.returncode
    return result


@dataclass
class StageUse:
    stage: int
    tables: list[str] = field(default_factory=list)
    """Logical tables (P4 tables and compiler-made ones) in the stage, ingress and egress."""
    gateways: int = 0
    srams: int = 0
    tcams: int = 0
    map_rams: int = 0
    stat_alus: int = 0


@dataclass
class Resources:
    target: str
    stages_available: int
    stages: list[StageUse]
    srams_per_stage: int
    tcams_per_stage: int
    map_rams_per_stage: int
    stat_alus_per_stage: int
    logical_tables_per_stage: int
    phv_used: dict[str, int]
    """Containers holding at least one field, by kind and width ("normal 16", "tagalong 32")."""
    phv_available: dict[str, int]
    """Containers the target has, by kind and width."""

    @property
    def stages_used(self) -> int:
        return len(self.stages)


def summarize(out: Path, target: str = "tofino") -> Resources:
    """Read ``pipe/logs/resources.json`` and ``phv.json`` of a ``-g`` compile."""
    logs = out / "pipe" / "logs"
    resources = json.loads((logs / "resources.json").read_text())["resources"]
    mau = resources["mau"]
    stages = []
    first = mau["mau_stages"][0]
    for stage in mau["mau_stages"]:
        tables = [t["table_name"] for t in stage["logical_tables"]["ids"]]
        stages.append(
            StageUse(
                stage=stage["stage_number"],
                tables=sorted(t for t in tables if not t.startswith("cond-")),
                gateways=len(stage["gateways"]["gateways"]),
                srams=len(stage["rams"]["srams"]),
                tcams=len(stage["tcams"]["tcams"]),
                map_rams=len(stage["map_rams"]["maprams"]),
                stat_alus=len(stage["statistic_alus"]["stats"]),
            )
        )
    phv = json.loads((logs / "phv.json").read_text())
    used: Counter[str] = Counter()
    for container in phv["containers"]:
        if container.get("slices"):
            used[f"{container['container_type']} {container['bit_width']}"] += 1
    available = {
        f"{kind} {group['width']}": int(group["units"])
        for kind, groups in resources["phv_containers"].items()
        for group in groups
    }
    return Resources(
        target=target,
        stages_available=int(mau["nStages"]),
        stages=stages,
        srams_per_stage=first["rams"]["nRows"] * first["rams"]["nColumns"],
        tcams_per_stage=first["tcams"]["nRows"] * first["tcams"]["nColumns"],
        map_rams_per_stage=first["map_rams"]["nRows"] * first["map_rams"]["nUnits"],
        stat_alus_per_stage=first["statistic_alus"]["nAlus"],
        logical_tables_per_stage=first["logical_tables"]["size"],
        phv_used=dict(used),
        phv_available=available,
    )


def report(result: Compiled, resources: Resources) -> str:
    lines = [
        f"{result.target}: compiled in {result.compile_s:.1f} s, assembled in {result.assemble_s:.1f} s "
        f"({result.binary.name} {result.binary.stat().st_size} bytes)",
        f"stages used: {resources.stages_used} of {resources.stages_available}",
    ]
    for s in resources.stages:
        lines.append(
            f"  stage {s.stage}: {len(s.tables)} tables + {s.gateways} gateways "
            f"(of {resources.logical_tables_per_stage} logical ids), "
            f"SRAM {s.srams}/{resources.srams_per_stage}, TCAM {s.tcams}/{resources.tcams_per_stage}, "
            f"map RAM {s.map_rams}/{resources.map_rams_per_stage}, "
            f"stats ALU {s.stat_alus}/{resources.stat_alus_per_stage}: {', '.join(s.tables)}"
        )
    phv = ", ".join(
        f"{kind}-bit {resources.phv_used.get(kind, 0)}/{n}" for kind, n in resources.phv_available.items()
    )
    lines.append(f"PHV containers used: {phv}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--target", choices=sorted(TARGETS), default="tofino")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "tofino")
    parser.add_argument("--json", type=Path, help="also write the resource summary here")
    args = parser.parse_args(argv)
    missing = [tool for tool in (COMPILER, ASSEMBLER) if shutil.which(tool) is None]
    if missing:
        print(
            f"{' and '.join(missing)} not on PATH: install the open-source Tofino compiler "
            "(bash ../shared/p4-tofino/install.sh, then export PATH=/opt/p4-tofino/bin:$PATH)",
            file=sys.stderr,
        )
        return 1
    result = compile_tna(args.target, args.out)
    sys.stderr.write(result.messages + result.assembler_messages)
    if result.returncode != 0:
        print(f"{args.target}: compile failed (exit {result.returncode})", file=sys.stderr)
        return 1
    resources = summarize(args.out, args.target)
    print(report(result, resources))
    if args.json:
        summary = {"compile_s": round(result.compile_s, 2), "assemble_s": round(result.assemble_s, 2)}
        args.json.write_text(json.dumps({**summary, **asdict(resources)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
