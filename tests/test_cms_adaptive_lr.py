"""Data-dependent CMS learning rate η_t^(ℓ) (NL eq. 31; ``model.cms_adaptive_lr``).

η_t = η · 2σ(w·a_t + b) per token and level. Checked in float64: the written Δ is the
rate-weighted gradient sum of eq. 31, teach_pass equals the online oracle in values
and gradients (the gate's included), those gradients are the derivatives of what the
level computes (gradcheck), and a zero gate is exactly the fixed-rate level.
"""

from __future__ import annotations

import pytest
import torch

import hope
from conftest import F64, tiny_lm
from conftest import rand64 as rand
from hope.errors import ConfigError
from hope.memory.cms import CMSLevel
from hope.memory.ops.cms_online import naive_online_level
from hope.model.lm import LanguageModel
from hope.optim.inner import DGDRule, GDRule, InnerRule, MomentumRule, OrthoMomentumRule

DIM, HIDDEN, PERIOD = 5, 7, 3
RULES = {
    "gd": lambda: GDRule(0.2, retention=0.9),
    "momentum": lambda: MomentumRule(0.1, retention=0.95, beta=0.8),
    "dgd_erase": lambda: DGDRule(0.1, erase=0.02, retention=0.97, beta=0.5),
    "orthogonal": lambda: OrthoMomentumRule(0.05, beta=0.7),
}


def make_level(rule: InnerRule, adaptive: bool = True, gate_seed: int | None = 3) -> CMSLevel:
    torch.manual_seed(0)
    level = CMSLevel(DIM, HIDDEN, PERIOD, rule, init_std=0.4, adaptive_lr=adaptive).to(F64)
    if adaptive and gate_seed is not None:  # a gate away from its zero init
        assert level.lr_gate_weight is not None and level.lr_gate_bias is not None
        with torch.no_grad():
            level.lr_gate_weight.copy_(rand(DIM, seed=gate_seed))
            level.lr_gate_bias.fill_(-0.4)
    return level


def test_written_delta_is_the_rate_weighted_gradient_sum_of_eq_31() -> None:
    """One boundary of plain GD: Δ = −η Σ_t η_t/η ∇_θ⟨MLP(a_t), δ_t⟩, with the per-token
    gradients from autograd and η_t/η = 2σ(w·a_t + b) computed by hand."""
    level = make_level(GDRule(0.2))
    a, teach = rand(2, PERIOD, DIM, seed=5), rand(2, PERIOD, DIM, seed=6)
    new = level.write(a, teach, level.init_state(2, dtype=F64))
    assert level.lr_gate_weight is not None and level.lr_gate_bias is not None
    rates = 2 * torch.sigmoid(a @ level.lr_gate_weight + level.lr_gate_bias)  # [B, C]
    assert rates.std() > 0.1  # the rates really differ per token
    for b in range(2):
        want_in, want_out = torch.zeros_like(level.w_in), torch.zeros_like(level.w_out)
        for t in range(PERIOD):
            objective = (level(a[b, t : t + 1]) * teach[b, t : t + 1]).sum()
            g_in, g_out = torch.autograd.grad(objective, [level.w_in, level.w_out])
            want_in -= 0.2 * rates[b, t] * g_in
            want_out -= 0.2 * rates[b, t] * g_out
        torch.testing.assert_close(new.delta_in[b], want_in, rtol=0, atol=1e-12)
        torch.testing.assert_close(new.delta_out[b], want_out, rtol=0, atol=1e-12)


