"""Token-by-token reference twins of ``chunk.py`` (oracle for tests only).

These loop over the tokens of a chunk and use per-token gradient matrices
materialized by autograd (``naive_inner_grads``), so they check both the
closed forms of §8.1 and the hand-written rank-1 factors of
``residual_mlp.grad_factors``. Semantics (MECHANISMS §3 "Chunking"): every
gradient of a chunk is taken at the chunk-start weights; decay, the DGD
preconditioner and momentum are then applied token by token (Ref
``_apply_chunk_update_seq``). Chunk-level momentum is defined in ``chunk.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hope.memory.residual_mlp import Objective, mlp_apply


def naive_inner_grads(
    w1: Tensor, w2: Tensor, k: Tensor, target: Tensor, objective: Objective, residual: bool
) -> tuple[Tensor, Tensor]:
    """Per-token gradients of the inner loss at fixed (w1, w2), by autograd.

    w1 [B,H,O,M], w2 [B,H,M,I], k [B,H,T,I], target [B,H,T,O] (a constant of
    the inner loss). Returns G1 [B,H,T,O,M], G2 [B,H,T,M,I]; differentiable
    with respect to every input (torch.func composes with outer autograd).
    """

    def token_loss(w1_: Tensor, w2_: Tensor, k_: Tensor, t_: Tensor) -> Tensor:
        pred = mlp_apply(w1_[None, None], w2_[None, None], k_[None, None, None], residual)[0, 0, 0]
        if objective == "l2":
            return (pred - t_).pow(2).sum()
        return -(pred * t_).sum()

    grad_fn = torch.func.grad(token_loss, argnums=(0, 1))
    over_t = torch.func.vmap(grad_fn, in_dims=(None, None, 0, 0))
    over_bh = torch.func.vmap(torch.func.vmap(over_t))
    g1, g2 = over_bh(w1, w2, k, target)
    return g1, g2


def _token_loop_dgd(
    w1: Tensor,
    w2: Tensor,
    k: Tensor,
    g1: Tensor,
    g2: Tensor,
    eta: Tensor,
    alpha: Tensor,
    precondition: bool,
) -> tuple[Tensor, Tensor]:
    eye = torch.eye(w2.shape[-1], dtype=w2.dtype, device=w2.device)
    for t in range(k.shape[2]):
        eta_t = eta[:, :, t, None, None]
        alpha_t = alpha[:, :, t, None, None]
        if precondition:
            k_t = k[:, :, t]
            outer = k_t.unsqueeze(-1) * k_t.unsqueeze(-2)  # [B, H, I, I]
            w2 = w2 @ (alpha_t * eye - eta_t * outer) - eta_t * g2[:, :, t]
        else:
            w2 = alpha_t * w2 - eta_t * g2[:, :, t]
        w1 = alpha_t * w1 - eta_t * g1[:, :, t]
    return w1, w2


def naive_dgd_update(
    w1: Tensor,
    w2: Tensor,
    m1: Tensor,
    m2: Tensor,
    k: Tensor,
    g1: Tensor,
    g2: Tensor,
    eta: Tensor,
    alpha: Tensor,
    precondition: bool,
    momentum: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Literal token loop of the DGD write (NL-arXiv eq. 88) over one chunk.

    g1 [B,H,C,O,M], g2 [B,H,C,M,I] are the per-token gradients at the chunk
    start. The homogeneous part (zero gradients, from W_0) and the increment
    (from zero weights) are run separately to apply chunk-level momentum.
    """
    hom1, hom2 = _token_loop_dgd(
        w1, w2, k, torch.zeros_like(g1), torch.zeros_like(g2), eta, alpha, precondition
    )
    inc1, inc2 = _token_loop_dgd(
        torch.zeros_like(w1), torch.zeros_like(w2), k, g1, g2, eta, alpha, precondition
    )
    m1_new = momentum * m1 + inc1 if momentum else inc1
    m2_new = momentum * m2 + inc2 if momentum else inc2
    return hom1 + m1_new, hom2 + m2_new, m1_new, m2_new


def naive_momentum_layers(
    weights: Sequence[Tensor],
    momenta: Sequence[Tensor],
    grads: Sequence[Tensor],
    theta: Tensor,
    eta: Tensor,
    keep: Tensor,
) -> tuple[list[Tensor], list[Tensor]]:
    """Literal token loop of the Titans write (Ti eqs. 13-14) over one chunk, for any
    number of matrices; grads[i] [B, H, C, O_i, I_i] per token at the chunk start."""
    ws, ss = list(weights), list(momenta)
    for t in range(theta.shape[2]):
        theta_t = theta[:, :, t, None, None]
        eta_t = eta[:, :, t, None, None]
        keep_t = keep[:, :, t, None, None]
        for i, g in enumerate(grads):
            ss[i] = eta_t * ss[i] - theta_t * g[:, :, t]
            ws[i] = keep_t * ws[i] + ss[i]
    return ws, ss


def naive_momentum_update(
    w1: Tensor,
    w2: Tensor,
    s1: Tensor,
    s2: Tensor,
    g1: Tensor,
    g2: Tensor,
    theta: Tensor,
    eta: Tensor,
    keep: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Literal token loop of the Titans write (Ti eqs. 13-14) over one chunk."""
    (w1, w2), (s1, s2) = naive_momentum_layers((w1, w2), (s1, s2), (g1, g2), theta, eta, keep)
    return w1, w2, s1, s2
