"""Inner update rules (NL §2.3, eq. 31; MECHANISMS §6) against hand computation, float64."""

from __future__ import annotations

import pytest
import torch

from conftest import F64
from conftest import rand64 as rand
from hope.config import load_config
from hope.errors import ConfigError
from hope.optim.inner import (
    DeepMomentumRule,
    DeltaMomentumRule,
    DGDRule,
    GDRule,
    MomentumRule,
    OrthoMomentumRule,
    PrecondMomentumRule,
    erase_term,
    make_inner_rule,
    newton_schulz,
)

B, O, I, C = 2, 3, 4, 5


def some(value: torch.Tensor | None) -> torch.Tensor:
    assert value is not None
    return value


def test_retention_one_keeps_delta_and_below_one_decays_it() -> None:
    delta, zero = rand(B, O, I, seed=0), torch.zeros(B, O, I, dtype=F64)
    kept, _ = GDRule(0.5, retention=1.0).step(delta, None, zero)
    torch.testing.assert_close(kept, delta, rtol=0, atol=0)
    state = delta
    for _ in range(3):
        state, _ = GDRule(0.5, retention=0.8).step(state, None, zero)
    torch.testing.assert_close(state, 0.8**3 * delta, rtol=0, atol=1e-15)


def test_gd_closed_form() -> None:
    delta, grad = rand(B, O, I, seed=0), rand(B, O, I, seed=1)
    new, mom = GDRule(0.3, retention=0.9).step(delta, None, grad)
    torch.testing.assert_close(new, 0.9 * delta - 0.3 * grad, rtol=0, atol=1e-15)
    assert mom is None


def test_momentum_closed_form_over_three_chunks() -> None:
    rule = MomentumRule(0.1, retention=0.9, beta=0.5)
    grads = [rand(B, O, I, seed=s) for s in range(3)]
    delta, mom = torch.zeros(B, O, I, dtype=F64), torch.zeros(B, O, I, dtype=F64)
    for grad in grads:
        delta, maybe_mom = rule.step(delta, mom, grad)
        mom = some(maybe_mom)
    # Hand unrolled: m1 = −ηg0, m2 = βm1 − ηg1, m3 = βm2 − ηg2; Δ3 = α²m1 + αm2 + m3.
    m1 = -0.1 * grads[0]
    m2 = 0.5 * m1 - 0.1 * grads[1]
    m3 = 0.5 * m2 - 0.1 * grads[2]
    torch.testing.assert_close(mom, m3, rtol=0, atol=1e-15)
    torch.testing.assert_close(delta, 0.81 * m1 + 0.9 * m2 + m3, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="momentum"):
        rule.step(delta, None, grads[0])


def test_dgd_erase_closed_form_per_token_sum() -> None:
    rule = DGDRule(0.2, erase=0.05, retention=0.9)
    delta, grad, base = rand(B, O, I, seed=0), rand(B, O, I, seed=1), rand(B, O, I, seed=2)
    inputs = rand(B, C, I, seed=3)
    weight = base + delta
    new, _ = rule.step(delta, None, grad, inputs, weight)
    for b in range(B):  # W_new − θ0 = αΔ − η′ Σ_t W x_t x_tᵀ − η G, by explicit outer products
        erase = sum(torch.outer(weight[b] @ inputs[b, t], inputs[b, t]) for t in range(C))
        expected = 0.9 * delta[b] - 0.05 * erase - 0.2 * grad[b]
        torch.testing.assert_close(new[b], expected, rtol=0, atol=1e-14)
    # With α = 1 and Δ = 0 this is the paper's W(I − η′ Σ x xᵀ) − ηG on the full weight.
    plain = DGDRule(0.2, erase=0.05)
    zero = torch.zeros_like(delta)
    new0, _ = plain.step(zero, None, grad, inputs, base)
    proj = torch.eye(I, dtype=F64) - 0.05 * inputs.transpose(1, 2) @ inputs
    torch.testing.assert_close(base + new0, base @ proj - 0.2 * grad, rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="inputs"):
        plain.step(zero, None, grad)


