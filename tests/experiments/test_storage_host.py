"""The bench's remote storage: nfs-ganesha in a namespace of its own, written through checkmate.nfs.

The server (:mod:`tests.experiments.nfs_server`) exports a small tmpfs so that "full" is
reachable; the client is libnfs through :mod:`checkmate.nfs`. Skipped with the reason when not
root or when nfs-ganesha, its VFS backend or libnfs is not installed (``make setup`` installs them).
"""

from __future__ import annotations

import errno
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from checkmate import nfs
from experiments.bench import storage_host
from experiments.bench.storage_host import EXPORT_PSEUDO, NFSServer, StorageHostError
from tests.experiments.nfs_server import EXPORT_MIB, UNREACHABLE, Served, missing, needs_server, serve


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve(tmp_path_factory)


def _state(seed: int = 0) -> dict[str, object]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {
        "weight": torch.randn(512, 1024, generator=generator),  # 2 MiB
        "step": torch.tensor([7], dtype=torch.int64),
        "iteration": 12,
    }


@needs_server
def test_torch_save_writes_the_same_bytes_to_the_export_as_to_a_local_file(served: Served) -> None:
    import torch

    state = _state()
    with served.client() as client:
        client.makedirs("/ts")
        nfs.write_atomically(client, "/ts/checkpoint.pt", lambda f: torch.save(state, f))
        assert client.listdir("/ts") == ["checkpoint.pt"]  # the temporary file was renamed
        with client.open("/ts/checkpoint.pt") as raw:
            loaded = torch.load(raw, weights_only=True)
    local = io.BytesIO()
    torch.save(state, local)  # a file object, as the NFS file is (a path would name the archive after it)
    assert (served.export_dir / "ts" / "checkpoint.pt").read_bytes() == local.getvalue()
    assert torch.equal(loaded["weight"], state["weight"]) and loaded["iteration"] == 12


@needs_server
def test_dcp_writes_and_reads_the_export_through_fsspec(served: Served) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from checkmate.nfs_fsspec import register

    register()
    state = _state(1)
    url = served.url("dcp/slot-0")
    dcp.save({"model": state}, storage_writer=FsspecWriter(url, sync_files=False), no_dist=True)
    files = sorted(p.name for p in (served.export_dir / "dcp" / "slot-0").iterdir())
    assert ".metadata" in files and any(name.endswith(".distcp") for name in files), files
    target = {"model": {"weight": torch.zeros(512, 1024), "step": torch.zeros(1, dtype=torch.int64)}}
    dcp.load(target, storage_reader=FsspecReader(url), no_dist=True)
    assert torch.equal(target["model"]["weight"], state["weight"])
    assert torch.equal(target["model"]["step"], state["step"])


@needs_server
def test_a_full_export_fails_the_write_and_leaves_no_partial_file(served: Served) -> None:
    too_big = b"\xa5" * ((EXPORT_MIB + 8) << 20)
    with served.client() as client:
        client.makedirs("/full")
        with pytest.raises(nfs.NFSError) as caught:
            nfs.write_atomically(client, "/full/checkpoint.pt", lambda f: f.write(too_big))
        assert caught.value.errno in (errno.ENOSPC, errno.EDQUOT), caught.value
        assert "/full/.checkpoint.pt.tmp-" in str(caught.value)
        assert client.listdir("/full") == []
    assert list((served.export_dir / "full").iterdir()) == []


@needs_server
def test_a_silent_server_fails_the_write_within_the_timeout(served: Served) -> None:
    with served.client(timeout=3.0) as client:
        client.makedirs("/slow")
        served.server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(nfs.NFSError) as caught:
                nfs.write_atomically(client, "/slow/checkpoint.pt", lambda f: f.write(b"x" * (4 << 20)))
            took = time.monotonic() - started
        finally:
            served.server.resume()
        assert caught.value.errno == errno.ETIMEDOUT, caught.value
        assert took < 30, took
    with served.client() as client:
        assert "checkpoint.pt" not in client.listdir("/slow")


@needs_server
def test_an_unreachable_server_fails_with_a_clear_error(served: Served) -> None:
    started = time.monotonic()
    with pytest.raises(nfs.NFSError) as caught:
        nfs.NFSClient(UNREACHABLE, EXPORT_PSEUDO, timeout=3.0)
    assert time.monotonic() - started < 30
    assert UNREACHABLE in str(caught.value) and "mount" in str(caught.value)


@needs_server
def test_the_server_refuses_to_start_on_a_missing_backend_with_its_log(tmp_path: Path) -> None:
    server = NFSServer(tmp_path / "export", tmp_path / "state", prefix=("false",))
    with pytest.raises(StorageHostError, match="exited with 1"):
        server.start(timeout=10)


