"""``checkmate-ckpt``: inspect, verify, convert and reshard universal checkpoints."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from checkmate import checkpoint_format as fmt
from checkmate.checkpoint_export import export_dcp, export_deepspeed_universal, export_safetensors, reshard
from checkmate.checkpoint_format import CheckpointError, CheckpointReader
from checkmate.checkpoint_load import data_position

logger = logging.getLogger(__name__)


def _reader(args: argparse.Namespace) -> CheckpointReader:
    return CheckpointReader(Path(args.root), args.step)


def cmd_inspect(args: argparse.Namespace) -> int:
    reader = _reader(args)
    summary = {
        "root": str(reader.root),
        "step": reader.step,
        "complete_steps": fmt.complete_steps(reader.root),
        "latest": fmt.read_latest(reader.root),
        "optimizer": reader.global_state.get("optimizer", {}).get("kind"),
        "data_position": data_position(reader),
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
    for shard in summary["shards"]:
        print(f"  shard {shard['shard']}: {shard['file']} ({shard['tensors']} tensors)")
    for name, meta in summary["parameters"].items():
        print(f"  {name:40s} {str(meta['shape']):20s} {meta['dtype']:16s} {','.join(meta['states'])}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    reader = _reader(args)
    reader.verify_files()
    count = 0
    for name in reader.parameters:
        for state in reader.states_of(name):
            reader.read(name, state, verify=True)
            count += 1
    print(
        f"ok: step {reader.step}, {len(reader.parameters)} parameters, {count} tensors, "
        f"{len(reader.manifests)} shards, all checksums match"
    )
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    reader = _reader(args)
    output = Path(args.output)
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
    where = reshard(reader, Path(args.output), args.shards)
    print(f"wrote step {reader.step} as {args.shards} shards to {where}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="checkmate-ckpt", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.add_argument("root", help="checkpoint root (the folder holding step-* and latest)")
        command.add_argument("--step", type=int, default=None, help="step to use (default: newest complete)")
        return command

    add("inspect", "show steps, shards and parameters").add_argument("--json", action="store_true")
    add("verify", "check coverage and every checksum (reads every byte)")
    convert = add("convert", "export to another format")
    convert.add_argument("--to", required=True, choices=["dcp", "safetensors", "deepspeed"])
    convert.add_argument("--output", "-o", required=True)
    resharded = add("reshard", "rewrite with another number of shard writers")
    resharded.add_argument("--shards", type=int, required=True)
    resharded.add_argument("--output", "-o", required=True)
    return parser


COMMANDS = {"inspect": cmd_inspect, "verify": cmd_verify, "convert": cmd_convert, "reshard": cmd_reshard}


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
