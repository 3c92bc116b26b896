"""Perplexity and passkey evaluation against direct references on stand-in models."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm
import torch
import torch.nn.functional as F
from torch import nn

from conftest import CLASSIC_SHELL
from hope.cli import run_stage
from hope.config import load_config
from hope.errors import ConfigError
from hope.eval import passkey
from hope.eval.perplexity import bits_per_byte, evaluate_perplexity
from hope.eval.run import val_bytes_per_token
from hope.io import non_numbers

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
VOCAB = 128


def char_encode(text: str) -> list[int]:
    """ASCII ids with a leading space, mimicking SentencePiece's dummy prefix."""
    return [ord(c) for c in " " + text]


class StandIn(nn.Module):
    """The LanguageModel calling convention without memories that learn."""

    def forward_teach(self, tokens: torch.Tensor, targets: torch.Tensor, state: object = None):
        return self(tokens, state)


class BigramModel(StandIn):
    """logits[t] = table[tokens[t]]: follows the LanguageModel forward contract."""

    def __init__(self, vocab: int = VOCAB, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=gen, dtype=dtype))

    def forward(self, tokens: torch.Tensor, state: object = None) -> tuple[torch.Tensor, None]:
        return self.table[tokens], None  # [B, T, V]


class UniformModel(StandIn):
    def forward(self, tokens: torch.Tensor, state: object = None) -> tuple[torch.Tensor, None]:
        return torch.zeros(*tokens.shape, VOCAB), None


class CopyModel(StandIn):
    """An induction "oracle": predicts the token that followed the latest earlier
    occurrence of the last ``k`` tokens (uniform when there is none)."""

    def __init__(self, k: int = 6, confidence: float = 10.0):
        super().__init__()
        self.k, self.confidence = k, confidence

    def forward(self, tokens: torch.Tensor, state: object = None) -> tuple[torch.Tensor, None]:
        batch, length = tokens.shape
        eq = tokens[:, :, None] == tokens[:, None, :]  # [B, T(t), T(s)]
        match = eq.clone()
        for j in range(1, self.k):  # window of k equal tokens ending at t and at s
            shifted = torch.zeros_like(eq)
            shifted[:, j:, j:] = eq[:, :-j, :-j]
            match &= shifted
        pos = torch.arange(length)
        match &= pos[None, :] < pos[:, None]  # only s < t, so s + 1 <= t is known
        score = torch.where(match, pos + 1, 0)  # latest match wins
        found = score.amax(-1) > 0  # [B, T]
        nxt = tokens.gather(1, score.argmax(-1).add(1).clamp(max=length - 1))  # [B, T]
        logits = torch.zeros(batch, length, VOCAB)
        logits.scatter_(2, nxt[..., None], self.confidence * found[..., None].float())
        return logits, None


def tiny_sentencepiece() -> spm.SentencePieceProcessor:
    rng = random.Random(0)
    needle = f"{passkey.NEEDLE_HEAD} 12345{passkey.NEEDLE_MID} 12345 {passkey.NEEDLE_TAIL}"
    lines = [passkey.FILLER, passkey.QUESTION, needle]
    lines += [f"The number {rng.randint(0, 99999)} is here." for _ in range(200)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 5),
        model_writer=model,
        vocab_size=80,
        model_type="unigram",
        num_threads=1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


# ---------------------------------------------------------------- perplexity


def test_perplexity_equals_exp_of_reference_mean_ce() -> None:
    model = BigramModel(seed=1)
    gen = torch.Generator().manual_seed(2)
    data = torch.randint(0, VOCAB, (3, 5, 17), generator=gen)  # 3 batches [5, 17]
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    result = evaluate_perplexity(model, batches, CPU)

    # Direct float64 reference: -log softmax of the table row, per token.
    table = model.table.detach().double()
    logp = table - torch.logsumexp(table, dim=-1, keepdim=True)
    nll = torch.cat([-logp[x, y].flatten() for x, y in batches])
    assert result.tokens == nll.numel() == 3 * 5 * 16
    assert result.loss == pytest.approx(nll.mean().item(), rel=1e-6)
    assert result.ppl == pytest.approx(math.exp(nll.mean().item()), rel=1e-6)
    assert result.ppl > 1.0


