"""An ordinary DDP script plus one line trains through the switch; the shadow ports see every
reduced gradient element exactly once per iteration.

Each test brings ``single`` up on the embedded target (taken down again even on
failure), registers a job with ``checkmate-ctl job add`` (shadows sh1, sh2; no
shadow node runs: ``examples.capture`` only records what reaches each
shadow's port), and runs ``examples/train_ddp.py`` on the workers
with ``checkmate-net exec``, under ``examples.ddp_probe`` (which records the
buckets DDP reduced, the reduced bytes, the tags sent and the final
parameters without touching the script). Then, for every iteration and every
bucket of the layout actually used:

* the shadow owning the bucket's shard key received every element: distinct
  coverage is exactly ``[0, n)``, and the bytes it got, in element order, are
  the reduced bucket's bytes on every rank (SHA-256);
* with no loss, no element arrived twice; with loss, repeats are counted
  (retransmissions of tagged data stay tagged, so they are copied again) and
  must repeat the original bytes;
* the other shadow received nothing of it, and nothing else arrived
  (no unknown buckets, every copy left the switch with REPLICATE cleared);
* the workers tagged every element exactly once, and the switch's
  ``shadow_copies`` counter equals the datagrams the shadows received;
* every rank ends with bit-identical parameters; for 2 workers they are also
  bit-identical to the same script without its Checkmate lines (plain DDP over
  gloo).

The lossy variant drops 1% of the frames leaving every worker-facing switch
port (``checkmate-switch --drop-egress``); the switch's own drop counters must
show those drops, and training and coverage must still be complete.
"""

from __future__ import annotations

import ast
import json
import re
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from checkmate.job import JobSpec
from checkmate.network import Network
from checkmate.wire import CHECKMATE_UDP_PORT
from tests.topologies.harness import REPO, RunningNetwork, root_interfaces, topology_copy

pytestmark = pytest.mark.root

SCRIPT = REPO / "examples" / "train_ddp.py"
MARK = "# Checkmate"
PYTHON = str(REPO / ".venv" / "bin" / "python")
SHADOWS = ("sh1", "sh2")
MASTER_PORT = 29500
TRAIN_TIMEOUT_S = 90.0
LOSS = 0.01
DROP_SEED = 7


@dataclass
class Run:
    """What one training run through the switch produced."""

    spec: JobSpec
    probes: list[dict[str, Any]]
    """ddp_probe's report per rank, in rank order."""
    captures: dict[str, dict[str, Any]]
    """examples.capture's summary per shadow."""
    shown: dict[str, Any]
    """``checkmate-ctl job show --json``."""
    switch_drops: dict[str, int] = field(default_factory=dict)
    """The switch's drop counters at exit: ``REASON@PORT`` -> frames."""
    outputs: dict[str, str] = field(default_factory=dict)
    """Each worker's stdout and stderr."""
    train_seconds: float = 0.0
    saved: Path | None = None
    """Rank 0's final state_dict."""


def _start(net: RunningNetwork, host: str, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return net.popen(host, argv, stdout=out, stderr=subprocess.STDOUT)


def _stop(process: subprocess.Popen[bytes], sig: int = signal.SIGKILL, timeout: float = 10.0) -> None:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout)


def _wait_files(paths: list[Path], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not created within {timeout:.0f} s: {[str(p) for p in paths if not p.exists()]}"
            )
        time.sleep(0.05)


def _switch_drops(log_file: Path) -> dict[str, int]:
    """The ``drops:`` of the embedded switch's ``final counts`` log line (logged when it stops)."""
    lines = [line for line in log_file.read_text(errors="replace").splitlines() if "final counts:" in line]
    assert lines, f"no final counts in {log_file}"
    _, _, drops = lines[-1].partition("drops:")
    return {key: int(value) for key, value in re.findall(r"(\w+@\d+)=(\d+)", drops)}


def _env(net: RunningNetwork, workers: tuple[str, ...], rank: int, job_file: Path) -> list[str]:
    """``env K=V ...`` for one rank: torchrun's variables plus the Checkmate job file."""
    values = {
        "RANK": rank,
        "LOCAL_RANK": 0,
        "WORLD_SIZE": len(workers),
        "MASTER_ADDR": net.network.host(workers[0]).address,
        "MASTER_PORT": MASTER_PORT,
        "GLOO_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": 1,
        "CHECKMATE_JOB_FILE": job_file,
        "CHECKMATE_TIMEOUT": 30,
        "CHECKMATE_PEER_TIMEOUT": 15,
    }
    return ["env", *[f"{key}={value}" for key, value in values.items()]]


