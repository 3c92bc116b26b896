"""Titans memories of any depth L_M ≥ 1 (Ti §3.1 "deep memory"; the paper ablates
L_M ∈ {1, 2, 3, 4}): M(z) = z + W_L σ(W_{L−1} … σ(W_1 z)), σ = GELU, per head and
per sample. L_M = 1 is the linear (matrix-valued) memory M(z) = z + W_1 z.

Weights are listed input → output, W_l [B, H, d_l, d_{l−1}] with d_0 = d_L = d_h and
hidden widths h. The inner loss ||M(k) − v||² (Ti eq. 12) has, per token, the
rank-1 gradients ∂ℓ_t/∂W_l = e_t^l (h_t^{l−1})ᵀ: e^L = 2(M(k) − v) and
e^{l} = (e^{l+1} W_{l+1}) ⊙ σ′(W_l h^{l−1}), h^0 = k, h^l = σ(W_l h^{l−1}).

Step bounds (the stabiliser of ``ops.chunk_rates.chunk_step_cap``, for any depth):
J_t J_sᵀ = Σ_l (h_t^{l−1}·h_s^{l−1}) B_t^l B_s^{lᵀ} with B^l = ∂M/∂(W_l h^{l−1});
B^L = I and B^l = B^{l+1} W_{l+1} diag(σ′(W_l h^{l−1})), so ||B_t^l|| ≤ n_t^l with
n^L = 1 and n_t^l = n_t^{l+1} ||W_{l+1} diag(σ′_t)||_F. Hence
    curvature λ_t = Σ_l ||h_t^{l−1}||² (n_t^l)² ≥ ||J_t J_tᵀ||,
    coupling K_ts = Σ_l |h_t^{l−1}·h_s^{l−1}| n_t^l n_s^l ≥ ||J_t J_sᵀ||;
at L_M = 2 both are exactly ``residual_mlp.curvature_bound`` / ``chunk_kernel_bound``
(a test checks it), so the two-layer fast path and this general one agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from hope.layers import gelu_prime
from hope.memory.ops.chunk import chunk_momentum_matrix, momentum_chunk_coefficients
from hope.memory.ops.naive import naive_momentum_layers


@dataclass
class DeepFastWeights:
    """Fast state of an L-layer memory: weights W_1..W_L and their surprise momenta."""

    FAST_WEIGHTS: ClassVar[tuple[str, ...]] = ("weights",)  # fast_weight_norms

    weights: tuple[Tensor, ...]  # W_l [B, H, d_l, d_{l-1}]
    momenta: tuple[Tensor, ...]  # S_l, same shapes

    def detach(self) -> DeepFastWeights:
        return DeepFastWeights(
            tuple(w.detach() for w in self.weights), tuple(s.detach() for s in self.momenta)
        )

    def select(self, index: slice) -> DeepFastWeights:
        return DeepFastWeights(
            tuple(w[index] for w in self.weights), tuple(s[index] for s in self.momenta)
        )


def layer_widths(d_head: int, hidden: int, depth: int) -> list[tuple[int, int]]:
    """(out, in) of W_1..W_L: d_h → h → … → h → d_h (d_h → d_h for depth 1)."""
    if depth < 1:
        raise ValueError(f"memory depth must be >= 1, got {depth}")
    dims = [d_head, *([hidden] * (depth - 1)), d_head]
    return [(dims[i + 1], dims[i]) for i in range(depth)]


class DeepMemoryInit(nn.Module):
    """Meta-learned initial weights of an L-layer memory for H heads: every layer but
    the last N(0, 1/fan_in) (hidden pre-activations O(1)), the last N(0, ``out_std``)
    so the residual memory starts near the identity (as ``MemoryInit`` at L = 2)."""

    def __init__(self, n_heads: int, d_head: int, hidden: int, depth: int, out_std: float):
        super().__init__()
        widths = layer_widths(d_head, hidden, depth)
        self.weights = nn.ParameterList(
            nn.Parameter(
                torch.randn(n_heads, out, inp)
                * (out_std if i == depth - 1 else 1.0 / math.sqrt(inp))
            )
            for i, (out, inp) in enumerate(widths)
        )

    def init_state(self, batch_size: int) -> DeepFastWeights:
        weights = tuple(w.unsqueeze(0).expand(batch_size, -1, -1, -1) for w in self.weights)
        return DeepFastWeights(weights, tuple(torch.zeros_like(w) for w in weights))


def deep_apply(weights: Sequence[Tensor], z: Tensor) -> Tensor:
    """M(z) = z + W_L σ(… σ(W_1 z)) for z [B, H, T, d_h]."""
    h = z
    for w in weights[:-1]:
        h = F.gelu(h @ w.transpose(-1, -2))
    return z + h @ weights[-1].transpose(-1, -2)


@dataclass
class DeepFactors:
    """Rank-1 factors of the per-token inner gradients and the step bounds at k."""

    errors: tuple[Tensor, ...]  # e^l [B, H, C, d_l]
    inputs: tuple[Tensor, ...]  # h^{l-1} [B, H, C, d_{l-1}]
    curvature: Tensor  # [B, H, C] λ_t >= ||J_t J_tᵀ||
    coupling: Tensor  # [B, H, C, C] K_ts >= ||J_t J_sᵀ|| (no graph: a stabiliser's input)


def deep_factors(weights: Sequence[Tensor], k: Tensor, target: Tensor) -> DeepFactors:
    """Factors of ||M(k_t) − v_t||² at ``weights`` (the target is a constant of the
    inner loss), with the curvature and coupling bounds of the module doc."""
    inputs, slopes = [k], []
    h = k
    for w in weights[:-1]:
        pre = h @ w.transpose(-1, -2)
        slopes.append(gelu_prime(pre))
        h = F.gelu(pre)
        inputs.append(h)
    pred = k + h @ weights[-1].transpose(-1, -2)
    err = 2.0 * (pred - target)
    errors = [err]
    norms = [torch.ones_like(k[..., 0])]  # n^L = 1, then downwards
    for w, slope in zip(reversed(weights[1:]), reversed(slopes), strict=True):
        err = (err @ w) * slope
        errors.append(err)
        col_sq = (w * w).sum(-2)  # ||W[:, j]||² [B, H, d_{l}]
        norms.append(norms[-1] * ((slope * slope) @ col_sq.unsqueeze(-1)).squeeze(-1).sqrt())
    errors.reverse()
    norms.reverse()
    curvature = sum(
        (x * x).sum(-1) * n * n for x, n in zip(inputs, norms, strict=True)
    )  # [B, H, C]
    coupling = sum(
        (x.detach() @ x.detach().transpose(-1, -2)).abs()
        * (n.detach().unsqueeze(-1) * n.detach().unsqueeze(-2))
        for x, n in zip(inputs, norms, strict=True)
    )
    return DeepFactors(tuple(errors), tuple(inputs), curvature, coupling)  # type: ignore[arg-type]


def deep_momentum_write(
    fast: DeepFastWeights,
    factors: DeepFactors,
    theta: Tensor,
    eta: Tensor,
    keep: Tensor,
    end_weights: Tensor | None = None,
) -> DeepFastWeights:
    """One chunk's Titans write (Ti eqs. 13-14, chunked per eqs. 16-18) of every layer,
    closed form over the chunk (``ops/chunk.py``); theta, eta, keep [B, H, C]."""
    coef = momentum_chunk_coefficients(theta, eta, keep, end_weights)
    pairs = [
        chunk_momentum_matrix(w, s, e, x, coef)
        for w, s, e, x in zip(
            fast.weights, fast.momenta, factors.errors, factors.inputs, strict=True
        )
    ]
    return DeepFastWeights(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs))


def naive_deep_grads(weights: Sequence[Tensor], k: Tensor, target: Tensor) -> list[Tensor]:
    """Per-token gradients [B, H, C, d_l, d_{l−1}] of ||M(k_t) − v_t||² by autograd
    (torch.func), the twin of ``deep_factors``."""

    def token_loss(ws: tuple[Tensor, ...], k_: Tensor, t_: Tensor) -> Tensor:
        pred = deep_apply([w[None, None] for w in ws], k_[None, None, None])[0, 0, 0]
        return (pred - t_).pow(2).sum()

    grad_fn = torch.func.grad(token_loss)
    over_t = torch.func.vmap(grad_fn, in_dims=(None, 0, 0))
    over_bh = torch.func.vmap(torch.func.vmap(over_t))
    return list(over_bh(tuple(weights), k, target))


def naive_deep_write(
    fast: DeepFastWeights, k: Tensor, target: Tensor, theta: Tensor, eta: Tensor, keep: Tensor
) -> DeepFastWeights:
    """Token-loop twin of ``deep_momentum_write`` with autograd gradients."""
    grads = naive_deep_grads(fast.weights, k, target)
    ws, ss = naive_momentum_layers(fast.weights, fast.momenta, grads, theta, eta, keep)
    return DeepFastWeights(tuple(ws), tuple(ss))
