"""The workers' account: threads, context switches, network counters and strace read right; differences."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from checkmate.os_threads import name_os_threads
from experiments.bench.cpu_time import TICKS_PER_S
from experiments.bench.worker_account import (
    SyscallWindow,
    account,
    agent_counters,
    difference,
    parse_strace_summary,
    read_network,
    read_threads,
    take_account,
    thread_kind,
)


def test_thread_kinds_drop_the_per_instance_suffix() -> None:
    assert thread_kind("cm-rx-10.0.0.1") == "cm-rx"
    assert thread_kind("cm-timer-10.0.1.2") == "cm-timer"
    assert thread_kind("cm-ring-0") == "cm-ring"
    assert thread_kind("cm-ctl-sh1") == "cm-ctl"
    assert thread_kind("python") == "main"
    assert thread_kind("pt_autograd_0") == "pt_autograd"


def _fake_thread(
    root: Path, pid: int, tid: int, name: str, user: int, system: int, vol: int, invol: int
) -> None:
    task = root / str(pid) / "task" / str(tid)
    task.mkdir(parents=True, exist_ok=True)
    (task / "stat").write_text(f"{tid} ({name}) S 1 1 1 0 -1 0 0 0 0 0 {user} {system} 0 0 20 0 1 0\n")
    (task / "status").write_text(
        f"Name:\t{name}\nvoluntary_ctxt_switches:\t{vol}\nnonvoluntary_ctxt_switches:\t{invol}\n"
    )


def test_account_per_worker_iteration_by_thread_kind(tmp_path: Path) -> None:
    first_root, last_root = tmp_path / "a", tmp_path / "b"
    _fake_thread(first_root, 10, 10, "python", 100, 10, 5, 1)
    _fake_thread(first_root, 10, 11, "cm-timer-10.0.0.1", 0, 0, 0, 0)
    _fake_thread(first_root, 20, 20, "python", 100, 10, 5, 1)
    _fake_thread(last_root, 10, 10, "python", 100 + TICKS_PER_S, 10 + TICKS_PER_S // 10, 105, 11)
    _fake_thread(last_root, 10, 11, "cm-timer-10.0.0.1", 0, TICKS_PER_S // 10, 1000, 0)
    _fake_thread(last_root, 20, 20, "python", 100 + TICKS_PER_S, 10, 5, 1)
    first = take_account([10, 20], 5, first_root)
    last = take_account([10, 20], 15, last_root)
    result = account(first, last, workers=2)
    assert result is not None
    # 2 workers x 10 iterations: 2 s of main-thread user time -> 100 ms per worker-iteration
    assert result["by_thread"]["main"]["user_ms"] == pytest.approx(100.0)
    assert result["by_thread"]["main"]["system_ms"] == pytest.approx(5.0)
    assert result["by_thread"]["main"]["voluntary"] == pytest.approx(5.0)
    assert result["by_thread"]["cm-timer"]["voluntary"] == pytest.approx(50.0)
    assert result["total"]["voluntary"] == pytest.approx(55.0)
    assert account(first, first, workers=2) is None  # no iteration passed


def test_real_threads_and_context_switches_of_this_process() -> None:
    stop = threading.Event()

    def sleeper() -> None:
        while not stop.wait(0.001):
            pass

    thread = threading.Thread(target=sleeper, name="cm-timer-test")
    thread.start()
    assert name_os_threads() >= 1  # Python 3.11 leaves OS threads named "python"
    try:
        before = take_account([os.getpid()], 0)
        time.sleep(0.2)
        after = take_account([os.getpid()], 1)
    finally:
        stop.set()
        thread.join()
    result = account(before, after, workers=1)
    assert result is not None
    assert result["by_thread"]["cm-timer"]["voluntary"] >= 20  # a 1 ms timer wakes ~200 times in 0.2 s
    assert read_threads(2**22 + 7) == {}


def test_network_counters_of_this_namespace() -> None:
    counters = read_network(os.getpid())
    assert {"udp_in", "udp_out", "tcp_in_segments", "tcp_out_segments"} <= set(counters)


def test_difference_lines_up_both_sides() -> None:
    a = {"total": {"user_ms": 10.0, "voluntary": 3}, "by_thread": {"cm-ctl": {"user_ms": 2.0}}}
    b = {"total": {"user_ms": 7.5, "voluntary": 1}, "by_thread": {}}
    d = difference(a, b)
    assert d["total"] == {"user_ms": 2.5, "voluntary": 2.0}
    assert d["by_thread"] == {"cm-ctl": {"user_ms": 2.0}}


def test_agent_counters_per_worker_iteration_from_the_ranks_done_records() -> None:
    """Summed over the ranks, divided by the iterations they ran; state (control links) left out."""
    done = [
        {
            "event": "done",
            "iteration": 9,
            "agent_stats": {
                "transport": {"retransmit.timeout": 30, "data_sent": 500},
                "ring": {"repair_datagrams": 100, "ops_started": 10},
                "control": {"sh1": {"certified": 10}},
            },
        },
        {
            "event": "done",
            "iteration": 9,
            "agent_stats": {"transport": {"retransmit.timeout": 10, "data_sent": 500}, "ring": {}},
        },
    ]
    assert agent_counters(done) == {
        "ring.ops_started": 0.5,
        "ring.repair_datagrams": 5.0,
        "transport.data_sent": 50.0,
        "transport.retransmit.timeout": 2.0,
    }
    assert agent_counters([{"event": "done", "iteration": 9}]) is None  # a gloo run has no agent
    assert agent_counters([]) is None


STRACE_OUTPUT = """\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 45.00    0.004500           4      1000           sendmsg
 30.00    0.003000           3      1000       100 recvmsg
 25.00    0.002500           2      1250           poll
------ ----------- ----------- --------- --------- ----------------
100.00    0.010000           3      3250       100 total
"""


def test_strace_summary_parsed() -> None:
    assert parse_strace_summary(STRACE_OUTPUT) == {"sendmsg": 1000, "recvmsg": 1000, "poll": 1250}


@pytest.mark.skipif(not SyscallWindow.available(), reason="strace is not installed")
def test_syscall_window_counts_a_real_process() -> None:
    child = subprocess.Popen(
        ["python3", "-c", "import os,time\nwhile True:\n    os.getppid(); time.sleep(0.001)"]
    )
    try:
        time.sleep(0.3)
        window = SyscallWindow()
        window.start([child.pid], 0)
        time.sleep(0.5)
        result = window.stop(10, workers=1)
    finally:
        child.kill()
        child.wait()
    if result is None:
        pytest.skip("strace could not attach (ptrace not permitted here)")
    assert result["per_worker_iteration"].get("getppid", 0) > 5
