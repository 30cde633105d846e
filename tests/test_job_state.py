"""The job state: codec round trip bit for bit, refusals naming the object, format version 2 on disk."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from checkmate import checkpoint as fmt
from checkmate.control import Commit, JobStart, attach_job_state, decode_message, encode_message, job_state_of
from checkmate.control_frame import ControlProtocolError
from checkmate.job_state import MAX_JOB_STATE_BYTES, JobState, JobStateError, capture, load_stateful, merge


class Box:
    """A Stateful object holding any value."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, value: Any) -> None:
        self.value = value


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(5, 3))  # running statistics move
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 2)


ODD = {
    1: (2.0, float("nan"), torch.arange(3)),
    "__x": [math.inf, None, True],
    "t": torch.tensor(1.5).bfloat16(),
}


def _same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        flat_a, flat_b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat_a, flat_b)
    elif isinstance(a, dict):
        assert type(b) is dict and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b and type(a) is type(b)


def test_a_commit_carries_buffers_stateful_objects_and_param_groups_bit_for_bit() -> None:
    model, optimizer, scheduler = _model()
    state = capture(model, {"scheduler": scheduler, "odd": Box(ODD)}, optimizer)
    frame = b"".join(bytes(p) for p in encode_message(Commit(1, 7, [0.1], job_state=state)))
    decoded = decode_message(
        frame[16 : 16 + int.from_bytes(frame[4:8], "big")], frame[16 + int.from_bytes(frame[4:8], "big") :]
    )
    assert isinstance(decoded, Commit) and decoded.job_state == state
    assert set(decoded.job_state.buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    for name, value in decoded.job_state.buffers.items():
        _same(value, model.state_dict()[name])
    _same(decoded.job_state.stateful["odd"], ODD)
    _same(decoded.job_state.stateful["scheduler"], scheduler.state_dict())
    assert decoded.job_state.param_groups[0]["betas"] == (0.8, 0.9)
    # a commit without a job state reads as before (no "job_state" key on the wire)
    plain = bytes(encode_message(Commit(1, 8, [0.1]))[1])
    assert b"job_state" not in plain


def test_a_job_start_carries_it_and_a_malformed_one_is_refused() -> None:
    model, optimizer, scheduler = _model()
    state = capture(model, {"scheduler": scheduler}, optimizer)
    start = attach_job_state(JobStart(1, 2, [], [], {"kind": "Adam", "param_groups": []}, 3), state)
    assert job_state_of(start) == state
    start.extra["job_state"]["buffers"]["1.running_mean"] = {"__tensor__": "nowhere"}
    with pytest.raises(ControlProtocolError, match="tensor 'nowhere' is missing"):
        job_state_of(start)


@pytest.mark.parametrize(
    "value,problem",
    [
        ({"rng": torch.Generator()}, "state_dict()['rng'] is a torch._C.Generator, which cannot be stored"),
        ({"f": lambda: 0}, "state_dict()['f'] is a builtins.function"),
        ([torch.zeros(2).to_sparse()], "state_dict()[0] is a torch.sparse_coo tensor"),
    ],
)
def test_a_state_that_cannot_travel_is_refused_naming_the_object_and_the_path(
    value: Any, problem: str
) -> None:
    with pytest.raises(JobStateError, match="stateful object 'loader'") as caught:
        capture(None, {"loader": Box(value)})
    assert problem in str(caught.value)


def test_not_stateful_or_too_large_is_refused() -> None:
    with pytest.raises(JobStateError, match=r"stateful object 'cfg' \(dict\) has no state_dict\(\)"):
        capture(None, {"cfg": {"a": 1}})
    with pytest.raises(JobStateError, match="the largest stateful object is 'cache'"):
        capture(None, {"small": Box(1), "cache": Box(torch.zeros(MAX_JOB_STATE_BYTES // 4 + 1))})


def test_load_names_a_missing_or_failing_object() -> None:
    state = capture(None, {"a": Box({"x": 1})})
    with pytest.raises(JobStateError, match=r"no state for stateful object\(s\) \['b'\]"):
        load_stateful({"b": Box(None)}, state)

    class Picky(Box):
        def load_state_dict(self, value: Any) -> None:
            raise KeyError("epoch")

    with pytest.raises(JobStateError, match="stateful object 'a': load_state_dict\\(\\) raised KeyError"):
        load_stateful({"a": Picky(None)}, state)
    target = Box(None)
    load_stateful({"a": target}, state)
    assert target.value == {"x": 1}


def test_merge_keeps_early_buffers_and_late_schedulers() -> None:
    model, optimizer, scheduler = _model()
    early = capture(model, {"loader": Box({"batch": 3})})
    late = capture(None, {"scheduler": scheduler}, optimizer)
    merged = merge(early, late, {"scheduler": scheduler, "loader": None})
    assert list(merged.stateful) == ["scheduler", "loader"]
    assert set(merged.buffers) == set(early.buffers) and merged.param_groups == late.param_groups


def _write(root: Path, state: JobState | None) -> fmt.CheckpointReader:
    w = torch.arange(4.0)
    fmt.write_global(root, 3, {"w": ([4], "torch.float32")}, {"kind": "SGD", "param_groups": []}, {}, state)
    fmt.write_shard(root, 3, 0, 1, {"w": {fmt.PARAM_STATE: w}})
    return fmt.CheckpointReader(root)


def test_version_2_stores_the_job_state_and_version_1_still_reads(tmp_path: Path) -> None:
    model, optimizer, scheduler = _model()
    state = capture(model, {"scheduler": scheduler, "odd": Box(ODD)}, optimizer)
    reader = _write(tmp_path / "v2", state)
    assert reader.global_state["format_version"] == 2 == fmt.FORMAT_VERSION
    assert reader.job_state() == state
    files = sorted(p.name for p in (tmp_path / "v2" / "step-00000003").iterdir())
    assert [f for f in files if f.startswith("job-state-")] == [reader.global_state["job_state"]["file"]]
    # the same state written again (a second shadow) names the same file
    _write(tmp_path / "v2", state)
    assert (
        len([p for p in (tmp_path / "v2" / "step-00000003").iterdir() if p.name.startswith("job-state-")])
        == 1
    )

    old = _write(tmp_path / "v1", None)
    path = tmp_path / "v1" / "step-00000003" / "global.json"
    document = json.loads(path.read_text())
    document["format_version"] = 1
    path.write_text(json.dumps(document))
    for manifest in (tmp_path / "v1" / "step-00000003").glob("shard-*.json"):
        m = json.loads(manifest.read_text())
        m["format_version"] = 1
        manifest.write_text(json.dumps(m))
    old = fmt.CheckpointReader(tmp_path / "v1")
    assert old.job_state() is None and torch.equal(old.parameter("w"), torch.arange(4.0))


def test_a_corrupted_job_state_file_is_refused(tmp_path: Path) -> None:
    model, optimizer, scheduler = _model()
    reader = _write(tmp_path, capture(model, {"scheduler": scheduler}, optimizer))
    data = reader.directory / reader.global_state["job_state"]["file"]
    data.write_bytes(data.read_bytes()[:-3] + b"xyz")
    with pytest.raises(fmt.CheckpointError, match="checksum mismatch"):
        fmt.CheckpointReader(tmp_path).job_state()
    future = reader.directory / "global.json"
    document = json.loads(future.read_text())
    document["format_version"] = 3
    future.write_text(json.dumps(document))
    with pytest.raises(fmt.CheckpointError, match="format version 3; this build reads versions 1, 2"):
        fmt.CheckpointReader(tmp_path)


def test_checkmate_ckpt_inspect_names_the_job_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from checkmate.checkpoint.cli import main

    model, optimizer, scheduler = _model()
    _write(tmp_path, capture(model, {"scheduler": scheduler}, optimizer))
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format_version"] == 2 and summary["job_state"] == {
        "buffers": ["1.num_batches_tracked", "1.running_mean", "1.running_var"],
        "stateful": ["scheduler"],
    }
    assert main(["inspect", str(tmp_path)]) == 0
    buffers = "['1.num_batches_tracked', '1.running_mean', '1.running_var']"
    assert f"job state: buffers {buffers}  stateful ['scheduler']" in capsys.readouterr().out


def test_persistent_buffers_follow_the_module_and_skip_non_persistent_ones() -> None:
    from checkmate.job_state import persistent_buffers

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    model.register_buffer("cache", torch.zeros(3), persistent=False)
    assert sorted(persistent_buffers(model)) == ["1.num_batches_tracked", "1.running_mean", "1.running_var"]
    assert persistent_buffers(model) is not persistent_buffers(model)  # a fresh dict each time
    model.register_buffer("seen", torch.zeros(1))  # the buffers changed: asked again
    assert "seen" in persistent_buffers(model) and "cache" not in persistent_buffers(model)
    assert persistent_buffers(torch.nn.Linear(2, 2)) == {}
