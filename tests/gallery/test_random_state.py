"""Random numbers: a dropout script resumes bit-identically with hosts.RandomState, is flagged without one.

* kill -> resume of ``dropout_rng.py`` with ``stateful={"rng": hosts.RandomState()}`` ends
  bit-identical to an uninterrupted run (the gallery's :func:`run_case`: shadows equal the
  workers, generator state included);
* the same script without a RandomState: rank 0 logs the warning naming the fix within
  the first iterations (rank 1 does not);
* per-rank seeds with a RandomState: enable_checkmate refuses on every rank, naming the
  cause and the fix;
* bad input: ``RandomState.load_state_dict`` given a state that is not one raises naming
  the object and changes no generator.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

import hosts
from checkmate.job_state import capture
from hosts.random_state import RandomStateError
from hosts.random_state import _unpack as unpack
from tests.gallery.test_gallery import _run, _shadows, run_case

WARNING = "this job draws random numbers"


def test_dropout_resumes_bit_identically_with_random_state() -> None:
    run_case("dropout_rng.py")


def _job(option: str, tmp: Path) -> None:
    nodes = _shadows(tmp)
    try:
        env = {"GALLERY_STDOUT": str(tmp / "rank{rank}.log")}
        _run(
            "dropout_rng.py",
            ["--iterations", "4", "--out", str(tmp / "out"), "--option", option],
            nodes,
            90,
            env,
        )
    finally:
        for n in nodes:
            n.close()


def test_dropout_without_random_state_is_flagged_on_rank_0() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gallery-no-rng-"))
    _job("no-rng", tmp)
    log = (tmp / "rank0.log").read_text()
    assert log.count(WARNING) == 1, log  # once, not every iteration
    assert "during iteration 0" in log and 'stateful={"rng": hosts.RandomState()' in log, log
    assert WARNING not in (tmp / "rank1.log").read_text()
    # with a RandomState the same script logs no such warning
    tmp = Path(tempfile.mkdtemp(prefix="gallery-rng-"))
    _job("", tmp)
    assert WARNING not in (tmp / "rank0.log").read_text()


def test_per_rank_seeds_are_refused_at_enable() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gallery-per-rank-"))
    _job("per-rank", tmp)
    for rank in range(2):
        message = (tmp / "out" / f"refused{rank}.txt").read_text()
        assert message.startswith("stateful object(s) ['rng'] (RandomState): the ranks' torch random"), (
            message
        )
        assert "Seed every rank identically" in message


def _bad_states() -> list[tuple[Any, str]]:
    rng = hosts.RandomState()
    numpy.random.rand()  # NumPy's and Python's generators changed: their states are in the dict
    random.random()
    good = rng.state_dict()
    low = good["torch"]["low"]
    python, numpy_state = good["python"], good["numpy"]
    return [
        ([1, 2], "the state is a list without a 'torch' generator state"),
        ({**good, "torch": low}, "'torch' is a torch.int32 tensor of shape (632,), not {low, high}"),
        (
            {**good, "torch": {"low": low[:100], "high": []}},
            "'torch' low is a torch.int32 tensor of shape (100,)",
        ),
        ({**good, "torch": {"low": low, "high": [[9999, 1]]}}, "not a list of [word index, int32] pairs"),
        ({**good, "python": {**python, "state": torch.zeros(3, dtype=torch.int32)}}, "625 int32 words"),
        ({**good, "python": {**python, "version": 2}}, "'python' version is 2"),
        ({**good, "numpy": {**numpy_state, "key": numpy_state["key"].long()}}, "624 int32 words"),
        ({**good, "numpy": {**numpy_state, "kind": "PCG64"}}, "not MT19937"),
        ({**good, "cuda": "x"}, "'cuda' is a str"),
        ({**good, "extra": 1}, "unknown keys ['extra']"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_a_state_that_is_not_a_random_state_is_refused_naming_the_object(case: int) -> None:
    state, expected = _bad_states()[case]
    before = (torch.get_rng_state(), numpy.random.get_state()[1].copy(), random.getstate())
    with pytest.raises(RandomStateError) as caught:
        hosts.RandomState("rng").load_state_dict(state)
    assert str(caught.value).startswith("rng.load_state_dict: ") and expected in str(caught.value)
    assert torch.equal(torch.get_rng_state(), before[0])  # nothing was set
    assert (numpy.random.get_state()[1] == before[1]).all() and random.getstate() == before[2]


def test_random_state_round_trips_every_generator() -> None:
    rng = hosts.RandomState()
    assert set(rng.state_dict()) == {"torch"}  # NumPy's and Python's untouched since: left out
    numpy.random.rand()
    random.random()
    saved = rng.state_dict()
    assert set(saved) == {"torch", "numpy", "python"}
    drawn = (torch.rand(5), numpy.random.rand(5), numpy.random.randn(), random.random())
    rng.load_state_dict(saved)
    again = (torch.rand(5), numpy.random.rand(5), numpy.random.randn(), random.random())
    assert torch.equal(drawn[0], again[0]) and (drawn[1] == again[1]).all()
    assert drawn[2:] == again[2:]
    # a state saved before NumPy and Python drew: loading it puts them back where they started
    fresh = hosts.RandomState()
    untouched = fresh.state_dict()
    start = (numpy.random.rand(3), random.random())
    fresh.load_state_dict(untouched)
    assert (numpy.random.rand(3) == start[0]).all() and random.random() == start[1]


def test_random_state_adds_under_3_kib_per_commit_for_a_torch_only_job() -> None:
    """torch's 5056-byte state packs exactly into 632 int32 words plus a few high halves."""
    torch.manual_seed(3)
    torch.rand(7)
    state = capture(None, {"rng": hosts.RandomState()})
    assert state.nbytes() < 3072, state.nbytes()
    packed = state.stateful["rng"]["torch"]
    assert torch.equal(unpack(packed["low"], packed["high"]), torch.get_rng_state())