def _train(
    net: RunningNetwork, folder: Path, workers: tuple[str, ...], argv: list[str], name: str
) -> tuple[dict[str, str], float]:
    """Run ``argv`` (after the env) on every worker at once; their outputs and the wall time."""
    job_file = folder / "job-file.json"
    logs = {w: folder / f"{name}-{w}.log" for w in workers}
    started = time.monotonic()
    procs = {
        w: _start(net, w, [*_env(net, workers, r, job_file), *argv], logs[w]) for r, w in enumerate(workers)
    }
    try:
        deadline = started + TRAIN_TIMEOUT_S
        for worker, proc in procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"{name} on {worker} did not finish within {TRAIN_TIMEOUT_S:.0f} s:\n"
                    + logs[worker].read_text(errors="replace")[-3000:]
                ) from None
    finally:
        for proc in procs.values():
            _stop(proc)
    outputs = {w: logs[w].read_text(errors="replace") for w in workers}
    failed = {w: outputs[w][-3000:] for w, p in procs.items() if p.returncode != 0}
    assert not failed, f"{name} failed: {failed}"
    return outputs, time.monotonic() - started


def train_through_switch(
    folder: Path,
    job_id: int,
    workers: tuple[str, ...],
    steps: int,
    loss: float = 0.0,
    plain_too: bool = False,
) -> Run:
    """Bring ``single`` up, add the job, capture at both shadows, train, take it down: a :class:`Run`.

    ``plain_too``: afterwards also run the script without its Checkmate lines (saved to
    ``plain.pt``) through the same switch, for a bit-for-bit comparison.
    """
    network_file = topology_copy("single", folder)
    network = Network.load(network_file)
    switch_args: tuple[str, ...] = ()
    if loss:
        ports = " ".join(f"--drop-egress {network.attachment(w)[1]}:{loss}" for w in workers)
        switch_args = (f"s1={ports} --drop-seed {DROP_SEED}",)
    net = RunningNetwork(
        name="single",
        target="embedded",
        network_file=network_file,
        run_dir=folder / "run",
        state_dir=folder / "ctl",
        network=network,
        interfaces_before=root_interfaces(),
        switch_args=switch_args,
    )
    captures: dict[str, subprocess.Popen[bytes]] = {}
    probe_dir = folder / "probe"
    try:
        result = net.up()
        assert result.returncode == 0, f"up failed:\n{result.stdout}\n{result.stderr}"
        spec = JobSpec(job_id, workers, SHADOWS)
        spec_file = folder / "job.json"
        spec_file.write_text(json.dumps(spec.to_json()))
        net.ctl("job", "add", "--spec", str(spec_file))
        (folder / "job-file.json").write_text(
            json.dumps(
                {
                    "job": spec.to_json(),
                    "worker_addresses": [f"{network.host(w).address}:{CHECKMATE_UDP_PORT}" for w in workers],
                    "shadow_control": {},  # no shadow node: the workers must not wait for one
                }
            )
        )
        for shadow in SHADOWS:
            argv = [PYTHON, "-m", "examples.capture", "--port", str(spec.shadow_port)]
            argv += ["--out", str(folder / f"{shadow}.json"), "--ready", str(folder / f"{shadow}.ready")]
            argv += ["--max-seconds", str(TRAIN_TIMEOUT_S * 2)]
            captures[shadow] = _start(net, shadow, argv, folder / f"capture-{shadow}.log")
        _wait_files([folder / f"{s}.ready" for s in SHADOWS])

        argv = [PYTHON, "-m", "examples.ddp_probe", "--out", str(probe_dir), str(SCRIPT)]
        argv += ["--steps", str(steps), "--save", str(folder / "checkmate.pt")]
        outputs, seconds = _train(net, folder, workers, argv, "checkmate")
        time.sleep(0.5)  # copies still queued in the switch or a socket
        for process in captures.values():
            _stop(process, signal.SIGTERM)
        for shadow, process in captures.items():
            assert process.returncode == 0, (folder / f"capture-{shadow}.log").read_text()
        shown = json.loads(net.ctl("job", "show", str(job_id), "--json").stdout)

        if plain_too:
            plain = folder / "train_ddp_plain.py"
            plain.write_text(plain_ddp_source())
            argv = [PYTHON, str(plain), "--steps", str(steps), "--save", str(folder / "plain.pt")]
            outputs.update(
                {f"plain-{w}": o for w, o in _train(net, folder, workers, argv, "plain")[0].items()}
            )

        result = net.down()
        assert result.returncode == 0, result.stdout + result.stderr
        assert net.state is not None
        drops = _switch_drops(Path(net.state.switches["s1"].log_file))
    finally:
        for process in captures.values():
            _stop(process)
        net.finalize()
    return Run(
        spec=spec,
        probes=[json.loads((probe_dir / f"rank{r}.json").read_text()) for r in range(len(workers))],
        captures={s: json.loads((folder / f"{s}.json").read_text()) for s in SHADOWS},
        shown=shown,
        switch_drops=drops,
        outputs=outputs,
        train_seconds=seconds,
        saved=folder / "checkmate.pt",
    )


