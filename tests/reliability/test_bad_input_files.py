"""Bad files: malformed topology descriptions and corrupted, foreign or half-written checkpoints.

Topologies: every malformed description is refused by ``Network.load`` with a
NetworkError naming the problem (never another exception), and ``checkmate-net
up`` prints one line, exits 1 and creates nothing.

Checkpoints: a good step 7 is written and hashed; corrupted copies of it as step 8
(truncated, bit-flipped, foreign, half-written, of a newer version, files missing)
are refused with a CheckpointError naming the file and problem -- or, for the
random bit flips, read back bit-identical when the flip was harmless -- and step 7
is byte-for-byte untouched. Writers killed mid-write leave the latest pointer on a
complete step and the partial step ignored by the loader.
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from checkmate import checkpoint as fmt
from checkmate.checkpoint import CheckpointError, CheckpointReader, storage
from checkmate.checkpoint import cli as checkpoint_cli
from checkmate.checkpoint.load import load_into
from checkmate.network import Network, NetworkError
from tests.reliability.fuzz_frames import tally
from tests.reliability.record import Recorder

REPO = Path(__file__).resolve().parents[2]
SINGLE = json.loads((REPO / "topologies" / "single.json").read_text())


# ---- topology files ----------------------------------------------------------------------------------
def _variant(**changes: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(SINGLE))
    data.update(changes)
    return data


def _host(name: str, **fields: Any) -> dict[str, Any]:
    hosts = json.loads(json.dumps(SINGLE["hosts"]))
    hosts[name].update(fields)
    for key in [k for k, v in fields.items() if v is None]:
        del hosts[name][key]
    return hosts


TEXT = json.dumps(SINGLE, indent=1)
TOPOLOGY_CASES: dict[str, tuple[str, str]] = {
    "empty file": ("", "is not valid JSON"),
    "truncated JSON": (TEXT[: len(TEXT) // 2], "is not valid JSON"),
    "not an object": ("[1, 2]", "a network description is a JSON object, got list"),
    "hosts is a list": (json.dumps(_variant(hosts=["h1"])), "hosts must be an object"),
    "ip is a number": (json.dumps(_variant(hosts=_host("h1", ip=10))), "hosts.h1.ip"),
    "device_id is a string": (
        json.dumps(_variant(switches={"s1": {"grpc": "127.0.0.1:50001", "device_id": "one"}})),
        "device_id",
    ),
    "links is an object": (json.dumps(_variant(links={"h1": "s1-p1"})), "links"),
    "link to an unknown host": (
        json.dumps(_variant(links=[*SINGLE["links"], ["h9", "s1-p9"]])),
        "'h9' names no host and no switch port",
    ),
    "duplicate IP": (json.dumps(_variant(hosts=_host("h2", ip="10.0.1.1/8"))), "is also used by host h1"),
    "duplicate MAC": (
        json.dumps(_variant(hosts=_host("h2", mac="08:00:00:00:01:01"))),
        "is also used by host h1",
    ),
    "malformed MAC": (json.dumps(_variant(hosts=_host("h1", mac="08:00:00:01:01"))), "is not a MAC address"),
    "multicast MAC": (json.dumps(_variant(hosts=_host("h1", mac="01:00:00:00:01:01"))), "not a unicast MAC"),
    "malformed IP": (json.dumps(_variant(hosts=_host("h1", ip="10.0.1.300/8"))), "is not an IPv4 address"),
    "IP without prefix": (json.dumps(_variant(hosts=_host("h1", ip="10.0.1.1"))), "must be ADDRESS/PREFIX"),
    "network address": (json.dumps(_variant(hosts=_host("h1", ip="10.0.0.0/8"))), "network or broadcast"),
    "missing ip": (json.dumps(_variant(hosts=_host("h1", ip=None))), "lacks 'ip'"),
    "unknown role": (json.dumps(_variant(hosts=_host("h1", role="trainer"))), "is not one of"),
    "missing switches": (
        json.dumps({k: v for k, v in SINGLE.items() if k != "switches"}),
        "lacks 'switches'",
    ),
    "bad gRPC address": (
        json.dumps(_variant(switches={"s1": {"grpc": "localhost", "device_id": 1}})),
        "must be 'HOST:PORT'",
    ),
    "port 0": (json.dumps(_variant(links=[*SINGLE["links"][:-1], ["sh2", "s1-p0"]])), "outside 1.."),
}


def _load_text(tmp_path: Path, text: str | bytes) -> Network:
    path = tmp_path / "net.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return Network.load(path)


def _mutate_json(value: Any, rng: random.Random) -> Any:
    """A random structural change somewhere in a parsed description."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(sorted(value))
        out = dict(value)
        choice = rng.randrange(4)
        if choice == 0:
            del out[key]
        elif choice == 1:
            out[key] = rng.choice([None, 0, -1, 1.5, "", "x", [], {}, True, 2**40])
        elif choice == 2:
            out[key + rng.choice(["_", "x"])] = out.pop(key)
        else:
            out[key] = _mutate_json(value[key], rng)
        return out
    if isinstance(value, list) and value and rng.random() < 0.7:
        out_list = list(value)
        i = rng.randrange(len(out_list))
        choice = rng.randrange(3)
        if choice == 0:
            del out_list[i]
        elif choice == 1:
            out_list.append(out_list[i])
        else:
            out_list[i] = _mutate_json(out_list[i], rng)
        return out_list
    if isinstance(value, str) and value:
        i = rng.randrange(len(value))
        return value[:i] + rng.choice(["", ":", "/", ".", "-p", "9", "\x00", "é", " "]) + value[i + 1 :]
    return rng.choice([None, 0, 70000, -3, "s1-p1", "h1", [], {}, 1.5])


