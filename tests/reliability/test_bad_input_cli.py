"""Malformed command lines for every console script: exit 2 (usage) or 1 (refused), no traceback.

Each script's cases run in one child process (a driver calls the script's ``main``
with each argument vector, stderr captured, an alarm per case), so the table stays
fast; then every installed console script is run once for real with a bad vector.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from checkmate import checkpoint as fmt
from tests.reliability.record import Recorder

REPO = Path(__file__).resolve().parents[2]
SINGLE = str(REPO / "topologies" / "single.json")
BIN = REPO / ".venv" / "bin"

SCRIPTS = {
    "checkmate-switch": "embedded_switch.cli",
    "checkmate-ctl": "controller.cli",
    "checkmate-net": "topologies.cli",
    "checkmate-shadow": "shadow.cli",
    "checkmate-ckpt": "checkmate.checkpoint.cli",
}

DRIVER = r"""
import contextlib, io, json, logging, signal, sys, traceback, importlib
todo = json.loads(sys.argv[1])
def alarm(signum, frame):
    raise TimeoutError("the command did not fail within 20 s")
signal.signal(signal.SIGALRM, alarm)
out = []
for name, argv in todo:
    module = importlib.import_module(name)
    err = io.StringIO()
    code, tb = None, ""
    for handler in logging.root.handlers[:]:  # each case configures logging afresh, as a new process would
        logging.root.removeHandler(handler)
    signal.alarm(20)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = module.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        tb = traceback.format_exc()
    finally:
        signal.alarm(0)
    out.append({"argv": argv, "code": code, "stderr": err.getvalue(), "traceback": tb})