def test_perplexity_restores_training_mode_and_rejects_empty() -> None:
    model = BigramModel()
    model.train()
    x = torch.zeros(1, 4, dtype=torch.long)
    evaluate_perplexity(model, [(x, x)], CPU)
    assert model.training
    with pytest.raises(Exception, match="no evaluation batches"):
        evaluate_perplexity(model, [], CPU)


def test_bits_per_byte_and_coverage_ratio(tmp_path) -> None:
    assert bits_per_byte(math.log(2.0), bytes_per_token=4.0) == pytest.approx(0.25)
    assert val_bytes_per_token(tmp_path) is None  # no coverage.json: metric skipped
    coverage = tmp_path / "coverage.json"
    coverage.write_text('{"bytes": 300, "tokens": 90, "documents": 10}')
    assert val_bytes_per_token(tmp_path) == pytest.approx(3.0)  # one EOS per document
    coverage.write_text('{"tokens": 100, "documents": 3}')
    assert val_bytes_per_token(tmp_path) is None


# ---------------------------------------------------------------- passkey prompts


@pytest.mark.parametrize("length", [98, 99, 150, 257])  # 98: no filler at all
def test_prompt_has_exact_length_and_contains_key_char_level(length: int) -> None:
    task = passkey.build_task(char_encode, length, trials=5, candidates=3, seed=7)
    assert task.prompts.shape == (5, length)
    for prompt, key, cand in zip(task.prompts, task.true_keys, task.candidates, strict=True):
        text = "".join(map(chr, prompt.tolist()))
        assert text.count(f" {key}") == 2  # needle says it twice
        assert text.endswith(passkey.QUESTION)
        assert "".join(map(chr, cand[0].tolist())) == f" {key}"
        distractors = {"".join(map(chr, c.tolist())) for c in cand[1:]}
        assert f" {key}" not in distractors and len(distractors) == 2


def test_prompt_exact_length_with_sentencepiece() -> None:
    sp = tiny_sentencepiece()

    def encode(text: str) -> list[int]:
        return list(sp.encode(text))

    for length in (64, 128, 131):
        task = passkey.build_task(encode, length, trials=4, candidates=4, seed=0)
        assert task.prompts.shape == (4, length)
        for prompt, key, cand, mask in zip(
            task.prompts, task.true_keys, task.candidates, task.candidate_mask, strict=True
        ):
            key_ids = cand[0][mask[0]].tolist()
            assert key_ids == encode(str(key))
            ids = prompt.tolist()
            hits = [i for i in range(length) if ids[i : i + len(key_ids)] == key_ids]
            assert len(hits) == 2
            assert str(key) in sp.decode(ids)


def test_depths_vary_and_task_is_seeded() -> None:
    a = passkey.build_task(char_encode, 120, trials=12, candidates=4, seed=3)
    b = passkey.build_task(char_encode, 120, trials=12, candidates=4, seed=3)
    c = passkey.build_task(char_encode, 120, trials=12, candidates=4, seed=4)
    assert torch.equal(a.prompts, b.prompts) and torch.equal(a.candidates, b.candidates)
    assert a.true_keys != c.true_keys
    starts = {"".join(map(chr, p.tolist())).index(passkey.NEEDLE_HEAD) for p in a.prompts}
    assert len(starts) > 6  # the needle moves around


def test_too_short_length_names_the_knob() -> None:
    with pytest.raises(ConfigError, match="eval.passkey_lengths"):
        passkey.build_task(char_encode, 97, trials=1, candidates=2, seed=0)
    with pytest.raises(ConfigError, match="eval.passkey_candidates"):
        passkey.build_task(char_encode, 100, trials=1, candidates=1, seed=0)


# ---------------------------------------------------------------- passkey scoring


def test_copy_oracle_scores_perfectly() -> None:
    results = passkey.evaluate_passkey(
        CopyModel(),
        char_encode,
        [100, 180],
        trials=8,
        candidates=4,
        seed=5,
        batch_size=6,
        device=CPU,
    )
    assert set(results) == {"len_100", "len_180"}
    for result in results.values():
        assert result["acc"] == 1.0
        assert result["chance"] == 0.25
        # all 6 key tokens predicted with logit 10 against 127 zeros
        per_token = -math.log1p(127 * math.exp(-10.0))
        assert result["true_logprob"] == pytest.approx(6 * per_token, rel=1e-4)


