"""Needle in a haystack (hope.eval.niah): prompts hold exactly what they claim, and the
scoring rewards reading the needle and nothing else: a constructed copying model that
reads the context scores 1 on single needles, a model blind to the context scores no
better than chance."""

from __future__ import annotations

import dataclasses
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


def test_memorise_then_ask_is_refused_for_titans_mac() -> None:
    from conftest import tiny_lm
    from hope.config import MemorizeParams, NiahConfig
    from hope.eval.niah import adaptive_config

    on, params = NiahConfig(memorize=True), MemorizeParams(steps=2, paths=["cms"])
    assert adaptive_config(NiahConfig(), params, tiny_lm("titans_mac")) is None  # off
    with pytest.raises(ConfigError, match="niah.memorize: titans_mac"):
        adaptive_config(on, params, tiny_lm("titans_mac"))
    mem = adaptive_config(on, params, tiny_lm("hope"))
    assert mem is not None and (mem.steps, mem.paths, mem.reset) == (
        2, ("cms",), "reset_per_sample",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="memorize.layers: 5 is not a block"):
        adaptive_config(on, MemorizeParams(layers=[5]), tiny_lm("hope"))
    with pytest.raises(ConfigError, match="memorize.use_correct_answer: only zero-shot"):
        adaptive_config(on, MemorizeParams(use_correct_answer=True), tiny_lm("hope"))


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
    assert load_stage("niah").main_with(stage_argv(*sets, "niah.lengths=[256]")) == 0
    metrics = json.loads(Path("reports/niah.json").read_text())
    assert non_numbers(metrics) == [] and metrics["step"] == 3
    assert set(metrics) == {"step", *TASKS}
    row = metrics["mk_niah"]["len_256"]
    assert set(row) == {"acc", "acc_ci_low", "acc_ci_high", "chance", "depth_0", "depth_1"}
    assert row["acc"] == (row["depth_0"] + row["depth_1"]) / 2
    assert Path("reports/niah_heatmap.png").stat().st_size > 1000
    assert json.loads(Path("reports/niah_meta.json").read_text())["variant"] == "hope"
    adaptive = stage_argv(*sets, "niah.lengths=[256]", "niah.tasks=[s_niah_1]",
                          "niah.memorize=true", "memorize.steps=2")  # fmt: skip
    assert load_stage("niah").main_with(adaptive) == 0
    row = json.loads(Path("reports/niah.json").read_text())["s_niah_1"]["len_256"]
    assert row["delta_acc"] == pytest.approx(row["adaptive_acc"] - row["acc"])
    meta = json.loads(Path("reports/niah_meta.json").read_text())
    assert meta["memorize"]["steps"] == 2 and meta["memorize"]["reset"] == "reset_per_sample"
    capsys.readouterr()
    assert load_stage("niah").main_with(stage_argv(*sets, "niah.lengths=[60]")) == 2
    assert "niah.lengths: 60 tokens is too short" in capsys.readouterr().err
    assert load_stage("niah").main_with(stage_argv(*sets, "niah.tasks=[s_niah_9]")) == 2
    assert "niah.tasks: unknown task 's_niah_9'" in capsys.readouterr().err


def _word_encode(text: str) -> list[int]:
    """Words and punctuation into tiny_lm's 64-token vocabulary (a stable hash)."""
    import re
    import zlib

    return [zlib.crc32(w.encode()) % 64 for w in re.findall(r"\w+|[^\w\s]", text)]


@pytest.mark.parametrize("variant", ["hope", "transformer", "titans_lmm"])
def test_one_memorisation_pass_scores_as_reading_the_prompt(variant: str) -> None:
    """Memorise-then-ask with one online pass == the plain read, candidate by candidate
    (float64); two passes change what the memories hold (and the scores)."""
    from conftest import tiny_lm
    from hope.eval.niah import build_task, memorized_scores
    from hope.model.memorize import MemorizeConfig

    online = ["model.cms_mode=exact_online", "model.cms_lr=0.01"] if variant == "hope" else []
    model = tiny_lm(variant, *online).double().eval()  # test time, as memorisation runs
    essay = _word_encode(ESSAY_TEXT)
    # 73 tokens: the memorised 72 end on every CMS/SMT/Titans chunk grid of tiny_lm.
    task = build_task(task_spec("s_niah_2", 1), _word_encode, essay, 73, 0.5, 2, 3, seed="m")
    trials, n_cand, _ = task.candidates.shape
    plain = torch.empty(trials, n_cand, dtype=torch.float64)
    with torch.no_grad():  # the reference: prompt and candidate in one teach pass
        for i in range(trials):
            for c in range(n_cand):
                cand = task.candidates[i, c][task.candidate_mask[i, c]]
                seq = torch.cat([task.prompts[i], cand])[None]
                logits, _ = model.forward_teach(seq[:, :-1], seq[:, 1:])
                logp = logits[0, -len(cand) :].log_softmax(-1)
                plain[i, c] = logp.gather(-1, cand[:, None]).sum()
    fresh = MemorizeConfig(steps=1, reset="reset_per_sample")
    once = memorized_scores(model, task, fresh, 8, CPU)
    torch.testing.assert_close(once, plain, rtol=1e-9, atol=1e-9)
    # Carried: the first prompt is read as before; the second on top of the first.
    carried = memorized_scores(model, task, MemorizeConfig(steps=1), 8, CPU)
    torch.testing.assert_close(carried[0], once[0], rtol=1e-9, atol=1e-9)
    assert (carried[1] - once[1]).abs().max() > 1e-6
    if variant != "transformer":  # no memory to write twice
        twice = memorized_scores(model, task, dataclasses.replace(fresh, steps=2), 8, CPU)
        assert (twice - once).abs().max() > 1e-6