print(json.dumps(out))
"""


def cases(tmp: Path) -> dict[str, list[tuple[list[str], set[int], str]]]:
    """Per script: (argv, allowed exit codes, a fragment the message must contain)."""
    garbage = tmp / "garbage.p4info.txt"
    garbage.write_text("this is { not a p4info\n")
    not_json = tmp / "bad.json"
    not_json.write_text("{ hosts: ")
    ckpt = tmp / "ckpt"
    state = {"w": {"param": torch.arange(6.0)}}
    fmt.write_global(ckpt, 3, {"w": ([6], "torch.float32")}, {"kind": "SGD"})
    fmt.write_shard(ckpt, 3, 0, 1, state)
    fmt.update_latest(ckpt, 3)
    noreach = ["--network", SINGLE, "--state-dir", str(tmp / "ctl"), "--timeout", "0.3", "--no-reconcile"]
    return {
        "checkmate-switch": [
            (["--bogus"], {2}, "unrecognized arguments"),
            (["--device-id", "one", "--no-p4"], {2}, "invalid int value"),
            (["--log-level", "loud", "--no-p4"], {2}, "invalid choice"),
            (["-i", "veth1", "--no-p4"], {2}, "expected PORT@IFACE"),
            (["-i", "600@lo", "--no-p4"], {2}, "out of range"),
            (["-i", "1@no-such-if0", "--no-p4"], {2}, "no interface named"),
            (["-i", "1@lo", "-i", "2@lo", "--no-p4"], {2}, "bound more than once"),
            (["--drop-egress", "1:1.5", "--no-p4"], {2}, "fraction must lie in [0, 1]"),
            (["--drop-egress", "x", "--no-p4"], {2}, "expected PORT:FRACTION"),
            ([], {2}, "give a config path"),
            ([str(tmp / "missing.json")], {2}, "does not exist"),
            ([str(not_json)], {2}, "is not JSON"),
            (
                ["--p4info", str(garbage), "--grpc-server-addr", "127.0.0.1:0"],
                {1, 2},
                "is not a P4Info text file",
            ),
            (["--no-p4", "--grpc-server-addr", "203.0.113.9:9559", "--insecure-grpc-server"], {1}, "cannot"),
            (["--no-p4", "--grpc-server-addr", "0.0.0.0:9559"], {2}, "--insecure-grpc-server"),
        ],
        "checkmate-ctl": [
            ([], {2}, "required"),
            (["job"], {2}, "required"),
            (["job", "remove", "seven"], {2}, "invalid int value"),
            (["shadow", "move", "--job", "1"], {2}, "required"),
            (["--network", str(tmp / "missing.json"), "forwarding", "install"], {1}, "cannot read network"),
            (["--network", str(not_json), "forwarding", "install"], {1}, "is not valid JSON"),
            ([*noreach, "job", "add", "--job-id", "7", "--workers", "h1,h9", "--shadows", "sh1"], {1}, "h9"),
            (
                [*noreach, "job", "add", "--job-id", "0", "--workers", "h1,h2", "--shadows", "sh1"],
                {1, 2},
                "job",
            ),
            ([*noreach, "job", "add", "--spec", str(not_json)], {1, 2}, "job description is not valid JSON"),
            ([*noreach, "job", "show", "99"], {1}, "99"),
        ],
        "checkmate-net": [
            ([], {2}, "required"),
            (["bogus"], {2}, "invalid choice"),
            (["up"], {2}, "the following arguments are required"),
            (["up", SINGLE, "--target", "tofino9"], {2}, "invalid choice"),
            (["up", str(tmp / "missing.json"), "--run-dir", str(tmp / "run")], {1}, "cannot read"),
            (["exec", "--run-dir", str(tmp / "run"), "h1"], {1, 2}, "no network is recorded"),
        ],
        "checkmate-shadow": [
            ([], {2}, "required"),
            (["run"], {2}, "--name"),
            (["status"], {2}, "address"),
            (["--log-level", "LOUD", "status", "127.0.0.1:1"], {1, 2}, "LOUD"),
            (["run", "--name", "s", "--shard-keys", "a,b"], {1, 2}, "shard"),
            (["run", "--name", "s", "--control", "127.0.0.1:http"], {1, 2}, "127.0.0.1:http"),
            (["run", "--name", "s", "--control", "127.0.0.1:99999"], {1, 2}, "99999"),
            (["run", "--name", "s", "--horizon", "zero"], {2}, "invalid int value"),
            (["run", "--name", "s", "--repair-grace", "-1"], {2}, "not negative"),
            (["run", "--name", "s", "--repair-max-grace", "nan"], {2}, "finite"),
            (["run", "--name", "s", "--repair-timeout", "soon"], {2}, "not a number of seconds"),
            (["run", "--name", "s", "--snapshot-timeout", "0"], {2}, "above zero"),
            (["run", "--name", "s", "--snapshot-timeout", "inf"], {2}, "finite"),
            (["run", "--name", "s", "--control", "203.0.113.9:0"], {1}, "203.0.113.9"),
            (["status", "127.0.0.1:1", "--timeout", "1"], {1}, "checkmate-shadow:"),
        ],
        "checkmate-ckpt": [
            ([], {2}, "required"),
            (["verify"], {2}, "root"),
            (["verify", str(tmp / "missing")], {1}, "no complete checkpoint"),
            (["inspect", str(ckpt), "--step", "x"], {2}, "invalid int value"),
            (["inspect", str(ckpt), "--step", "9"], {1}, "step 9 is not complete"),
            (["convert", str(ckpt), "--to", "zip", "-o", str(tmp / "o")], {2}, "invalid choice"),
            (["reshard", str(ckpt), "--shards", "0", "-o", str(tmp / "r0")], {1, 2}, "shard"),
            (["reshard", str(ckpt), "--shards", "-2", "-o", str(tmp / "r1")], {1, 2}, "shard"),
        ],
    }


def _run_driver(todo: list[tuple[str, list[str]]]) -> list[dict[str, object]]:
    """Run (module, argv) pairs in one child process (one import of torch for all five scripts)."""
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(todo)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rows: list[dict[str, object]] = json.loads(result.stdout.strip().splitlines()[-1])
    return rows


def test_malformed_command_lines(tmp_path: Path, reliability: Recorder) -> None:
    table = cases(tmp_path)
    failures = []
    total = 0
    flat = [
        (script, argv, codes, fragment) for script, items in table.items() for argv, codes, fragment in items
    ]
    rows = _run_driver([(SCRIPTS[script], argv) for script, argv, _, _ in flat])
    for (script, argv, codes, fragment), row in zip(flat, rows, strict=True):
        total += 1
        stderr = str(row["stderr"])
        problem = None
        if row["traceback"]:
            problem = f"raised:\n{row['traceback']}"
        elif row["code"] not in codes:
            problem = f"exit {row['code']}, expected {sorted(codes)}"
        elif "Traceback" in stderr:
            problem = "a traceback on stderr"
        elif fragment not in stderr:
            problem = f"stderr lacks {fragment!r}"
        elif not stderr.strip():
            problem = "nothing on stderr"
        if problem:
            failures.append(f"{script} {' '.join(argv)}: {problem}\n  stderr: {stderr.strip()[:500]}")
    assert not failures, "\n".join(failures)

    # every installed console script, once for real
    for script in SCRIPTS:
        result = subprocess.run(
            [str(BIN / script), "--no-such-option"], capture_output=True, text=True, timeout=120, check=False
        )
        assert result.returncode == 2, (script, result.stderr)
        assert (
            "unrecognized arguments" in result.stderr
            or "invalid choice" in result.stderr
            or "required" in (result.stderr)
        ), (script, result.stderr)
        assert "Traceback" not in result.stderr
        total += 1
    reliability.record(
        area="bad input",
        case="malformed command lines for checkmate-switch, -ctl, -net, -shadow and -ckpt "
        "(unknown options, wrong types, out-of-range values, missing arguments, missing or garbage files, "
        "unbindable addresses)",
        target="console scripts",
        trials=total,
        lost=0,
        held="every vector exited 2 (usage) or 1 (refused) with a message naming the problem on stderr and "
        "no Python traceback; nothing was started",
    )
