"""The backend's liveness watch (hosts/c10d_liveness.py): a dead rank fails the group within peer_timeout.

The unit tests drive :class:`StoreLiveness` on a real ``HashStore`` with a stand-in for the group's
flows. The process tests run 3 ranks on the backend: rank 2 exits (``os._exit``) after every byte it
received was acknowledged, which the transport alone cannot see from rank 0 (waiting to receive
from it); rank 0 must fail within seconds, naming rank 2, not at the 120 s collective timeout. A
rank that is only slow (asleep for 3x peer_timeout) must not be declared dead.
"""

from __future__ import annotations

import os
import queue
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hosts.c10d_liveness import ALIVE, CLOSED, DEAD, StoreLiveness
from hosts.transport import PeerTimeoutError
from tests.hosts.harness import _CTX
from tests.listen_ports import listen_port

PEERS = (("127.0.0.1", 1), ("127.0.0.2", 2), ("127.0.0.3", 3))


class _Flows:
    """What the watch asks of the group's flow collectives."""

    def __init__(self, waiting_since: float | None) -> None:
        self.since = waiting_since
        self.failed: list[PeerTimeoutError] = []

    def waiting_since(self) -> float | None:
        return self.since

    def on_peer_failure(self, error: PeerTimeoutError) -> None:
        self.failed.append(error)


def _watch(store: dist.Store, flows: _Flows, rank: int = 0) -> StoreLiveness:
    watch = StoreLiveness(store, rank, PEERS, 7, 0.3, flows, lambda: None, interval=0.05)  # type: ignore[arg-type]
    watch.start()
    return watch


def _wait_for(condition: Any, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_a_silent_predecessor_fails_a_waiting_group_and_is_published() -> None:
    store = dist.HashStore()
    flows = _Flows(waiting_since=time.monotonic())
    watch = _watch(store, flows)
    assert _wait_for(lambda: flows.failed, 3.0), "rank 2 never beat, yet the waiting group did not fail"
    error = flows.failed[0]
    assert error.rank == 2 and error.job_id == 7 and "no heartbeat" in str(error), error
    assert store.get(DEAD).decode().startswith("2|no heartbeat"), store.get(DEAD)
    assert watch.declared is error
    watch.close()


def test_a_beating_predecessor_or_an_idle_group_is_never_declared() -> None:
    store = dist.HashStore()
    flows = _Flows(waiting_since=time.monotonic())
    watch = _watch(store, flows)
    for _ in range(40):  # 2 s of beats from rank 2, far past the 0.3 s silence allowed
        store.add(f"{ALIVE}2", 1)
        time.sleep(0.05)
    assert flows.failed == [] and watch.declared is None

    idle = _Flows(waiting_since=None)  # nothing running: silence is not death (ranks leaving)
    other = _watch(dist.HashStore(), idle)
    time.sleep(1.0)
    assert idle.failed == [] and other.declared is None
    watch.close()
    other.close()


def test_a_death_another_rank_published_fails_this_group_with_its_words() -> None:
    store = dist.HashStore()
    store.set(DEAD, "1|no heartbeat in the group's store for 2.0s (seen by rank 2)")
    flows = _Flows(waiting_since=None)
    watch = _watch(store, flows)
    assert _wait_for(lambda: flows.failed, 3.0)
    assert flows.failed[0].rank == 1 and "seen by rank 2" in str(flows.failed[0])
    assert not store.check([f"{CLOSED}0"])
    watch.close()
    assert store.check([f"{CLOSED}0"])  # a rank that closes says so, and is not watched after


def test_a_predecessor_that_closed_its_group_is_not_dead() -> None:
    store = dist.HashStore()
    store.set(f"{CLOSED}2", "1")
    flows = _Flows(waiting_since=time.monotonic())
    watch = _watch(store, flows)
    time.sleep(1.0)
    assert flows.failed == [] and watch.declared is None
    watch.close()


def test_garbage_in_the_dead_key_is_reported_not_raised() -> None:
    store = dist.HashStore()
    store.set(DEAD, "not a rank")
    flows = _Flows(waiting_since=None)
    watch = _watch(store, flows)
    assert _wait_for(lambda: flows.failed, 3.0)
    assert flows.failed[0].rank == 2 and "another rank declared" in str(flows.failed[0])
    watch.close()


def test_silent_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="silent_after"):
        StoreLiveness(dist.HashStore(), 0, PEERS, 1, 0.0, _Flows(None), lambda: None)  # type: ignore[arg-type]


# ---- three ranks on the backend ---------------------------------------------------------------
def _rank(rank: int, world: int, port: int, scenario: str, out: Any) -> None:
    torch.set_num_threads(1)
    import datetime

    from hosts.c10d_backend import CheckmateBackendOptions

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(
        "checkmate",
        timeout=datetime.timedelta(seconds=120),
        pg_options=CheckmateBackendOptions(bind=f"127.0.0.{220 + rank}", peer_timeout=1.5),
    )
    gloo = dist.new_group(backend="gloo")
    first = torch.full((3000,), float(rank + 1))
    dist.all_reduce(first)  # every byte of it acknowledged before anyone goes on
    dist.barrier(group=gloo)
    if scenario == "dies" and rank == 2:
        os._exit(0)  # no close, no goodbye: the process is gone
    if scenario == "slow" and rank == 2:
        time.sleep(4.5)  # three peer_timeouts, alive
    started = time.monotonic()
    second = torch.full((3000,), float(rank + 1))
    try:
        dist.all_reduce(second)
        result: Any = ("ok", float(second[0]), float(first[0]))
    except Exception as exc:  # noqa: BLE001 - torch wraps the Work's error in its own type
        result = ("failed", str(exc))
    out.put((rank, time.monotonic() - started, result))
    out.close()
    out.join_thread()  # the queue's feeder thread has sent it before this process may exit
    if scenario == "slow":
        dist.barrier(group=gloo)
        dist.destroy_process_group()
    else:
        os._exit(0)  # the group is failed: leave without the collective goodbyes


def _run(scenario: str, expect: int) -> dict[int, tuple[float, Any]]:
    out = _CTX.Queue()
    port = listen_port()
    procs = [_CTX.Process(target=_rank, args=(r, 3, port, scenario, out), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    results: dict[int, tuple[float, Any]] = {}
    try:
        for _ in range(expect):
            rank, took, result = out.get(timeout=90)
            results[rank] = (took, result)
    except queue.Empty:
        pytest.fail(f"{scenario}: ranks {sorted(set(range(3)) - set(results))} reported nothing within 90 s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, 9)
    return results


def test_a_rank_that_dies_with_nothing_outstanding_fails_its_successor_within_seconds() -> None:
    results = _run("dies", expect=2)
    took, result = results[0]
    assert result[0] == "failed", result
    # rank 0 receives from rank 2 and owes it nothing: only the liveness watch can see it gone
    assert "rank 2" in result[1] and "heartbeat" in result[1], result
    assert took < 20.0, f"rank 0 failed after {took:.1f}s (collective timeout 120 s, peer_timeout 1.5 s)"
    took, result = results[1]
    assert result[0] == "failed" and "rank 2" in result[1], result  # it sends to rank 2: unacknowledged
    assert took < 20.0, took


def test_a_slow_rank_is_waited_for() -> None:
    results = _run("slow", expect=3)
    for rank, (_took, result) in results.items():
        assert result[0] == "ok", (rank, result)
        assert result[1] == 6.0 and result[2] == 6.0, (rank, result)  # 1 + 2 + 3, both times
    assert results[0][0] > 3.0, results  # rank 0 really waited past peer_timeout for rank 2