def test_dgd_erase_removes_the_stored_association() -> None:
    # One unit input x: with η′ = 1 the erase zeroes W x before the new write.
    x = torch.zeros(1, 1, I, dtype=F64)
    x[0, 0, 1] = 1.0
    weight = rand(1, O, I, seed=4)
    new, _ = DGDRule(0.0, erase=1.0).step(
        torch.zeros_like(weight), None, torch.zeros_like(weight), x, weight
    )
    torch.testing.assert_close(
        (weight + new) @ x[0, 0], torch.zeros(1, O, dtype=F64), rtol=0, atol=1e-15
    )
    torch.testing.assert_close(erase_term(weight, x)[0], torch.outer(weight[0] @ x[0, 0], x[0, 0]))


def test_dgd_with_momentum_closed_form() -> None:
    rule = DGDRule(0.2, erase=0.01, beta=0.5)
    delta, mom, grad = rand(B, O, I, seed=0), rand(B, O, I, seed=1), rand(B, O, I, seed=2)
    inputs, weight = rand(B, C, I, seed=3), rand(B, O, I, seed=4)
    new, new_mom = rule.step(delta, mom, grad, inputs, weight)
    torch.testing.assert_close(new_mom, 0.5 * mom - 0.2 * grad, rtol=0, atol=1e-15)
    expected = delta - 0.01 * erase_term(weight, inputs) + some(new_mom)
    torch.testing.assert_close(new, expected, rtol=0, atol=1e-15)


def test_delta_momentum_closed_form() -> None:
    rule = DeltaMomentumRule(0.1, retention=0.95, beta=0.9, delta_coef=0.3)
    delta, mom, grad = rand(B, O, I, seed=0), rand(B, O, I, seed=1), rand(B, O, I, seed=2)
    new, new_mom = rule.step(delta, mom, grad)
    for b in range(B):  # m(βI − ε GᵀG) − ηG
        expected_m = (
            mom[b] @ (0.9 * torch.eye(I, dtype=F64) - 0.3 * grad[b].T @ grad[b]) - 0.1 * grad[b]
        )
        torch.testing.assert_close(some(new_mom)[b], expected_m, rtol=0, atol=1e-14)
        torch.testing.assert_close(new[b], 0.95 * delta[b] + expected_m, rtol=0, atol=1e-14)


def test_newton_schulz_orthogonalises_and_keeps_zero() -> None:
    x = rand(2, 3, 6, seed=0)
    y = newton_schulz(x, steps=30)
    eye = torch.eye(3, dtype=F64).expand(2, 3, 3)
    torch.testing.assert_close(y @ y.transpose(1, 2), eye, rtol=0, atol=1e-6)
    tall = newton_schulz(x.transpose(1, 2), steps=30)  # same on the transposed side
    torch.testing.assert_close(tall, y.transpose(1, 2), rtol=0, atol=1e-12)
    assert newton_schulz(torch.zeros(1, 3, 4, dtype=F64)).abs().max() == 0
    rule = OrthoMomentumRule(0.1, beta=0.5, ns_steps=30)
    new, new_mom = rule.step(torch.zeros_like(x), torch.zeros_like(x), x)
    torch.testing.assert_close(new_mom, x, rtol=0, atol=0)
    torch.testing.assert_close(new, -0.1 * y, rtol=0, atol=1e-6)


def test_gate_keeps_state_of_closed_samples() -> None:
    rule = MomentumRule(0.1, beta=0.5)
    delta, mom, grad = rand(B, O, I, seed=0), rand(B, O, I, seed=1), rand(B, O, I, seed=2)
    gate = torch.tensor([False, True])
    new, new_mom = rule.step(delta, mom, grad, gate=gate)
    open_delta, open_mom = rule.step(delta, mom, grad)
    torch.testing.assert_close(new[0], delta[0], rtol=0, atol=0)
    torch.testing.assert_close(some(new_mom)[0], mom[0], rtol=0, atol=0)
    torch.testing.assert_close(new[1], open_delta[1], rtol=0, atol=0)
    torch.testing.assert_close(some(new_mom)[1], some(open_mom)[1], rtol=0, atol=0)


