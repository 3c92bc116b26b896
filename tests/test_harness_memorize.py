"""Adaptive scoring in the lm-eval adapter (hope.eval.harness_memorize): one pass that
writes every memory scores exactly as the plain read (float64); carrying makes a task's
documents one stream, the correct answer enters only after its document is scored, and
a new task starts fresh; the stage reports adaptive numbers beside the plain ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_pipeline_layout, rand_tokens, stage_argv, tiny_lm
from hope.errors import StageError
from hope.eval.harness import memorize_from_args
from hope.eval.harness_memorize import score_documents
from hope.model.memorize import MemorizeConfig
from test_eval import load_stage

ROOT = Path(__file__).resolve().parents[1]
RESET = MemorizeConfig(reset="reset_per_sample")
CARRY = MemorizeConfig(reset="carry_across_samples")


def _documents() -> tuple[list[tuple[list[int], list[int]]], list[tuple[str, int]], list[bool]]:
    """Three multiple-choice documents of task a (3 choices, the second correct) and one
    of task b; contexts of 9 tokens (the 8 memorised end on every chunk grid)."""
    pairs, docs, answers = [], [], []
    for d, task in enumerate(["a", "a", "a", "b"]):
        context = rand_tokens(1, 9, seed=40 + d)[0].tolist()
        for c in range(3):
            pairs.append((context, rand_tokens(1, 1 + c, seed=60 + 3 * d + c)[0].tolist()))
            docs.append((task, d))
            answers.append(c == 1)
    return pairs, docs, answers


def _plain(model: torch.nn.Module, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """The plain score: context and continuation in one teach pass from a fresh state."""
    out = []
    with torch.no_grad():
        for context, cont in pairs:
            seq = torch.tensor([context + cont])
            logits, _ = model.forward_teach(seq[:, :-1], seq[:, 1:])
            logp = logits[0, -len(cont) :].double().log_softmax(-1)
            out.append(float(logp.gather(-1, torch.tensor(cont)[:, None]).sum()))
    return out


@pytest.mark.parametrize("variant", ["hope", "hope_attention", "titans_lmm", "transformer"])
def test_one_pass_per_document_scores_as_the_plain_read(variant: str) -> None:
    online = ["model.cms_mode=exact_online", "model.cms_lr=0.01"] if "hope" in variant else []
    model = tiny_lm(variant, *online).double().eval()
    pairs, docs, answers = _documents()
    got = score_documents(model, pairs, docs, answers, RESET, use_correct_answer=False)
    assert [s for s, _ in got] == pytest.approx(_plain(model, pairs), rel=1e-9, abs=1e-9)
    if variant != "transformer":  # a second pass writes the memories again
        twice = score_documents(model, pairs, docs, answers, MemorizeConfig(steps=2,
                                reset="reset_per_sample"), use_correct_answer=False)  # fmt: skip
        assert max(abs(a[0] - b[0]) for a, b in zip(twice, got, strict=True)) > 1e-6


def test_carry_streams_a_tasks_documents_and_answers_enter_after_scoring() -> None:
    model = tiny_lm("hope", "model.cms_mode=exact_online", "model.cms_lr=0.01").eval()
    pairs, docs, answers = _documents()
    fresh = [s for s, _ in score_documents(model, pairs, docs, answers, RESET, False)]
    context_only = [s for s, _ in score_documents(model, pairs, docs, answers, CARRY, False)]
    with_answer = [s for s, _ in score_documents(model, pairs, docs, answers, CARRY, True)]
    # Document 0 and task b's document start from a fresh state in every mode.
    for i in (0, 1, 2, 9, 10, 11):
        assert context_only[i] == pytest.approx(fresh[i], abs=1e-6)
        assert with_answer[i] == pytest.approx(fresh[i], abs=1e-6)
    later = range(3, 9)  # documents 1 and 2 read with earlier ones memorised
    assert max(abs(context_only[i] - fresh[i]) for i in later) > 1e-4
    assert max(abs(with_answer[i] - context_only[i]) for i in later) > 1e-4


def test_model_args_build_the_memorisation_and_name_a_bad_key() -> None:
    assert memorize_from_args({}) is None and memorize_from_args({"memorize_steps": "0"}) is None
    mem = memorize_from_args(
        {"memorize_steps": "2", "memorize_paths": "cms+smt", "memorize_layers": "0+1",
         "memorize_reset": "carry_across_samples", "memorize_surprise_threshold": "0.5"}
    )  # fmt: skip
    assert mem == MemorizeConfig(
        paths=("cms", "smt"), layers=(0, 1), surprise_threshold=0.5, steps=2,
        reset="carry_across_samples",
    )  # fmt: skip
    with pytest.raises(StageError, match="unknown model_args key 'memorize_step'"):
        memorize_from_args({"memorize_step": "2"})
    with pytest.raises(StageError, match="unknown path 'kv'"):
        memorize_from_args({"memorize_steps": "1", "memorize_paths": "kv"})


def test_stage_puts_adaptive_numbers_beside_the_plain_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    from hope.io import non_numbers

    monkeypatch.chdir(make_pipeline_layout(tmp_path))
    shutil.copytree(ROOT / "configs/lm_eval", tmp_path / "configs/lm_eval")
    sets = ["zeroshot.items=6", "zeroshot.bootstrap_iters=0", "zeroshot.memorize=true",
            "memorize.steps=2", "memorize.reset=carry_across_samples",
            "memorize.use_correct_answer=true"]  # fmt: skip
    assert load_stage("zeroshot").main_with(stage_argv(*sets)) == 0
    metrics = json.loads(Path("reports/zeroshot.json").read_text())
    assert non_numbers(metrics) == []
    choice = metrics["hope_choice"]
    assert choice["delta_acc"] == pytest.approx(choice["adaptive_acc"] - choice["acc"])
    assert choice["adaptive_n"] == choice["n"] == 6
    assert "adaptive_perplexity" in metrics["hope_cloze"]
    assert not any(k.startswith("adaptive_") for k in metrics["hope_rolling"])  # plain only
    meta = json.loads(Path("reports/zeroshot_meta.json").read_text())
    assert meta["memorize"]["steps"] == 2
    rolling = stage_argv(*sets, "zeroshot.tasks=[hope_rolling]")  # nothing to adapt
    assert load_stage("zeroshot").main_with(rolling) == 0
    only = json.loads(Path("reports/zeroshot.json").read_text())["hope_rolling"]
    assert not any(k.startswith("adaptive_") for k in only)
    capsys.readouterr()
    bad = stage_argv(*sets, "memorize.use_correct_answer=false", "memorize.layers=[7]")
    assert load_stage("zeroshot").main_with(bad) == 2
    assert "memorize.layers: 7 is not a block" in capsys.readouterr().err


def test_side_by_side_puts_adaptive_and_delta_beside_each_number() -> None:
    from hope.eval.memorizing import side_by_side

    row = side_by_side(
        {"acc": 0.5, "acc_stderr": 0.1, "n": 8, "loss": None},
        {"acc": 0.75, "acc_stderr": 0.12, "n": 8, "loss": 2.0},
    )
    assert row == {
        "acc": 0.5, "acc_stderr": 0.1, "n": 8, "loss": None,
        "adaptive_acc": 0.75, "delta_acc": 0.25, "adaptive_acc_stderr": 0.12,
        "adaptive_n": 8, "adaptive_loss": 2.0, "delta_loss": None,
    }  # fmt: skip
