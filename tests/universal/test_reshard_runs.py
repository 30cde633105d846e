"""Real multi-rank CPU runs (gloo, one thread per rank): train TP=2 x DP=2, resume in other layouts.

The TP=2 x DP=2 job (torch ColwiseParallel / RowwiseParallel DTensors, a
vocabulary-parallel embedding, fused QKV and gate/up) saves universal
checkpoints at steps 3 and 6. Each target layout (plain DP, FSDP2, TP, PP,
FSDP2 x TP, ZeRO-1/2/3 over padded flat partitions, ZeRO-1 and ZeRO-3 under
TP=2) loads step 3, saves it again at once — which must give the same atoms
element for element — and trains steps 4..6 on the same global batches: its
losses must continue the source run's (same math, other reduction orders).
The way back: a checkpoint saved by ZeRO-1, FSDP2, ZeRO-3 x TP and PP runs
resumes as TP=2 x DP=2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkmate.checkpoint import CheckpointReader
from checkmate.universal.layout import Layout
from checkmate.universal.runs import RunJob, run_layout, write_initial
from checkmate.universal.tiny import TinyConfig

torch.set_num_threads(1)
SOURCE = "tp=2,pp=1,dp=2"


@pytest.fixture(scope="module")
def source_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    root = tmp_path_factory.mktemp("reshard")
    write_initial(root / "init", TinyConfig())
    losses = run_layout(
        RunJob(SOURCE, str(root / "init"), 0, 6, save_root=str(root / "ckpt"), save_steps=[3, 6]), timeout=120
    )
    return root, losses


def assert_same_atoms(first: CheckpointReader, second: CheckpointReader) -> None:
    assert first.parameters == second.parameters
    for name in first.parameters:
        assert first.states_of(name) == second.states_of(name), name
        for state in first.states_of(name):
            assert torch.equal(first.parameter(name, state), second.parameter(name, state)), (
                f"{name}::{state}"
            )


def test_source_run_saves_complete_universal_checkpoints(source_run: tuple[Path, dict[int, float]]) -> None:
    root, losses = source_run
    reader = CheckpointReader(root / "ckpt", 3)
    assert reader.global_state["extra"]["universal"]["source_layout"] == SOURCE
    assert len(reader.manifests) == 4  # one universal shard per rank
    # vocabulary padding trimmed, fused weights whole, Adam state for every parameter
    assert reader.parameters["embed.weight"]["shape"] == [49, 16]
    assert reader.parameters["layers.0.attn.qkv.weight"]["shape"] == [48, 16]
    assert all(reader.states_of(n) == ["exp_avg", "exp_avg_sq", "param", "step"] for n in reader.parameters)
    assert float(reader.parameter("head.weight", "step")) == 3.0
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    "target",
    [
        "tp=1,dp=3",
        "dp=2,fsdp=1",
        "tp=2,dp=1",
        "pp=2",
        "tp=2,dp=2,fsdp=1",
        "dp=3,zero=1,align=4",
        "dp=2,zero=2",
        "dp=3,zero=3,align=4",
        "tp=2,dp=2,zero=1",
        "tp=2,dp=2,zero=3",
    ],
)
def test_resume_in_another_layout(
    source_run: tuple[Path, dict[int, float]], target: str, tmp_path: Path
) -> None:
    root, source_losses = source_run
    losses = run_layout(
        RunJob(
            target,
            str(root / "ckpt"),
            3,
            6,
            resave_root=str(tmp_path / "resave"),
            save_root=str(tmp_path / "after"),
            save_steps=[6],
        ),
        timeout=120,
    )
    # the loaded state, saved again from the new layout, is the saved state element for element
    assert_same_atoms(CheckpointReader(root / "ckpt", 3), CheckpointReader(tmp_path / "resave", 3))
    # and training continues the same curve
    for step in (4, 5, 6):
        assert losses[step] == pytest.approx(source_losses[step], abs=1e-4), (step, losses, source_losses)
    source, resumed = CheckpointReader(root / "ckpt", 6), CheckpointReader(tmp_path / "after", 6)
    for name in source.parameters:
        got, want = resumed.parameter(name), source.parameter(name)
        if name.endswith("qkv.bias"):
            # the key bias has no effect on softmax: its gradient is rounding noise, which Adam
            # scales up to lr-sized steps that differ with the reduction order; compare q and v
            d = got.shape[0] // 3
            got, want = torch.cat([got[:d], got[2 * d :]]), torch.cat([want[:d], want[2 * d :]])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("middle", ["dp=3,zero=1,align=4", "dp=2,fsdp=1", "tp=2,dp=2,zero=3", "pp=2"])
def test_a_checkpoint_saved_in_another_layout_resumes_as_tp_by_dp(
    source_run: tuple[Path, dict[int, float]], tmp_path: Path, middle: str
) -> None:
    root, source_losses = source_run
    run_layout(
        RunJob(middle, str(root / "ckpt"), 3, 4, save_root=str(tmp_path / "mid"), save_steps=[4]), timeout=120
    )
    losses = run_layout(
        RunJob(SOURCE, str(tmp_path / "mid"), 4, 5, resave_root=str(tmp_path / "back")), timeout=120
    )
    assert CheckpointReader(tmp_path / "mid", 4).global_state["extra"]["universal"]["source_layout"] == (
        Layout.parse(middle).describe()
    )
    assert_same_atoms(CheckpointReader(tmp_path / "mid", 4), CheckpointReader(tmp_path / "back", 4))
    assert losses[5] == pytest.approx(source_losses[5], abs=1e-4)


def test_checkpoint_of_a_tp_job_loads_into_a_plain_model(source_run: tuple[Path, dict[int, float]]) -> None:
    from checkmate.checkpoint.load import load_into
    from checkmate.universal.tiny import TinyLM

    root, _ = source_run
    reader = CheckpointReader(root / "ckpt", 3)
    config = TinyConfig()
    model = TinyLM(config, config.vocab, config.layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    assert load_into(reader, model, optimizer) == 3
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.detach(), reader.parameter(name)), name
        assert torch.equal(optimizer.state[parameter]["exp_avg"], reader.parameter(name, "exp_avg")), name
