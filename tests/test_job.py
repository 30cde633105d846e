"""The shared job description: defaults, ring order, shard moves and every bad input."""

from __future__ import annotations

import pytest

from checkmate.job import JobSpec, JobSpecError


def test_default_shard_map_is_round_robin_over_shadows() -> None:
    job = JobSpec(5, ("h1", "h2", "h3"), ("s1", "s2"))
    assert job.shard_to_shadow == {0: "s1", 1: "s2"}
    assert [job.shadow_for_bucket(b) for b in range(4)] == ["s1", "s2", "s1", "s2"]
    assert [job.ring_next(w) for w in job.workers] == ["h2", "h3", "h1"]


def test_json_round_trip_and_shard_move() -> None:
    job = JobSpec(5, ("h1", "h2"), ("s1", "s2"), {0: "s1", 1: "s1"})
    again = JobSpec.loads(
        '{"job_id": 5, "workers": ["h1", "h2"], "shadows": ["s1", "s2"],'
        ' "shard_to_shadow": {"0": "s1", "1": "s1"}}'
    )
    assert again == job and JobSpec.from_json(job.to_json()) == job
    moved = job.with_shard_moved(1, "s2")
    assert moved.shard_to_shadow == {0: "s1", 1: "s2"} and job.shard_to_shadow[1] == "s1"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(job_id=0), "outside"),
        (dict(job_id=2**32), "outside"),
        (dict(job_id="7"), "integer"),
        (dict(workers=("h1",)), "at least 2 workers"),
        (dict(shadows=()), "at least 1 shadow"),
        (dict(workers=("h1", "h1")), "listed twice"),
        (dict(shadows=("h1",)), "both worker and shadow"),
        (dict(shard_to_shadow={0: "nobody"}), "not one of the shadows"),
        (dict(shard_to_shadow={70000: "s1"}), "outside"),
        (dict(shadow_port=0), "not a UDP port"),
    ],
)
def test_bad_job_descriptions_name_the_problem(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = dict(job_id=1, workers=("h1", "h2"), shadows=("s1",))
    fields.update(kwargs)
    with pytest.raises(JobSpecError, match=message):
        JobSpec(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1]", "JSON object"),
        ("{", "not valid JSON"),
        ('{"job_id": 1, "workers": ["a", "b"], "shadows": ["s"], "colour": 1}', "unknown job field"),
        ('{"job_id": 1, "workers": ["a", "b"]}', "lacks 'shadows'"),
        ('{"job_id": 1, "workers": "ab", "shadows": ["s"]}', "list of host names"),
        (
            '{"job_id": 1, "workers": ["a", "b"], "shadows": ["s"], "shard_to_shadow": {"x": "s"}}',
            "not an integer",
        ),
    ],
)
def test_bad_job_json(text: str, message: str) -> None:
    with pytest.raises(JobSpecError, match=message):
        JobSpec.loads(text)


def test_moving_a_shard_the_job_does_not_have() -> None:
    with pytest.raises(JobSpecError, match="no shard 9"):
        JobSpec(1, ("a", "b"), ("s",)).with_shard_moved(9, "s")
