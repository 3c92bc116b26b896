"""Long-context perplexity (hope.eval.longctx): the streamed read equals one pass over
the whole sequence, sequences and buckets are what they claim, the HF loader reads a
local dataset folder, and the stage reports numbers only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_pipeline_layout, rand_tokens, stage_argv, tiny_lm
from hope.config import LongctxConfig
from hope.errors import ConfigError, StageError
from hope.eval.longctx import by_position, load_texts, long_sequences
from hope.infer import position_losses
from hope.io import non_numbers
from test_eval import load_stage

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("variant", ["hope", "transformer", "titans_mac", "hope_attention"])
def test_streamed_windows_equal_one_pass_over_the_whole_sequence(variant: str) -> None:
    """Exact for every memory read online. (CMS in ``teach_pass`` mode takes each call's
    teach signal from the call-start weights, docs/FAITHFULNESS.md: there the window
    is the approximation's chunk, and the numbers depend on it.)"""
    online = ["model.cms_mode=exact_online", "model.cms_lr=0.01"] if "hope" in variant else []
    model = tiny_lm(variant, *online).double()
    tokens = rand_tokens(2, 48, seed=4)
    whole = position_losses(model, tokens, window=48)
    streamed = position_losses(model, tokens, window=16, stream=True)
    fresh = position_losses(model, tokens, window=16)
    assert whole.shape == streamed.shape == (2, 47)
    torch.testing.assert_close(streamed, whole, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(fresh[:, :15], whole[:, :15], rtol=1e-9, atol=1e-9)
    assert not torch.allclose(fresh[:, 16:], whole[:, 16:])  # fresh windows forget


def test_fast_weight_norms_name_every_memory_and_are_the_per_sample_norms() -> None:
    """Every fast weight a state declares (CMS deltas, SMT and Titans memory weights),
    by path, as its Frobenius norm per sample; caches, pending buffers, conv tails and
    momenta are left out; ``NormRecorder`` keeps the max over samples by position."""
    from hope.eval.longctx import NormRecorder
    from hope.memory.fast_state import fast_weight_norms, named_tensor_leaves

    for variant, expected in [
        ("hope", {"blocks[1].cms[1].delta_out", "blocks[0].mixer.memories['k'].w2"}),
        ("titans_mac", {"blocks[0].memory.memory.w1"}),
        ("transformer", set()),
    ]:
        model = tiny_lm(variant).double()
        _, state = model(rand_tokens(2, 20, seed=1))
        norms = fast_weight_norms(state.blocks, "blocks")
        assert expected <= set(norms), (variant, sorted(norms))
        leaves = dict(named_tensor_leaves(state.blocks, "blocks"))
        for name, value in norms.items():
            assert value.shape == (2,)
            torch.testing.assert_close(value.double(), leaves[name].flatten(1).norm(dim=1))
        assert not any("pending" in n or "mom" in n or ".m1" in n for n in norms)
    recorder = NormRecorder()
    model, tokens = tiny_lm("hope").double(), rand_tokens(2, 40, seed=2)
    position_losses(model, tokens, window=16, stream=True, on_window=recorder)
    table = recorder.table()
    assert all(list(row) == ["16", "32", "40"] for row in table.values())
    targets = torch.full_like(tokens, -100)
    targets[:, :-1] = tokens[:, 1:]
    state = None
    assert model.stream_call == 4  # HOPE streams in calls of its fastest CMS period
    for start in range(0, 40, 4):  # the same calls, the state carried
        span = slice(start, start + 4)
        _, state = model.forward_teach(tokens[:, span], targets[:, span], state)
    last = fast_weight_norms(state.blocks, "blocks")
    for name in ("blocks[0].cms[0].delta_in", "blocks[1].mixer.memories['mem'].w1"):
        assert table[name]["40"] == pytest.approx(float(last[name].max()), rel=1e-9)


def test_long_sequences_take_the_longest_documents_first_with_eos_between() -> None:
    texts = ["a" * 3, "b" * 10, "c" * 6]
    tokens = long_sequences(texts, lambda t: [ord(c) for c in t], eos=0, length=8, count=2)
    flat = tokens.flatten().tolist()
    assert tokens.shape == (2, 8)
    assert flat == [ord("b")] * 10 + [0] + [ord("c")] * 5
    with pytest.raises(StageError, match="fewer than longctx.sequences=3 x longctx.length=8"):
        long_sequences(texts, lambda t: [ord(c) for c in t], eos=0, length=8, count=3)


def test_buckets_are_the_mean_loss_of_their_positions() -> None:
    losses = torch.arange(12, dtype=torch.float64).view(2, 6)  # positions 0..5
    assert by_position(losses, 4) == {"0": (0 + 1 + 2 + 3 + 6 + 7 + 8 + 9) / 8, "4": 7.5}


def test_hf_source_reads_a_local_dataset_folder_and_names_a_missing_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "books"
    folder.mkdir()
    rows = [{"text": f"book {i} " * 50, "title": str(i)} for i in range(5)]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = LongctxConfig(source="hf", hf_name=str(folder), hf_split="test", max_documents=3)
    assert load_texts(cfg, tmp_path / "unused") == [r["text"] for r in rows[:3]]
    cfg.text_field = "body"
    with pytest.raises(ConfigError, match="no 'body' \\(fields: text, title\\)"):
        load_texts(cfg, tmp_path / "unused")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    unreachable = LongctxConfig(source="hf", hf_name="someone/no-such-books")
    with pytest.raises(StageError, match="could not be read.*longctx.source=val"):
        load_texts(unreachable, tmp_path / "unused")


def test_stage_reports_loss_by_position_beyond_the_training_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(make_pipeline_layout(tmp_path))
    argv = stage_argv("longctx.length=96", "longctx.sequences=2", "longctx.bucket=32")
    assert load_stage("longctx").main_with(argv) == 0
    metrics = json.loads(Path("reports/longctx.json").read_text())
    records = json.loads(Path("reports/longctx_meta.json").read_text())
    assert non_numbers(metrics) == [] and metrics["step"] == 3 and metrics["tokens"] == 2 * 95
    assert set(metrics["by_position"]) == set(metrics["fresh_by_position"]) == {"0", "32", "64"}
    # The first window is the same context either way (streamed in C1 calls, so only
    # the teach pass's approximation differs); later ones differ (state carried).
    assert metrics["fresh_by_position"]["0"] == pytest.approx(metrics["by_position"]["0"], abs=1e-3)
    assert metrics["fresh_by_position"]["64"] != metrics["by_position"]["64"]
    assert metrics["stream_gain"] == pytest.approx(metrics["fresh_loss"] - metrics["loss"])
    assert records["window"] == records["trained_context"] == 32  # data.seq_len of the run
    norms = records["fast_weight_norm_by_position"]  # hope: every CMS delta, SMT memory
    assert {"blocks[0].cms[0].delta_in", "blocks[0].cms[1].delta_out"} <= set(norms)
    assert any(".mixer.memories['mem'].w1" in name for name in norms)
    assert all(set(row) == {"32", "64", "96"} for row in norms.values())  # tokens read
    assert metrics["fast_weight_norm_max"] == max(v for row in norms.values() for v in row.values())
    assert norms["blocks[0].cms[0].delta_in"]["32"] > 0  # written within the first window
    assert Path("reports/longctx.png").stat().st_size > 1000
    adaptive = [*argv, "--set=longctx.memorize=true", "--set=memorize.steps=2"]
    assert load_stage("longctx").main_with(adaptive) == 0
    again = json.loads(Path("reports/longctx.json").read_text())
    assert again["loss"] == metrics["loss"] and non_numbers(again) == []
    assert again["delta_loss"] == pytest.approx(again["adaptive_loss"] - again["loss"])
    assert set(again["adaptive_by_position"]) == {"0", "32", "64"}
    assert again["adaptive_by_position"]["0"] == metrics["by_position"]["0"]  # nothing yet
    assert again["adaptive_by_position"]["64"] != metrics["by_position"]["64"]
    carry = [*adaptive, "--set=memorize.reset=carry_across_samples"]
    assert load_stage("longctx").main_with(carry) == 2


@pytest.mark.parametrize("variant", ["hope", "titans_mac", "hope_attention"])
def test_one_memorising_pass_over_each_read_window_is_the_plain_stream(variant: str) -> None:
    """Memorising each window once, every memory, after reading it == reading on (float64,
    every position); two passes, or writing only some memories, change later windows."""
    from hope.eval.longctx import memorised_position_losses
    from hope.model.memorize import MemorizeConfig

    online = ["model.cms_mode=exact_online", "model.cms_lr=0.01"] if "hope" in variant else []
    model = tiny_lm(variant, *online).double().eval()
    tokens = rand_tokens(2, 48, seed=5)
    plain = position_losses(model, tokens, window=16, stream=True)
    once = memorised_position_losses(model, tokens, 16, MemorizeConfig())
    torch.testing.assert_close(once, plain, rtol=1e-9, atol=1e-9)
    twice = memorised_position_losses(model, tokens, 16, MemorizeConfig(steps=2))
    torch.testing.assert_close(twice[:, :16], plain[:, :16], rtol=1e-9, atol=1e-9)
    assert (twice[:, 16:] - plain[:, 16:]).abs().max() > 1e-6
