"""Closed-form chunk updates of MLP fast weights (MECHANISMS §8.1; Ti eqs. 16-18).

Both functions take a whole chunk of C tokens at once, batched over [B, H],
with the per-token inner gradients given as rank-1 factors computed at the
chunk-start weights (``hope.memory.residual_mlp.grad_factors``). No Python
loop over tokens; the decay products are log-cumsums and the DGD
preconditioner is one C x C unit-lower-triangular solve. Everything is
differentiable (autograd goes through the solve).

Chunk-level momentum (both functions, and the token-loop twins in
``naive.py``): the chunk map is affine in the chunk-start weights,
W_C = Hom(W_0) + Inc, where Hom is the update with zero gradients and Inc the
update from zero weights. With momentum beta,

    m_n = beta * m_{n-1} + Inc_n,    W_C = Hom(W_0) + m_n,

so beta = 0 is exactly the token recurrence (MECHANISMS §3 step 5: "apply
momentum per chunk").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def _log_decay_ratios(log_keep: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Decay ratios of gamma_t = prod_{s<=t} keep_s from logs [B, H, C].

    Returns (prev_over_s [B,H,C,C] = gamma_{t-1}/gamma_s for s < t else 0,
    gamma_prev [B,H,C] = gamma_{t-1}, end_over_s [B,H,C] = gamma_C/gamma_s,
    gamma_end [B,H]). Ratios are formed as exp of log differences so they never
    overflow (each is <= 1 when keep <= 1).
    """
    cum = torch.cumsum(log_keep, dim=-1)  # log gamma_t
    prev = cum - log_keep  # log gamma_{t-1}, with gamma_0 = 1
    n = log_keep.shape[-1]
    not_below = torch.ones(n, n, dtype=torch.bool, device=log_keep.device).triu()  # s >= t
    diff = prev.unsqueeze(-1) - cum.unsqueeze(-2)  # [B, H, t, s]
    # -inf off the strict lower triangle before exp: an entry there could be +large
    # (inf, whose gradient would be 0 * inf), and exp(-inf) is exactly 0 with a zero
    # gradient. Two launches each way instead of a zeroed where on both sides of exp.
    prev_over_s = torch.exp(diff.masked_fill(not_below, -math.inf))
    end = cum[..., -1]
    return prev_over_s, torch.exp(prev), torch.exp(end.unsqueeze(-1) - cum), torch.exp(end)