def test_malformed_topology_files(tmp_path: Path, reliability: Recorder) -> None:
    for name, (text, fragment) in TOPOLOGY_CASES.items():
        with pytest.raises(NetworkError) as info:
            _load_text(tmp_path, text)
        message = str(info.value)
        assert fragment in message and "\n" not in message, (name, message)
        assert str(tmp_path / "net.json") in message, (name, message)  # names the file
    # not UTF-8, unreadable, a directory
    for name, content in (
        ("binary garbage", b"\xff\xfe\x00{"),
        ("latin-1", TEXT.replace("h1", "h\xe9").encode("latin-1")),
    ):
        with pytest.raises(NetworkError) as info:
            _load_text(tmp_path, content)
        assert "net.json" in str(info.value), name
    with pytest.raises(NetworkError, match="cannot read network description"):
        Network.load(tmp_path)
    with pytest.raises(NetworkError, match="cannot read network description"):
        Network.load(tmp_path / "missing.json")
    # a host without a role is a plain host (documented default), not an error
    assert _load_text(tmp_path, json.dumps(_variant(hosts=_host("h1", role=None)))).hosts["h1"].role == "host"

    rng = random.Random(60)
    outcomes: collections.Counter[str] = collections.Counter()
    trials = 2000
    for _ in range(trials):
        data = SINGLE
        for _ in range(rng.randint(1, 3)):
            data = _mutate_json(data, rng)
        text = json.dumps(data)
        if rng.random() < 0.2:
            text = text[: rng.randrange(len(text))]
        try:
            Network.from_json(json.loads(text)) if rng.random() < 0.5 else _load_text(tmp_path, text)
        except NetworkError as exc:
            assert str(exc) and "\n" not in str(exc)
            outcomes["refused"] += 1
        except json.JSONDecodeError:
            outcomes["not JSON (json.loads, before the loader)"] += 1
        else:
            outcomes["valid after mutation"] += 1
    assert outcomes["refused"] > trials // 2
    reliability.record(
        area="bad input",
        case="malformed topology files: " + ", ".join(TOPOLOGY_CASES) + ", binary garbage, missing file",
        target="network description (checkmate.network.Network.load)",
        trials=len(TOPOLOGY_CASES) + 5,
        lost=0,
        held="each refused with a one-line NetworkError naming the file, the field and the problem; "
        "a host without a role loads as a plain host (the documented default)",
    )
    reliability.record(
        area="bad input",
        case="randomly mutated topology descriptions "
        "(deleted, retyped, renamed keys; edited strings; truncation)",
        target="network description (checkmate.network.Network.load)",
        trials=trials,
        lost=0,
        held=f"{tally(outcomes)}; never any exception but NetworkError, every message one line",
    )


def _net_state() -> tuple[set[str], set[str]]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return set(os.listdir("/sys/class/net")), {line.split()[0] for line in netns.splitlines() if line.strip()}