def test_the_cited_rate_keeps_llama3s_write_to_allreduce_ratio() -> None:
    rate = storage_host.cited_rate(fabric_busbw_MBps=55.0, workers=3)
    assert rate.cluster == "llama3-405b"
    assert rate.write_s == pytest.approx(405e9 * 12 / 2000e9)
    assert rate.allreduce_s == pytest.approx(2 * 127 / 128 * 405e9 / 128 * 4 / 50e9)
    assert rate.ratio == pytest.approx(4.84, abs=0.01)
    # a checkpoint (3 bytes per gradient byte) written in `ratio` all-reduce times of this fabric
    bench_allreduce_per_gradient_byte = 2 * 2 / 3 / 55.0
    assert rate.rate_MBps * rate.ratio * bench_allreduce_per_gradient_byte == pytest.approx(3.0)
    assert rate.rate_MBps == pytest.approx(25.6, abs=0.1)
    with pytest.raises(StorageHostError, match="busbw"):
        storage_host.cited_rate(fabric_busbw_MBps=0.0, workers=3)


def test_the_storage_host_gets_its_own_switch_port() -> None:
    base = json.loads((Path(__file__).resolve().parents[2] / "topologies" / "single.json").read_text())
    topology = storage_host.with_storage_host(base)
    assert topology["hosts"]["st1"] == {"ip": "10.0.8.1/8", "mac": "08:00:00:00:08:01", "role": "host"}
    assert topology["links"][-1] == ["st1", "s1-p7"]
    assert storage_host.with_storage_host(topology) == topology
    assert storage_host.storage_url("torch-save-1") == "nfs://10.0.8.1/checkpoints/torch-save-1"


def test_the_token_bucket_command() -> None:
    assert storage_host.tbf_command("bn1-p7", 204.8) == [
        "tc", "qdisc", "replace", "dev", "bn1-p7", "root", "tbf", "rate", "204.800mbit",
        "burst", "256000", "latency", "100ms",
    ]  # fmt: skip
    with pytest.raises(StorageHostError, match="positive"):
        storage_host.tbf_command("bn1-p7", 0)


def test_the_storage_options_are_checked_before_anything_starts() -> None:
    from experiments.bench.cli import build_parser, config_from
    from experiments.bench.config import BenchError

    def config(*argv: str) -> object:
        return config_from(build_parser().parse_args(["--workloads", "tinylm", *argv]), "x")

    assert config().storage == "local"  # type: ignore[attr-defined]
    with pytest.raises(BenchError, match="--storage-mbit needs --storage remote"):
        config("--storage-mbit", "100")
    with pytest.raises(BenchError, match="--storage-cluster: unknown 'nowhere'"):
        config("--storage", "remote", "--storage-cluster", "nowhere")
    with pytest.raises(BenchError, match="--storage-mbit must be above 0"):
        config("--storage", "remote", "--storage-mbit", "0")
    if missing() is None:
        remote = config("--storage", "remote", "--storage-mbit", "200")
        assert (remote.storage, remote.storage_mbit) == ("remote", 200.0)  # type: ignore[attr-defined]


