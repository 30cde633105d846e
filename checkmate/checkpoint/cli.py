"""``checkmate-ckpt``: inspect, verify, convert, reshard and import universal checkpoints.

``plan`` / ``convert --to ranks`` / ``reshard --layout`` know parallel layouts
(``tp=2,pp=2,dp=3,zero=1``, ``dp=2,fsdp=1``; :mod:`checkmate.universal`);
``import`` reads rank files of any layout, DeepSpeed universal folders and torch DCP.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from checkmate import nfs
from checkmate.checkpoint import storage
from checkmate.checkpoint.export import export_dcp, export_deepspeed_universal, export_safetensors, reshard
from checkmate.checkpoint.format import CheckpointError
from checkmate.checkpoint.load import data_position
from checkmate.checkpoint.reader import CheckpointReader
from checkmate.universal.convert import from_rank_files, plan, to_rank_files
from checkmate.universal.interop import import_dcp, import_deepspeed_universal
from checkmate.universal.layout import Layout
from checkmate.universal.spec import ReshapeSpec

logger = logging.getLogger(__name__)


def _reader(args: argparse.Namespace) -> CheckpointReader:
    return CheckpointReader(Path(args.root), args.step)


def _job_state_summary(reader: CheckpointReader) -> dict[str, Any] | None:
    """Names of the step's buffers and stateful objects (format version 2), None without a job state."""
    state = reader.job_state()
    if state is None:
        return None
    return {"buffers": sorted(state.buffers), "stateful": sorted(state.stateful)}