def test_uniform_model_ties_count_as_failures() -> None:
    task = passkey.build_task(char_encode, 110, trials=10, candidates=4, seed=1)
    result = passkey.score_task(UniformModel(), task, batch_size=7, device=CPU)
    assert result.acc == 0.0  # every candidate ties; a tie is not a hit
    assert result.chance == 0.25
    assert result.true_logprob == pytest.approx(-6 * math.log(VOCAB), rel=1e-6)


def naive_passkey_scores(model: nn.Module, task: passkey.PasskeyTask) -> torch.Tensor:
    """Token-by-token reference: one forward per (trial, candidate, key position)."""
    trials, n_cand, _ = task.candidates.shape
    scores = torch.zeros(trials, n_cand, dtype=torch.float64)
    for i in range(trials):
        for c in range(n_cand):
            key = task.candidates[i, c][task.candidate_mask[i, c]].tolist()
            context = task.prompts[i].tolist()
            for token in key:
                # The oracle does not know the token it is about to score: its own
                # target is -100; earlier targets are the tokens that followed.
                targets = torch.tensor([context[1:] + [-100]])
                logits, _ = model.forward_teach(torch.tensor([context]), targets)
                scores[i, c] += F.log_softmax(logits[0, -1].double(), -1)[token]
                context.append(token)
    return scores


def test_batched_scoring_matches_token_by_token_reference() -> None:
    sp = tiny_sentencepiece()
    model = BigramModel(vocab=sp.vocab_size(), seed=3, dtype=torch.float64)
    task = passkey.build_task(lambda t: list(sp.encode(t)), 70, trials=9, candidates=3, seed=2)
    assert not bool(task.candidate_mask.all())  # keys of unequal token length are padded
    ref = naive_passkey_scores(model, task)
    ref_acc = (ref[:, 0] > ref[:, 1:].amax(1)).double().mean().item()
    for batch_size in (1, 4, 27):
        got = passkey.score_task(model, task, batch_size=batch_size, device=CPU)
        assert got.acc == pytest.approx(ref_acc, abs=1e-12)
        assert got.true_logprob == pytest.approx(ref[:, 0].mean().item(), rel=1e-6)
    assert 0.0 < ref_acc < 1.0  # a random bigram table is neither oracle nor blind


def test_unigram_entropy_of_targets() -> None:
    y = torch.tensor([[1, 1, 2, 3]])
    result = evaluate_perplexity(UniformModel(), [(torch.zeros_like(y), y)], CPU)
    p = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    assert result.unigram_entropy == pytest.approx(-(p * p.log()).sum().item(), rel=1e-12)
    assert result.loss == pytest.approx(math.log(VOCAB), rel=1e-6)  # uniform over 128


# ---------------------------------------------------------------- the real pipeline pieces


