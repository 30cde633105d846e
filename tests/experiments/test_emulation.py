"""The emulation's own bandwidths (experiments.bench.emulation): measured, or why they are not."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.bench.emulation import checkpoint_bytes, compute_from, header_line, measure, storage_rate


def test_the_storage_is_written_at_the_size_asked_and_left_clean(tmp_path: Path) -> None:
    found = storage_rate(tmp_path / "checkpoints", 3 << 20, writes=2)
    assert found["bytes"] == 3 << 20 and found["writes"] == 2
    assert len(found["buffered_s"]) == len(found["durable_s"]) == 2
    assert found["buffered_MBps"] > 0 and found["durable_MBps"] > 0
    assert list((tmp_path / "checkpoints").iterdir()) == []  # the probes are removed
    with pytest.raises(ValueError, match="positive size"):
        storage_rate(tmp_path, 0)


def test_the_checkpoint_size_is_the_workloads_parameters_with_adamw_state() -> None:
    assert checkpoint_bytes(()) == 136_960 * 12  # TinyLM as the demo trains it
    large = ("--width", "768", "--layers", "3", "--heads", "12", "--context", "32", "--bucket-cap-mb", "8")
    assert checkpoint_bytes(large) == 21_682_944 * 12  # ~260 MB: large-state


def test_compute_is_ideal_gloos_training_thread_or_nothing() -> None:
    systems = {
        "ideal-gloo": {
            "mean_iteration_ms": 90.0,
            "worker_account": {"by_thread": {"main": {"user_ms": 60.5, "system_ms": 1.25}}},
        }
    }
    assert compute_from(systems) == {
        "source": "ideal-gloo's worker account: the training thread (forward, backward, optimizer step)",
        "cpu_ms_per_iteration": 61.75,
        "mean_iteration_ms": 90.0,
    }
    assert compute_from({"checkmate": {}}) is None


def test_what_could_not_be_measured_is_said_not_filled_in(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-topology.json"
    found = measure(missing, 3, tmp_path / "checkpoints", None, tmp_path / "work")
    assert "fabric" not in found and "storage" not in found
    assert set(found["errors"]) == {"fabric", "storage"}
    line = header_line(found)
    assert (
        "fabric not measured" in line
        and "storage not measured: the workload states no checkpoint size" in line
    )
    assert header_line(None) == "The emulation's bandwidths were not measured in this run."
    measured = {
        "fabric": {"world_size": 3, "mib": 8, "gloo_busbw_MBps": 50.0, "checkmate_busbw_MBps": 48.25},
        "storage": {"bytes": 1_643_520, "buffered_MBps": 900.4, "durable_MBps": 200.6},
        "compute": {"cpu_ms_per_iteration": 61.75},
        "errors": {},
    }
    assert header_line(measured) == (
        "The emulation itself, measured at the start: fabric (all-reduce busbw through the emulated switch, "
        "3 ranks, 8 MiB): gloo 50.0 MB/s, Checkmate's ring 48.2 MB/s; the peers' storage (1.6 MB writes): "
        "900 MB/s buffered, 201 MB/s with fsync; compute: 61.8 ms CPU per iteration (ideal-gloo)."
    )
