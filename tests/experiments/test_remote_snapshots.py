"""Shadows' snapshots on remote storage (nfs://): written, pointed at, pruned and read back as on a
local disk, and a storage that is unreachable, full or silent fails a write clearly without
stopping the writer or leaving ``latest`` on a partial step.

The server is a real nfs-ganesha (:mod:`tests.experiments.nfs_server`); the tests that need none
(URL handling, the error mapping) run everywhere.
"""

from __future__ import annotations

import errno
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from checkmate import checkpoint as fmt
from checkmate import nfs
from checkmate.checkpoint import CheckpointReader
from checkmate.checkpoint.remote import RemoteRoot, url_of
from checkmate.checkpoint.source import SnapshotDirectory
from experiments.bench.storage_host import EXPORT_PSEUDO
from shadow.snapshots import Snapshot, SnapshotPolicy, Snapshotter, disk_status, local_directory
from tests.experiments.nfs_server import EXPORT_MIB, UNREACHABLE, Served, needs_server, serve


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve(tmp_path_factory)


def snapshot(step: int, shard: int = 0, num_shards: int = 1, rows: int = 4) -> Snapshot:
    weight = torch.full((rows, 4), float(step))
    return Snapshot(
        step,
        shard,
        num_shards,
        {f"w{shard}": {"param": weight}},
        {f"w{s}": ([rows, 4], "torch.float32") for s in range(num_shards)},
        {"kind": "SGD"},
        {"data_position": {"epoch": 0, "index": step}},
    )


def policy(url: str, tmp_path: Path, **kwargs: Any) -> SnapshotPolicy:
    """A remote policy whose local directory is the test's (not the shared temporary one)."""
    return SnapshotPolicy(tmp_path / "local", remote=url, **kwargs)


def wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


# ---- without a server -------------------------------------------------------------------------
def test_a_url_names_the_remote_and_the_local_directory_stays_a_path(tmp_path: Path) -> None:
    given = SnapshotPolicy("nfs://10.0.8.1/checkpoints/shadows")  # type: ignore[arg-type]
    assert given.remote == "nfs://10.0.8.1/checkpoints/shadows"
    assert given.directory == local_directory(given.remote)
    assert given.directory.parts[-3:] == ("10.0.8.1", "checkpoints", "shadows")
    assert isinstance(given.directory, Path) and "checkmate-snapshots" in given.directory.parts
    assert url_of(Path("nfs://10.0.8.1/checkpoints/shadows")) == "nfs://10.0.8.1/checkpoints/shadows"
    assert url_of(tmp_path) is None and url_of("snapshots") is None
    assert SnapshotPolicy(tmp_path).remote is None
    with pytest.raises(ValueError, match="names a server and an export"):
        SnapshotPolicy(tmp_path, remote="nfs://10.0.8.1")
    with pytest.raises(ValueError, match="timeout must be positive"):
        SnapshotPolicy(tmp_path, remote="nfs://10.0.8.1/checkpoints", timeout=0)


