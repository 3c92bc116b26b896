"""Per-sample, per-head 2-layer MLP memories and their rank-1 gradient factors.

A memory is M(z) = z + W1 gelu(W2 z) (MECHANISMS §3; NL-arXiv eqs. 89/91), or
M(z) = W1 gelu(W2 z) when d_out != d_in (the scalar memories M_eta, M_alpha).
Its weights are *fast state* with a leading batch axis, so every sample owns
its memory: W2 [B, H, h_m, d_in], W1 [B, H, d_out, h_m]. The initial state is
a meta parameter [H, ...] (``MemoryInit``) expanded per context.

The inner loss of one token is l2: ||M(k) - v_hat||^2 (no 1/2, as in Ref) or
dot: -<M(k), v_hat>. Its weight gradient is a sum of rank-1 outer products
(MECHANISMS §3 step 6); ``grad_factors`` returns the factors only, never the
per-token [T, h_m, d_in] gradient matrices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Literal, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from hope.layers import gelu_prime
from hope.memory.ops.memory_apply import memory_apply
from hope.memory.ops.memory_pass import memory_pass
from hope.memory.ops.stacking import repeat_heads

Objective = Literal["l2", "dot"]
# Residual-ness of a memory: a bool, or a [1, G*H, 1, 1] 0/1 scale when memories with
# and without the skip are stacked along the head axis (SMT's one-group chunk step).
Residual = bool | Tensor


def add_residual(out: Tensor, z: Tensor, residual: Residual) -> Tensor:
    """out + z where the memory is residual (d_out = d_in there)."""
    if isinstance(residual, Tensor):
        return out + residual.to(z.dtype) * z
    return out + z if residual else out


@dataclass
class FastWeights:
    """One memory's fast state; every tensor has a leading batch axis B."""

    FAST_WEIGHTS: ClassVar[tuple[str, ...]] = ("w1", "w2")  # fast_weight_norms

    w1: Tensor  # [B, H, d_out, h_m]
    w2: Tensor  # [B, H, h_m, d_in]
    m1: Tensor  # [B, H, d_out, h_m]  chunk-level momentum of the W1 increment
    m2: Tensor  # [B, H, h_m, d_in]   chunk-level momentum of the W2 increment

    def detach(self) -> FastWeights:
        return FastWeights(self.w1.detach(), self.w2.detach(), self.m1.detach(), self.m2.detach())

    def select(self, index: slice) -> FastWeights:
        """The state of samples ``index`` (for batch-independence checks)."""
        return FastWeights(self.w1[index], self.w2[index], self.m1[index], self.m2[index])

    def with_weights(self, w1: Tensor, w2: Tensor, m1: Tensor, m2: Tensor) -> FastWeights:
        return replace(self, w1=w1, w2=w2, m1=m1, m2=m2)


@dataclass
class GradFactors:
    """Rank-1 factors of the per-token inner gradient (MECHANISMS §3 step 6).

    dL_t/dW1 = E_t A_t^T and dL_t/dW2 = D_t k_t^T.
    """

    e: Tensor  # [B, H, T, d_out]  output error
    a: Tensor  # [B, H, T, h_m]    hidden activation gelu(W2 k)
    d: Tensor  # [B, H, T, h_m]    back-propagated hidden error
    pre: Tensor  # [B, H, T, h_m]  pre-activation W2 k (the DGD preconditioner reuses it)


def mlp_hidden(w2: Tensor, z: Tensor) -> Tensor:
    """Pre-activation W2 z: w2 [B, H, h_m, d_in], z [B, H, T, d_in] -> [B, H, T, h_m]."""
    return z @ w2.transpose(-1, -2)


def mlp_apply(w1: Tensor, w2: Tensor, z: Tensor, residual: Residual) -> Tensor:
    """M(z) = [z +] W1 gelu(W2 z), batched over [B, H, T]; -> [B, H, T, d_out]."""
    out = F.gelu(mlp_hidden(w2, z)) @ w1.transpose(-1, -2)
    return add_residual(out, z, residual)


