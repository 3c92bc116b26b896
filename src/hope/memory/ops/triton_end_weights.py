"""Triton kernel of ``hope::chunk_end_weights`` and its backward (``end_weights.py``): one
program per (sample, head), the chunk's C x C terms P[j, s] in registers (C padded to a
power of two >= 16; padded tokens have eta = keep = 1 and take no part). eta, keep and
the incoming gradient are read through their strides (the Titans gates are transposed
views), so no copy runs before the kernel.

Tested on a CPU with ``TRITON_INTERPRET=1`` (tests/test_fused_ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hope.memory.ops.triton_kernels import compute_dtype


@triton.jit
def end_terms(eta, keep, t, C):
    """The terms P[j, s] [CP, CP] of one chunk's end weights (zero outside the live
    j >= s) and the weights w_s = sum_j P[j, s] [CP], from eta and keep [CP] (1 on
    padded tokens)."""
    log_b = tl.cumsum(tl.log(eta), 0)
    log_a = tl.cumsum(tl.log(keep), 0)
    log_a_end = tl.sum(tl.log(keep), 0)  # padded tokens add log 1 = 0
    j, s = t[:, None], t[None, :]
    later = (j >= s) & (j < C)
    logit = (log_a_end - log_a + log_b)[:, None] - log_b[None, :]
    terms = tl.where(later, tl.exp(tl.where(later, logit, 0.0)), 0.0)  # P[j, s]
    return terms, tl.sum(terms, 0)


@triton.jit
def end_weight_grads(terms, weights, g, eta, keep, t, C):
    """(dL/deta, dL/dkeep) [CP] of the end weights given dL/dw = g (0 on padded tokens)."""
    along = tl.sum(terms * g[None, :], 1)  # R_j
    total = tl.sum(g * weights, 0)
    d_log_b = along - g * weights
    d_log_a = tl.where(t == C - 1, total, 0.0) - along
    # suffix sums sum_{i >= t}: padded entries are zero
    suffix_b = tl.sum(d_log_b, 0) - tl.cumsum(d_log_b, 0) + d_log_b
    suffix_a = tl.sum(d_log_a, 0) - tl.cumsum(d_log_a, 0) + d_log_a
    return suffix_b / eta, suffix_a / keep


@triton.jit
def _end_weights(eta_ptr, keep_ptr, g_ptr, w_out, d_eta_out, d_keep_out, C, H,
                 s_eta_b, s_eta_h, s_eta_c, s_keep_b, s_keep_h, s_keep_c,
                 s_g_b, s_g_h, s_g_c, CP: tl.constexpr, BACKWARD: tl.constexpr,
                 ACC: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    t = tl.arange(0, CP)
    live = t < C
    at_eta = eta_ptr + b * s_eta_b + h * s_eta_h + t * s_eta_c
    eta = tl.load(at_eta, mask=live, other=1.0).to(ACC)
    keep = tl.load(keep_ptr + b * s_keep_b + h * s_keep_h + t * s_keep_c, mask=live, other=1.0)
    keep = keep.to(ACC)
    terms, weights = end_terms(eta, keep, t, C)
    if BACKWARD:
        g = tl.load(g_ptr + b * s_g_b + h * s_g_h + t * s_g_c, mask=live, other=0.0).to(ACC)
        d_eta, d_keep = end_weight_grads(terms, weights, g, eta, keep, t, C)
        tl.store(d_eta_out + bh * C + t, d_eta, mask=live)
        tl.store(d_keep_out + bh * C + t, d_keep, mask=live)
    else:
        tl.store(w_out + bh * C + t, weights, mask=live)


def _launch(eta: Tensor, keep: Tensor, grad: Tensor | None) -> tuple[Tensor, Tensor]:
    batch, heads, c = eta.shape
    out = torch.empty(batch, heads, c, dtype=eta.dtype, device=eta.device)
    other = torch.empty_like(out) if grad is not None else out
    g = eta if grad is None else grad
    _end_weights[(batch * heads,)](
        eta, keep, g, out, out, other, c, heads, *eta.stride(), *keep.stride(), *g.stride(),
        CP=max(16, triton.next_power_of_2(c)), BACKWARD=grad is not None, ACC=compute_dtype(eta),
    )  # fmt: skip
    return out, other


def chunk_end_weights_triton(eta: Tensor, keep: Tensor) -> Tensor:
    """``hope::chunk_end_weights`` in one kernel launch."""
    return _launch(eta, keep, None)[0]


def chunk_end_weights_backward_triton(
    eta: Tensor, keep: Tensor, grad: Tensor
) -> tuple[Tensor, Tensor]:
    """``hope::chunk_end_weights_backward`` in one kernel launch."""
    return _launch(eta, keep, grad)