def test_the_shadow_cli_keeps_a_url_and_refuses_a_malformed_one() -> None:
    from shadow.cli import _parser as build_parser

    base = ["run", "--name", "sh1"]
    args = build_parser().parse_args([*base, "--snapshot-dir", "nfs://10.0.8.1/checkpoints/shadows"])
    assert args.snapshot_dir == "nfs://10.0.8.1/checkpoints/shadows"
    assert build_parser().parse_args([*base, "--snapshot-dir", "snaps"]).snapshot_dir == Path("snaps")
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--snapshot-dir", "nfs://10.0.8.1"])


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("nfs://", "names a server and an export"),
        ("nfs://10.0.8.1", "names a server and an export"),
        ("nfs:///checkpoints/shadows", "names a server and an export"),
        ("nfs://10.0.8.1:2049/checkpoints", "host name or an IPv4 address"),
        ("nfs://a b/checkpoints", "host name or an IPv4 address"),
        ("nfs://-x/checkpoints", "host name or an IPv4 address"),
        ("nfs://10.0.8.1/checkpoints/a\x00b", "NUL"),
    ],
)
def test_every_command_refuses_a_malformed_url_before_it_connects(
    url: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each entry point that takes a remote directory answers a bad URL with a usage error naming the rule."""
    from checkmate.checkpoint.cli import build_parser as ckpt_parser
    from examples.train_lm import build_parser as train_parser
    from shadow.cli import _parser as shadow_parser

    with pytest.raises(ValueError, match=words):
        nfs.NFSURL.parse(url)
    for parse in (
        lambda: ckpt_parser().parse_args(["verify", url]),
        lambda: shadow_parser().parse_args(["run", "--name", "sh1", "--snapshot-dir", url]),
        lambda: train_parser().parse_args(["--checkpoint", "torch-save", "--checkpoint-dir", url]),
        lambda: train_parser().parse_args(["--snapshot-dir", url]),
    ):
        with pytest.raises(SystemExit) as exited:
            parse()
        assert exited.value.code == 2
        assert words in capsys.readouterr().err


def test_a_url_keeps_its_server_and_export_and_a_directory_stays_a_path() -> None:
    assert (
        nfs.location_argument("nfs://storage-1.example/checkpoints/run/")
        == "nfs://storage-1.example/checkpoints/run"
    )
    assert nfs.location_argument("nfs://10.0.8.1/checkpoints") == "nfs://10.0.8.1/checkpoints"
    assert nfs.location_argument("snaps/run 1") == Path("snaps/run 1")
    assert nfs.NFSURL.parse("nfs://h/e/with space/x").path == "/with space/x"
    assert url_of("nfs://") == "nfs://"  # not the local directory "nfs:"


class _Library:
    """libnfs's error for a call, as the client reads it."""

    def __init__(self, message: bytes) -> None:
        self.message = message

    def nfs_get_error(self, context: object) -> bytes:
        return self.message


@pytest.mark.parametrize(
    ("ran_s", "code", "words"),
    [(3.0, errno.ETIMEDOUT, "within the client's 3 s timeout"), (0.2, errno.ECONNABORTED, "connection")],
)
def test_a_cancelled_call_reads_as_the_timeout_or_a_lost_connection(
    ran_s: float, code: int, words: str
) -> None:
    client = object.__new__(nfs.NFSClient)
    client.server, client.export, client.timeout = "10.0.8.1", "/checkpoints", 3.0
    client._lib = _Library(b"Command was cancelled")  # type: ignore[assignment]
    client._ctx = 1
    client._call_started = time.monotonic() - ran_s
    with pytest.raises(nfs.NFSError) as caught:
        client._check(-errno.EINTR, "write", "/shadows/step-00000003/shard-000-of-002.safetensors")
    assert caught.value.errno == code
    assert words in str(caught.value) and "Command was cancelled" in str(caught.value)
    assert "10.0.8.1:/checkpoints/shadows/step-00000003" in str(caught.value)


# ---- against a real ganesha -------------------------------------------------------------------
@needs_server
def test_snapshots_go_to_the_export_with_latest_and_pruning(served: Served, tmp_path: Path) -> None:
    url = served.url("written")
    writer = Snapshotter(policy(url, tmp_path, keep=2))
    try:
        for step in range(4):
            assert writer.offer(step, lambda s=step: snapshot(s))
            assert writer.flush(30)
    finally:
        writer.close()
    assert writer.stats.written == 4 and writer.stats.failed == 0 and writer.stats.failing is None
    assert writer.stats.storage == url
    on_disk = served.export_dir / "written"
    assert sorted(p.name for p in on_disk.iterdir()) == ["latest", "step-00000002", "step-00000003"]
    assert fmt.complete_steps(on_disk) == [2, 3] and fmt.read_latest(on_disk) == 3
    assert not [p for p in on_disk.rglob(".*")]  # no temporary file left
    assert {oct(p.stat().st_mode & 0o777) for p in on_disk.rglob("*") if p.is_file()} == {"0o600"}
    # the same files a local writer makes: the reader checks every checksum
    assert torch.equal(CheckpointReader(on_disk).parameter("w0"), torch.full((4, 4), 3.0))
    status = disk_status(writer.policy.directory, 5)
    assert status["newest_complete_step"] == 3 and status["age_iterations"] == 2
    assert status["storage"] == url and status["failing"] is None


@needs_server
def test_shadows_pruning_the_same_step_leave_it_to_each_other(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two shadows prune the same old step; the one that finds it gone under it (NFS3ERR_STALE, as
    measured in a bench run) neither fails its snapshot nor drops its connection."""
    url = served.url("pruned")
    writer = Snapshotter(policy(url, tmp_path, keep=1))
    removing = nfs.NFSClient.rmtree
    raced: list[str] = []

    def raced_rmtree(client: nfs.NFSClient, path: str) -> None:
        if not raced:  # the other shadow got there first: the directory vanished mid-removal
            raced.append(path)
            removing(client, path)
            raise nfs.NFSError(errno.ESTALE, f"NFS unlink {path}: NFS3ERR_STALE(-116)")
        removing(client, path)

    monkeypatch.setattr(nfs.NFSClient, "rmtree", raced_rmtree)
    try:
        for step in range(3):
            writer.offer(step, lambda s=step: snapshot(s), force=True)
            assert writer.flush(30)
        client = writer.remote._client if writer.remote else None
        assert client is not None  # the connection was kept
    finally:
        writer.close()
    assert raced and writer.stats.failed == 0 and writer.stats.written == 3
    assert fmt.complete_steps(served.export_dir / "pruned") == [2]


@needs_server
def test_restore_reads_the_url_back(served: Served, tmp_path: Path) -> None:
    url = served.url("restore")
    shards = [Snapshotter(policy(url, tmp_path / str(k))) for k in range(2)]
    try:
        for k, writer in enumerate(shards):  # both shards of step 7; shard 0 alone of step 8
            writer.offer(7, lambda k=k: snapshot(7, k, 2))
            assert writer.flush(30)
        shards[0].offer(8, lambda: snapshot(8, 0, 2), force=True)
        assert shards[0].flush(30)
    finally:
        for writer in shards:
            writer.close()
    state = SnapshotDirectory(url).latest(timeout=20)
    assert state.iteration == 7 and state.detail == f"{url}/step-00000007"
    assert torch.equal(state.parameters["w1"], torch.full((4, 4), 7.0))
    assert state.data_position == {"epoch": 0, "index": 7}
    # a caller that made a Path of the URL (hosts.resume does) reaches the export too
    assert SnapshotDirectory(Path(url)).latest().iteration == 7
    reader = CheckpointReader(url)
    assert reader.location == url and reader.step == 7 and fmt.read_latest(reader.root) == 7
    staged = reader.root
    del reader
    assert not staged.exists()  # the staged copy goes with the reader
    from checkmate.checkpoint.cli import main as checkmate_ckpt

    assert checkmate_ckpt(["verify", url]) == 0  # every checksum, read from the staged copy
    from checkmate.checkpoint.source import SourceError

    with pytest.raises(SourceError, match=f"no usable checkpoint in {served.url('nowhere')}"):
        SnapshotDirectory(served.url("nowhere")).latest(timeout=20)


@needs_server
def test_the_status_goes_to_the_export_so_a_restore_from_the_url_knows_what_it_lost(
    served: Served, tmp_path: Path
) -> None:
    """The node hands its status to the writer; the export then holds ``status-<shadow>.json`` and a
    restore from the URL says how far the shadows' memory was ahead of the step it read."""
    url = served.url("status")
    on_disk = served.export_dir / "status"
    writer = Snapshotter(policy(url, tmp_path))
    try:
        assert writer.offer(4, lambda: snapshot(4))
        assert writer.flush(30)
        assert SnapshotDirectory(url).latest(timeout=20).lost_iterations is None  # no status yet: unknown
        writer.publish_status("status-sh1.json", json.dumps({"applied_iteration": 6}).encode())
        wait_for(lambda: (on_disk / "status-sh1.json").is_file())
        # the newest document wins, and the last one given before close still goes out
        writer.publish_status("status-sh1.json", json.dumps({"applied_iteration": 9}).encode())
    finally:
        writer.close()
    assert json.loads((on_disk / "status-sh1.json").read_text()) == {"applied_iteration": 9}
    assert not [p for p in on_disk.rglob(".*")]  # written whole: no temporary name left
    assert fmt.complete_steps(on_disk) == [4]  # a status file is not a step
    state = SnapshotDirectory(url).latest(timeout=20)
    assert state.iteration == 4 and state.lost_iterations == 5
    with pytest.raises(ValueError, match="plain file name"):
        RemoteRoot(url).write_file("../escape.json", b"{}")


def test_the_node_hands_its_status_to_the_remote_writer(tmp_path: Path) -> None:
    """Maintenance writes the status file locally and gives the same document to the publisher."""
    import threading
    from types import SimpleNamespace

    from shadow.node_maintenance import Maintenance

    given: list[tuple[str, bytes]] = []
    config = SimpleNamespace(
        name="sh7", resync_on_unrepairable=True, status_file=tmp_path / "status-sh7.json", snapshots=None
    )
    maintenance = Maintenance(
        config,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        lambda: {"applied_iteration": 3},
        threading.Event(),
        lambda name, document: given.append((name, document)),
    )
    maintenance.write_status()
    assert given == [("status-sh7.json", (tmp_path / "status-sh7.json").read_bytes())]
    assert json.loads(given[0][1]) == {"applied_iteration": 3}


@needs_server
def test_resume_stages_the_newest_complete_step_locally(served: Served, tmp_path: Path) -> None:
    url = served.url("resume")
    writer = Snapshotter(policy(url, tmp_path / "first"))
    try:
        writer.offer(4, lambda: snapshot(4))
        assert writer.flush(30)
    finally:
        writer.close()
    again = Snapshotter(policy(url, tmp_path / "again", stage_latest=True))
    again.close()
    local = tmp_path / "again" / "local"
    assert fmt.complete_steps(local) == [4] and fmt.read_latest(local) == 4


@needs_server
def test_a_full_export_fails_the_write_and_latest_stays_on_the_whole_step(
    served: Served, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = served.url("full")
    writer = Snapshotter(policy(url, tmp_path))
    rows = ((EXPORT_MIB + 8) << 20) // 16  # a shard larger than the export
    try:
        writer.offer(1, lambda: snapshot(1))
        assert writer.flush(30) and writer.stats.failing is None
        writer.offer(2, lambda: snapshot(2, rows=rows), force=True)
        wait_for(lambda: writer.stats.failed >= 1, 60)
        assert writer.stats.written == 1
        failing = writer.stats.failing or ""
        assert f"snapshot of step 2 (shard 0) to {url} failed" in failing
        assert "No space left on device" in failing or "quota" in failing.lower(), failing
        assert any(url in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
        status = disk_status(writer.policy.directory, 2)
        assert status["newest_complete_step"] == 1 and status["failing"] == failing
        on_disk = served.export_dir / "full"
        assert fmt.read_latest(on_disk) == 1 and fmt.complete_steps(on_disk) == [1]
        assert not (on_disk / "step-00000002" / "shard-000-of-001.safetensors").exists()
        assert not [p for p in (on_disk / "step-00000002").iterdir() if p.name.startswith(".")]
        flushing = time.monotonic()
        assert not writer.flush(
            60
        )  # the storage is failing: a flush (the shadow's close) does not wait on it
        assert time.monotonic() - flushing < 10
        # the writer keeps going: the next capture (3) replaces the failed one (2) and is written
        writer.offer(3, lambda: snapshot(3), force=True)
        wait_for(lambda: writer.stats.last_step == 3, 60)
        assert writer.stats.failing is None and writer.stats.written == 2
        assert fmt.read_latest(on_disk) == 3
    finally:
        writer.close()


@needs_server
def test_a_silent_server_fails_the_write_within_the_timeout_and_offers_never_wait(
    served: Served, tmp_path: Path
) -> None:
    url = served.url("silent")
    writer = Snapshotter(policy(url, tmp_path, timeout=3.0))
    try:
        writer.offer(1, lambda: snapshot(1))
        assert writer.flush(30)
        served.server.pause()
        try:
            started = time.monotonic()
            writer.offer(2, lambda: snapshot(2), force=True)
            for step in range(3, 6):  # the writer is stuck on the server: offers return at once
                assert writer.offer(step, lambda s=step: snapshot(s), force=True)
            assert time.monotonic() - started < 2.0
            wait_for(lambda: writer.stats.failed >= 1)
            took = time.monotonic() - started
        finally:
            served.server.resume()
        failing = writer.stats.failing or ""
        assert f"to {url} failed" in failing and "3 s" in failing, failing
        assert took < 30, took
        assert json.dumps(vars(writer.stats))  # the status document takes it as it is
        # the failed capture (the newest, 5) is held and written once the server answers again
        wait_for(lambda: writer.stats.failing is None, 60)
        assert writer.flush(30)
        assert writer.stats.last_step == 5 and writer.stats.written == 2
    finally:
        writer.close()
    assert fmt.read_latest(served.export_dir / "silent") == 5


@needs_server
def test_an_unreachable_server_is_said_and_the_shadow_goes_on(served: Served, tmp_path: Path) -> None:
    url = f"nfs://{UNREACHABLE}{EXPORT_PSEUDO}/shadows"
    started = time.monotonic()
    writer = Snapshotter(policy(url, tmp_path, timeout=3.0))
    assert time.monotonic() - started < 1.0  # nothing is asked of the server at start
    try:
        assert writer.offer(1, lambda: snapshot(1))
        wait_for(lambda: writer.stats.failed >= 1)
        failing = writer.stats.failing or ""
        assert f"to {url} failed" in failing and UNREACHABLE in failing, failing
        assert disk_status(writer.policy.directory, 1)["newest_complete_step"] is None
        assert writer.offer(2, lambda: snapshot(2), force=True)  # still taking captures
        writer.publish_status("status-sh1.json", b"{}")  # returns at once; its upload fails and is said
    finally:
        writer.close(timeout=1.0)
    with pytest.raises(nfs.NFSError):
        RemoteRoot(url, timeout=3.0).complete_steps()


@needs_server
def test_a_status_the_storage_cannot_take_is_said_once_and_never_holds_up_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Status uploads to an unreachable server: one warning (repeats go to debug, with a growing
    back-off), and at close a failing storage is not waited on again."""
    url = f"nfs://{UNREACHABLE}{EXPORT_PSEUDO}/shadows"
    writer = Snapshotter(policy(url, tmp_path, timeout=2.0))
    caplog.set_level("DEBUG", logger="shadow.snapshots")
    try:
        writer.publish_status("status-sh1.json", b"{}")
        wait_for(lambda: any("cannot put the status file" in r.getMessage() for r in caplog.records))
        writer.publish_status("status-sh1.json", b'{"applied_iteration": 1}')
    finally:
        writer.close(timeout=30.0)
    assert not writer._thread.is_alive()
    said = [r for r in caplog.records if "cannot put the status file status-sh1.json" in r.getMessage()]
    assert [r.levelname for r in said][:1] == ["WARNING"]
    assert all(r.levelname == "DEBUG" for r in said[1:])
    assert writer.stats.written == 0 and writer.stats.failed == 0  # a status is not a snapshot


def test_the_bench_starts_shadows_persisting_to_the_url_with_their_status_kept_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from experiments import shadows as module
    from experiments.bench.storage_host import SHADOW_SNAPSHOTS, storage_url

    started: list[list[str]] = []
    monkeypatch.setattr(module.subprocess, "Popen", lambda argv, **kwargs: started.append(argv))
    monkeypatch.setattr(module, "secret_env", lambda job_file: {})
    config = SimpleNamespace(python="python", job_id=1, shadows=["sh1"], snapshot_keep=3)
    processes = module.ShadowProcesses(
        config,  # type: ignore[arg-type]
        tmp_path / "net",
        tmp_path / "snapshots",
        tmp_path / "logs",
        tmp_path / "job.json",
        lambda host: "10.0.1.1",
        None,  # type: ignore[arg-type]
    )
    processes.snapshot_url = storage_url(SHADOW_SNAPSHOTS)
    processes.start("sh1")
    argv = started[0]
    assert argv[argv.index("--snapshot-dir") + 1] == "nfs://10.0.8.1/checkpoints/shadows"
    assert argv[argv.index("--status-file") + 1] == str(tmp_path / "snapshots" / "status-sh1.json")


def test_the_workers_fall_back_to_where_the_shadows_persist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the shadows on the storage host, train_lm's --snapshot-dir (its resume's fallback when
    the shadows' memory is gone) is the same URL; with local snapshots, the run's directory."""
    from experiments import job as module
    from experiments.bench.storage_host import SHADOW_SNAPSHOTS, storage_url
    from experiments.job_config import JobConfig

    monkeypatch.setattr(module, "secret_env", lambda job_file, env: {})
    run = module.JobRun(JobConfig(work_dir=tmp_path, results_dir=None))
    monkeypatch.setattr(run, "address", lambda host: "10.0.0.1")

    def fallback() -> str:
        args = list(run.launch_config(tmp_path / "logs", tmp_path / "job.json", (), False).command)
        return args[args.index("--snapshot-dir") + 1]

    assert fallback() == str(run.snapshot_dir)
    run.shadows.snapshot_url = storage_url(SHADOW_SNAPSHOTS)
    assert fallback() == "nfs://10.0.8.1/checkpoints/shadows"


@needs_server
def test_the_storage_probe_reports_rates_and_its_own_cpu_per_write(served: Served) -> None:
    """make bench's remote storage measurement: each write's wall time and the client's CPU time."""
    from experiments.bench.storage_probe import probe

    found = probe(served.url("probe"), 2 << 20, 2, timeout=20)
    assert found["bytes"] == 2 << 20 and found["writes"] == 2
    durable, cpu = found["durable_s"], found["cpu_s"]
    assert isinstance(durable, list) and isinstance(cpu, list) and len(cpu) == 2
    assert all(c > 0 for c in cpu) and 0 < float(found["cpu_s_per_write"]) <= max(cpu)  # type: ignore[arg-type]
    assert float(found["durable_MBps"]) > 0  # type: ignore[arg-type]
    assert not list((served.export_dir / "probe").iterdir())  # its files are removed