def cmd_inspect(args: argparse.Namespace) -> int:
    reader = _reader(args)
    summary = {
        "root": str(reader.root),
        "step": reader.step,
        "complete_steps": storage.complete_steps(reader.root),
        "latest": storage.read_latest(reader.root),
        "optimizer": reader.global_state.get("optimizer", {}).get("kind"),
        "data_position": data_position(reader),
        "format_version": reader.global_state.get("format_version"),
        "job_state": _job_state_summary(reader),
        "shards": [
            {"shard": m["shard"], "file": m["file"], "tensors": len(m["entries"])} for m in reader.manifests
        ],
        "parameters": {n: {**m, "states": reader.states_of(n)} for n, m in sorted(reader.parameters.items())},
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(f"checkpoint {reader.directory}  step {reader.step}  optimizer {summary['optimizer']}")
    print(f"complete steps: {summary['complete_steps']}  latest: {summary['latest']}")
    if summary["data_position"] is not None:
        print(f"data position after step {reader.step}: {json.dumps(summary['data_position'])}")
    state = summary["job_state"]
    if state is None:
        print(f"job state: none (format version {summary['format_version']})")
    else:
        print(f"job state: buffers {state['buffers'] or '-'}  stateful {state['stateful'] or '-'}")
    for shard in summary["shards"]:
        print(f"  shard {shard['shard']}: {shard['file']} ({shard['tensors']} tensors)")
    for name, meta in summary["parameters"].items():
        print(f"  {name:40s} {str(meta['shape']):20s} {meta['dtype']:16s} {','.join(meta['states'])}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    reader = _reader(args)
    reader.verify_files()
    reader.check_optimizer_states()
    count = 0
    for name in reader.parameters:
        for state in reader.states_of(name):
            reader.read(name, state)
            count += 1
    print(
        f"ok: step {reader.step}, {len(reader.parameters)} parameters, {count} tensors, "
        f"{len(reader.manifests)} shards, all checksums match, optimizer state complete"
    )
    return 0


def _spec(args: argparse.Namespace) -> ReshapeSpec | None:
    return ReshapeSpec.load(Path(args.spec)) if getattr(args, "spec", None) else None


def _to_ranks(reader: CheckpointReader, args: argparse.Namespace) -> int:
    if not args.layout:
        raise CheckpointError("--to ranks needs --layout (e.g. tp=2,dp=2)")
    layout = Layout.parse(args.layout)
    where, elements = to_rank_files(reader, Path(args.output), layout, _spec(args))
    print(
        f"wrote step {reader.step} as {layout.world_size} rank files of {layout.describe()} to {where} "
        f"({elements} elements read)"
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    reader = _reader(args)
    layout = Layout.parse(args.layout)
    ranks = plan(reader, layout, _spec(args))
    if args.json:
        print(json.dumps({"layout": layout.describe(), "step": reader.step, "ranks": ranks}, indent=1))
        return 0
    print(f"step {reader.step} fits {layout.describe()} ({layout.world_size} ranks)")
    for item in ranks:
        flat = (
            f", flat optimizer partition {item['flat_state_elements']}" if item["flat_state_elements"] else ""
        )
        print(
            f"  rank {item['rank']:3d} {item['coords']}: {item['parameters']} parameters, "
            f"{item['param_elements']} elements{flat}"
        )
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    source, output = Path(args.source), Path(args.output)
    if args.kind == "ranks":
        where = from_rank_files(source, output, args.shards)
    elif args.kind == "deepspeed":
        where = import_deepspeed_universal(source, output, args.shards)
    else:
        where = import_dcp(source, output, _spec(args), args.tp, args.vocab, args.step or 0, args.shards)
    print(f"imported {args.kind} checkpoint {source} as {where}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    reader = _reader(args)
    output = Path(args.output)
    if args.to == "ranks":
        return _to_ranks(reader, args)
    if args.to == "dcp":
        where = export_dcp(reader, output)
    elif args.to == "safetensors":
        where = export_safetensors(reader, output)
    else:
        where = export_deepspeed_universal(reader, output)
    print(f"wrote {args.to} export of step {reader.step} to {where}")
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    reader = _reader(args)
    if (args.shards is None) == (args.layout is None):
        raise CheckpointError("reshard needs one of --shards K (universal writers) or --layout (rank files)")
    if args.layout is not None:
        return _to_ranks(reader, args)
    where = reshard(reader, Path(args.output), args.shards)
    print(f"wrote step {reader.step} as {args.shards} shards to {where}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="checkmate-ckpt", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.add_argument(
            "root",
            type=nfs.location_argument,
            help="checkpoint root (the folder holding step-* and latest), or nfs://SERVER/EXPORT/PATH",
        )
        command.add_argument("--step", type=int, default=None, help="step to use (default: newest complete)")
        return command

    add("inspect", "show steps, shards and parameters").add_argument("--json", action="store_true")
    add("verify", "check coverage and every checksum (reads every byte)")
    convert = add("convert", "export to another format")
    convert.add_argument("--to", required=True, choices=["dcp", "safetensors", "deepspeed", "ranks"])
    convert.add_argument("--output", "-o", required=True)
    resharded = add("reshard", "rewrite with another number of shard writers, or as a layout's rank files")
    resharded.add_argument("--shards", type=int, default=None)
    resharded.add_argument("--output", "-o", required=True)
    planned = add("plan", "check that a layout can hold the checkpoint; show each rank's share")
    planned.add_argument("--json", action="store_true")
    for command, required in ((convert, False), (resharded, False), (planned, True)):
        command.add_argument(
            "--layout",
            required=required,
            default=None,
            help="target layout, e.g. tp=2,pp=1,dp=3,zero=1 or dp=2,fsdp=1",
        )
        command.add_argument("--spec", default=None, help="reshape spec JSON (default: the checkpoint's own)")
    imported = sub.add_parser("import", help="import rank files, a DeepSpeed universal folder or a torch DCP")
    imported.add_argument("kind", choices=["ranks", "deepspeed", "dcp"])
    imported.add_argument("source", help="rank-file folder / DeepSpeed folder holding zero/ / DCP folder")
    imported.add_argument("--output", "-o", required=True, help="new universal checkpoint root")
    imported.add_argument("--shards", type=int, default=1)
    imported.add_argument("--spec", default=None, help="dcp: reshape spec JSON of the model")
    imported.add_argument(
        "--tp",
        type=int,
        default=None,
        help="dcp: TP degree of the job that saved it (unless the DCP records it)",
    )
    imported.add_argument("--vocab", type=int, default=None, help="dcp: real vocabulary size (trims padding)")
    imported.add_argument("--step", type=int, default=None, help="dcp: step to record (default: Adam's step)")
    return parser


COMMANDS = {
    "inspect": cmd_inspect,
    "verify": cmd_verify,
    "convert": cmd_convert,
    "reshard": cmd_reshard,
    "plan": cmd_plan,
    "import": cmd_import,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        return COMMANDS[args.command](args)
    except CheckpointError as exc:
        print(f"checkmate-ckpt: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"checkmate-ckpt: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