def test_make_inner_rule_selects_by_name() -> None:
    assert type(make_inner_rule("gd", 1e-3, 1.0, 0.0, 0.0)) is GDRule
    assert type(make_inner_rule("momentum", 1e-3, 1.0, 0.9, 0.0)) is MomentumRule
    dgd = make_inner_rule("dgd", 1e-3, 0.99, 0.9, 1e-4)
    assert type(dgd) is DGDRule and dgd.uses_momentum and dgd.uses_inputs
    delta = make_inner_rule("delta_momentum", 1e-3, 1.0, 0.9, 0.5)
    assert type(delta) is DeltaMomentumRule and (delta.beta, delta.delta_coef) == (0.9, 0.5)
    ortho = make_inner_rule("ortho_momentum", 1e-3, 1.0, 0.8, 0.0)
    assert type(ortho) is OrthoMomentumRule and ortho.beta == 0.8
    precond = make_inner_rule("precond_momentum", 1e-3, 1.0, 0.5, 2.0)
    assert type(precond) is PrecondMomentumRule and (precond.beta, precond.damping) == (0.5, 2.0)
    with pytest.raises(ValueError, match="retention"):
        make_inner_rule("gd", 1e-3, 1.5, 0.0, 0.0)
    with pytest.raises(ValueError, match="unknown inner rule 'adam'"):
        make_inner_rule("adam", 1e-3, 1.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.cms_momentum=0.9"], r"cms_momentum=0.9 has no effect with model.cms_rule=gd"),
        (["model.cms_rule=momentum"], r"cms_rule=momentum needs model.cms_momentum > 0"),
        (["model.cms_rule=dgd"], r"cms_rule=dgd needs model.cms_erase > 0"),
        (["model.cms_rule=precond_momentum"], r"precond_momentum needs model.cms_erase > 0"),
        (["model.cms_rule=deep_momentum"], r"deep_momentum needs model.cms_momentum_width"),
        (["model.cms_momentum_width=4"], r"cms_momentum_width=4 has no effect"),
        (["model.cms_rule=ortho_momentum", "model.cms_erase=0.1"], r"cms_erase=0.1 has no"),
        (["model.cms_rule=momentum", "model.cms_momentum=1.5"], r"cms_momentum=1.5 must be"),
        (["model.cms_rule=sgd"], r"model.cms_rule"),
    ],
)
def test_rule_knobs_that_would_do_nothing_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_precond_momentum_is_eq_21_with_the_inverse_input_second_moment() -> None:
    """m ← βm − η G (εI + XᵀX/C)⁻¹ (Woodbury form) against the explicit I×I inverse,
    over two chunks; a descent direction: ⟨G, G P⟩ > 0."""
    rule = PrecondMomentumRule(0.1, retention=0.9, beta=0.5, damping=0.3)
    delta, mom = torch.zeros(B, O, I, dtype=F64), torch.zeros(B, O, I, dtype=F64)
    want_d, want_m = delta.clone(), mom.clone()
    for chunk in range(2):
        grad, inputs = rand(B, O, I, seed=chunk), rand(B, C, I, seed=10 + chunk)
        delta, maybe = rule.step(delta, mom, grad, inputs, torch.zeros_like(grad))
        mom = some(maybe)
        second = inputs.transpose(1, 2) @ inputs / C
        precond = torch.linalg.inv(0.3 * torch.eye(I, dtype=F64) + second)
        step = grad @ precond
        assert ((grad * step).sum(dim=(1, 2)) > 0).all()
        want_m = 0.5 * want_m - 0.1 * step
        want_d = 0.9 * want_d + want_m
        torch.testing.assert_close(mom, want_m, rtol=0, atol=1e-13)
        torch.testing.assert_close(delta, want_d, rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match="damping"):
        PrecondMomentumRule(0.1, damping=0.0)