def check_coverage(run: Run, lossless: bool) -> dict[str, Any]:
    """Every assertion on coverage, tags, counters and parameters; returns the measured figures."""
    spec, probes = run.spec, run.probes
    world = spec.world_size
    for p in probes:
        assert p["agent"] and p["exit_status"] == 0, p.get("error")
        assert p["world_size"] == world and p["job_id"] == spec.job_id
        assert p["dtypes"] == ["float32"]
    iterations = probes[0]["iterations"]
    layouts: dict[str, dict[str, int]] = probes[0]["layouts"]
    assert iterations >= 2 and sorted(layouts, key=int) == [str(i) for i in range(iterations)]
    n_params = sum(layouts["0"].values())
    for p in probes[1:]:
        assert p["layouts"] == layouts, "ranks reduced different bucket layouts"
        assert p["reduced_sha256"] == probes[0]["reduced_sha256"], "ranks hold different reduced buckets"
        assert p["params_sha256"] == probes[0]["params_sha256"], "ranks ended with different parameters"

    # The workers tagged every element of every bucket exactly once (summed over ranks).
    tagged: dict[str, list[tuple[int, int]]] = {}
    for p in probes:
        for iteration, bucket, offset, count, shard in p["tags"]:
            assert shard == spec.shard_key_for_bucket(bucket)
            tagged.setdefault(f"{iteration}/{bucket}", []).append((offset, count))
    expected_keys: dict[str, set[str]] = {s: set() for s in SHADOWS}
    for iteration, buckets in layouts.items():
        assert sum(buckets.values()) == n_params
        for bucket, n in buckets.items():
            key = f"{iteration}/{bucket}"
            cursor = 0
            for offset, count in sorted(tagged.pop(key, [])):
                assert offset == cursor, f"{key}: tags leave a gap or overlap at {cursor}"
                cursor += count
            assert cursor == n, f"{key}: tags cover {cursor} of {n} elements"
            expected_keys[spec.shadow_for_bucket(int(bucket))].add(key)
    assert not tagged, f"tags for buckets DDP never reduced: {sorted(tagged)}"
    assert all(expected_keys.values()), f"every shadow owns some bucket: {expected_keys}"

    # Each shadow got exactly its buckets, each element at least once and with the reduced bytes.
    figures: dict[str, Any] = {"duplicates": {}, "datagrams": {}, "retransmitted_copies": {}}
    for shadow, capture in run.captures.items():
        assert capture["malformed"] == 0 and set(capture["by_type"]) <= {"DATA"}, capture["by_type"]
        assert capture["replicate_set"] == 0, "a copy left the switch with REPLICATE still set"
        assert capture["kernel"].get("RcvbufErrors", 0) == 0, f"{shadow}'s receiver fell behind"
        assert set(capture["jobs"]) == {str(spec.job_id)}, f"{shadow} got copies of other jobs"
        got = capture["jobs"][str(spec.job_id)]
        assert set(got) == expected_keys[shadow], (
            f"{shadow}: missing {sorted(expected_keys[shadow] - set(got))}, "
            f"not its own {sorted(set(got) - expected_keys[shadow])}"
        )
        for key, coverage in got.items():
            iteration, bucket = (int(x) for x in key.split("/"))
            n = layouts[str(iteration)][str(bucket)]
            assert coverage["ranges"] == [[0, n]], f"{shadow} {key}: covered {coverage['ranges']} of [0, {n})"
            assert coverage["distinct"] == n
            assert coverage["shard_keys"] == [spec.shard_key_for_bucket(bucket)]
            assert coverage["conflicting"] == 0, f"{shadow} {key}: a repeat carried different bytes"
            assert coverage["sha256"] == probes[0]["reduced_sha256"][key], (
                f"{shadow} {key}: not the reduced bytes"
            )
            if lossless:
                assert coverage["duplicates"] == 0, f"{shadow} {key}: {coverage['duplicates']} elements twice"
        figures["duplicates"][shadow] = sum(c["duplicates"] for c in got.values())
        figures["datagrams"][shadow] = capture["datagrams"]
        figures["retransmitted_copies"][shadow] = capture["retransmit"]

    # The switch counted exactly the copies the shadows received; no tagged datagram was refused.
    counters = run.shown["counters"]["s1"]
    assert counters["shadow_copies"]["packets"] == sum(c["datagrams"] for c in run.captures.values())
    assert counters["rejected_replications"]["packets"] == 0
    tags_sent = sum(len(p["tags"]) for p in probes)
    if lossless:
        assert counters["shadow_copies"]["packets"] == tags_sent

    times = [t for p in probes for t in p["iteration_seconds"][1:]]  # iteration 0 builds the buckets
    figures.update(
        iterations=iterations,
        parameters=n_params,
        tags_sent=tags_sent,
        shadow_copies=counters["shadow_copies"]["packets"],
        median_iteration_ms=round(1000 * statistics.median(times), 1),
        train_wall_s=round(run.train_seconds, 1),
        switch_drops=run.switch_drops,
        retransmissions=sum(
            v for p in probes for k, v in p["stats"]["transport"].items() if k.startswith("retransmit")
        ),
    )
    return figures


