"""Triton kernels of ``hope::momentum_chunk`` and its backward (``memory/ops/fused.py``):
the Titans memory's chunk write (Ti eqs. 13-14, chunked per eqs. 16-18), one program
per (sample, head), the h_m rows of both matrices in blocks of ``BLOCK_M``.

Per program: the chunk's coefficients from theta, eta, keep and the end weights w_s
(log b, log a as cumulative sums; c = sum_j (a_C/a_j) b_j over the live tokens only),
then W' = a_C W + c S - (w θ ⊙ err)^T inp and S' = b_C S - (b_C/b_s θ ⊙ err)^T inp for
(W1, S1, E, A) and (W2, S2, D, K). The backward is
``momentum_chunk_backward_reference`` written per program. Padding and tiles as in
``triton_kernels.py`` (padded tokens: θ = 0, eta = keep = 1, w = 0).

Tested on a CPU with ``TRITON_INTERPRET=1`` (tests/test_fused_ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hope.memory.ops.triton_kernels import flat_heads, launch_sizes, load_tile, store_tile


@triton.jit
def _coefficients(theta_ptr, eta_ptr, keep_ptr, ew_ptr, C, CP: tl.constexpr):
    t = tl.arange(0, CP)
    live = t < C
    theta = tl.load(theta_ptr + t, mask=live, other=0.0)
    eta = tl.load(eta_ptr + t, mask=live, other=1.0)
    keep = tl.load(keep_ptr + t, mask=live, other=1.0)
    end_weights = tl.load(ew_ptr + t, mask=live, other=0.0)
    log_b = tl.cumsum(tl.log(eta), 0)
    log_a = tl.cumsum(tl.log(keep), 0)
    b_end = tl.sum(tl.log(eta), 0)
    a_end = tl.sum(tl.log(keep), 0)
    gain = tl.exp(b_end - log_b)  # b_C / b_s
    carry_terms = tl.where(live, tl.exp(a_end - log_a + log_b), 0.0)
    return (t, live, theta, eta, keep, end_weights, gain, carry_terms, tl.exp(a_end),
            tl.exp(b_end))  # fmt: skip


@triton.jit
def _momentum_fwd(w1_ptr, w2_ptr, s1_ptr, s2_ptr, k_ptr, e_ptr, a_ptr, d_ptr,
                  theta_ptr, eta_ptr, keep_ptr, ew_ptr, w1_out, w2_out, s1_out, s2_out,
                  C, I, O, M, CP: tl.constexpr, IP: tl.constexpr, OP: tl.constexpr,
                  BLOCK_M: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    co = (theta_ptr + bh * C, eta_ptr + bh * C, keep_ptr + bh * C, ew_ptr + bh * C)
    terms = _coefficients(co[0], co[1], co[2], co[3], C, CP)
    t, theta, end_weights, gain, carry_terms = terms[0], terms[2], terms[5], terms[6], terms[7]
    keep_end, decay_end = terms[8], terms[9]
    carry = tl.sum(carry_terms, 0)
    to_w, to_m = end_weights * theta, gain * theta
    i, o = tl.arange(0, IP), tl.arange(0, OP)
    e = load_tile(e_ptr + bh * C * O, t, o, C, O, O)
    k = load_tile(k_ptr + bh * C * I, t, i, C, I, I)
    w1_off, w2_off, cm_off = bh * O * M, bh * M * I, bh * C * M
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        a = load_tile(a_ptr + cm_off, t, m, C, M, M)
        w1 = load_tile(w1_ptr + w1_off, o, m, O, M, M)
        s1 = load_tile(s1_ptr + w1_off, o, m, O, M, M)
        to_w1 = tl.dot(tl.trans(to_w[:, None] * e), a, input_precision=DOT)
        to_s1 = tl.dot(tl.trans(to_m[:, None] * e), a, input_precision=DOT)
        store_tile(w1_out + w1_off, keep_end * w1 + carry * s1 - to_w1, o, m, O, M, M)
        store_tile(s1_out + w1_off, decay_end * s1 - to_s1, o, m, O, M, M)
        d = load_tile(d_ptr + cm_off, t, m, C, M, M)
        w2 = load_tile(w2_ptr + w2_off, m, i, M, I, I)
        s2 = load_tile(s2_ptr + w2_off, m, i, M, I, I)
        to_w2 = tl.dot(tl.trans(to_w[:, None] * d), k, input_precision=DOT)
        to_s2 = tl.dot(tl.trans(to_m[:, None] * d), k, input_precision=DOT)
        store_tile(w2_out + w2_off, keep_end * w2 + carry * s2 - to_w2, m, i, M, I, I)
        store_tile(s2_out + w2_off, decay_end * s2 - to_s2, m, i, M, I, I)


@triton.jit
def _momentum_bwd(w1_ptr, w2_ptr, s1_ptr, s2_ptr, k_ptr, e_ptr, a_ptr, d_ptr,
                  theta_ptr, eta_ptr, keep_ptr, ew_ptr, gw1_ptr, gw2_ptr, gs1_ptr, gs2_ptr,
                  dw1_ptr, dw2_ptr, ds1_ptr, ds2_ptr, dk_ptr, de_ptr, da_ptr, dd_ptr,
                  dtheta_ptr, deta_ptr, dkeep_ptr, dew_ptr,
                  C, I, O, M, CP: tl.constexpr, IP: tl.constexpr, OP: tl.constexpr,
                  BLOCK_M: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    co = (theta_ptr + bh * C, eta_ptr + bh * C, keep_ptr + bh * C, ew_ptr + bh * C)
    terms = _coefficients(co[0], co[1], co[2], co[3], C, CP)
    t, live, theta, eta, keep = terms[0], terms[1], terms[2], terms[3], terms[4]
    end_weights, gain, carry_terms, keep_end, decay_end = (terms[5], terms[6], terms[7],
                                                           terms[8], terms[9])  # fmt: skip
    carry = tl.sum(carry_terms, 0)
    to_w, to_m = end_weights * theta, gain * theta
    i, o = tl.arange(0, IP), tl.arange(0, OP)
    e = load_tile(e_ptr + bh * C * O, t, o, C, O, O)
    k = load_tile(k_ptr + bh * C * I, t, i, C, I, I)
    w1_off, w2_off, cm_off = bh * O * M, bh * M * I, bh * C * M
    x_w1 = tl.zeros([CP, OP], dtype=k.dtype)
    x_s1 = tl.zeros([CP, OP], dtype=k.dtype)
    d_k = tl.zeros([CP, IP], dtype=k.dtype)
    d_tw = tl.zeros([CP], dtype=k.dtype)
    d_tm = tl.zeros([CP], dtype=k.dtype)
    d_keep_end = tl.zeros([BLOCK_M], dtype=k.dtype)
    d_carry = tl.zeros([BLOCK_M], dtype=k.dtype)
    d_decay_end = tl.zeros([BLOCK_M], dtype=k.dtype)
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        gw1 = load_tile(gw1_ptr + w1_off, o, m, O, M, M)
        gs1 = load_tile(gs1_ptr + w1_off, o, m, O, M, M)
        w1 = load_tile(w1_ptr + w1_off, o, m, O, M, M)
        s1 = load_tile(s1_ptr + w1_off, o, m, O, M, M)
        gw2 = load_tile(gw2_ptr + w2_off, m, i, M, I, I)
        gs2 = load_tile(gs2_ptr + w2_off, m, i, M, I, I)
        w2 = load_tile(w2_ptr + w2_off, m, i, M, I, I)
        s2 = load_tile(s2_ptr + w2_off, m, i, M, I, I)
        d_keep_end += tl.sum(gw1 * w1, 0) + tl.sum(gw2 * w2, 1)
        d_carry += tl.sum(gw1 * s1, 0) + tl.sum(gw2 * s2, 1)
        d_decay_end += tl.sum(gs1 * s1, 0) + tl.sum(gs2 * s2, 1)
        store_tile(dw1_ptr + w1_off, keep_end * gw1, o, m, O, M, M)
        store_tile(ds1_ptr + w1_off, carry * gw1 + decay_end * gs1, o, m, O, M, M)
        store_tile(dw2_ptr + w2_off, keep_end * gw2, m, i, M, I, I)
        store_tile(ds2_ptr + w2_off, carry * gw2 + decay_end * gs2, m, i, M, I, I)
        a = load_tile(a_ptr + cm_off, t, m, C, M, M)
        x_w1 -= tl.dot(a, tl.trans(gw1), input_precision=DOT)
        x_s1 -= tl.dot(a, tl.trans(gs1), input_precision=DOT)
        d_a = -tl.dot(to_w[:, None] * e, gw1, input_precision=DOT)
        d_a -= tl.dot(to_m[:, None] * e, gs1, input_precision=DOT)
        store_tile(da_ptr + cm_off, d_a, t, m, C, M, M)
        d = load_tile(d_ptr + cm_off, t, m, C, M, M)
        x_w2 = -tl.dot(k, tl.trans(gw2), input_precision=DOT)
        x_s2 = -tl.dot(k, tl.trans(gs2), input_precision=DOT)
        store_tile(dd_ptr + cm_off, to_w[:, None] * x_w2 + to_m[:, None] * x_s2, t, m, C, M, M)
        d_tw += tl.sum(d * x_w2, 1)
        d_tm += tl.sum(d * x_s2, 1)
        d_k -= tl.dot(to_w[:, None] * d, gw2, input_precision=DOT)
        d_k -= tl.dot(to_m[:, None] * d, gs2, input_precision=DOT)
    store_tile(de_ptr + bh * C * O, to_w[:, None] * x_w1 + to_m[:, None] * x_s1, t, o, C, O, O)
    store_tile(dk_ptr + bh * C * I, d_k, t, i, C, I, I)
    d_tw += tl.sum(e * x_w1, 1)
    d_tm += tl.sum(e * x_s1, 1)
    gain_grad = gain * theta * d_tm
    carry_grad = tl.sum(d_carry, 0) * carry_terms
    d_log_b = carry_grad - gain_grad
    d_b_end = tl.sum(gain_grad, 0) + tl.sum(d_decay_end, 0) * decay_end
    d_a_end = tl.sum(carry_grad, 0) + tl.sum(d_keep_end, 0) * keep_end
    d_eta = (d_log_b - tl.cumsum(d_log_b, 0) + tl.sum(d_log_b, 0) + d_b_end) / eta
    d_keep = (tl.cumsum(carry_grad, 0) - tl.sum(carry_grad, 0) - carry_grad + d_a_end) / keep
    row = bh * C + t
    tl.store(dtheta_ptr + row, end_weights * d_tw + gain * d_tm, mask=live)
    tl.store(deta_ptr + row, d_eta, mask=live)
    tl.store(dkeep_ptr + row, d_keep, mask=live)
    tl.store(dew_ptr + row, theta * d_tw, mask=live)


def _inputs(tensors: tuple[Tensor, ...]) -> list[Tensor]:
    """The twelve inputs flattened to [B*H, ...]: eight matrices, four gate rows."""
    return [flat_heads(x) for x in tensors[:8]] + [
        x.reshape(-1, x.shape[-1]).contiguous() for x in tensors[8:]
    ]


def _momentum_sizes(w1: Tensor, k: Tensor) -> dict[str, object]:
    sizes = launch_sizes(w1, k)
    sizes.pop("SQUARINGS")
    return sizes


def momentum_chunk_triton(*tensors: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``hope::momentum_chunk`` in one kernel launch (arguments as the operator's)."""
    ins = _inputs(tensors)
    outs = [torch.empty_like(x) for x in ins[:4]]
    _momentum_fwd[(ins[4].shape[0],)](*ins, *outs, **_momentum_sizes(tensors[0], tensors[4]))
    w1, w2, s1, s2 = (out.view_as(x) for out, x in zip(outs, tensors[:4], strict=True))
    return w1, w2, s1, s2


def momentum_chunk_backward_triton(
    inputs: tuple[Tensor, ...], grads: tuple[Tensor, ...]
) -> tuple[Tensor, ...]:
    """``hope::momentum_chunk_backward`` in one kernel launch."""
    ins = _inputs(inputs)
    flat_grads = [flat_heads(g) for g in grads]
    outs = [torch.empty_like(x) for x in ins]
    _momentum_bwd[(ins[4].shape[0],)](
        *ins, *flat_grads, *outs, **_momentum_sizes(inputs[0], inputs[4])
    )
    return tuple(out.view_as(x) for out, x in zip(outs, inputs, strict=True))
