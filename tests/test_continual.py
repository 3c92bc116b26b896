"""Continual learning in the fast state (hope.eval.continual): writing a segment changes
what the memories hold for earlier ones, nothing changes when no memory is written,
and the forgetting summary is the arithmetic it claims."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import make_pipeline_layout, rand_tokens, stage_argv, tiny_lm
from hope.errors import ConfigError
from hope.eval.continual import forgetting_matrix, package_text, summarise
from hope.io import non_numbers
from hope.model.memorize import MemorizeConfig
from test_eval import load_stage

ROOT = Path(__file__).resolve().parents[1]


def _segments(count: int) -> list[tuple[list[int], list[int]]]:
    return [
        (rand_tokens(1, 32, seed=10 + k)[0].tolist(), rand_tokens(1, 12, seed=20 + k)[0].tolist())
        for k in range(count)
    ]


@pytest.mark.parametrize("variant", ["hope", "titans_lmm"])
def test_writing_a_later_segment_changes_the_loss_on_an_earlier_one(variant: str) -> None:
    model = tiny_lm(variant, "model.cms_lr=0.01")
    base, after = forgetting_matrix(model, _segments(3), MemorizeConfig())
    assert len(after) == 3 and all(len(row) == 3 for row in after)
    assert abs(after[1][0] - after[0][0]) > 1e-4  # writing B moved A's loss
    assert abs(after[0][0] - base[0]) > 1e-4  # writing A moved A's loss


def test_no_memory_written_means_no_loss_changes() -> None:
    """The control: the probes read the memories alone (fresh context), so with every
    layer excluded from the writes each probe's loss stays its fresh-state loss."""
    model = tiny_lm("hope", "model.cms_lr=0.01")
    base, after = forgetting_matrix(model, _segments(3), MemorizeConfig(layers=()))
    assert all(row == base for row in after)


def test_summary_is_forgetting_bwt_and_memorised_delta() -> None:
    names = ["a", "b", "c"]
    base = [5.0, 5.0, 5.0]
    after = [[4.0, 5.1, 5.2], [4.5, 3.0, 5.0], [4.8, 3.5, 2.0]]
    out = summarise(names, base, after)
    assert out["forgetting"] == {"a": 0.7999999999999998, "b": 0.5, "c": 0.0}
    assert out["bwt"] == pytest.approx(((4.8 - 4.0) + (3.5 - 3.0)) / 2)
    assert out["memorised_delta"] == {"a": -1.0, "b": -2.0, "c": -3.0}
    assert out["after"]["1_b"] == {"a": 4.5, "b": 3.0, "c": 5.0}
    assert non_numbers(out) == []


def test_segments_are_stdlib_package_docstrings() -> None:
    assert "JSON" in package_text("json")
    with pytest.raises(ConfigError, match="'no_such_pkg' is no documented stdlib package"):
        package_text("no_such_pkg")


def test_stage_reports_the_matrix_and_refuses_bad_segments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(make_pipeline_layout(tmp_path))
    argv = stage_argv(
        "continual.segments=[json,csv]", "continual.write_tokens=64", "continual.probe_tokens=32"
    )
    assert load_stage("continual").main_with(argv) == 0
    metrics = json.loads(Path("reports/continual.json").read_text())
    assert non_numbers(metrics) == [] and metrics["step"] == 3
    assert set(metrics["after"]) == {"0_json", "1_csv"} and set(metrics["base"]) == {"json", "csv"}
    assert Path("reports/continual.png").stat().st_size > 1000
    capsys.readouterr()
    assert load_stage("continual").main_with([*argv, "--set=continual.segments=[jsonx]"]) == 2
    assert "'jsonx' is no documented stdlib package" in capsys.readouterr().err
    assert load_stage("continual").main_with([*argv, "--set=memorize.paths=[kv]"]) == 2
    assert "memorize.paths: unknown memory 'kv'" in capsys.readouterr().err
    assert load_stage("continual").main_with([*argv, "--set=continual.segments=[]"]) == 2
    assert "continual.segments is empty" in capsys.readouterr().err
    assert load_stage("continual").main_with([*argv, "--set=continual.checkpoints=[2]"]) == 2
    assert "no checkpoint of step 2 in models/checkpoints (kept: 3;" in capsys.readouterr().err


def test_stage_runs_the_protocol_on_every_named_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """continual.checkpoints: the protocol per checkpoint and each segment's fresh-state
    loss along training; an earlier checkpoint with other weights gives other losses."""
    import torch

    from hope.train.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint

    monkeypatch.chdir(make_pipeline_layout(tmp_path))
    payload = load_checkpoint(checkpoint_path(Path("models/checkpoints"), 3))
    torch.manual_seed(0)
    payload["model"] = {
        k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v
        for k, v in payload["model"].items()
    }
    save_checkpoint(Path("models/checkpoints"), 1, {**payload, "step": 1}, keep=5)
    argv = stage_argv(
        "continual.segments=[json,csv]", "continual.write_tokens=48",
        "continual.probe_tokens=24", "continual.checkpoints=[1]", "memorize.layers=[0]",
    )  # fmt: skip
    assert load_stage("continual").main_with(argv) == 0
    metrics = json.loads(Path("reports/continual.json").read_text())
    training = metrics["training"]
    assert list(training["base"]) == ["step_1", "step_3"]
    assert training["base"]["step_3"] == metrics["base"]
    assert training["base"]["step_1"]["json"] != metrics["base"]["json"]
    for name in ("json", "csv"):
        losses = [training["base"][k][name] for k in ("step_1", "step_3")]
        assert training["forgetting"][name] == pytest.approx(losses[-1] - min(losses))
    meta = json.loads(Path("reports/continual_meta.json").read_text())
    assert meta["memorize"]["layers"] == [0] and meta["memorize"]["reset"] == "carry_across_samples"


def test_reset_per_sample_writes_each_segment_alone() -> None:
    """The control: reset_per_sample memorises every segment into a fresh state, so row
    k is what segment k alone does (== a carried run that writes k first)."""
    model = tiny_lm("hope", "model.cms_lr=0.01")
    segs = _segments(3)
    _, alone = forgetting_matrix(model, segs, MemorizeConfig(reset="reset_per_sample"))
    _, first = forgetting_matrix(model, [segs[2], segs[0], segs[1]], MemorizeConfig())
    assert first[0] == pytest.approx([alone[2][2], alone[2][0], alone[2][1]], abs=1e-9)
    _, carried = forgetting_matrix(model, segs, MemorizeConfig())
    assert abs(carried[2][0] - alone[2][0]) > 1e-5  # carrying is not the control
