"""Using a trained model (``hope.infer``, the ``hope`` command): streaming decoding equals
re-running the prefix, seeded sampling, state files, scoring, and the CLI on a real
release bundle built from a tiny model and a real tokenizer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

import hope
from conftest import assert_states_close, make_bundle, rand_tokens, tiny_lm
from hope import infer
from hope.app import main
from hope.config import load_config
from hope.errors import StageError
from hope.model.state_file import load_state_file, save_state_file

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("variant", hope.VARIANTS)
def test_greedy_decoding_with_state_carry_equals_rerunning_the_prefix(variant: str) -> None:
    model = tiny_lm(variant)
    prefix = rand_tokens(1, 6, seed=3)[0].tolist()
    decoder = infer.Decoder(model)
    decoder.feed(prefix)
    for _ in range(11):  # past every chunk, segment and period boundary of tiny_lm
        with torch.no_grad():
            rerun, _ = model(torch.tensor([prefix]))
        assert decoder.logits is not None
        torch.testing.assert_close(decoder.logits, rerun[0, -1], rtol=0, atol=1e-10)
        token = int(rerun[0, -1].argmax())
        prefix.append(token)
        decoder.feed([token])
    ids, _ = infer.generate_ids(model, prefix[:6], 11, temperature=0.0)
    assert ids == prefix[6:]


def test_sampling_is_reproducible_for_a_seed_and_varies_across_seeds() -> None:
    model = tiny_lm("hope")
    prompt = rand_tokens(1, 5, seed=4)[0].tolist()
    runs = {seed: infer.generate_ids(model, prompt, 12, seed=seed)[0] for seed in (0, 1, 2)}
    assert infer.generate_ids(model, prompt, 12, seed=0)[0] == runs[0]
    assert len({tuple(r) for r in runs.values()}) > 1


def test_top_k_draws_only_from_the_k_best_and_temperature_zero_is_argmax() -> None:
    logits = torch.tensor([0.5, 3.0, -1.0, 2.5, 2.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    draws = {infer._sample(logits, 2.0, 3, gen) for _ in range(200)}
    assert draws == {1, 3, 4}
    assert infer._sample(logits, 0.0, 0, gen) == 1


def test_generation_stops_after_eos() -> None:
    model = tiny_lm("transformer")
    prompt = [5, 6, 7]
    greedy, _ = infer.generate_ids(model, prompt, 8, temperature=0.0)
    stopped, _ = infer.generate_ids(model, prompt, 8, temperature=0.0, eos_id=greedy[2])
    assert stopped == greedy[: greedy.index(greedy[2]) + 1]


@pytest.mark.parametrize("variant", hope.VARIANTS)
def test_a_saved_state_continues_exactly_like_the_live_one(variant: str, tmp_path: Path) -> None:
    model = tiny_lm(variant)
    first, second = rand_tokens(2, 12, seed=1), rand_tokens(2, 8, seed=2)
    with torch.no_grad():
        _, state = model(first)  # pending chunks and CMS buffers are non-empty
        state = model.reset_state(state, torch.tensor([False, True]))  # KV masks appear
        save_state_file(model, state, tmp_path / "s.safetensors")
        loaded = load_state_file(model, tmp_path / "s.safetensors")
        assert_states_close(loaded, state, atol=0)
        live, _ = model(second, state)
        resumed, _ = model(second, loaded)
    # Same values; the file's tensors are contiguous where the live ones are views,
    # so a matmul may sum in another order (last-bit differences).
    torch.testing.assert_close(resumed, live, rtol=0, atol=1e-12)


def test_a_state_of_another_model_is_refused(tmp_path: Path) -> None:
    model = tiny_lm("hope")
    _, state = model(rand_tokens(1, 8))
    save_state_file(model, state, tmp_path / "s.safetensors")
    other = tiny_lm("hope", "model.cms_periods=[4, 16]")
    with pytest.raises(ValueError, match="another model config"):
        load_state_file(other, tmp_path / "s.safetensors")


@pytest.mark.parametrize("variant", ["transformer", "titans_lmm"])
def test_score_is_the_mean_next_token_loss_of_the_teach_path(variant: str) -> None:
    model = tiny_lm(variant)
    ids = rand_tokens(1, 20, seed=5)[0].tolist()
    x = torch.tensor([ids])
    with torch.no_grad():
        logits, _ = model.forward_teach(x[:, :-1], x[:, 1:])
    want = F.cross_entropy(logits[0].double(), x[0, 1:], reduction="sum").item()
    for window in (20, 8, 4):  # windows on the chunk grid carry the state exactly
        nats, count = infer.score_ids(model, ids, window, stream=True)
        assert count == 19
        assert nats == pytest.approx(want, rel=1e-10), window
    # Default: every window a fresh context (the eval stage's protocol).
    fresh = 0.0
    with torch.no_grad():
        for start in range(0, 20, 8):
            xs, ys = x[:, start : start + 8], torch.full_like(x[:, start : start + 8], -100)
            ys[:, : min(8, 19 - start)] = x[:, start + 1 : start + 9]
            logits, _ = model.forward_teach(xs, ys)
            fresh += F.cross_entropy(logits[0].double(), ys[0], ignore_index=-100, reduction="sum")
    assert infer.score_ids(model, ids, 8)[0] == pytest.approx(float(fresh), rel=1e-10)


# --------------------------------------------------------------- the hope command


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A release bundle of a tiny hope model with a real 512-piece tokenizer."""
    return make_bundle(tmp_path_factory.mktemp("front"))


def test_hope_generate_is_reproducible_for_a_seed(bundle: Path, capsys) -> None:
    argv = ["generate", "--model", str(bundle), "--prompt", "The module", "--seed", "3",
            "--max-new-tokens", "12"]  # fmt: skip
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first
    assert first.startswith("The module") and len(first.strip()) > len("The module")