def _outputs_and_grads(level: CMSLevel, online: bool, prefix: int) -> list:
    state = level.init_state(2, dtype=F64)
    if prefix:  # a partial chunk pending from an earlier call (a constant here)
        with torch.no_grad():
            state = level.write(rand(2, prefix, DIM, seed=7), rand(2, prefix, DIM, seed=8), state)
    x = rand(2, 11, DIM, seed=5).requires_grad_(True)
    teach, weight = rand(2, 11, DIM, seed=3), rand(2, 11, DIM, seed=4)
    if online:
        y, new = naive_online_level(level, x, teach, state)
    else:
        y, new = level.teach_forward(x, teach, state)
    params = [x, level.w_in, level.w_out, level.lr_gate_weight, level.lr_gate_bias]
    grads = torch.autograd.grad((y * weight).sum(), params)
    return [y, new.delta_in, new.delta_out, new.pending_teach, *grads]


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("prefix", [0, 2])
def test_teach_pass_equals_online_oracle_with_adaptive_rates(rule: str, prefix: int) -> None:
    level = make_level(RULES[rule]())
    fast = _outputs_and_grads(level, False, prefix)
    slow = _outputs_and_grads(level, True, prefix)
    for got, want in zip(fast, slow, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    gate_w_grad, gate_b_grad = fast[-2], fast[-1]
    assert gate_w_grad.abs().max() > 1e-4 and gate_b_grad.abs() > 1e-4


@pytest.mark.parametrize("rule", ["gd", "orthogonal"])
def test_gate_gradients_are_the_derivatives_of_the_level(rule: str) -> None:
    """gradcheck of the read (inputs and δ held constant, as in a write) as a function
    of the gate's (w, b): autograd through the scan is the true derivative."""
    level = make_level(RULES[rule]())
    del level.lr_gate_weight, level.lr_gate_bias  # plain tensors from here on
    x, teach = rand(2, 10, DIM, seed=5), rand(2, 10, DIM, seed=3)
    weight = rand(2, 10, DIM, seed=4)

    def read(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        level.lr_gate_weight, level.lr_gate_bias = w, b  # type: ignore[assignment]
        y, _ = level.teach_forward(x, teach, level.init_state(2, dtype=F64))
        return (y * weight).sum()

    w0 = rand(DIM, seed=3).requires_grad_(True)
    b0 = torch.tensor(-0.4, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(read, (w0, b0), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_zero_gate_is_the_fixed_rate_level(rule: str) -> None:
    """At its zero init η_t = η: values, states and θ0 gradients of the fixed-rate level."""
    adaptive = make_level(RULES[rule](), gate_seed=None)
    fixed = make_level(RULES[rule](), adaptive=False)
    fixed.load_state_dict(adaptive.state_dict(), strict=False)
    got = _outputs_and_grads(adaptive, False, 2)
    x = rand(2, 11, DIM, seed=5).requires_grad_(True)
    state = fixed.init_state(2, dtype=F64)
    with torch.no_grad():
        state = fixed.write(rand(2, 2, DIM, seed=7), rand(2, 2, DIM, seed=8), state)
    y, new = fixed.teach_forward(x, rand(2, 11, DIM, seed=3), state)
    grads = torch.autograd.grad((y * rand(2, 11, DIM, seed=4)).sum(), [x, fixed.w_in, fixed.w_out])
    want = [y, new.delta_in, new.delta_out, new.pending_teach, *grads]
    for g, w in zip(got[:7], want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def _gates(model: LanguageModel) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if "lr_gate" in n]


@pytest.mark.parametrize("variant", ["hope", "hope_attention"])
def test_model_trains_the_gate_and_c1_calls_equal_the_oracle(variant: str) -> None:
    """In a model with gates away from zero: teach_pass in C1-token calls equals
    exact_online, and one training loss reaches every gate (2 layers x 2 levels)."""
    knobs = ("model.cms_adaptive_lr=true",)
    model = tiny_lm(variant, "model.cms_mode=teach_pass", *knobs)
    oracle = tiny_lm(variant, "model.cms_mode=exact_online", *knobs)
    with torch.no_grad():
        for i, gate in enumerate(_gates(model)):
            gate.copy_(0.5 * rand(*gate.shape, seed=40 + i))
    oracle.load_state_dict(model.state_dict())
    assert len(_gates(model)) == 2 * 2 * 2  # layers x levels x (w, b)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    state, pieces = model.init_state(2), []
    for start in range(0, 12, 4):
        logits, state = model.forward_teach(tokens[:, start : start + 4],
                                            targets[:, start : start + 4], state)  # fmt: skip
        pieces.append(logits)
    logits_o, _ = oracle.forward_teach(tokens, targets)
    torch.testing.assert_close(torch.cat(pieces, dim=1), logits_o, rtol=1e-12, atol=1e-12)
    fresh = tiny_lm(variant, "model.cms_mode=teach_pass", *knobs)
    fresh.load_state_dict(model.state_dict())
    fresh.training_loss(tokens, targets).backward()
    for gate in _gates(fresh):
        assert gate.grad is not None and gate.grad.abs().max() > 1e-8


def test_knob_is_refused_where_it_cannot_train_or_read() -> None:
    with pytest.raises(ConfigError, match="model.cms_adaptive_lr"):
        hope.load_config(None, ["model.cms_adaptive_lr=true", "model.cms_mode=static"])
    with pytest.raises(ValueError, match="adaptive_lr"):
        CMSLevel(DIM, HIDDEN, PERIOD, GDRule(0.1), read_form="dual", adaptive_lr=True)
