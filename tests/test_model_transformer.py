"""Transformer baseline and LM shell: causality, streaming, batch independence, gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hope
from hope.model.lm import LanguageModel
from hope.optim.outer import build_optimizer, split_decay_params

VOCAB = 64


def tiny_model(qk_norm: bool = False, seed: int = 0) -> LanguageModel:
    cfg = hope.load_config(
        None,
        [
            "model.variant=transformer",
            "model.dim=32",
            "model.n_layers=2",
            "model.n_heads=4",
            f"tokenizer.vocab_size={VOCAB}",
            f"model.qk_norm={str(qk_norm).lower()}",
        ],
    )
    torch.manual_seed(seed)
    return hope.build_model(cfg.model)


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=gen)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_perturbing_later_tokens_leaves_earlier_logits_unchanged(qk_norm: bool) -> None:
    model = tiny_model(qk_norm).double()
    x = tokens(2, 13)
    logits, _ = model(x)
    for t in (0, 5, 11):
        perturbed = x.clone()
        perturbed[:, t + 1 :] = (perturbed[:, t + 1 :] + 7) % VOCAB
        logits_p, _ = model(perturbed)
        torch.testing.assert_close(logits_p[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-12)
        # The change must be visible afterwards, or the check above proves nothing.
        assert (logits_p[:, t + 1 :] - logits[:, t + 1 :]).abs().max() > 1e-3


@pytest.mark.parametrize("splits", [[5, 8], [1] * 13, [3, 1, 4, 5]])
def test_streaming_with_state_equals_one_call(splits: list[int]) -> None:
    model = tiny_model(qk_norm=True).double()
    x = tokens(2, 13)
    full_logits, full_state = model(x)
    state = model.init_state(2)
    pieces, start = [], 0
    for size in splits:
        piece, state = model(x[:, start : start + size], state)
        pieces.append(piece)
        start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), full_logits, rtol=0, atol=1e-10)
    assert state.pos == full_state.pos == 13
    for streamed, whole in zip(state.blocks, full_state.blocks, strict=True):
        torch.testing.assert_close(streamed.k, whole.k, rtol=0, atol=1e-12)
        torch.testing.assert_close(streamed.v, whole.v, rtol=0, atol=1e-12)


def test_streaming_gradients_equal_one_call_gradients() -> None:
    model = tiny_model().double()
    x, y = tokens(2, 11), tokens(2, 11, seed=2)

    def grads(splits: list[int]) -> list[torch.Tensor]:
        model.zero_grad()
        state, pieces, start = model.init_state(2), [], 0
        for size in splits:
            piece, state = model(x[:, start : start + size], state)
            pieces.append(piece)
            start += size
        logits = torch.cat(pieces, dim=1)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    for streamed, whole in zip(grads([4, 1, 6]), grads([11]), strict=True):
        torch.testing.assert_close(streamed, whole, rtol=0, atol=1e-12)


def test_batch_equals_independent_single_runs() -> None:
    model = tiny_model().double()
    x = tokens(3, 9)
    batched, _ = model(x)
    for b in range(3):
        single, _ = model(x[b : b + 1])
        torch.testing.assert_close(batched[b : b + 1], single, rtol=0, atol=1e-12)


def test_forward_never_changes_parameters() -> None:
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = tokens(2, 10)
    _, state = model(x[:, :4])
    model(x[:, 4:], state)
    model.training_loss(x, x).backward()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize("qk_norm", [False, True])
def test_every_parameter_gets_a_nonzero_gradient(qk_norm: bool) -> None:
    model = tiny_model(qk_norm)
    x = tokens(2, 12)
    model.training_loss(x, tokens(2, 12, seed=3)).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.abs().sum() > 0, name


def test_initial_loss_is_near_uniform_and_overfitting_lowers_it() -> None:
    classic = hope.load_config(
        None,
        ["model.variant=transformer", f"tokenizer.vocab_size={VOCAB}", "model.dim=32",
         "model.n_heads=4", "model.final_norm=true", "model.embed_init_std=null"],
    )  # fmt: skip
    torch.manual_seed(0)
    x, y = tokens(2, 16), tokens(2, 16, seed=4)
    # The classic shell (final norm, every init std 0.02): near-uniform predictions.
    uniform = hope.build_model(classic.model).training_loss(x, y)
    assert abs(uniform.item() - torch.log(torch.tensor(float(VOCAB))).item()) < 0.1
    # The default shell (no final norm, 0.5-std tied embedding) starts by predicting
    # the token it reads (logit |e|^2 ~ 0.25 d): far above log V on random targets.
    model = tiny_model()
    first = model.training_loss(x, y)
    assert first.item() > torch.log(torch.tensor(float(VOCAB))).item() + 1.0
    cfg = hope.load_config(None, ["optim.lr=0.01"])
    optimizer = build_optimizer(model, cfg.optim)
    for _ in range(60):
        optimizer.zero_grad()
        loss = model.training_loss(x, y)
        loss.backward()
        optimizer.step()
    assert model.training_loss(x, y).item() < 0.25 * first.item()


def test_residual_projections_use_scaled_init() -> None:
    cfg = hope.load_config(
        None, ["model.variant=transformer", "model.n_layers=8", "model.init_std=0.05"]
    )
    torch.manual_seed(0)
    model = hope.build_model(cfg.model)
    block: Any = model.blocks[0]
    assert abs(block.attn.qkv.weight.std().item() - 0.05) < 0.003
    assert abs(block.attn.out.weight.std().item() - 0.05 / 4.0) < 0.001
    assert abs(block.mlp.down.weight.std().item() - 0.05 / 4.0) < 0.001


def test_head_is_tied_to_embedding() -> None:
    model = tiny_model()
    x = tokens(1, 5)
    with torch.no_grad():
        model.embed.weight.mul_(2.0)
    hidden = model.embed(x)
    for block, state in zip(model.blocks, model.init_state(1).blocks, strict=True):
        hidden, _ = block(hidden, state, 0)
    expected = model.norm(hidden) @ model.embed.weight.T
    torch.testing.assert_close(model(x)[0], expected)


def test_weight_decay_only_on_non_embedding_matrices() -> None:
    model = tiny_model(qk_norm=True)
    decay, no_decay = split_decay_params(model)
    decay_ids, no_decay_ids = {id(p) for p in decay}, {id(p) for p in no_decay}
    assert all(p.dim() >= 2 for p in decay)
    assert id(model.embed.weight) in no_decay_ids and id(model.embed.weight) not in decay_ids
    block: Any = model.blocks[0]
    assert id(block.attn.qkv.weight) in decay_ids
    assert all(p.dim() == 1 for p in no_decay if p is not model.embed.weight)
    assert len(decay) + len(no_decay) == len(list(model.parameters()))


@pytest.mark.parametrize("name", ["adamw", "muon", "m3"])
def test_every_outer_optimizer_builds_and_steps(name: str) -> None:
    model = tiny_model()
    shell = ["model.final_norm=true"] if name == "m3" else []  # m3 needs it (config check)
    cfg = hope.load_config(None, [f"optim.name={name}", "model.variant=transformer", *shell])
    optimizer = build_optimizer(model, cfg.optim)
    before = [p.detach().clone() for p in model.parameters()]
    tokens = torch.randint(0, model.cfg.vocab_size or 1, (2, 9))
    model.training_loss(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)]
    assert all(changed)


def test_unknown_variant_raises_config_error() -> None:
    cfg = hope.load_config(None)
    cfg.model.variant = "nope"  # type: ignore[assignment]  # bypasses validation on purpose
    with pytest.raises(hope.ConfigError, match="model.variant 'nope' is not a variant"):
        hope.build_model(cfg.model)
    assert "transformer" in hope.VARIANTS