def test_hope_score_reports_loss_perplexity_and_bits_per_byte(bundle: Path, tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("The module defines functions for working with text. " * 4)
    assert main(["score", "--model", str(bundle), str(text)]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["file"] == str(text) and row["tokens"] > 10 and row["bytes"] == 208
    assert row["ppl"] == pytest.approx(math.exp(row["loss"]), rel=1e-12)
    nats = row["loss"] * row["tokens"]
    assert row["bits_per_byte"] == pytest.approx(nats / (math.log(2) * 208), rel=1e-12)
    run = infer.load(bundle)
    assert row["loss"] == pytest.approx(infer.score(run, text.read_text()).loss, rel=1e-12)


def test_hope_memorize_then_generate_from_the_saved_state(bundle: Path, tmp_path, capsys):
    doc, state = tmp_path / "doc.txt", tmp_path / "doc.safetensors"
    doc.write_text("The secret number is 4271. Remember it well.")
    assert main(["memorize", "--model", str(bundle), "--text", str(doc), "--save", str(state)]) == 0
    assert "memorised" in capsys.readouterr().out and state.is_file()
    run = infer.load(bundle)
    saved = infer.load_state(run, state)
    assert saved.pos == len(run.tokenizer.encode(doc.read_text()))
    argv = ["generate", "--model", str(bundle), "--prompt", " The secret number is",
            "--temperature", "0", "--max-new-tokens", "6", "--state", str(state)]  # fmt: skip
    assert main(argv) == 0
    prompt = " The secret number is"
    want = infer.generate(run, prompt, max_new_tokens=6, temperature=0.0, state=saved).text
    assert capsys.readouterr().out == prompt + want + "\n"
    # The memorised state is what the continuation reads: its next-token logits differ.
    ids = run.tokenizer.encode(prompt)
    with_doc, without = infer.Decoder(run.model, saved), infer.Decoder(run.model)
    with_doc.feed(ids)
    without.feed(ids)
    assert with_doc.logits is not None and without.logits is not None
    assert (with_doc.logits - without.logits).abs().max() > 1e-4


def test_diverged_writes_are_refused_not_handed_on(bundle: Path, tmp_path: Path) -> None:
    run = infer.load(bundle)
    with torch.no_grad():  # a rate no fast state survives
        for level in (lvl for block in run.model.hope_blocks() for lvl in block.cms.levels):
            level.rule.lr = 1e12
    text = "The module defines functions for text. " * 20
    total = len(run.tokenizer.encode(text))
    with pytest.raises(StageError) as raised:
        infer.memorize_text(run, text)
    message = str(raised.value)
    assert message.startswith("memorize: the fast state diverged: blocks[0].")
    assert "is non-finite after token " in message and f" of {total} " in message


def test_a_diverging_stream_is_an_error_naming_the_memory_and_position(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's extreme inner rate (model.cms_lr=1e12): ``hope score --stream`` stops
    with one line naming the first fast-state leaf that turned non-finite and after how
    many tokens, instead of printing a NaN score; fresh windows still score."""
    extreme = make_bundle(tmp_path / "extreme", "model.cms_lr=1e12")
    text = tmp_path / "long.txt"
    text.write_text("The module defines functions for working with text files. " * 30)
    assert main(["score", "--model", str(extreme), "--stream", str(text)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: score --stream: the fast state diverged: blocks[")
    assert ".cms" in last and "is non-finite after token " in last, last
    run = infer.load(extreme)
    tokens = len(run.tokenizer.encode(text.read_text()))
    at = int(last.split("after token ")[1].split(" ")[0])
    assert 0 < at <= tokens and f"of {tokens} " in last
    assert main(["score", "--model", str(extreme), str(text)]) == 0  # fresh windows
    assert math.isfinite(json.loads(capsys.readouterr().out)["loss"])


def test_hope_refuses_bad_input_with_one_line(bundle: Path, tmp_path, capsys) -> None:
    assert main(["score", "--model", str(bundle), str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt: no such file" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["params", "--set", "model.dimm=3"]) == 2
    assert "did you mean 'model.dim'" in capsys.readouterr().err


def test_hope_params_prints_the_resolved_preset(capsys) -> None:
    assert main(["params", "--params", str(ROOT / "params.yaml"), "--preset", "pilot"]) == 0
    printed = capsys.readouterr().out
    resolved = load_config(None, ["preset=pilot"])
    assert f"dim: {resolved.model.dim}" in printed and "preset: pilot" in printed
    assert yaml.safe_load(printed) == resolved.to_dict()  # every knob, resolved


def test_hope_doctor_names_each_problem_with_its_fix(monkeypatch, capsys) -> None:
    from hope import doctor

    monkeypatch.setattr(doctor, "TOOLS", ("dvc", "no-such-tool-xyz"))
    assert main(["doctor", "--params", str(ROOT / "params.yaml")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("ok    dvc:") for line in lines)
    missing = next(line for line in lines if "no-such-tool-xyz" in line)
    assert missing.startswith("FAIL") and "fix: run `make setup`" in missing


def test_hope_params_write_needs_a_preset_and_writes_a_loadable_file(tmp_path, capsys) -> None:
    target = tmp_path / "params.yaml"
    assert main(["params", "--write", str(target)]) == 2
    assert "--write needs --preset" in capsys.readouterr().err and not target.exists()
    assert (
        main(["params", "--preset", "pilot", "--set", "train.steps=5", "--write", str(target)]) == 0
    )
    assert f"wrote {target} (preset pilot)" in capsys.readouterr().out
    assert load_config(target) == load_config(None, ["preset=pilot", "train.steps=5"])
