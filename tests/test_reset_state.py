"""Model-level per-sample reset (MECHANISMS §5): `LanguageModel.reset_state` starts a
new context for the masked samples of a batch, for every variant (float64)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import TINY_VOCAB, tiny_lm
from hope.memory.fast_state import tensor_leaves
from hope.model.attention import KVCache
from hope.model.lm import LanguageModel, LMState

VOCAB = TINY_VOCAB
VARIANTS = [
    "transformer",
    "hope_attention",
    "hope",
    "titans_lmm",
    "titans_mal",
    "titans_mag",
    "titans_mac",
]
# Every chunk grid (CMS 4/8, SMT 2/4, Titans 4) is at a boundary after 8 tokens.
ALIGNED = 8


def tiny_model(variant: str) -> LanguageModel:
    return tiny_lm(variant, "model.titans_persistent=2", "model.titans_window=6")


def tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=gen)


def _memory_leaves(state: LMState) -> list[torch.Tensor]:
    """Tensor leaves of the state without its KV caches (which grow with the context)."""
    blocks = [
        dataclasses.replace(b, cache=None) if isinstance(getattr(b, "cache", None), KVCache)
        else None if isinstance(b, KVCache)
        else dataclasses.replace(b, mixer=None) if isinstance(getattr(b, "mixer", None), KVCache)
        else b
        for b in state.blocks
    ]  # fmt: skip
    return tensor_leaves(blocks)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("teach", [False, True])
def test_reset_sample_continues_like_a_fresh_context(variant: str, teach: bool) -> None:
    """After 8 tokens (every grid at a boundary) sample 0 is reset: on the next 12
    tokens it gives the logits of a fresh context fed those tokens, and sample 1 the
    logits of a run without reset."""
    model = tiny_model(variant)
    first, second = tokens(2, ALIGNED, seed=1), tokens(2, 12, seed=2)
    targets = tokens(2, 12, seed=3)

    def run(x: torch.Tensor, y: torch.Tensor, state: LMState | None) -> tuple:
        return model.forward_teach(x, y, state) if teach else model(x, state)

    _, state = run(first, tokens(2, ALIGNED, seed=4), None)
    reset = model.reset_state(state, torch.tensor([True, False]))
    logits, after = run(second, targets, reset)
    fresh_logits, fresh_state = run(second[:1], targets[:1], None)
    carried, _ = run(second, targets, state)
    torch.testing.assert_close(logits[:1], fresh_logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(logits[1:], carried[1:], rtol=0, atol=1e-12)
    assert (carried[:1] - fresh_logits).abs().max() > 1e-3  # the reset mattered
    # The memories, conv tails and pending tokens carry on from the fresh state.
    got, want = _memory_leaves(after), _memory_leaves(fresh_state)
    assert len(got) == len(want) and (variant == "transformer") == (not got)
    for leaf, ref in zip(got, want, strict=True):
        torch.testing.assert_close(leaf[:1], ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("variant", ["hope", "titans_lmm"])
def test_reset_restores_the_meta_learned_initial_memory_not_zeros(variant: str) -> None:
    model = tiny_model(variant)
    _, state = model(tokens(2, ALIGNED, seed=1))
    reset = model.reset_state(state, torch.tensor([False, True]))
    init = model.init_state(2)
    for got, old, want in zip(
        tensor_leaves(reset.blocks), tensor_leaves(state.blocks), tensor_leaves(init.blocks),
        strict=True,
    ):  # fmt: skip
        if got.shape == want.shape and got.dim() > 1:
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
            torch.testing.assert_close(got[0], old[0], rtol=0, atol=0)
    nonzero = [t for t in tensor_leaves(init.blocks) if t.numel() and t.abs().max() > 0]
    assert nonzero, "the initial memories are meta parameters, not zeros"


@pytest.mark.parametrize("variant", ["transformer", "hope"])
def test_reset_mask_of_the_wrong_batch_is_refused(variant: str) -> None:
    model = tiny_model(variant)
    _, state = model(tokens(2, ALIGNED, seed=1))
    with pytest.raises(ValueError, match="reset mask shape"):
        model.reset_state(state, torch.tensor([True, False, True]))
