"""The lm-eval adapter (``hope.eval.harness``): its numbers equal a direct computation
from the model's logits, and lm-eval runs end to end on a task YAML written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance

from conftest import make_bundle
from hope import infer
from hope.eval.harness import HopeHarnessLM, main

VARIANTS = ("hope", "transformer", "titans_mac")


@pytest.fixture(scope="module", params=VARIANTS)
def lm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HopeHarnessLM:
    bundle = make_bundle(tmp_path_factory.mktemp(request.param), f"model.variant={request.param}")
    return HopeHarnessLM(str(bundle), batch_size=3)


def _direct_logprob(lm: HopeHarnessLM, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context), one unpadded teach pass (the training read)."""
    seq = torch.tensor([context + continuation])
    with torch.no_grad():
        logits, _ = lm.model.forward_teach(seq[:, :-1], seq[:, 1:])
    logprobs = logits[0].double().log_softmax(-1)
    n = len(continuation)
    picked = logprobs[-n:].gather(-1, seq[0, -n:].unsqueeze(-1))
    return float(picked.sum())


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


PAIRS = [
    ("The module provides", " functions"),
    ("Return the value of the", " attribute named by the string"),
    ("If the file", " exists"),
    ("A list is", " a mutable sequence of items, usually"),
    ("Raise", " an error"),
]


def test_loglikelihood_equals_the_direct_computation_padded_in_batches(lm: HopeHarnessLM) -> None:
    got = lm.loglikelihood(_requests("loglikelihood", PAIRS), disable_tqdm=True)
    for (context, continuation), (logprob, _) in zip(PAIRS, got, strict=True):
        ctx = lm.tok_encode(context)
        cont = lm.tok_encode(context + continuation)[len(ctx) :]
        assert logprob == pytest.approx(_direct_logprob(lm, ctx, cont), rel=1e-5, abs=1e-5)
        assert logprob < 0


def test_is_greedy_holds_exactly_for_the_argmax_continuation(lm: HopeHarnessLM) -> None:
    context = lm.tok_encode("The module provides")
    seq = list(context)
    with torch.no_grad():
        for _ in range(4):
            logits, _ = lm.model(torch.tensor([seq]))
            seq.append(int(logits[0, -1].argmax()))
    greedy_tail = seq[len(context) :]
    other = [(greedy_tail[0] + 1) % lm.model.cfg.vocab_size, *greedy_tail[1:]]
    (_, is_greedy), (_, not_greedy) = lm.score_pairs([(context, greedy_tail), (context, other)])
    assert is_greedy and not not_greedy


def test_rolling_loglikelihood_is_the_sum_over_disjoint_windows(lm: HopeHarnessLM) -> None:
    lm.max_length = 8
    try:
        text = "The module provides functions for working with files and directories on disk."
        ids = lm.tok_encode(text)
        assert len(ids) > 16  # three windows at least
        [got] = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]), True)
    finally:
        lm.max_length = 32
    want = 0.0
    for start in range(0, len(ids), 8):  # each window reads 8 tokens, a fresh context
        end = min(start + 8, len(ids))
        context = [lm.eot_token_id] if start == 0 else ids[end - 9 : start]
        want += _direct_logprob(lm, context, ids[start:end])
    assert got == pytest.approx(want, rel=1e-5)


def test_generate_until_is_greedy_decoding_cut_at_the_stop_string(lm: HopeHarnessLM) -> None:
    prompt = "The module"
    ids, _ = infer.generate_ids(lm.model, lm.tok_encode(prompt), 12, temperature=0.0)
    full = lm.sp.decode(ids)
    [free] = lm.generate_until(_requests("generate_until", [(prompt, {"max_gen_toks": 12})]))
    assert free == full and len(free) > 0
    stop = full.strip()[:1]
    [cut] = lm.generate_until(
        _requests("generate_until", [(prompt, {"until": [stop], "max_gen_toks": 12})])
    )
    assert cut == full[: full.index(stop)]


CHOICE_TASK = """
task: test_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _choice_task(tmp_path: Path) -> tuple[Path, list[dict]]:
    items = [
        {
            "context": "The module provides",
            "choices": [" functions", " apples", " the"],
            "label": 0,
        },
        {"context": "Return the", "choices": [" value", " table", " of"], "label": 1},
        {"context": "If the file", "choices": [" exists", " is", " moon"], "label": 2},
        {"context": "A list is", "choices": [" mutable", " red", " a"], "label": 0},
    ]
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "test_choice.yaml").write_text(CHOICE_TASK.format(data=data))
    return tasks, items


def test_lm_eval_runs_a_task_written_here_and_scores_as_the_model(
    lm: HopeHarnessLM, tmp_path: Path
) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks, items = _choice_task(tmp_path)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=["test_choice"], task_manager=TaskManager(include_path=str(tasks)),
        num_fewshot=0, bootstrap_iters=0,
    )  # fmt: skip
    assert out is not None
    acc = out["results"]["test_choice"]["acc,none"]
    correct = 0
    for item in items:
        ctx = lm.tok_encode(item["context"])
        scores = [
            _direct_logprob(lm, ctx, lm.tok_encode(item["context"] + choice)[len(ctx) :])
            for choice in item["choices"]
        ]
        correct += int(max(range(len(scores)), key=scores.__getitem__) == item["label"])
    assert acc == pytest.approx(correct / len(items))


def test_the_command_line_registers_hope_and_hands_over_to_lm_eval(
    lm: HopeHarnessLM, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if lm.model.cfg.variant != "hope":
        pytest.skip("one variant is enough for the command line")
    tasks, _ = _choice_task(tmp_path)
    bundle = lm.pretrained
    argv = ["--model_args", f"pretrained={bundle}", "--batch_size", "2", "--tasks", "test_choice",
            "--include_path", str(tasks), "--output_path", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    written = list((tmp_path / "out").rglob("results_*.json"))
    assert len(written) == 1
    assert "acc,none" in json.loads(written[0].read_text())["results"]["test_choice"]
    assert main([*argv[:2], "--tasks", "no_such_task"]) == 2
    assert "no_such_task" in capsys.readouterr().err