def plain_ddp_source() -> str:
    """The example script without its Checkmate lines (import, resume, enable), each a single line."""
    lines = SCRIPT.read_text().splitlines(keepends=True)
    marked = [line for line in lines if line.rstrip().endswith(MARK)]
    assert len(marked) <= 4 and sum("enable_checkmate(" in line for line in marked) == 1, marked
    plain = "".join(line for line in lines if line not in marked)
    for node in ast.walk(ast.parse(plain)):
        imported = [a.name for a in node.names] if isinstance(node, ast.Import | ast.ImportFrom) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.append(node.module)
        assert not any(name.split(".")[0] in {"hosts", "checkmate"} for name in imported), imported
        assert not (isinstance(node, ast.Constant) and node.value in {"hosts", "checkmate"}), (
            "a hidden import"
        )
    return plain


def test_two_workers_shadows_see_every_reduced_element_once(tmp_path: Path) -> None:
    plain_ddp_source()  # fails here, before any network, if the script is not plain DDP + one line
    run = train_through_switch(tmp_path, job_id=21, workers=("h1", "h2"), steps=12, plain_too=True)
    figures = check_coverage(run, lossless=True)
    assert not any(k.startswith("FAULT_INJECTION") for k in run.switch_drops), run.switch_drops
    # Without the Checkmate lines the same script is plain DDP over gloo: the same bits (2 ranks).
    ours, plain = torch.load(tmp_path / "checkmate.pt"), torch.load(tmp_path / "plain.pt")
    assert ours.keys() == plain.keys()
    for name in ours:
        assert torch.equal(ours[name].view(torch.int32), plain[name].view(torch.int32)), name
    for name, worker in (("checkmate", "h1"), ("gloo", "plain-h1")):
        steps = re.findall(r"([0-9.]+) ms/step", run.outputs[worker])
        figures[f"script_ms_per_step_{name}"] = float(steps[-1])
    print(f"\n2 workers, no loss: {json.dumps(figures)}")


def test_three_workers_shadows_see_every_reduced_element_once(tmp_path: Path) -> None:
    run = train_through_switch(tmp_path, job_id=22, workers=("h1", "h2", "h3"), steps=8)
    figures = check_coverage(run, lossless=True)
    print(f"\n3 workers, no loss: {json.dumps(figures)}")


def test_two_workers_with_one_percent_loss_still_cover_every_element(tmp_path: Path) -> None:
    run = train_through_switch(tmp_path, job_id=23, workers=("h1", "h2"), steps=12, loss=LOSS)
    figures = check_coverage(run, lossless=False)
    injected = {k: v for k, v in run.switch_drops.items() if k.startswith("FAULT_INJECTION")}
    assert sum(injected.values()) > 0, f"no frame was dropped: {run.switch_drops}"
    assert figures["retransmissions"] > 0
    print(f"\n2 workers, {LOSS:.0%} egress loss on worker ports: {json.dumps(figures)}")