def stacked_apply(
    w1: Tensor, w2: Tensor, z: Tensor, residual: Residual, first: int, count: int, fused: bool,
    token_major: bool = False,
) -> Tensor:  # fmt: skip
    """Members ``first`` ... ``first + count - 1`` of memories stacked along the head axis
    (w1 [B, G*H, d_out, h_m], ``residual`` their flags) applied to a shared z
    [B, H, T, d_in]: [B, count*H, T, d_out], member-major. ``fused``: as one operator
    (``ops.memory_apply``; the memory backend ``fused``), in the fast state's dtype, and
    with ``token_major`` over a [B, T, count*H, d_out] buffer (the same values)."""
    heads = z.shape[1]
    if fused:
        scale = residual.reshape(-1) if isinstance(residual, Tensor) else None
        z = z.to(w1.dtype)
        return memory_apply(w1, w2, z, scale, residual is True, first, count, token_major)  # type: ignore[no-any-return]
    if (first, count) != (0, w1.shape[1] // heads):
        part = slice(first * heads, (first + count) * heads)
        w1, w2 = w1[:, part], w2[:, part]
        residual = residual[:, part] if isinstance(residual, Tensor) else residual
    return mlp_apply(w1, w2, repeat_heads(z, count), residual)


def inner_loss(
    w1: Tensor, w2: Tensor, k: Tensor, target: Tensor, objective: Objective, residual: bool
) -> Tensor:
    """Per-token inner loss [B, H, T] of the memory on keys k and targets v_hat."""
    pred = mlp_apply(w1, w2, k, residual)
    if objective == "l2":
        return (pred - target).pow(2).sum(-1)
    return -(pred * target).sum(-1)


@dataclass
class _Hidden:
    """The memory's hidden layer at keys k, shared by the factors and the curvature."""

    pre: Tensor  # [B, H, T, h_m] W2 k
    act: Tensor  # [B, H, T, h_m] gelu(W2 k)
    slope: Tensor  # [B, H, T, h_m] gelu'(W2 k)


def _hidden(w2: Tensor, k: Tensor) -> _Hidden:
    pre = mlp_hidden(w2, k)
    return _Hidden(pre, F.gelu(pre), gelu_prime(pre))


def _factors(
    w1: Tensor,
    k: Tensor,
    target: Tensor,
    hid: _Hidden,
    objective: Objective,
    residual: Residual,
    pred: Tensor | None = None,
) -> GradFactors:
    """``pred`` = M(k) when the caller already has it (it equals the recomputation)."""
    if objective == "l2":
        if pred is None:
            pred = add_residual(hid.act @ w1.transpose(-1, -2), k, residual)
        err = 2.0 * (pred - target)
    else:
        err = -target
    hidden_err = (err @ w1) * hid.slope
    return GradFactors(e=err, a=hid.act, d=hidden_err, pre=hid.pre)


def _curvature_terms(
    act: Tensor, slope: Tensor, w1: Tensor, k: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(curvature [B, H, T], col_sq [B, H, h_m] = squared column norms of W1,
    back_sq [B, H, T] = ||W1 G_t||_F^2, k_sq [B, H, T] = ||k_t||^2)."""
    col_sq = (w1 * w1).sum(-2)
    back_sq = ((slope * slope) @ col_sq.unsqueeze(-1)).squeeze(-1)
    k_sq = (k * k).sum(-1)
    return (act * act).sum(-1) + k_sq * back_sq, col_sq, back_sq, k_sq


def curvature_reference(act: Tensor, slope: Tensor, w1: Tensor, k: Tensor) -> Tensor:
    """||a_t||^2 + ||k_t||^2 ||W1 G_t||_F^2 differentiated by autograd through its
    elementary ops (the twin of ``_Curvature``); act/slope [B, H, T, h_m],
    w1 [B, H, d_out, h_m], k [B, H, T, d_in]."""
    return _curvature_terms(act, slope, w1, k)[0]


class _Curvature(torch.autograd.Function):
    """``curvature_reference`` with its gradient written out: one backward node that
    saves only small [B, H, T] / [B, H, h_m] sums beside the inputs (which the memory
    pass keeps anyway), instead of a square and a product per input. Also returns
    back_sq = ||W1 G_t||_F^2 [B, H, T] without a graph, which the chunk's kernel bound
    reuses (``chunk_pass``)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, act: Tensor, slope: Tensor, w1: Tensor, k: Tensor
    ) -> tuple[Tensor, Tensor]:
        curvature, col_sq, back_sq, k_sq = _curvature_terms(act, slope, w1, k)
        ctx.save_for_backward(act, slope, w1, k, col_sq, back_sq, k_sq)
        ctx.mark_non_differentiable(back_sq)
        return curvature, back_sq

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: Tensor, _back_sq: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        act, slope, w1, k, col_sq, back_sq, k_sq = ctx.saved_tensors  # type: ignore[attr-defined]
        needs = ctx.needs_input_grad  # type: ignore[attr-defined]
        g = grad.unsqueeze(-1)  # [B, H, T, 1]
        g_back = grad * k_sq  # d c / d back_sq, [B, H, T]
        d_act = 2.0 * act * g if needs[0] else None
        d_slope = 2.0 * slope * g_back.unsqueeze(-1) * col_sq.unsqueeze(-2) if needs[1] else None
        d_w1 = None
        if needs[2]:
            # d c / d col_sq[j] = sum_t g_back[t] slope[t, j]^2 (slope^2 recomputed, not saved).
            # Backward runs outside autocast, where the incoming gradient and the saved
            # slope may differ in dtype (bf16 / fp32 on CUDA): the product takes the
            # wider one, as the Titans heads' backward does.
            common = torch.promote_types(g_back.dtype, slope.dtype)
            slope_sq = (slope * slope).to(common)
            d_col = (g_back.unsqueeze(-2).to(common) @ slope_sq).squeeze(-2)  # [B, H, h_m]
            d_w1 = 2.0 * w1 * d_col.unsqueeze(-2)
        d_k = 2.0 * k * (grad * back_sq).unsqueeze(-1) if needs[3] else None
        return d_act, d_slope, d_w1, d_k


def _curvature(w1: Tensor, k: Tensor, hid: _Hidden) -> tuple[Tensor, Tensor]:
    """(curvature [B, H, T], back_sq [B, H, T] without a graph) (``_Curvature``)."""
    return cast(tuple[Tensor, Tensor], _Curvature.apply(hid.act, hid.slope, w1, k))


def grad_factors(
    w1: Tensor, w2: Tensor, k: Tensor, target: Tensor, objective: Objective, residual: Residual
) -> GradFactors:
    """Factors E, A, D of the inner gradient at weights (w1, w2).

    The target is a constant of the inner loss (NL-arXiv eq. 84: v_hat is
    produced by the memory but not differentiated through in the inner step),
    which is automatic here because the gradient is written out by hand; the
    outer graph may still flow through ``target``.
    """
    return _factors(w1, k, target, _hidden(w2, k), objective, residual)


def curvature_bound(w1: Tensor, w2: Tensor, k: Tensor) -> Tensor:
    """Upper bound [B, H, T] on ||J_t J_t^T||_2, J_t = dM(k_t)/d(W1, W2).

    For M(z) = [z +] W1 gelu(W2 z), J_t J_t^T = ||a_t||^2 I + ||k_t||^2 W1 G_t^2 W1^T
    with a_t = gelu(W2 k_t), G_t = diag(gelu'(W2 k_t)); so its norm is at most
    ||a_t||^2 + ||k_t||^2 ||W1 G_t||_F^2. A gradient step of size theta on the
    l2 loss changes M(k_t) by -2 theta J J^T e_t (cf. Ti eq. 12).
    """
    return _curvature(w1, k, _hidden(w2, k))[0]


def _kernel(act: Tensor, back_sq: Tensor, k: Tensor) -> Tensor:
    """``chunk_kernel_bound`` from the hidden activations at k (act [B, H, C, h_m]) and
    back_sq = ||W1 G_t||_F^2 [B, H, C] (``_curvature_terms``)."""
    back = back_sq.sqrt()
    act_gram = (act @ act.transpose(-1, -2)).abs()
    key_gram = (k @ k.transpose(-1, -2)).abs()
    return act_gram + key_gram * (back.unsqueeze(-1) * back.unsqueeze(-2))


def chunk_kernel_bound(w1: Tensor, w2: Tensor, k: Tensor) -> Tensor:
    """Entrywise bound [B, H, C, C] on ||J_t J_s^T||_2 between the tokens of a chunk.

    J_t J_s^T = (a_t . a_s) I + (k_t . k_s) W1 G_t G_s W1^T (notation of
    ``curvature_bound``), so its norm is at most |a_t . a_s| + |k_t . k_s| n_t n_s with
    n_t = ||W1 G_t||_F; the diagonal is ``curvature_bound``. Shared directions among a
    chunk's keys and hidden activations show up as large off-diagonal entries: the
    coupling of the chunk's stale gradient steps (Ti eq. 16; NL-arXiv eq. 90).
    """
    hid = _hidden(w2, k)
    back_sq = _curvature_terms(hid.act, hid.slope, w1, k)[2]
    return _kernel(hid.act, back_sq, k)


def perron_bound(matrix: Tensor, iterations: int = 4) -> Tensor:
    """Upper bound [...] on the spectral norm of a symmetric matrix [..., n, n] with
    entries >= 0: max_i (A x)_i / x_i for any x > 0 (Collatz-Wielandt), with x from a
    few power iterations from the ones vector, so the bound is nearly tight."""
    x = torch.ones_like(matrix[..., 0])
    for _ in range(iterations):
        x = (matrix @ x.unsqueeze(-1)).squeeze(-1)
        x = x / x.amax(-1, keepdim=True).clamp_min(1e-30) + 1e-12  # stays > 0
    ax = (matrix @ x.unsqueeze(-1)).squeeze(-1)
    return (ax / x).amax(-1)


def overshoot_ratio(kernel: Tensor, step: Tensor) -> Tensor:
    """rho [B, H] = 2 ||diag(sqrt(step)) K diag(sqrt(step))||_2 bounded by ``perron_bound``.

    Linearised, a chunk's writes with per-token steps ``step`` [B, H, C] taken at the
    chunk-start weights move the predictions at its keys by -2 J diag(step) J^T e:
    no error grows while rho <= 1 (K = ``chunk_kernel_bound`` >= ||J_t J_s^T||).
    A bound the papers do not have: a deviation (docs/FAITHFULNESS.md)."""
    root = step.clamp_min(0.0).sqrt()
    return 2.0 * perron_bound(root.unsqueeze(-1) * kernel * root.unsqueeze(-2))


@dataclass
class ChunkPass:
    """One evaluation of a memory at its chunk-start weights on [v | k | q] (each C
    tokens along T): the self-generated targets M(v), the inner-gradient factors and
    curvature at the keys, and the reads M(q). One MLP call instead of three."""

    target: Tensor  # [B, H, C, d_out]  v_hat = M(v) (NL-arXiv eq. 84), or the given one
    factors: GradFactors
    curvature: Tensor  # [B, H, C]  ``curvature_bound`` at k
    read: Tensor | None  # [B, H, C, d_out]  M(q), when queries were given
    # [B, H, C, C] ``chunk_kernel_bound`` at k, without a graph (a stabiliser's input)
    coupling: Tensor
    # k as the write takes it, shared by the stacked members [B, H_in, C, d_in] (in the
    # fast state's dtype under ``fused``; ``dispatch.dgd_write`` forms its Gram matrix
    # once per head)
    keys: Tensor


def chunk_pass(
    w1: Tensor,
    w2: Tensor,
    v: Tensor | None,
    k: Tensor,
    q: Tensor | None,
    objective: Objective,
    residual: Residual,
    target: Tensor | None = None,
    fused: bool = False,
    members: int = 1,
) -> ChunkPass:
    """``mlp_apply`` on v and q, ``grad_factors`` and ``curvature_bound`` at k, at once.

    v, k, q [B, H_in, ·, d_in], shared by the ``members`` memories stacked along the
    head axis of w1, w2 (H = members * H_in; ``repeat_heads``). The inner loss's target
    is M(v) (the SMT's self-generated v_hat), or ``target`` [B, H, C, d_out] when given
    with v None (the Titans memory's values, Ti eq. 12); it is a constant of the inner
    loss but stays in the outer graph (M_v's only path to its meta-gradient). Queries
    may be fewer than keys (a chunk completing one an earlier call left pending reads
    only this call's tokens). ``fused``: all of it as one operator
    (``ops.memory_pass``; the memory backend ``fused``)."""
    if (v is None) == (target is None):
        raise ValueError("chunk_pass: give exactly one of the values v or the target")
    if fused:
        return _fused_pass(w1, w2, v, k, q, objective, residual, target, members)
    shared_k = k
    v, q = (None if t is None else repeat_heads(t, members) for t in (v, q))
    k = repeat_heads(k, members)
    parts = [t for t in (v, k, q) if t is not None]
    z = torch.cat(parts, dim=2)
    sizes = [t.shape[2] for t in parts]
    at_k = 0 if v is None else 1
    pre = mlp_hidden(w2, z)
    act = F.gelu(pre)
    out = add_residual(act @ w1.transpose(-1, -2), z, residual).split(sizes, dim=2)
    pre_k = pre.split(sizes, dim=2)[at_k]
    act_k = act.split(sizes, dim=2)[at_k]
    pred, read = out[at_k], (out[at_k + 1] if q is not None else None)
    if target is None:
        target = out[0]
    hid = _Hidden(pre_k, act_k, gelu_prime(pre_k))
    factors = _factors(w1, k, target, hid, objective, residual, pred=pred)
    curvature, back_sq = _curvature(w1, k, hid)
    coupling = _kernel(hid.act.detach(), back_sq, k.detach())  # a stabiliser's input
    return ChunkPass(target, factors, curvature, read, coupling, shared_k)


def _fused_pass(
    w1: Tensor,
    w2: Tensor,
    v: Tensor | None,
    k: Tensor,
    q: Tensor | None,
    objective: Objective,
    residual: Residual,
    target: Tensor | None,
    members: int,
) -> ChunkPass:
    """``chunk_pass`` as ``hope::memory_pass`` (its inputs in the fast state's dtype)."""
    work = w1.dtype
    v, q, target = (None if t is None else t.to(work) for t in (v, q, target))
    k = k.to(work)
    scale = residual.reshape(-1) if isinstance(residual, Tensor) else None
    outs = memory_pass(w1, w2, k, v, q, target, scale, residual is True, objective == "dot")
    v_hat, read, err, act, hidden_err, pre, curvature, _, coupling = outs
    factors = GradFactors(e=err, a=act, d=hidden_err, pre=pre)
    return ChunkPass(
        v_hat if target is None else target, factors, curvature,
        None if q is None else read, coupling.detach(), k,
    )  # fmt: skip


class MemoryInit(nn.Module):
    """Meta-learned initial state of one memory for H heads.

    W2_0 ~ N(0, 1/d_in) keeps the hidden pre-activation O(1); W1_0 ~ N(0, std)
    is small, so a residual memory starts near the identity and a scalar one
    near zero.
    """

    def __init__(self, n_heads: int, d_in: int, d_hidden: int, d_out: int, w1_std: float):
        super().__init__()
        self.d_in, self.d_hidden, self.d_out = d_in, d_hidden, d_out
        self.residual = d_out == d_in
        self.w2 = nn.Parameter(torch.randn(n_heads, d_hidden, d_in) / math.sqrt(d_in))
        self.w1 = nn.Parameter(torch.randn(n_heads, d_out, d_hidden) * w1_std)

    def init_state(self, batch_size: int) -> FastWeights:
        """Per-sample fast state at context start (a differentiable view of the params)."""
        w1 = self.w1.unsqueeze(0).expand(batch_size, -1, -1, -1)
        w2 = self.w2.unsqueeze(0).expand(batch_size, -1, -1, -1)
        return FastWeights(w1=w1, w2=w2, m1=torch.zeros_like(w1), m2=torch.zeros_like(w2))
