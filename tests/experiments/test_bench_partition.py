"""The benchmark's CPU partition: parsing and checks, and that pinned processes really have the CPU set."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from experiments.bench.partition import (
    CpuPartition,
    PartitionError,
    check_placement,
    cpus_allowed,
    default_partition,
    descendants,
    exec_prefix,
    format_cpu_list,
    make_partition,
    parse_cpu_list,
    pin_process,
    read_back,
)

CPUS = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs this process may use")

SLEEPER = "import os, sys, threading, time; threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); print(os.getpid(), flush=True); time.sleep(30)"  # noqa: E501


def test_cpu_lists_round_trip_and_bad_ones_refused() -> None:
    assert parse_cpu_list("0-2,5") == {0, 1, 2, 5}
    assert parse_cpu_list(" 3 ") == {3}
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert parse_cpu_list(format_cpu_list({4, 0, 9, 1})) == {0, 1, 4, 9}
    for bad in ("", "a", "1-", "3-1", "-1", "0,,x"):
        with pytest.raises(PartitionError):
            parse_cpu_list(bad)


def test_default_partition_splits_disjoint_halves() -> None:
    assert default_partition([0, 1]) == CpuPartition(frozenset({0}), frozenset({1}))
    assert default_partition(range(5)) == CpuPartition(frozenset({0, 1, 2}), frozenset({3, 4}))
    with pytest.raises(PartitionError, match="at least 2 CPUs"):
        default_partition([0])


def test_make_partition_refuses_missing_overlapping_and_empty_sets() -> None:
    available = [0, 1, 2, 3]
    assert make_partition("0", "1-3", available) == CpuPartition(frozenset({0}), frozenset({1, 2, 3}))
    assert make_partition("0-1", None, available).infrastructure == {2, 3}  # the rest
    assert make_partition(None, "3", available).workers == {0, 1, 2}
    with pytest.raises(PartitionError, match="not available here"):
        make_partition("0", "7", available)
    with pytest.raises(PartitionError, match="overlap on 1"):
        make_partition("0-1", "1-2", available)
    with pytest.raises(PartitionError, match="empty"):
        make_partition("0-3", None, available)


def test_check_placement_names_each_stray_process() -> None:
    partition = CpuPartition(frozenset({0}), frozenset({1}))
    good = {
        "workers": [{"pid": 10, "cpus_allowed_list": "0"}],
        "switch": [{"pid": 11, "cpus_allowed_list": "1"}],
    }
    assert check_placement(good, partition) == []
    bad = {
        "workers": [{"pid": 10, "cpus_allowed_list": "0-1"}],
        "switch": [{"pid": 11, "cpus_allowed_list": "1", "threads_cpus_allowed_lists": ["0", "1"]}],
    }
    problems = check_placement(bad, partition, required=("workers", "shadows"))
    assert any("workers pid 10 may run on 0-1" in p for p in problems)
    assert any("switch pid 11 may run on 0" in p for p in problems)
    assert "no shadows process was found to check" in problems


@contextmanager
def _started(argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        yield process
    finally:
        process.kill()
        process.wait(timeout=10)


@two_cpus
def test_exec_wrapper_pins_the_same_pid_also_when_its_parent_is_pinned_elsewhere() -> None:
    workers, infrastructure = CPUS[0], CPUS[1]
    # the parent is pinned to the infrastructure CPU, as the benchmark is; the worker must still
    # get the worker CPU (a wrapper that checked its own mask refused exactly this)
    parent = [
        sys.executable,
        "-c",
        f"import os, sys; os.sched_setaffinity(0, {{{infrastructure}}}); os.execv(sys.argv[1], sys.argv[1:])",
    ]
    argv = [*parent, *exec_prefix({workers}), sys.executable, "-c", SLEEPER]
    with _started(argv) as process:
        assert process.stdout is not None
        printed = int(process.stdout.readline())
        assert printed == process.pid  # exec'd: the launcher's signals reach the command itself
        assert cpus_allowed(process.pid) == {workers}
        observed = read_back({"workers": [process.pid]})
        assert observed["workers"][0]["cpus_allowed_list"] == str(workers)
        assert "threads_cpus_allowed_lists" not in observed["workers"][0]  # its thread has it too
        assert (
            check_placement(observed, CpuPartition(frozenset({workers}), frozenset({infrastructure}))) == []
        )


@two_cpus
def test_exec_wrapper_refuses_a_cpu_the_machine_lacks() -> None:
    missing = max(CPUS) + 64
    result = subprocess.run(
        [*exec_prefix({missing}), sys.executable, "-c", "print('ran')"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "ran" not in result.stdout
    assert f"cannot run on CPUs {missing}" in result.stderr


@two_cpus
def test_pin_process_sets_every_thread_and_children_inherit() -> None:
    target = CPUS[1]
    with _started([sys.executable, "-c", SLEEPER]) as process:
        assert process.stdout is not None
        process.stdout.readline()
        time.sleep(0.2)  # its second thread is running
        pin_process(process.pid, {target})
        observed = read_back({"x": [process.pid]})["x"][0]
        assert observed["cpus_allowed_list"] == str(target)
        assert "threads_cpus_allowed_lists" not in observed
        tids = os.listdir(f"/proc/{process.pid}/task")
        assert len(tids) >= 2
        assert all(cpus_allowed(int(t)) == {target} for t in tids)
    # a child started after this process pins itself inherits the mask (how the switch and shadows get it)
    before = os.sched_getaffinity(0)
    try:
        pin_process(0, {target})
        with _started([sys.executable, "-c", SLEEPER]) as child:
            assert child.stdout is not None
            child.stdout.readline()
            assert cpus_allowed(child.pid) == {target}
            assert child.pid in descendants(os.getpid())
    finally:
        pin_process(0, before)
    assert os.sched_getaffinity(0) == before


def test_read_back_leaves_out_vanished_processes() -> None:
    beyond = int(open("/proc/sys/kernel/pid_max").read()) + 1  # no process can have it
    observed = read_back({"workers": [os.getpid(), beyond]})
    assert [p["pid"] for p in observed["workers"]] == [os.getpid()]
    assert cpus_allowed(beyond) is None