@pytest.mark.root
def test_checkmate_net_up_with_a_bad_file_creates_nothing(tmp_path: Path, reliability: Recorder) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    cases = ["truncated JSON", "link to an unknown host", "duplicate MAC", "malformed IP", "ip is a number"]
    before = _net_state()
    for name in cases:
        path = tmp_path / f"{name.replace(' ', '_')}.json"
        path.write_text(TOPOLOGY_CASES[name][0])
        result = subprocess.run(
            [
                str(REPO / ".venv" / "bin" / "checkmate-net"),
                "up",
                str(path),
                "--run-dir",
                str(tmp_path / "run"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            check=False,
        )
        assert result.returncode == 1, (name, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("checkmate-net: error:"), (name, result.stderr)
        assert TOPOLOGY_CASES[name][1] in lines[0] and "Traceback" not in result.stderr
        assert not (tmp_path / "run").exists()
        assert _net_state() == before, name
    reliability.record(
        area="bad input",
        case="checkmate-net up with a malformed topology file (" + ", ".join(cases) + ")",
        target="checkmate-net (root)",
        trials=len(cases),
        lost=0,
        held="exit 1, one line 'checkmate-net: error: FILE: ...' naming the problem, no traceback, "
        "no run directory, no network namespace or interface created",
    )


# ---- checkpoints -------------------------------------------------------------------------------------
SHAPES = {"embed.weight": (40, 8), "block.0.weight": (8, 8), "block.0.bias": (8,), "head.weight": (3, 8)}
LAYOUT = [["embed.weight"], ["block.0.weight", "block.0.bias", "head.weight"]]


def _state(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: {
            "param": torch.randn(s, generator=g),
            "exp_avg": torch.randn(s, generator=g),
            "step": torch.tensor(3.0),
        }
        for n, s in SHAPES.items()
    }


def _write(root: Path, step: int, state: dict[str, dict[str, torch.Tensor]], latest: bool = True) -> None:
    fmt.write_global(
        root,
        step,
        {n: (list(s["param"].shape), "torch.float32") for n, s in state.items()},
        {"kind": "Adam", "param_groups": [{"lr": 0.1, "params": sorted(state)}]},
    )
    for index, names in enumerate(LAYOUT):
        fmt.write_shard(root, step, index, len(LAYOUT), {n: state[n] for n in names})
    if latest:
        fmt.update_latest(root, step)


def _hash_tree(path: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(f.relative_to(path)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def _read_all(root: Path, step: int) -> dict[tuple[str, str], torch.Tensor]:
    """What a loader gets: coverage checked, every file hashed, every tensor read and verified."""
    reader = CheckpointReader(root, step)
    reader.verify_files()
    out = {}
    for name in reader.parameters:
        for state in reader.states_of(name):
            out[(name, state)] = reader.parameter(name, state)
    return out


def _model() -> torch.nn.Module:
    m = torch.nn.Module()
    for name, shape in SHAPES.items():
        parent = m
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))
    return m


def _cli(*argv: str) -> tuple[int, str]:
    """checkmate-ckpt in-process; returns (exit status, stderr)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = checkpoint_cli.main(list(argv))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, err.getvalue()


def _edit_json(path: Path, fn: Callable[[dict[str, Any]], object]) -> None:
    document = json.loads(path.read_text())
    fn(document)
    path.write_text(json.dumps(document))


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x40
    path.write_bytes(bytes(data))


S0, S1 = "shard-000-of-002", "shard-001-of-002"
CHECKPOINT_CASES: dict[str, tuple[Callable[[Path], object], str]] = {
    "truncated shard file": (lambda d: _truncate(d / f"{S1}.safetensors", 0.5), ""),
    "shard file cut to its header": (lambda d: _truncate(d / f"{S0}.safetensors", 0.02), ""),
    "bit flip in shard data": (lambda d: _flip(d / f"{S0}.safetensors", -20), "checksum"),
    "bit flip in the shard file's header": (lambda d: _flip(d / f"{S1}.safetensors", 12), ""),
    "truncated manifest": (lambda d: _truncate(d / f"{S0}.json", 0.6), "not valid JSON"),
    "manifest of a newer format version": (
        lambda d: _edit_json(d / f"{S0}.json", lambda m: m.update(format_version=fmt.FORMAT_VERSION + 1)),
        "written by a newer Checkmate",
    ),
    "global.json of a newer format version": (
        lambda d: _edit_json(d / "global.json", lambda m: m.update(format_version=9)),
        "written by a newer Checkmate",
    ),
    "manifest without entries": (
        lambda d: _edit_json(d / f"{S1}.json", lambda m: m.pop("entries")),
        "entries",
    ),
    "manifest entry with a wrong type": (
        lambda d: _edit_json(d / f"{S1}.json", lambda m: m["entries"][0].update(start="zero")),
        "",
    ),
    "global.json without parameters": (
        lambda d: _edit_json(d / "global.json", lambda m: m.pop("parameters")),
        "parameters",
    ),
    "global.json with a wrong shape": (
        lambda d: _edit_json(
            d / "global.json", lambda m: m["parameters"]["head.weight"].update(shape=[8, 3, 2])
        ),
        "",
    ),
    "manifest of another step": (
        lambda d: _edit_json(d / f"{S0}.json", lambda m: m.update(step=5)),
        "belongs to step 5",
    ),
    "shard data file missing": (lambda d: (d / f"{S1}.safetensors").unlink(), "is missing"),
    "overlapping shards": (
        lambda d: _edit_json(d / f"{S1}.json", lambda m: m["entries"][0].update(start=1)),
        "",
    ),
    "checkpoint of another model": (
        lambda d: _edit_json(
            d / "global.json",
            lambda m: m["parameters"].update({"other.weight": {"shape": [2], "dtype": "torch.float32"}}),
        ),
        "is in no shard",
    ),
}


def _corrupt_copy(root: Path, case: Callable[[Path], object]) -> Path:
    good = fmt.step_dir(root, 7)
    bad = fmt.step_dir(root, 8)
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(good, bad)
    for manifest in bad.glob("*.json"):
        _edit_json(manifest, lambda m: m.update(step=8))
    case(bad)
    return bad


def test_malformed_checkpoint_files(tmp_path: Path, reliability: Recorder) -> None:
    root = tmp_path / "ckpt"
    state = _state(1)
    _write(root, 7, state)
    good = _hash_tree(fmt.step_dir(root, 7))
    want = _read_all(root, 7)
    refused = 0
    for name, (case, fragment) in CHECKPOINT_CASES.items():
        bad = _corrupt_copy(root, case)
        with pytest.raises(CheckpointError) as info:
            _read_all(root, 8)
            load_into(CheckpointReader(root, 8), _model())
        message = str(info.value)
        assert fragment in message and str(bad) in message, (name, message)
        for command in ("verify", "inspect"):
            code, err = _cli(command, str(root), "--step", "8")
            if (
                command == "verify" or code != 0
            ):  # inspect reads no tensor data: it may list a step verify refuses
                assert code == 1 and err.startswith("checkmate-ckpt: ") and "Traceback" not in err, (
                    name,
                    err,
                )
                assert len(err.strip().splitlines()) == 1, (name, err)
        refused += 1
        assert _hash_tree(fmt.step_dir(root, 7)) == good, name
        again = _read_all(root, 7)
        assert again.keys() == want.keys() and all(torch.equal(again[k], want[k]) for k in want)
    # a checkpoint of another model is refused by the loader, naming the difference
    shutil.rmtree(fmt.step_dir(root, 8))
    other = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_into(CheckpointReader(root), other)
    wrong_shape = _model()
    wrong_shape.head.weight = torch.nn.Parameter(torch.zeros(8, 3))  # type: ignore[union-attr]
    with pytest.raises(CheckpointError, match=r"head.weight: state shape \(3, 8\), model \(8, 3\)"):
        load_into(CheckpointReader(root), wrong_shape)
    # a garbage latest pointer and a missing root are clear errors too
    (root / "latest").write_bytes(b"\xff\xfe garbage")
    assert fmt.read_latest(root) is None
    fmt.update_latest(root, 7)
    assert fmt.read_latest(root) == 7
    code, err = _cli("verify", str(tmp_path / "nowhere"))
    assert code == 1 and "no complete checkpoint" in err
    refused += 4
    loaded = _model()
    assert load_into(CheckpointReader(root), loaded) == 7
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), state[name]["param"])
    assert _hash_tree(fmt.step_dir(root, 7)) == good

    # random corruption: refused, or (a harmless flip) read back bit-identical
    rng = random.Random(70)
    outcomes: collections.Counter[str] = collections.Counter()
    trials = 300
    files = sorted(p.name for p in fmt.step_dir(root, 7).iterdir())
    for _ in range(trials):
        bad = _corrupt_copy(root, lambda d: None)
        target = bad / rng.choice(files)
        data = bytearray(target.read_bytes())
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.8:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            else:
                del data[rng.randrange(len(data)) :]
                if not data:
                    break
        target.write_bytes(bytes(data))
        try:
            got = _read_all(root, 8)
        except CheckpointError:
            outcomes["refused"] += 1
        else:
            assert got.keys() == want.keys()
            for key, value in got.items():
                assert torch.equal(
                    value.reshape(-1).view(torch.int32), want[key].reshape(-1).view(torch.int32)
                ), key
            outcomes["harmless flip, read back bit-identical"] += 1
    assert _hash_tree(fmt.step_dir(root, 7)) == good
    assert outcomes["refused"] > trials // 2
    reliability.record(
        area="bad input",
        case="malformed checkpoint files: " + ", ".join(CHECKPOINT_CASES) + "; another model, wrong shapes, "
        "garbage latest pointer, missing root",
        target="checkpoint loader and checkmate-ckpt",
        trials=refused,
        lost=0,
        held="each refused with a CheckpointError naming the file and the problem "
        "(checkmate-ckpt verify: exit 1, one line, no traceback); the good step 7 hashed identical "
        "before and after, still loads bit-exactly",
    )
    reliability.record(
        area="bad input",
        case="random bit flips and truncations in a checkpoint's files (shards, manifests, global.json)",
        target="checkpoint loader",
        trials=trials,
        lost=0,
        held=f"{tally(outcomes)}; nothing read wrong, never an exception but CheckpointError; the previous "
        "step's files byte-identical throughout",
    )


def _writer(root: Path, ready: Any) -> None:
    """Write steps 101, 102, ... of a 4-shard checkpoint forever, keeping 2 (the process is killed)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    state = {
        f"layer{i}.weight": {
            "param": torch.randn(256, 256, generator=g),
            "exp_avg": torch.randn(256, 256, generator=g),
        }
        for i in range(8)
    }
    names = sorted(state)
    step = 100
    ready.set()
    while True:
        step += 1
        fmt.write_global(root, step, {n: ([256, 256], "torch.float32") for n in names}, {"kind": "Adam"})
        for shard in range(4):
            fmt.write_shard(root, step, shard, 4, {n: state[n] for n in names[shard::4]})
        fmt.update_latest(root, step)
        fmt.prune(root, keep=2)


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint(
    tmp_path: Path, reliability: Recorder
) -> None:
    root = tmp_path / "ckpt"
    rng = random.Random(80)
    kills = 4
    partial_seen = 0
    for _ in range(kills):
        ctx = multiprocessing.get_context("fork")  # no second torch import: the writer starts at once
        ready = ctx.Event()
        proc = ctx.Process(target=_writer, args=(root, ready), daemon=True)
        proc.start()
        try:
            assert ready.wait(30)
            time.sleep(rng.uniform(0.3, 1.0))
            while fmt.read_latest(root) is None:  # at least one step complete before the kill
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 0.2))
        finally:
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
        latest = fmt.read_latest(root)
        complete = fmt.complete_steps(root)
        steps = sorted(int(p.name[5:]) for p in root.glob("step-*"))
        assert latest is not None and latest in complete, (latest, complete)
        partial_seen += any(s not in complete for s in steps)
        reader = CheckpointReader(root)  # the newest complete step, never a partial one
        assert reader.step == max(complete) and reader.step >= latest
        _read_all(root, reader.step)
        _read_all(root, latest)

    # an exception inside the write path (here: the second shard's data file) leaves the same picture
    before = fmt.read_latest(root)
    assert before is not None
    good = _hash_tree(fmt.step_dir(root, before))
    step = max(int(p.name[5:]) for p in root.glob("step-*")) + 1
    original = storage.save_file
    calls = []

    def failing(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str]) -> None:
        calls.append(filename)
        if len(calls) == 2:
            Path(filename).write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        original(tensors, filename, metadata=metadata)

    storage.save_file = failing  # type: ignore[assignment]
    try:
        with pytest.raises(OSError, match="No space"):
            _write(root, step, _state(2))
    finally:
        storage.save_file = original
    assert fmt.read_latest(root) == before and step not in fmt.complete_steps(root)
    assert CheckpointReader(root).step != step
    with pytest.raises(CheckpointError, match="not complete|expected one complete set"):
        CheckpointReader(root, step)
    assert _hash_tree(fmt.step_dir(root, before)) == good
    reliability.record(
        area="bad input",
        case="a checkpoint writer killed (SIGKILL at a random moment) or failing mid-write",
        target="checkpoint writer and loader",
        trials=kills + 1,
        lost=0,
        held=f"after every kill the latest pointer named a complete step that verified bit for bit and the "
        f"loader chose the newest complete step ({partial_seen} kills left a partial step behind, always "
        "ignored); a write failing in its second shard left the previous checkpoint byte-identical and "
        "the pointer unmoved",
    )