def test_large_state_runs_on_both_storages_by_default_and_tinylm_on_local(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without --storage each workload runs where its figures mean something: large-state (where
    writing the state takes longer than an iteration) on local and remote storage, TinyLM locally;
    --storage overrides it for every workload."""
    from experiments.bench import cli
    from experiments.bench import storage_host as host
    from experiments.bench.config import BenchError

    monkeypatch.setattr(host, "ganesha_missing", lambda: None)  # the plan only; nothing is started
    monkeypatch.setattr("checkmate.nfs.available", lambda: None)

    def plan(*argv: str) -> list[tuple[str, str, str]]:
        args = cli.build_parser().parse_args(["--workloads", "tinylm,large-state", "--sweep-k", "", *argv])
        return [(c.workload, c.placement, c.storage) for c in cli.plan_from(args, "x")]

    assert plan() == [
        ("tinylm", "partitioned", "local"),
        ("tinylm", "colocated", "local"),
        ("large-state", "partitioned", "local"),
        ("large-state", "partitioned", "remote"),
    ]
    assert {storage for _, _, storage in plan("--storage", "local")} == {"local"}
    assert {storage for _, _, storage in plan("--storage", "remote", "--no-emulation-check",
                                              "--storage-mbit", "200")} == {"remote"}  # fmt: skip
    # remote storage's link is shaped from the busbw the emulation check measures
    with pytest.raises(
        BenchError, match="give --storage-mbit with --no-emulation-check \\(or --storage local\\)"
    ):
        plan("--no-emulation-check")
    # where no NFS server can run, the default says so and names the way out
    monkeypatch.setattr(host, "ganesha_missing", lambda: "nfs-ganesha is not installed")
    with pytest.raises(
        BenchError, match="large-state also runs on remote storage by default.*--storage local"
    ):
        plan()
    assert {storage for _, _, storage in plan("--storage", "local")} == {"local"}
    with pytest.raises(BenchError, match="--storage: unknown"):
        plan("--storage", ",")


def test_the_docs_header_names_the_remote_storage_and_its_shaping() -> None:
    from experiments.bench.emulation import header_line

    line = header_line(
        {
            "remote_storage": {"link_mbit": 64.0, "shaped_by": "llama3-405b: 4.84 all-reduces",
                               "bytes": 1643520, "written_MBps": 8.09, "durable_MBps": 7.84},
            "storage": {"bytes": 1643520, "buffered_MBps": 2514.0, "durable_MBps": 94.0},
        }
    )  # fmt: skip
    assert "remote storage (NFS on the storage host, link shaped to 64 Mbit/s: llama3-405b" in line
    assert "8.1 MB/s written, 7.8 MB/s committed" in line
    assert "this machine's local storage (1.6 MB writes): 2514 MB/s buffered" in line


def test_both_storages_run_one_after_the_other_and_report_side_by_side() -> None:
    from experiments.bench.cli import build_parser, plan_from
    from experiments.bench.config import BenchError
    from experiments.bench.report import suite_markdown, suite_summary

    def plan(*argv: str) -> list[object]:
        args = ["--workloads", "tinylm", "--placement", "colocated", "--sweep-k", "", *argv]
        return plan_from(build_parser().parse_args(args), "x")  # type: ignore[return-value]

    if missing() is None:
        both = plan("--storage", "local,remote")
        assert [c.storage for c in both] == ["local", "remote"]  # type: ignore[attr-defined]
    with pytest.raises(BenchError, match="--storage: unknown 'nfs'"):
        plan("--storage", "local,nfs")

    def run(storage: str, rates: dict[str, float]) -> dict[str, object]:
        systems = [
            {"name": name, "checkpoint_every": 1 if name != "ideal-gloo" else None, "iterations_per_s": rate,
             "ratio_to_ideal": rate / rates["ideal-gloo"], "ratio_to_gloo_ideal": rate / rates["ideal-gloo"]}
            for name, rate in rates.items()
        ]  # fmt: skip
        return {
            "systems": systems, "targets": {}, "sweep": {}, "errors": {}, "emulation": None,
            "cpu_placement": {"mode": "colocated", "partition": None, "observed": {}, "problems": []},
            "settings": {"workload": "tinylm", "model": "TinyLM", "rounds": 1, "iterations_per_run": 20,
                         "sweep_k": [], "storage": storage},
        }  # fmt: skip

    local = run("local", {"ideal-gloo": 4.0, "torch-save-1": 2.0, "checkmate": 3.5})
    remote = run("remote", {"ideal-gloo": 4.0, "torch-save-1": 0.5})
    summary = suite_summary([local, remote], "x", 1.0)
    assert [r["storage"] for r in summary["runs"]] == ["local", "remote"]
    text = suite_markdown(summary)
    assert (
        "| system | every | co-located, local storage: iterations/s | ratio to same-transport ideal | "
        "ratio to gloo ideal | co-located, remote storage: iterations/s |" in text
    )
    assert "| torch-save-1 | 1 | 2.00 | 0.500 | 0.500 | 0.50 | 0.125 | 0.125 |" in text
    assert "| checkmate | 1 | 3.50 | 0.875 | 0.875 | — | — | — |" in text
    assert "colocated, remote storage: The emulation's bandwidths were not measured" in text
    # one storage: the table keeps its two placement groups and says nothing of storage
    alone = suite_markdown(suite_summary([local], "x", 1.0))
    assert "| system | every | partitioned: iterations/s |" in alone and "storage" not in alone


def test_with_remote_storage_the_stall_watchdog_outwaits_the_nfs_timeout(tmp_path: Path) -> None:
    """A worker stuck on a silent storage host fails with the NFS client's error, not the watchdog's."""
    from experiments.bench.config import BenchConfig
    from experiments.bench.run import STORAGE_STALL_MARGIN_S, BenchRun
    from experiments.launcher import LaunchConfig

    launch = LaunchConfig(
        run_dir=tmp_path, workers=("h1",), master_addr="10.0.1.1", command=("train",), log_dir=tmp_path
    )
    for storage, stall in (("local", launch.stall_timeout), ("remote", nfs.DEFAULT_TIMEOUT_S + 30.0)):
        config = BenchConfig(
            iterations=12, warmup=2, k=1, rounds=1, systems=("torch-save-1",), work_dir=tmp_path / storage,
            json_out=None, png_out=None, docs=None, storage=storage, measure_emulation=False,
        )  # fmt: skip
        run = BenchRun(config)
        run._system = config.known()["torch-save-1"]
        if storage == "remote":
            run._storage = storage_host.StorageHost.__new__(storage_host.StorageHost)
            run._storage.export_dir = tmp_path / "export"  # type: ignore[misc]
        assert run._launch(launch).stall_timeout == stall
    assert STORAGE_STALL_MARGIN_S == 30.0
