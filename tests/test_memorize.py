"""Test-time memorisation (MECHANISMS §5 "API", "online_chunk_size", "Reset vs carry";
§7 invariant 10): path/layer/teach-mask filters, each token written once, causality,
reset vs carry, batch mode, a real memorisation effect, meta parameters untouched.
float64, tiny models."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hope
from conftest import F64, TINY_VOCAB, tiny_lm
from hope.memory.fast_state import tensor_leaves
from hope.model.hope import HopeLM
from hope.model.lm import LanguageModel, LMState
from hope.model.memorize import (
    MemorizeConfig,
    fresh_context,
    memorize,
    memorize_chunks,
    memorize_sequence,
    next_token_targets,
)

VOCAB = TINY_VOCAB
T = 14  # not a multiple of 4 or 8: a partial last chunk and pending CMS tokens


def tiny_model(variant: str = "hope", *extra: str, seed: int = 0) -> LanguageModel:
    return tiny_lm(variant, *extra, seed=seed)


def rand_tokens(batch: int = 2, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_same(a: Any, b: Any, atol: float = 1e-12) -> None:
    leaves_a, leaves_b = tensor_leaves(a), tensor_leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


def max_diff(a: Any, b: Any) -> float:
    pairs = zip(tensor_leaves(a), tensor_leaves(b), strict=True)
    return max(float((x - y).detach().abs().max()) for x, y in pairs if x.numel())


def smt_memories(state: LMState, layer: int) -> list[Any]:
    return [state.blocks[layer].mixer.memories]


def online_twin(model: LanguageModel, variant: str) -> LanguageModel:
    """The same weights in ``cms_mode=exact_online`` (the oracle of MECHANISMS §8.3a)."""
    twin = tiny_model(variant, "model.cms_mode=exact_online")
    twin.load_state_dict(model.state_dict())
    return twin


def cms_memory(state: LMState, layer: int, level: int) -> list[torch.Tensor]:
    lvl = state.blocks[layer].cms[level]
    return [lvl.delta_in, lvl.delta_out, lvl.updates]


# 1. Paths and layers filter updates exactly ---------------------------------------------


def test_paths_cms_writes_only_cms_and_smt_writes_only_smt() -> None:
    model, x = tiny_model(), rand_tokens()
    fresh = model.init_state(2)
    full = memorize(model, x)
    only_cms = memorize(model, x, cfg=MemorizeConfig(paths=("cms",)))
    only_smt = memorize(model, x, cfg=MemorizeConfig(paths=("smt",)))
    for layer in (0, 1):
        assert_same(smt_memories(only_cms, layer), smt_memories(fresh, layer), atol=0)
        assert max_diff(smt_memories(only_smt, layer), smt_memories(fresh, layer)) > 1e-3
        for level in (0, 1):
            assert_same(cms_memory(only_smt, layer, level), cms_memory(fresh, layer, level), atol=0)
            assert (
                max_diff(cms_memory(only_cms, layer, level), cms_memory(fresh, layer, level)) > 1e-3
            )
    # Layer 0's SMT sees only embeddings, so its writes do not depend on the CMS filter.
    assert_same(smt_memories(only_smt, 0), smt_memories(full, 0))
    # Context advances whatever is written: position and conv tails as in the full run.
    assert only_cms.pos == only_smt.pos == T
    assert_same(only_cms.blocks[0].mixer.conv_tail, full.blocks[0].mixer.conv_tail)


def test_path_cms_level_and_layers_select_single_memories() -> None:
    model, x = tiny_model(), rand_tokens()
    fresh = model.init_state(2)
    level0 = memorize(model, x, cfg=MemorizeConfig(paths=("cms:0",)))
    for layer in (0, 1):
        assert max_diff(cms_memory(level0, layer, 0), cms_memory(fresh, layer, 0)) > 1e-3
        assert_same(cms_memory(level0, layer, 1), cms_memory(fresh, layer, 1), atol=0)
        assert_same(smt_memories(level0, layer), smt_memories(fresh, layer), atol=0)
    # Level 1 keeps its pending tokens on the shared grid although it writes nothing.
    assert level0.blocks[0].cms[1].pending == T % 8

    layer1 = memorize(model, x, cfg=MemorizeConfig(layers=(1,)))
    assert_same(smt_memories(layer1, 0), smt_memories(fresh, 0), atol=0)
    for level in (0, 1):
        assert_same(cms_memory(layer1, 0, level), cms_memory(fresh, 0, level), atol=0)
        assert max_diff(cms_memory(layer1, 1, level), cms_memory(fresh, 1, level)) > 1e-3
    assert max_diff(smt_memories(layer1, 1), smt_memories(fresh, 1)) > 1e-3


def test_titans_path_filter() -> None:
    model, x = tiny_model("titans_mal"), rand_tokens(length=12)
    fresh = model.init_state(2)
    written = memorize(model, x)
    skipped = memorize(model, x, cfg=MemorizeConfig(layers=(0,)))
    assert max_diff(written.blocks[1].memory.memory, fresh.blocks[1].memory.memory) > 1e-4
    assert_same(skipped.blocks[1].memory.memory, fresh.blocks[1].memory.memory, atol=0)
    assert_same(skipped.blocks[0].memory.memory, written.blocks[0].memory.memory)
    # The SWA context advances whatever is written (window 64: all 12 tokens cached).
    assert skipped.blocks[1].cache.k.shape == written.blocks[1].cache.k.shape
    assert skipped.blocks[1].cache.k.shape[2] == 12 and skipped.pos == 12


# 2. teach_mask ----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ("hope", "hope_attention"))
def test_teach_mask_false_gives_no_cms_update_but_smt_still_writes(variant: str) -> None:
    model, x = tiny_model(variant), rand_tokens()
    fresh = model.init_state(2)
    masked = memorize(model, x, teach_mask=torch.zeros_like(x, dtype=torch.bool))
    for layer in (0, 1):
        for level in (0, 1):
            lvl = masked.blocks[layer].cms[level]
            assert lvl.delta_in.abs().max() == 0 and lvl.delta_out.abs().max() == 0
        if variant == "hope":
            assert max_diff(smt_memories(masked, layer), smt_memories(fresh, layer)) > 1e-3


def test_teach_mask_equals_ignored_targets() -> None:
    """teach_mask[b, t] False drops exactly the loss at position t (target = token t+1)."""
    model, x = tiny_model("hope_attention"), rand_tokens()
    mask = torch.rand(x.shape, generator=torch.Generator().manual_seed(3)) > 0.5
    state = memorize(model, x, teach_mask=mask)
    targets = torch.where(mask, next_token_targets(x), -100)
    # Memorising in C1 chunks is the online oracle's run (test_chunked_memorize_...).
    _, direct = online_twin(model, "hope_attention").forward_teach(x, targets)
    assert_same(state.blocks, direct.blocks, atol=1e-10)
    assert max_diff(state.blocks, memorize(model, x).blocks) > 1e-4


# 3. Transformer: memorize is plain streaming ------------------------------------------


def test_transformer_memorize_equals_streaming_forward() -> None:
    model, x, query = tiny_model("transformer"), rand_tokens(), rand_tokens(length=5, seed=9)
    _, streamed = model(x)
    ref, _ = model(query, streamed)
    joint, _ = model(torch.cat([x, query], dim=1))
    for cfg in (MemorizeConfig(), MemorizeConfig(online_chunk_size=3, steps=2)):
        state = memorize(model, x, cfg=cfg)
        assert state.pos == T
        logits, _ = model(query, state)
        torch.testing.assert_close(logits, ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(logits, joint[:, T:], rtol=0, atol=1e-10)


# 4. Each token written once: chunks == the online oracle / chained calls -----------------


@pytest.mark.parametrize("chunk", (None, 4, 8))
@pytest.mark.parametrize("variant", ("hope", "hope_attention"))
def test_chunked_memorize_equals_one_teach_call(variant: str, chunk: int | None) -> None:
    """At the model's grid (C1 = 4) memorising is ``exact_online`` over the text; at a
    coarser chunk it is chained ``forward_teach`` calls of that size (pass A refreshed
    from the carried Δ at every call)."""
    model, x = tiny_model(variant), rand_tokens()
    state = memorize(model, x, cfg=MemorizeConfig(online_chunk_size=chunk))
    targets = next_token_targets(x)
    if chunk == 8:
        once, step = model.init_state(2), 8
        for start in range(0, T, step):
            _, once = model.forward_teach(
                x[:, start : start + step], targets[:, start : start + step], once
            )
    else:
        _, once = online_twin(model, variant).forward_teach(x, targets)
    assert state.pos == once.pos == T
    assert_same(state.blocks, once.blocks, atol=1e-10)
    for block in state.blocks:
        for level, period in zip(block.cms, (4, 8), strict=True):
            # ⌊T/C⌋ updates per level: no prefix re-feeding, nothing written twice.
            torch.testing.assert_close(level.updates, torch.full((2,), float(T // period)))
            assert level.boundaries == T // period and level.pending == T % period


@pytest.mark.parametrize("variant", ("titans_lmm", "titans_mac"))
def test_titans_memorize_equals_one_call(variant: str) -> None:
    model, x = tiny_model(variant), rand_tokens(length=12)
    state = memorize(model, x, cfg=MemorizeConfig(online_chunk_size=4))
    _, once = model(x)
    assert_same(state.blocks, once.blocks, atol=1e-10)


# 5. Causality ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ("hope", "hope_attention"))
def test_state_after_chunk_m_ignores_tokens_after_next_chunk_start(variant: str) -> None:
    model, c = tiny_model(variant), 4
    x = rand_tokens(length=16)
    cfg = MemorizeConfig(online_chunk_size=c)
    states = list(memorize_chunks(model, x, cfg=cfg))
    assert len(states) == 4
    for m in range(3):
        boundary = (m + 1) * c  # first token of chunk m+1: chunk m's last target
        later = x.clone()
        later[:, boundary + 1 :] = (later[:, boundary + 1 :] + 7) % VOCAB
        perturbed = list(memorize_chunks(model, later, cfg=cfg))
        for j in range(m + 1):
            assert_same(perturbed[j].blocks, states[j].blocks, atol=0)
        assert max_diff(perturbed[-1].blocks, states[-1].blocks) > 1e-6
        # The boundary token itself is chunk m's last target, so it does reach Δ.
        moved = x.clone()
        moved[:, boundary] = (moved[:, boundary] + 5) % VOCAB
        changed = list(memorize_chunks(model, moved, cfg=cfg))
        if m:  # chunk m-1's last target is token m·c: untouched
            assert_same(changed[m - 1].blocks, states[m - 1].blocks, atol=0)
        assert max_diff(cms_memory(changed[m], 1, 0), cms_memory(states[m], 1, 0)) > 1e-6


# 6. Reset vs carry; batch mode ---------------------------------------------------------


def test_reset_per_sample_vs_carry_across_samples() -> None:
    model = tiny_model()
    first, second = rand_tokens(seed=1), rand_tokens(seed=2)
    after_first = memorize(model, first)
    carry = memorize(model, second, after_first, MemorizeConfig(reset="carry_across_samples"))
    reset = memorize(model, second, after_first, MemorizeConfig(reset="reset_per_sample"))
    alone = memorize(model, second)
    assert carry.pos == 2 * T and reset.pos == T
    assert_same(reset.blocks, alone.blocks, atol=0)
    assert max_diff(carry.blocks[1].cms[0].delta_in, alone.blocks[1].cms[0].delta_in) > 1e-3


def test_batch_mode_rereads_from_the_starting_context() -> None:
    model, x = tiny_model("hope_attention"), rand_tokens(length=16)
    once = memorize(model, x)
    twice = memorize(model, x, cfg=MemorizeConfig(steps=2))
    assert twice.pos == T + 2  # one reading of the context ...
    assert twice.blocks[0].mixer.k.shape[2] == 16
    for level, period in zip(twice.blocks[1].cms, (4, 8), strict=True):  # ... two of memory
        torch.testing.assert_close(level.updates, torch.full((2,), 2.0 * 16 // period))
    assert max_diff(twice.blocks[1].cms[0].delta_in, once.blocks[1].cms[0].delta_in) > 1e-3


def test_batch_equals_single_samples() -> None:
    model, x = tiny_model(), rand_tokens(batch=3)
    batched = memorize(model, x)
    for b in range(3):
        single = memorize(model, x[b : b + 1])
        for leaf_b, leaf_1 in zip(
            tensor_leaves(batched.blocks), tensor_leaves(single.blocks), strict=True
        ):
            torch.testing.assert_close(leaf_b[b : b + 1], leaf_1, rtol=0, atol=1e-10)


def test_memorize_sequence_is_batch_one_memorize() -> None:
    model = tiny_model()

    def encode(text: str) -> list[int]:
        return [ord(ch) % VOCAB for ch in text]

    assert hope.memorize is memorize and hope.MemorizeConfig is MemorizeConfig  # lazy exports
    text = "the cat sat on the mat"
    state = memorize_sequence(model, encode, text)
    assert_same(state.blocks, memorize(model, torch.tensor([encode(text)])).blocks, atol=0)


# 7. Inner rate and a real memorisation effect ----------------------------------------------


def test_first_cms_update_scales_with_inner_lr() -> None:
    """One chunk, one level-0 boundary: Δ = −η·G(θ0, δ) with δ independent of η."""
    x = rand_tokens(length=4)
    small = memorize(tiny_model("hope", "model.cms_lr=0.5"), x)
    large = memorize(tiny_model("hope", "model.cms_lr=1.0"), x)
    for layer in (0, 1):
        d_small, d_large = small.blocks[layer].cms[0], large.blocks[layer].cms[0]
        assert d_small.delta_in.abs().max() > 1e-6
        torch.testing.assert_close(d_large.delta_in, 2 * d_small.delta_in, rtol=1e-9, atol=1e-14)
        torch.testing.assert_close(d_large.delta_out, 2 * d_small.delta_out, rtol=1e-9, atol=1e-14)


def test_memorised_state_lowers_loss_on_the_memorised_text() -> None:
    """hope_attention, untrained: CMS memories of a 4× repeated random sequence lower the
    loss of re-reading it without its context (no KV cache to copy from), against a fresh
    state and against the memories of another sequence (so it is not a unigram effect).
    cms_lr 0.03 (0.1 overshoots at this width); measured margins ≈ 0.24 and 0.17 nats."""
    model = tiny_model("hope_attention", "model.dim=32", "model.cms_lr=0.03")
    generator = torch.Generator().manual_seed(10)
    pattern = torch.randint(0, VOCAB, (1, 16), generator=generator)
    other = torch.randint(0, VOCAB, (1, 16), generator=generator)

    @torch.no_grad()
    def reread_loss(state: LMState | None) -> float:
        logits, _ = model(pattern, state)
        return float(F.cross_entropy(logits[0, :-1], pattern[0, 1:]))

    own = reread_loss(fresh_context(model, memorize(model, pattern.repeat(1, 4))))
    control = reread_loss(fresh_context(model, memorize(model, other.repeat(1, 4))))
    assert own < reread_loss(None) - 0.1
    assert own < control - 0.1


# 8. Meta parameters and config validation -------------------------------------------------


@pytest.mark.parametrize("variant", ("hope", "hope_attention", "titans_mag"))
def test_memorize_never_changes_meta_parameters(variant: str) -> None:
    model, x = tiny_model(variant), rand_tokens(length=12)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for cfg in (MemorizeConfig(), MemorizeConfig(steps=2, surprise_threshold=0.5)):
        memorize(model, x, cfg=cfg)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.equal(value, after[key]), key
    assert all(p.grad is None for p in model.parameters())


def test_surprise_threshold_override_is_temporary() -> None:
    model, x = tiny_model("hope_attention"), rand_tokens()
    closed = memorize(model, x, cfg=MemorizeConfig(surprise_threshold=1e9))
    for block in closed.blocks:
        for level in block.cms:
            assert level.delta_in.abs().max() == 0 and level.updates.abs().max() == 0
    # τ = 0 opens every l2 gate: the same memories as no gate; the model's own τ is restored.
    opened, ungated = (
        memorize(model, x, cfg=MemorizeConfig(surprise_threshold=0.0)),
        memorize(model, x),
    )
    for layer in (0, 1):
        for level in (0, 1):
            assert_same(cms_memory(opened, layer, level), cms_memory(ungated, layer, level), atol=0)
            assert cms_memory(opened, layer, level)[0].abs().max() > 1e-3
    assert model.cfg.surprise_threshold is None
    assert isinstance(model, HopeLM)
    levels = [lvl for block in model.hope_blocks() for lvl in block.cms.levels]
    assert len(levels) == 4 and all(lvl.surprise_threshold is None for lvl in levels)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"paths": ("memory",)}, "paths"),
        ({"paths": ("cms:x",)}, "paths"),
        ({"layers": (-1,)}, "layers"),
        ({"online_chunk_size": 0}, "online_chunk_size"),
        ({"steps": 0}, "steps"),
        ({"reset": "never"}, "reset"),
        ({"surprise_threshold": float("nan")}, "surprise_threshold"),
    ],
)
def test_bad_config_fields_raise(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MemorizeConfig(**kwargs)


@pytest.mark.parametrize(
    ("variant", "cfg", "field"),
    [
        ("hope", MemorizeConfig(paths=("cms:2",)), "cms:2"),
        ("hope_attention", MemorizeConfig(paths=("smt",)), "'smt'"),
        ("transformer", MemorizeConfig(paths=("cms",)), "'cms'"),
        ("hope", MemorizeConfig(layers=(2,)), "layers"),
        ("titans_mac", MemorizeConfig(online_chunk_size=6), "online_chunk_size"),
    ],
)
def test_config_checked_against_the_model(variant: str, cfg: MemorizeConfig, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        memorize(tiny_model(variant), rand_tokens(length=12), cfg=cfg)


def test_bad_tokens_and_teach_mask_raise() -> None:
    model, x = tiny_model("hope_attention"), rand_tokens()
    with pytest.raises(ValueError, match="teach_mask"):
        memorize(model, x, teach_mask=torch.ones(2, T - 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="tokens"):
        memorize(model, x[0])
    with pytest.raises(ValueError, match="'titans'"):  # checked eagerly, before any next()
        memorize_chunks(model, x, cfg=MemorizeConfig(paths=("titans",)))


# 8. Repeated memorisation tracks the online oracle ------------------------------------------


def test_repeated_memorisation_tracks_the_online_oracle() -> None:
    """Memorising 512 tokens in 64-token calls (4 chunks of C1 = 16 per call): pass A reads
    the call-start Δ, so δ sees what the levels already wrote and |Δ| follows the oracle
    (measured: 1.47/1.88/2.41 vs 1.44/1.81/2.28 after 1/2/4 passes; reading θ0 instead
    gave 56 → 3.6e5 → 2e14). The gap is the within-call staleness of δ (3 stale chunks
    of 4), first order in cms_lr: 10% bounds it at cms_lr = 1e-2 (measured ≤ 6%)."""
    extra = ("model.dim=32", "model.n_heads=4", "model.cms_periods=[16, 64]")
    overrides = (*extra, "tokenizer.vocab_size=256", "model.cms_lr=0.01")
    cfg = hope.load_config(None, ["model.variant=hope_attention", "model.n_layers=2", *overrides])
    torch.manual_seed(0)
    model = hope.build_model(cfg.model).to(F64)
    oracle = hope.build_model(dataclasses.replace(cfg.model, cms_mode="exact_online")).to(F64)
    oracle.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, 256, (48,), generator=gen).repeat(11)[:512]  # a repeated phrase
    noise = torch.rand(512, generator=gen) < 0.2
    text[noise] = torch.randint(0, 256, (int(noise.sum()),), generator=gen)
    x = text[None]
    results = {}
    for name, m in (("teach_pass", model), ("exact_online", oracle)):
        for steps in (1, 4):
            cfg_m = MemorizeConfig(online_chunk_size=64, steps=steps)
            with torch.no_grad():
                state = memorize(m, x, cfg=cfg_m)
                logits, _ = m(x, state)  # the text again, through the memorised state
            norm = sum(float(level.delta_out.norm()) for b in state.blocks for level in b.cms)
            loss = float(F.cross_entropy(logits[0, :-1], x[0, 1:]))
            results[name, steps] = (norm, loss)
    for steps in (1, 4):
        ours, theirs = results["teach_pass", steps][0], results["exact_online", steps][0]
        assert abs(ours - theirs) <= 0.1 * theirs, (steps, ours, theirs)
    for name in ("teach_pass", "exact_online"):  # more passes: lower loss on the text
        assert results[name, 4][1] < results[name, 1][1] - 0.03, results
