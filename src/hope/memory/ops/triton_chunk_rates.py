"""Triton kernel of ``hope::titans_chunk_rates`` and its backward (``chunk_rates.py``): one
program per (sample, head), the chunk's C x C end-weight terms and kernel bound in
registers (C padded to a power of two >= 16; padded tokens have eta = keep = 1, theta
= 0 and no kernel entries, so they take no part). Every argument is read through its
strides (the Titans gates are strided chunks of [B, H, T] rows), so no copy runs
before the kernel.

Tested on a CPU with ``TRITON_INTERPRET=1`` (tests/test_fused_ops.py).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from hope.memory.ops.chunk_rates import rates_dtype
from hope.memory.ops.triton_end_weights import end_terms, end_weight_grads
from hope.memory.ops.triton_kernels import compute_dtype, overshoot_of


@triton.jit
def _row(ptr, sb, sh, sc, b, h, t, live, other, ACC: tl.constexpr):
    """A [CP] row of a [B, H, C] argument with strides (sb, sh, sc), in the compute dtype."""
    return tl.load(ptr + b * sb + h * sh + t * sc, mask=live, other=other).to(ACC)


@triton.jit
def _chunk_rates(theta_ptr, eta_ptr, alpha_ptr, curv_ptr, k_ptr, gk_ptr, gw_ptr, gr_ptr,
                 out_0, out_1, out_2, out_3, C, H,
                 s0b, s0h, s0c, s1b, s1h, s1c, s2b, s2h, s2c, s3b, s3h, s3c,
                 k_b, k_h, k_r, k_c, s5b, s5h, s5c, s6b, s6h, s6c, s7b, s7h, s7c,
                 CP: tl.constexpr, ITERATIONS: tl.constexpr, BACKWARD: tl.constexpr,
                 HAS_GK: tl.constexpr, HAS_GW: tl.constexpr, HAS_GR: tl.constexpr,
                 ACC: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    t = tl.arange(0, CP)
    live = t < C
    theta = _row(theta_ptr, s0b, s0h, s0c, b, h, t, live, 0.0, ACC)
    eta = _row(eta_ptr, s1b, s1h, s1c, b, h, t, live, 1.0, ACC)
    keep = 1.0 - _row(alpha_ptr, s2b, s2h, s2c, b, h, t, live, 0.0, ACC)
    curvature = _row(curv_ptr, s3b, s3h, s3c, b, h, t, live, 1.0, ACC)
    rows, cols = t[:, None], t[None, :]
    kernel = tl.load(k_ptr + b * k_b + h * k_h + rows * k_r + cols * k_c,
                     mask=(rows < C) & (cols < C), other=0.0).to(ACC)  # fmt: skip
    terms, weights = end_terms(eta, keep, t, C)
    diagonal = tl.maximum(tl.sum(tl.where(rows == cols, kernel, 0.0), 1), 1.0)
    rho = overshoot_of(weights / diagonal, kernel, live, ITERATIONS)
    cap = 1.0 / tl.maximum(rho, 1.0)
    bounded = tl.maximum(curvature, 1.0)
    out = bh * C + t
    if BACKWARD:
        d_theta = tl.zeros([CP], dtype=ACC)
        d_curvature = tl.zeros([CP], dtype=ACC)
        d_eta = tl.zeros([CP], dtype=ACC)
        d_alpha = tl.zeros([CP], dtype=ACC)
        if HAS_GR:
            g_rate = _row(gr_ptr, s7b, s7h, s7c, b, h, t, live, 0.0, ACC)
            d_theta = g_rate * cap / bounded
            d_curvature = tl.where(curvature >= 1.0, -d_theta * theta / bounded, 0.0)
        if HAS_GW:
            g_weights = _row(gw_ptr, s6b, s6h, s6c, b, h, t, live, 0.0, ACC)
            d_eta, d_keep = end_weight_grads(terms, weights, g_weights, eta, keep, t, C)
            d_alpha -= d_keep
        if HAS_GK:
            d_alpha -= _row(gk_ptr, s5b, s5h, s5c, b, h, t, live, 0.0, ACC)
        tl.store(out_0 + out, d_theta, mask=live)
        tl.store(out_1 + out, d_eta, mask=live)
        tl.store(out_2 + out, d_alpha, mask=live)
        tl.store(out_3 + out, d_curvature, mask=live)
    else:
        tl.store(out_0 + out, keep, mask=live)
        tl.store(out_1 + out, weights, mask=live)
        tl.store(out_2 + out, cap * theta / bounded, mask=live)


def _launch(
    inputs: tuple[Tensor, ...], grads: tuple[Tensor | None, ...] | None
) -> tuple[Tensor, ...]:
    """The forward's three outputs (``grads`` None) or the backward's four gradients."""
    theta, eta, alpha, curvature, coupling = inputs
    batch, heads, c = theta.shape
    given = (None, None, None) if grads is None else grads
    g_keep, g_weights, g_rate = (theta if g is None else g for g in given)
    # forward: keep, weights and rates in the inputs' common dtype; backward: each input's
    # gradient in that input's dtype
    if grads is None:
        dtype = rates_dtype(theta, eta, alpha, curvature)
        outs = [theta.new_empty(batch, heads, c, dtype=dtype) for _ in range(3)]
    else:
        outs = [t.new_empty(batch, heads, c) for t in (theta, eta, alpha, curvature)]
    vectors = (theta, eta, alpha, curvature, coupling, g_keep, g_weights, g_rate)
    strides = [s for v in vectors for s in v.stride()]
    _chunk_rates[(batch * heads,)](
        *vectors, *outs, *outs[: 4 - len(outs)], c, heads, *strides,
        CP=max(16, triton.next_power_of_2(c)), ITERATIONS=4, BACKWARD=grads is not None,
        HAS_GK=given[0] is not None, HAS_GW=given[1] is not None, HAS_GR=given[2] is not None,
        ACC=compute_dtype(theta),
    )  # fmt: skip
    return tuple(outs)


def titans_chunk_rates_triton(
    theta: Tensor, eta: Tensor, alpha: Tensor, curvature: Tensor, coupling: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``hope::titans_chunk_rates`` in one kernel launch: (keep, weights, rate)."""
    keep, weights, rate = _launch((theta, eta, alpha, curvature, coupling), None)
    return keep, weights, rate


def titans_chunk_rates_backward_triton(
    inputs: tuple[Tensor, ...],
    g_keep: Tensor | None,
    g_weights: Tensor | None,
    g_rate: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``hope::titans_chunk_rates_backward`` in one kernel launch."""
    d_theta, d_eta, d_alpha, d_curvature = _launch(inputs, (g_keep, g_weights, g_rate))
    return d_theta, d_eta, d_alpha, d_curvature