def _deep_momentum_by_autograd(
    rule: DeepMomentumRule, delta: torch.Tensor, theta: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 23 written plainly: GD on ⟨m(û), u⟩ by torch.func (θ = (W_a − W_a0, W_bᵀ)),
    retention toward θ0, then Δ ← αΔ + m_new(û)."""
    r = rule.width
    w_a0 = rule.key_init(grad[0].numel(), grad)

    def memory(params: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu((w_a0 + params[:r]) @ key) @ params[r:]

    def objective(params: torch.Tensor, key: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return (memory(params, key) * u).sum()

    new_theta, new_delta = [], []
    for b in range(grad.shape[0]):
        u = grad[b].flatten()
        key = u / u.norm()
        params = rule.beta * theta[b] - rule.lr * torch.func.grad(objective)(theta[b], key, u)
        new_theta.append(params)
        new_delta.append(rule.retention * delta[b] + memory(params, key).view_as(grad[b]))
    return torch.stack(new_delta), torch.stack(new_theta)


def test_deep_momentum_is_gd_on_its_memory_objective_then_a_read() -> None:
    """DMGD (eq. 23) against autograd over three chunks, from the rule's own init."""
    rule = DeepMomentumRule(0.3, retention=0.9, beta=0.7, width=3)
    assert rule.momentum_shape(O, I) == (6, O * I)
    theta = torch.zeros(B, 6, O * I, dtype=F64)
    delta = torch.zeros(B, O, I, dtype=F64)
    want_d, want_t = delta.clone(), theta.clone()
    for chunk in range(3):
        grad = rand(B, O, I, seed=chunk)
        delta, maybe = rule.step(delta, theta, grad)
        theta = some(maybe)
        want_d, want_t = _deep_momentum_by_autograd(rule, want_d, want_t, grad)
        torch.testing.assert_close(theta, want_t, rtol=0, atol=1e-13)
        torch.testing.assert_close(delta, want_d, rtol=0, atol=1e-13)
        if chunk == 0:  # from W_b = 0: a GD step of size η‖gelu(W_a0 û)‖² along −u
            keys = grad.flatten(1) / grad.flatten(1).norm(dim=1, keepdim=True)
            feat = torch.nn.functional.gelu(keys @ rule.key_init(O * I, grad).T)  # [B, r]
            scale = -0.3 * (feat * feat).sum(1)
            torch.testing.assert_close(delta, scale[:, None, None] * grad, rtol=0, atol=1e-13)
            assert (scale < 0).all()


def test_deep_momentum_with_constant_features_is_plain_momentum() -> None:
    """With gelu(W_a x) ≡ 1 the memory is value-less and eq. 23 is eq. 17-18's momentum."""

    class ConstantFeatures(DeepMomentumRule):
        @staticmethod
        def features(pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.ones_like(pre), torch.zeros_like(pre)

    deep = ConstantFeatures(0.1, retention=0.9, beta=0.5, width=1)
    plain = MomentumRule(0.1, retention=0.9, beta=0.5)
    theta = torch.zeros(B, 2, O * I, dtype=F64)
    d_deep, d_plain = torch.zeros(B, O, I, dtype=F64), torch.zeros(B, O, I, dtype=F64)
    m_plain = torch.zeros(B, O, I, dtype=F64)
    for chunk in range(3):
        grad = rand(B, O, I, seed=chunk)
        d_deep, maybe = deep.step(d_deep, theta, grad)
        theta = some(maybe)
        d_plain, m_next = plain.step(d_plain, m_plain, grad)
        m_plain = some(m_next)
        torch.testing.assert_close(d_deep, d_plain, rtol=0, atol=1e-14)
