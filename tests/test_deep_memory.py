"""Titans memories of any depth (hope.memory.deep_mlp; Ti §3.1 L_M): the general code
equals the two-layer fast path at L_M = 2, its factors are the autograd gradients,
its curvature and coupling bound the true Gauss-Newton blocks, its closed-form chunk
write equals the token loop. float64, tiny sizes."""

from __future__ import annotations

import pytest
import torch

from conftest import rand64 as rand
from hope.memory.deep_mlp import (
    DeepFastWeights,
    DeepMemoryInit,
    deep_apply,
    deep_factors,
    deep_momentum_write,
    layer_widths,
    naive_deep_grads,
    naive_deep_write,
)
from hope.memory.ops.chunk import chunk_momentum_update
from hope.memory.residual_mlp import (
    chunk_kernel_bound,
    curvature_bound,
    grad_factors,
    mlp_apply,
)

B, H, C, D, HID = 2, 2, 5, 4, 6


def weights(depth: int, seed: int = 0) -> list[torch.Tensor]:
    return [
        (rand(B, H, out, inp, seed=seed + i) / inp**0.5).requires_grad_(True)
        for i, (out, inp) in enumerate(layer_widths(D, HID, depth))
    ]


def gates(seed: int = 9) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.sigmoid(rand(3, B, H, C, seed=seed))
    return 0.3 * g[0], 0.5 + 0.4 * g[1], 1.0 - 0.1 * g[2]  # theta, eta, keep


def test_depth_two_equals_the_two_layer_fast_path() -> None:
    """W_1 (input layer) is residual_mlp's w2 and W_2 its w1: apply, factors, bounds
    and the chunk write agree, values and gradients."""
    w_in, w_out = weights(2)
    k, v = rand(B, H, C, D, seed=5), rand(B, H, C, D, seed=6)
    theta, eta, keep = gates()
    fac = deep_factors([w_in, w_out], k, v)
    ref = grad_factors(w_out, w_in, k, v, "l2", True)
    pairs = [
        (deep_apply([w_in, w_out], k), mlp_apply(w_out, w_in, k, True)),
        (fac.errors[1], ref.e), (fac.inputs[1], ref.a), (fac.errors[0], ref.d),
        (fac.inputs[0], k), (fac.curvature, curvature_bound(w_out, w_in, k)),
        (fac.coupling, chunk_kernel_bound(w_out, w_in, k)),
    ]  # fmt: skip
    fast = DeepFastWeights((w_in, w_out), (rand(B, H, HID, D, seed=7), rand(B, H, D, HID, seed=8)))
    new = deep_momentum_write(fast, fac, theta, eta, keep)
    w1, w2, s1, s2 = chunk_momentum_update(
        w_out, w_in, fast.momenta[1], fast.momenta[0], k, ref.e, ref.a, ref.d, theta, eta, keep
    )
    pairs += [(new.weights[0], w2), (new.weights[1], w1), (new.momenta[0], s2),
              (new.momenta[1], s1)]  # fmt: skip
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    loss_deep = sum((t * rand(*t.shape, seed=20)).sum() for t in (*new.weights, fac.curvature))
    loss_ref = sum((t * rand(*t.shape, seed=20)).sum() for t in (w2, w1, pairs[5][1]))
    for got, want in zip(
        torch.autograd.grad(loss_deep, [w_in, w_out]),
        torch.autograd.grad(loss_ref, [w_in, w_out]),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


@pytest.mark.parametrize("depth", [1, 3, 4])
def test_factors_are_the_per_token_autograd_gradients(depth: int) -> None:
    ws = weights(depth)
    k, v = rand(B, H, C, D, seed=5), rand(B, H, C, D, seed=6)
    fac = deep_factors(ws, k, v)
    grads = naive_deep_grads(ws, k, v)
    for err, inp, g in zip(fac.errors, fac.inputs, grads, strict=True):
        rank_one = err.unsqueeze(-1) * inp.unsqueeze(-2)  # [B, H, C, out, in]
        torch.testing.assert_close(rank_one, g, rtol=0, atol=1e-12)


@pytest.mark.parametrize("depth", [1, 3])
def test_curvature_and_coupling_bound_the_gauss_newton_blocks(depth: int) -> None:
    """λ_t >= ||J_t J_tᵀ||_2 and K_ts >= ||J_t J_sᵀ||_2, J_t = ∂M(k_t)/∂(W_1..W_L),
    with equality-free slack at depth 1 only through the top layer's identity."""
    ws = [w.detach()[:1, :1] for w in weights(depth)]
    k = rand(1, 1, C, D, seed=5)
    fac = deep_factors(ws, k, torch.zeros_like(k))

    def outputs(*flat: torch.Tensor) -> torch.Tensor:
        return deep_apply(list(flat), k)[0, 0]  # [C, D]

    jac = torch.autograd.functional.jacobian(outputs, tuple(ws))
    per_token = torch.cat([j.reshape(C, D, -1) for j in jac], dim=-1)  # [C, D, P]
    for t in range(C):
        for s in range(C):
            block = torch.linalg.matrix_norm(per_token[t] @ per_token[s].T, ord=2)
            assert block <= fac.coupling[0, 0, t, s] + 1e-12
        exact = torch.linalg.matrix_norm(per_token[t] @ per_token[t].T, ord=2)
        assert exact <= fac.curvature[0, 0, t] + 1e-12
        if depth == 1:  # J_t J_tᵀ = ||k_t||² I: the bound is exact
            torch.testing.assert_close(exact, fac.curvature[0, 0, t], rtol=1e-12, atol=0)


@pytest.mark.parametrize("depth", [1, 3])
def test_chunk_write_equals_the_token_loop_states_and_grads(depth: int) -> None:
    ws = weights(depth)
    momenta = tuple(rand(*w.shape, seed=30 + i) for i, w in enumerate(ws))
    fast = DeepFastWeights(tuple(ws), momenta)
    k, v = rand(B, H, C, D, seed=5), rand(B, H, C, D, seed=6).requires_grad_(True)
    theta, eta, keep = gates()
    closed = deep_momentum_write(fast, deep_factors(ws, k, v), theta, eta, keep)
    loop = naive_deep_write(fast, k, v, theta, eta, keep)
    probe = [rand(*t.shape, seed=40 + i) for i, t in enumerate((*closed.weights, *closed.momenta))]
    results = []
    for state in (closed, loop):
        leaves = (*state.weights, *state.momenta)
        loss = sum((t * p).sum() for t, p in zip(leaves, probe, strict=True))
        results.append([*leaves, *torch.autograd.grad(loss, [*ws, v])])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_init_starts_near_the_identity_with_unit_scale_hidden_layers() -> None:
    init = DeepMemoryInit(n_heads=3, d_head=16, hidden=64, depth=3, out_std=0.02)
    shapes = [tuple(w.shape) for w in init.weights]
    assert shapes == [(3, 64, 16), (3, 64, 64), (3, 16, 64)]
    assert init.weights[-1].std() < 0.03 and 0.5 < init.weights[0].std() * 16**0.5 < 1.5
    state = init.init_state(2)
    assert all(w.shape[0] == 2 for w in state.weights) and all(
        float(s.abs().max()) == 0.0 for s in state.momenta
    )
    with pytest.raises(ValueError, match="depth"):
        layer_widths(16, 64, 0)