def _write_jsonl(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def test_eval_plot_release_stages_on_real_artifacts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Tokenizer, shards and checkpoint made by the real library, then the three stages."""
    from pydoc_data.topics import topics

    import hope
    from hope.data.shards import write_shards
    from hope.data.tokenizer import train_tokenizer
    from hope.train.checkpoint import save_checkpoint

    monkeypatch.chdir(tmp_path)
    overrides = [
        "model.dim=32",
        "model.n_layers=1",
        "model.n_heads=2",
        "tokenizer.vocab_size=512",
        "data.seq_len=32",
        "eval.batch_size=3",
        "eval.max_batches=2",
        "eval.passkey_lengths=[80,112]",
        "eval.passkey_trials=4",
        "eval.passkey_candidates=4",
        "train.device=cpu",
        *CLASSIC_SHELL,  # untrained and near uniform: checked below
    ]
    sets = [f"--set={o}" for o in overrides]
    params = ["--params", str(ROOT / "params.yaml")]
    cfg = load_config(ROOT / "params.yaml", overrides)
    docs = [topics[name] for name in sorted(topics)[:80]]
    _write_jsonl(Path("data/raw/train.jsonl"), docs[:64])
    _write_jsonl(Path("data/raw/val.jsonl"), docs[64:])
    train_tokenizer(
        cfg.tokenizer,
        Path("data/raw/train.jsonl"),
        Path("data/tokenizer"),
        val_jsonl=Path("data/raw/val.jsonl"),
    )
    write_shards(Path("data/tokenizer/spm.model"), Path("data/raw"), Path("data/shards"))
    torch.manual_seed(0)
    model = hope.build_model(cfg.model)
    payload = {"model": model.state_dict(), "config": cfg.to_dict(), "step": 3}
    save_checkpoint(Path("models/checkpoints"), 3, payload)

    assert load_stage("eval").main_with(params + sets) == 0
    report = json.loads(Path("reports/eval.json").read_text())
    assert non_numbers(report) == []  # a DVC metrics file; names and runtime beside it
    records = json.loads(Path("reports/eval_meta.json").read_text())
    assert report["step"] == 3 and records["variant"] == cfg.model.variant
    assert records["runtime"]["device"] == "cpu"
    val = report["val"]
    assert val["tokens"] == 2 * 3 * 32
    assert abs(val["loss"] - math.log(512)) < 0.1  # an untrained model is near uniform
    assert val["unigram_entropy"] < val["loss"]
    assert val["bpb"] == pytest.approx(val["loss"] / math.log(2) / val["bytes_per_token"])
    assert set(report["passkey"]) == {"len_80", "len_112"}
    for result in report["passkey"].values():
        assert result["chance"] == 0.25 and 0.0 <= result["acc"] <= 1.0
        assert result["true_logprob"] == pytest.approx(-6 * math.log(512), rel=0.05)
    assert Path("reports/eval_config.yaml").is_file()

    Path("reports/train_log.tsv").write_text(
        "step\ttrain_loss\tval_subset_loss\tlr\ttokens\ttokens_per_s\n"
        "1\t5.7\t\t0.001\t96\t100\n3\t5.6\t5.65\t0.002\t288\t100\n"
    )
    Path("reports/train.json").write_text(json.dumps({"steps": 3, "val_subset_loss": 5.65}))
    Path("reports/train_meta.json").write_text(json.dumps({"runtime": {"device": "cpu"}}))
    assert load_stage("plot").main_with(params) == 0
    assert all(
        Path(f"reports/plots/{n}.png").stat().st_size > 1000 for n in ("loss", "lr", "passkey")
    )
    assert load_stage("release").main_with(params + sets) == 0
    assert "ok: 9 files verified" in capsys.readouterr().out  # no dvc.lock here
    Path("reports/eval.json").unlink()
    assert load_stage("plot").main_with(params) == 2
    assert "reports/eval.json not found" in capsys.readouterr().err


class _Stage:
    def __init__(self, module: Any) -> None:
        self.module = module

    def main_with(self, argv: list[str]) -> int:
        extra = getattr(self.module, "add_args", None)
        return run_stage(self.module.__doc__, self.module.body, argv=argv, extra_args=extra)


def load_stage(name: str) -> _Stage:
    spec = importlib.util.spec_from_file_location(f"stage_{name}", ROOT / "stages" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return _Stage(module)


@pytest.mark.parametrize("variant", __import__("hope").VARIANTS)
def test_every_variant_scores_like_the_token_by_token_reference(variant: str) -> None:
    """The real models: batched, padded passkey scoring == one forward per key token."""
    import hope

    cfg = load_config(
        ROOT / "params.yaml",
        [f"model.variant={variant}", "model.dim=32", "model.n_layers=1", "model.n_heads=2"],
    )
    cfg.model.vocab_size = VOCAB
    torch.manual_seed(0)
    model = hope.build_model(cfg.model).double()
    task = passkey.build_task(char_encode, 100, trials=3, candidates=2, seed=0)
    ref = naive_passkey_scores(model, task)
    got = passkey.score_task(model, task, batch_size=4, device=CPU)
    assert got.true_logprob == pytest.approx(ref[:, 0].mean().item(), rel=1e-5)
    assert got.acc == (ref[:, 0] > ref[:, 1:].amax(1)).double().mean().item()
    x = task.prompts[:, :-1]
    assert evaluate_perplexity(model, [(x, task.prompts[:, 1:])], CPU).tokens == x.numel()
