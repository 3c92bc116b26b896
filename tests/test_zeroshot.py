"""The ``zeroshot`` stage: offline items built from validation text, lm-eval run on the
latest checkpoint through the shipped task YAMLs, numbers-only metrics, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import make_pipeline_layout, stage_argv
from hope.errors import StageError
from hope.eval.zeroshot import flatten_results
from hope.eval.zeroshot_items import CHOICES, choice_items, cloze_items, write_items
from hope.io import non_numbers
from test_eval import load_stage

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    " ".join(f"word{d}x{i}" if i % 5 else f"alpha{chr(97 + (d + i) % 26)}" for i in range(120))
    for d in range(6)
]


def test_cloze_items_end_on_the_passage_word_and_are_reproducible() -> None:
    items = cloze_items(TEXTS, 10, 6, seed=3)  # passages end on words 5, 11, 17...
    assert len(items) == 10 and items == cloze_items(TEXTS, 10, 6, seed=3)
    for item in items:
        passage = item["context"] + " " + item["target"]
        assert len(passage.split()) == 6 and item["target"].startswith("alpha")
        assert any(passage in text for text in TEXTS)


def test_choice_items_hold_the_true_ending_at_the_label() -> None:
    items = choice_items(TEXTS, 12, 8, seed=5)
    assert len(items) == 12 and items == choice_items(TEXTS, 12, 8, seed=5)
    labels = set()
    for item in items:
        assert len(item["choices"]) == CHOICES
        true = item["context"] + " " + item["choices"][item["label"]]
        assert any(true in text for text in TEXTS)
        wrong = [c for i, c in enumerate(item["choices"]) if i != item["label"]]
        assert not any(item["context"] + " " + c in text for c in wrong for text in TEXTS)
        labels.add(item["label"])
    assert len(labels) > 1  # the answer is not always in one place


def test_too_little_text_is_one_error_naming_the_task(tmp_path: Path) -> None:
    with pytest.raises(StageError, match="no hope_cloze items.*zeroshot.cloze_words"):
        write_items(["too short"], tmp_path, 4, 0, 24, 12)


def test_flatten_results_keeps_numbers_and_names_filters() -> None:
    results = {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": "N/A",
                     "exact_match,flexible": 0.25}}  # fmt: skip
    assert flatten_results(results, {"t": {"original": 8, "effective": 4}}) == {
        "t": {"acc": 0.5, "exact_match/flexible": 0.25, "n": 4}
    }


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pipeline layout (raw val texts, tokenizer, checkpoint, task YAMLs) of an
    untrained tiny hope model."""
    root = make_pipeline_layout(tmp_path_factory.mktemp("zeroshot"))
    shutil.copytree(ROOT / "configs/lm_eval", root / "configs/lm_eval")
    return root


def _stage(workdir: Path, monkeypatch: pytest.MonkeyPatch, *sets: str) -> int:
    monkeypatch.chdir(workdir)
    return load_stage("zeroshot").main_with(stage_argv(*sets))


def test_stage_runs_lm_eval_on_the_offline_tasks(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _stage(workdir, monkeypatch, "zeroshot.items=16") == 0
    metrics = json.loads((workdir / "reports/zeroshot.json").read_text())
    records = json.loads((workdir / "reports/zeroshot_meta.json").read_text())
    assert non_numbers(metrics) == [] and metrics["step"] == 3
    assert set(metrics) == {"step", "hope_cloze", "hope_choice", "hope_rolling"}
    for task, row in metrics.items():
        if task != "step":
            assert row["n"] == records["offline_items"][task] <= 16, task
    assert 0.0 <= metrics["hope_choice"]["acc"] <= 1.0 and "acc_stderr" in metrics["hope_choice"]
    assert metrics["hope_cloze"]["perplexity"] > 1.0
    assert metrics["hope_rolling"]["bits_per_byte"] > 0.0
    assert records["variant"] == "hope" and records["versions"]["hope_cloze"] == 1.0
    items = (workdir / "data/zeroshot/hope_choice.jsonl").read_bytes()
    assert _stage(workdir, monkeypatch, "zeroshot.items=16", "zeroshot.tasks=[hope_choice]") == 0
    assert (workdir / "data/zeroshot/hope_choice.jsonl").read_bytes() == items  # same seed


def test_bad_input_is_one_line_and_exit_code_2(
    workdir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _stage(workdir, monkeypatch, "zeroshot.tasks=[hope_clozee]") == 2
    err = capsys.readouterr().err
    assert (
        "zeroshot.tasks: unknown lm-eval task 'hope_clozee'" in err and len(err.splitlines()) == 1
    )
    monkeypatch.chdir(workdir)
    shutil.move("models/checkpoints", "models/elsewhere")
    try:
        assert _stage(workdir, monkeypatch) == 2
        assert "models/checkpoints" in capsys.readouterr().err
    finally:
        shutil.move("models/elsewhere", "models/checkpoints")


def test_paper_presets_name_tasks_lm_eval_knows() -> None:
    from hope.config import load_config
    from hope.eval.zeroshot import check_tasks, task_manager

    tasks = {
        p: load_config(None, [f"preset={p}"]).zeroshot.tasks for p in ("pilot", "mid", "target")
    }
    assert all("hellaswag" in names and "lambada_openai" in names for names in tasks.values())
    manager = task_manager(tasks["pilot"], ROOT / "configs/lm_eval")  # lm-eval's whole index
    for names in tasks.values():
        check_tasks(names, manager)
