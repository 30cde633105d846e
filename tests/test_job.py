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


SIZED = dict(parallelism="fsdp2", model_params=7_000_000_000, optimizer="adamw", shadow_memory_gib=64.0)


def test_sizing_fields_round_trip_and_old_files_load_unsized() -> None:
    job = JobSpec(5, ("h1", "h2"), ("s1", "s2"), **SIZED)  # type: ignore[arg-type]
    document = job.to_json()
    assert {k: document[k] for k in SIZED} == SIZED and "grad_dtype" not in document
    assert JobSpec.from_json(document) == job and job.sized
    # a JSON count written as a float is the integer it is
    assert JobSpec.from_json({**document, "model_params": 7e9}).model_params == 7_000_000_000
    old = JobSpec.loads('{"job_id": 5, "workers": ["h1", "h2"], "shadows": ["s1"]}')
    assert old.parallelism == "ddp" and old.model_params is None and not old.sized
    assert set(old.to_json()) == {"job_id", "workers", "shadows", "shard_to_shadow", "shadow_port"}
    assert job.with_workers(("h1", "h2", "h3")).model_params == 7_000_000_000  # moves keep the sizing


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(parallelism="fsdp3"), "unknown parallelism 'fsdp3'; known: ddp, fsdp2"),
        (dict(parallelism="zero1"), "parallelism 'zero1': ZeRO-1 .* is not protected by Checkmate yet"),
        (dict(parallelism="zero2"), "parallelism 'zero2': ZeRO-2 .* is not protected"),
        (dict(parallelism="fsdp2", tp_degree=2), "parallelism 'fsdp2' with tp_degree 2"),
        ({**SIZED, "model_params": -5}, r"model_params -5 is not a model size"),
        ({**SIZED, "model_params": 0}, r"model_params 0 is not a model size"),
        ({**SIZED, "model_params": 10**16}, r"is not a model size"),
        ({**SIZED, "model_params": 1.5}, "model_params must be an integer"),
        ({**SIZED, "model_params": True}, "model_params must be an integer"),
        ({**SIZED, "shadow_memory_gib": -1.0}, "shadow_memory_gib -1 must be positive"),
        ({**SIZED, "shadow_memory_gib": 0}, "shadow_memory_gib 0 must be positive"),
        ({**SIZED, "shadow_memory_gib": float("nan")}, "shadow_memory_gib must be a number"),
        ({**SIZED, "shadow_memory_gib": "64"}, "shadow_memory_gib must be a number"),
        ({**SIZED, "optimizer": ""}, "optimizer must be a name"),
        (dict(model_params=1000), "model_params given without optimizer, shadow_memory_gib"),
        (dict(shadow_memory_gib=8.0), "shadow_memory_gib given without model_params, optimizer"),
        (dict(grad_dtype="bf16"), "grad_dtype given without model_params"),
        (
            dict(model_params=1, optimizer="sgd", shadow_memory_gib=1.0, tp_degree=2),
            "fewer than the tp_degree",
        ),
    ],
)
def test_bad_sizing_fields_name_the_field(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = dict(job_id=1, workers=("h1", "h2"), shadows=("s1",))
    fields.update(kwargs)
    with pytest.raises(JobSpecError, match=message):
        JobSpec(**fields)  # type: ignore[arg-type]