def chunk_dgd_update(
    w1: Tensor,
    w2: Tensor,
    m1: Tensor,
    m2: Tensor,
    k: Tensor,
    e: Tensor,
    a: Tensor,
    d: Tensor,
    eta: Tensor,
    alpha: Tensor,
    precondition: bool,
    momentum: float,
    w2k: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """DGD write of one chunk (NL-arXiv eq. 88, MECHANISMS §3 step 5, §8.1).

    Token recurrence (factors fixed at the chunk start):
      W2 <- W2 (alpha_t I - eta_t k_t k_t^T) - eta_t D_t k_t^T   (precondition)
      W2 <- alpha_t W2 - eta_t D_t k_t^T                        (no precondition)
      W1 <- alpha_t W1 - eta_t E_t A_t^T

    Shapes: w1/m1 [B,H,O,M], w2/m2 [B,H,M,I], k [B,H,C,I], e [B,H,C,O],
    a/d [B,H,C,M], eta/alpha [B,H,C]. ``w2k`` [B,H,C,M] = W2_0 k_t when the
    caller already has it (``GradFactors.pre``). Returns (w1, w2, m1, m2) after
    the chunk.

    G memories stacked along the head axis (H = G*H_k, member-major) may pass the k
    [B,H_k,C,I] and alpha [B,H_k,C] they share: the key Gram matrix and the decay
    ratios are then formed once per head, not once per member (each member keeps its
    own steps eta, so its own system L).
    """
    members = w1.shape[1] // k.shape[1]
    if alpha.shape[:2] != k.shape[:2]:
        raise ValueError(f"chunk_dgd_update: alpha {tuple(alpha.shape)}, k {tuple(k.shape)}")

    def per_member(t: Tensor) -> Tensor:  # [B, H, ...] -> [B, G, H_k, ...], a view
        return t.unflatten(1, (members, -1))

    prev_over_s, gamma_prev, end_over_s, gamma_end = (
        t.unsqueeze(1) for t in _log_decay_ratios(torch.log(alpha))
    )  # shared by the members: [B, 1, H_k, ...]
    k, eta = k.unsqueeze(1), per_member(eta)
    gamma = gamma_end[..., None, None]  # [B, 1, H_k, 1, 1]
    u = -eta.unsqueeze(-1) * per_member(d)  # [B, G, H_k, C, M]: u_t = -eta_t D_t
    weighted_k = end_over_s.unsqueeze(-1) * k  # [B, 1, H_k, C, I]: (gamma_C/gamma_s) k_s
    if precondition:
        # r_t + eta_t sum_{s<t} M_ts r_s = u_t - eta_t gamma_{t-1} S_0 k_t, with
        # M_ts = (gamma_{t-1}/gamma_s) k_s.k_t, i.e. R = L^-1 RHS for the unit lower
        # triangular L; then S_C = gamma_C S_0 + R^T diag(gamma_C/gamma_s) K. Associated
        # as RHS^T (L^-T diag(gamma_C/gamma_s) K): the C x C inverse meets the I-wide
        # keys (C^2 I) instead of the 2M right-hand sides, and the driven (u) and
        # homogeneous (S_0) parts share that one product.
        decayed_gram = prev_over_s * (k @ k.transpose(-1, -2))  # [B, 1, H_k, C, C]
        eye = torch.eye(k.shape[-2], dtype=k.dtype, device=k.device)
        lower = eye + eta.unsqueeze(-1) * decayed_gram  # [B, G, H_k, C, C]
        s0k = k @ per_member(w2).transpose(-1, -2) if w2k is None else per_member(w2k)
        hom_rhs = -(eta * gamma_prev).unsqueeze(-1) * s0k  # [B, G, H_k, C, M]
        # Invert the C x C system once (batched trsm over many right-hand sides is
        # ~4x slower on CPU at C=16). Well conditioned: unit diagonal,
        # |off-diagonal| <= eta_t << 1.
        inverse = torch.linalg.solve_triangular(
            lower, eye.expand_as(lower), upper=False, unitriangular=True
        )
        keys = inverse.transpose(-1, -2) @ weighted_k  # [B, G, H_k, C, I]
        inc2 = u.transpose(-1, -2) @ keys  # [B, G, H_k, M, I]: the write from zero weights
        # The chunk's change to W2 beyond the decay: inc2 (+ momentum) + hom_rhs^T keys.
        from_start = hom_rhs.transpose(-1, -2) @ keys if momentum else None
        total_rhs = u + hom_rhs
    else:
        keys, from_start, total_rhs = k, None, None
        inc2 = (end_over_s.unsqueeze(-1) * u).transpose(-1, -2) @ k
    # W1_C = gamma_C W1_0 - E^T diag(eta_s gamma_C/gamma_s) A (cf. Ti eqs. 16-17);
    # the minus sign on the C x O factor, not on the O x M product.
    to_end = -(eta * end_over_s).unsqueeze(-1) * per_member(e)
    inc1 = to_end.transpose(-1, -2) @ per_member(a)  # [B, G, H_k, O, M]
    w1, w2 = per_member(w1), per_member(w2)
    if momentum:
        m1_new = torch.add(inc1, per_member(m1), alpha=momentum)
        m2_new = torch.add(inc2, per_member(m2), alpha=momentum)
        change2 = m2_new if from_start is None else m2_new + from_start
        out = (torch.addcmul(m1_new, gamma, w1), torch.addcmul(change2, gamma, w2), m1_new, m2_new)
    else:
        # Without momentum one product gives the whole W2 change: (u + hom_rhs)^T keys.
        change2 = inc2 if total_rhs is None else total_rhs.transpose(-1, -2) @ keys
        out = (torch.addcmul(inc1, gamma, w1), torch.addcmul(change2, gamma, w2), inc1, inc2)
    w1_new, w2_new, m1_new, m2_new = (t.flatten(1, 2) for t in out)
    return w1_new, w2_new, m1_new, m2_new


def chunk_end_terms(log_b: Tensor, log_a: Tensor) -> Tensor:
    """P[j, s] = (a_C/a_j)(b_j/b_s) [B, H, C(j), C(s)] for j >= s (zero elsewhere) from
    log b_t, log a_t [B, H, C]: token s's share, through token j, of the chunk end."""
    n = log_b.shape[-1]
    above = torch.ones(n, n, dtype=torch.bool, device=log_b.device).triu(1)  # j < s
    # log[(a_C/a_j)(b_j/b_s)] indexed [j, s]
    logit = (log_a[..., -1:] - log_a + log_b).unsqueeze(-1) - log_b.unsqueeze(-2)
    return torch.exp(logit.masked_fill(above, -math.inf))  # as in _log_decay_ratios


def _chunk_end_weights(log_b: Tensor, log_a: Tensor) -> Tensor:
    """w_s = sum_{j>=s} (a_C/a_j)(b_j/b_s) [B, H, C] from log b_t, log a_t [B, H, C]."""
    return chunk_end_terms(log_b, log_a).sum(-2)


def momentum_chunk_weights(eta: Tensor, keep: Tensor) -> Tensor:
    """How much of token s's gradient reaches the chunk-end weights per unit step:
    w_s = sum_{j>=s} (a_C/a_j)(b_j/b_s) [B, H, C] (``chunk_momentum_update``); at most
    C - s + 1, about 1/(1 - eta) for a constant momentum decay eta."""
    log_b = torch.cumsum(torch.log(eta), dim=-1)
    log_a = torch.cumsum(torch.log(keep), dim=-1)
    return _chunk_end_weights(log_b, log_a)


@dataclass
class MomentumChunkWeights:
    """Per-token and carried coefficients of one chunk's Titans write (all matrices)."""

    to_weight: Tensor  # [B, H, C]  w_s theta_s: token s's gradient in W_C
    to_momentum: Tensor  # [B, H, C]  (b_C/b_s) theta_s: token s's gradient in S_C
    carry: Tensor  # [B, H, 1, 1]  c: S_0's share of W_C
    keep_end: Tensor  # [B, H, 1, 1]  a_C
    decay_end: Tensor  # [B, H, 1, 1]  b_C


def momentum_chunk_coefficients(
    theta: Tensor, eta: Tensor, keep: Tensor, end_weights: Tensor | None = None
) -> MomentumChunkWeights:
    """The coefficients of ``chunk_momentum_update`` from theta, eta, keep [B, H, C];
    ``end_weights`` = ``momentum_chunk_weights(eta, keep)`` when the caller has them
    (the Titans memory computes them once for its step cap and its write)."""
    log_b = torch.cumsum(torch.log(eta), dim=-1)  # log b_t
    log_a = torch.cumsum(torch.log(keep), dim=-1)  # log a_t
    if end_weights is None:
        end_weights = _chunk_end_weights(log_b, log_a)
    return MomentumChunkWeights(
        to_weight=end_weights * theta,
        to_momentum=torch.exp(log_b[..., -1:] - log_b) * theta,
        carry=torch.exp(log_a[..., -1:] - log_a + log_b).sum(-1)[..., None, None],
        keep_end=torch.exp(log_a[..., -1])[..., None, None],
        decay_end=torch.exp(log_b[..., -1])[..., None, None],
    )


def chunk_momentum_matrix(
    w: Tensor, s: Tensor, err: Tensor, inp: Tensor, coef: MomentumChunkWeights
) -> tuple[Tensor, Tensor]:
    """One matrix's Titans chunk write, its per-token gradients g_t = err_t inp_tᵀ
    (err [B, H, C, O], inp [B, H, C, I]) taken at the chunk start: (W_C, S_C)."""
    # The minus signs on the C x O factors; the decays fused into the adds (addcmul).
    minus_to_w = (-coef.to_weight.unsqueeze(-1) * err).transpose(-1, -2) @ inp
    minus_to_s = (-coef.to_momentum.unsqueeze(-1) * err).transpose(-1, -2) @ inp
    new_w = torch.addcmul(torch.addcmul(minus_to_w, coef.keep_end, w), coef.carry, s)
    return new_w, torch.addcmul(minus_to_s, coef.decay_end, s)


def chunk_momentum_update(
    w1: Tensor,
    w2: Tensor,
    s1: Tensor,
    s2: Tensor,
    k: Tensor,
    e: Tensor,
    a: Tensor,
    d: Tensor,
    theta: Tensor,
    eta: Tensor,
    keep: Tensor,
    end_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Titans write of one chunk (Ti eqs. 13-14, chunked per eqs. 16-18).

    Token recurrence, gradients g_t at the chunk-start weights W_0:
      S_t = eta_t S_{t-1} - theta_t g_t,   W_t = keep_t W_{t-1} + S_t,
    with keep_t = 1 - alpha_t. With b_t = prod eta, a_t = prod keep (chunk-local):
      S_C = b_C S_0 - sum_s (b_C/b_s) theta_s g_s
      W_C = a_C W_0 + c S_0 - sum_s w_s theta_s g_s,
      c = sum_j (a_C/a_j) b_j,   w_s = sum_{j>=s} (a_C/a_j)(b_j/b_s).
    g_t for W1 is E_t A_t^T and for W2 is D_t k_t^T. Shapes as in
    ``chunk_dgd_update``; theta/eta/keep [B, H, C]; ``end_weights`` the w_s when the
    caller has them (``momentum_chunk_coefficients``). Returns (w1, w2, s1, s2).
    """
    coef = momentum_chunk_coefficients(theta, eta, keep, end_weights)
    new_w1, new_s1 = chunk_momentum_matrix(w1, s1, e, a, coef)
    new_w2, new_s2 = chunk_momentum_matrix(w2, s2, d, k, coef)
    return new_w1, new_w2, new_s1, new_s2
