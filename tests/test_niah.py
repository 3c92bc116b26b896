"""Needle in a haystack (hope.eval.niah): prompts hold exactly what they claim, and the
scoring rewards reading the needle and nothing else: a constructed copying model that
reads the context scores 1 on single needles, a model blind to the context scores no
better than chance."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from hope.errors import ConfigError
from hope.eval.niah import TASKS, build_prompt, evaluate_niah, task_spec, wilson

CPU = torch.device("cpu")
VOCAB = 128
ESSAY_TEXT = (
    "The river bends twice before the town and the old bridge carries the road over it. "
    "Farmers bring apples in autumn and the market fills the square every week. "
) * 4


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


ESSAY = encode(ESSAY_TEXT)


class InductionCopier(nn.Module):
    """Reads the context: at each position, finds the latest earlier position whose last
    ``span`` tokens match its own and predicts the token that followed there (an ideal
    induction head), with a margin of 20 nats over every other token."""

    def __init__(self, span: int = 6) -> None:
        super().__init__()
        self.span = span

    def forward_teach(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, None]:
        rows, length = x.shape
        logits = torch.zeros(rows, length, VOCAB)
        same = x[:, :, None] == x[:, None, :]  # [R, t, j]
        match = torch.ones_like(same)
        for back in range(self.span):  # x[t - k] == x[j - k] for k < span
            shifted = torch.zeros_like(same)
            shifted[:, back:, back:] = same[:, : length - back, : length - back]
            match &= shifted
        earlier = torch.ones(length, length, dtype=torch.bool).tril(-1)
        match &= earlier
        positions = torch.arange(length).expand(rows, length, length)
        latest = torch.where(match, positions, -1).amax(-1)  # [R, t]
        found = latest >= 0
        follower = x.gather(1, (latest + 1).clamp(max=length - 1))
        logits[found] = logits[found].scatter(-1, follower[found].unsqueeze(-1), 20.0)
        return logits, None


class ContextBlind(nn.Module):
    """Sees only the current token (a fixed random bigram table): no context at all."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 3

    def forward_teach(self, x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.table[x], None


def _run(model: nn.Module, tasks: tuple[str, ...], trials: int) -> dict:
    return evaluate_niah(
        model, encode, ESSAY, tasks, [600], [0.0, 0.5, 1.0], trials, 4, 3, seed=7,
        batch_size=32, device=CPU,
    )  # type: ignore[arg-type]  # fmt: skip


def test_a_model_that_reads_the_needle_finds_it_at_every_depth() -> None:
    report = _run(InductionCopier(), ("s_niah_1", "s_niah_2", "s_niah_3"), 6)
    for task in ("s_niah_1", "s_niah_2", "s_niah_3"):
        row = report[task]["len_600"]
        assert row["acc"] == 1.0 and row["depth_0"] == row["depth_0.5"] == row["depth_1"] == 1.0
        assert row["acc_ci_low"] > 0.8 and row["chance"] == 0.25


def test_multi_key_needs_the_key_not_just_a_number() -> None:
    """The copier without the key in its match span copies whichever needle came last:
    the other needles' values are distractors, so it misses often."""
    keyless = _run(InductionCopier(span=2), ("mk_niah",), 12)["mk_niah"]["len_600"]
    keyed = _run(InductionCopier(span=16), ("mk_niah",), 12)["mk_niah"]["len_600"]
    assert keyed["acc"] == 1.0
    assert keyless["acc"] < 0.75


def test_a_model_blind_to_the_context_scores_no_better_than_chance() -> None:
    report = _run(ContextBlind(), TASKS, 20)
    hits = [report[task]["len_600"]["acc"] for task in TASKS]
    assert sum(hits) / len(hits) < 0.25 + 0.1  # 240 trials: chance 0.25, 2.5 sigma above
    assert all(report[task]["len_600"]["acc_ci_low"] < 0.25 for task in TASKS)


@pytest.mark.parametrize("task", TASKS)
def test_prompts_hold_the_needle_value_once_per_needle_at_the_asked_length(task: str) -> None:
    spec = task_spec(task, 3)
    prompt, values = build_prompt(spec, encode, ESSAY, 700, 0.5, random.Random(1), 4)
    assert len(prompt) == 700 and len(values) == 4 and len({tuple(v) for v in values}) == 4
    text = "".join(map(chr, prompt))
    true = "".join(map(chr, values[0]))
    assert text.count(true) == 1
    key = text.rsplit(" for ", 1)[1].removesuffix(" is:")
    assert f"for {key} is:{true}." in text
    others = ["".join(map(chr, v)) for v in values[1:]]
    assert sum(text.count(o) for o in others) == spec.needles - 1  # mk: others are needles
    if spec.value == "uuid":
        assert len(true) == 36 and true.count("-") == 4
    if spec.haystack == "noise":
        assert "grass is green" in text


def test_bad_settings_are_one_clear_error() -> None:
    with pytest.raises(ConfigError, match="unknown task 's_niah_9'"):
        task_spec("s_niah_9", 1)
    with pytest.raises(ConfigError, match="too short for the needles"):
        build_prompt(task_spec("mk_niah", 4), encode, ESSAY, 100, 0.5, random.Random(0), 4)


def test_wilson_interval_brackets_the_proportion() -> None:
    low, high = wilson(8, 10)
    assert low < 0.8 < high and low >= 0.0 and high <= 1.0
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0


def test_stage_writes_numbers_heatmap_and_refuses_bad_input(
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json
    from pathlib import Path

    from conftest import make_pipeline_layout, stage_argv
    from hope.io import non_numbers
    from test_eval import load_stage

    monkeypatch.chdir(make_pipeline_layout(tmp_path_factory.mktemp("niah")))
    sets = ["niah.depths=[0.0,1.0]", "niah.trials=2"]
    assert load_stage("niah").main_with(stage_argv(*sets, "niah.lengths=[240,320]")) == 0
    metrics = json.loads(Path("reports/niah.json").read_text())
    assert non_numbers(metrics) == [] and metrics["step"] == 3
    assert set(metrics) == {"step", *TASKS}
    row = metrics["mk_niah"]["len_320"]
    assert set(row) == {"acc", "acc_ci_low", "acc_ci_high", "chance", "depth_0", "depth_1"}
    assert row["acc"] == (row["depth_0"] + row["depth_1"]) / 2
    assert Path("reports/niah_heatmap.png").stat().st_size > 1000
    assert json.loads(Path("reports/niah_meta.json").read_text())["variant"] == "hope"
    capsys.readouterr()
    assert load_stage("niah").main_with(stage_argv(*sets, "niah.lengths=[60]")) == 2
    assert "niah.lengths: 60 tokens is too short" in capsys.readouterr().err
    assert load_stage("niah").main_with(stage_argv(*sets, "niah.tasks=[s_niah_9]")) == 2
    assert "niah.tasks: unknown task 's_niah_9'" in capsys.readouterr().err
