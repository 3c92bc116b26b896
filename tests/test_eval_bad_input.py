"""Every evaluator stage refuses bad input before any scoring with one line and exit
code 2: a missing checkpoint, a window the variant cannot take, a memorisation the
evaluator cannot do."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import ROOT, make_pipeline_layout, stage_argv
from test_eval import load_stage

STAGES = ("zeroshot", "niah", "longctx", "continual")


@pytest.fixture(scope="module")
def titans_layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_pipeline_layout(tmp_path_factory.mktemp("titans"), "model.variant=titans_mac")
    shutil.copytree(ROOT / "configs/lm_eval", root / "configs/lm_eval")
    return root


@pytest.mark.parametrize("stage", STAGES)
def test_a_missing_checkpoint_is_one_line_and_exit_2(
    stage: str, titans_layout: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    work = tmp_path / "work"
    shutil.copytree(titans_layout, work)
    shutil.rmtree(work / "models/checkpoints")
    monkeypatch.chdir(work)
    assert load_stage(stage).main_with(stage_argv("zeroshot.items=4")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    expected = (
        "error: models/checkpoints: no release bundle or checkpoint directory there"
        if stage == "zeroshot"  # read through hope.infer.load, as the lm-eval adapter
        else "error: no checkpoint (step_*) in models/checkpoints"
    )
    assert err[-1].startswith(expected)


@pytest.mark.parametrize(
    ("stage", "sets", "message"),
    [
        ("longctx", ["longctx.window=30"], "longctx.window=30 must be a multiple of "
         "model.titans_chunk"),
        ("niah", ["niah.memorize=true"], "niah.memorize: titans_mac continues a state"),
        ("zeroshot", ["zeroshot.memorize=true"], "zeroshot.memorize: titans_mac"),
        ("niah", ["niah.tasks=[s_niah_7]"], "niah.tasks: unknown task 's_niah_7'"),
        ("zeroshot", ["zeroshot.tasks=[no_such_task]"], "unknown lm-eval task 'no_such_task'"),
        ("continual", ["continual.segments=[]"], "continual.segments is empty"),
    ],
)  # fmt: skip
def test_what_the_variant_or_evaluator_cannot_take_is_refused(
    stage: str, sets: list[str], message: str, titans_layout: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.chdir(titans_layout)
    assert load_stage(stage).main_with(stage_argv("zeroshot.items=4", *sets)) == 2
    assert message in capsys.readouterr().err
    assert not Path("reports", f"{stage}.json").exists()  # nothing scored, nothing written
