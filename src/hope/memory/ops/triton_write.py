"""Triton kernels of ``hope::smt_write`` and its backward (``smt_write.py``): the
memory pass (``triton_pass.py``), the bounded step (``triton_kernels._overshoot``) and
the DGD write (``triton_kernels._dgd_chunk_*``) composed in one program, nothing
between them written to memory.

Forward, one program per (sample, stacked head): a walk over the hidden blocks for
the predictions, v_hat, the reads and the kernel bound; E; the bound rho and the
steps eta / (1 + rho); the write's C x C terms; a second walk writing W1', W2' and
the increments, with A, D and W2 k recomputed per block.

Backward, one program per (sample, head) over the G stacked members (k, v, q, eta,
alpha are shared: their gradients are summed in registers). Per member: the pass's
first walk again (E and the bound come back from the inputs and the saved gain), the
write's backward walk and its C x C part, which give dL/dE, and per block dL/dA,
dL/dD and dL/dW2k; a walk completing dL/dE from D; a last walk that forms the
pass's backward block by block and writes dW1, dW2 (the write's gain term included).
Padding and precision as in ``triton_pass.py``; tested on a CPU with
``TRITON_INTERPRET=1`` against ``smt_write_reference`` and its backward.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl
from torch import Tensor

from hope.memory.ops.triton_kernels import (
    chunk_terms_of,
    dgd_cc_backward,
    flat_heads,
    load_strided,
    load_tile,
    store_tile,
)
from hope.memory.ops.triton_pass import (
    curve_of,
    gelu,
    pass_sizes,
    rows_backward,
    slope_of,
)


@triton.jit
def _pass_forward(w1_ptr, w2_ptr, k, v, q, t, i, o, I, O, M, HAS_Q: tl.constexpr,
                  CP: tl.constexpr, OP: tl.constexpr, BLOCK_M: tl.constexpr,
                  DOT: tl.constexpr):  # fmt: skip
    """Predictions at k, v_hat = M(v), reads M(q) (without the skip) and the kernel
    bound's parts: the Gram matrix of A and back_sq."""
    pred = tl.zeros([CP, OP], dtype=k.dtype)
    v_hat = tl.zeros([CP, OP], dtype=k.dtype)
    read = tl.zeros([CP, OP], dtype=k.dtype)
    back_sq = tl.zeros([CP], dtype=k.dtype)
    gram = tl.zeros([CP, CP], dtype=k.dtype)
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        w2 = load_tile(w2_ptr, m, i, M, I, I)
        w1 = load_tile(w1_ptr, o, m, O, M, M)
        pre = tl.dot(k, tl.trans(w2), input_precision=DOT)
        act = gelu(pre)
        slope = slope_of(pre)
        pred += tl.dot(act, tl.trans(w1), input_precision=DOT)
        back_sq += tl.sum(slope * slope * tl.sum(w1 * w1, 0)[None, :], 1)
        gram += tl.dot(act, tl.trans(act), input_precision=DOT)
        v_act = gelu(tl.dot(v, tl.trans(w2), input_precision=DOT))
        v_hat += tl.dot(v_act, tl.trans(w1), input_precision=DOT)
        if HAS_Q:
            q_act = gelu(tl.dot(q, tl.trans(w2), input_precision=DOT))
            read += tl.dot(q_act, tl.trans(w1), input_precision=DOT)
    return pred, v_hat, read, back_sq, gram


@triton.jit
def _bound(k, gram, back_sq, eta, live, DOT: tl.constexpr):
    """rho = 2 ||diag(sqrt(eta)) K diag(sqrt(eta))|| by four power iterations
    (``residual_mlp.overshoot_ratio``), K the chunk's kernel bound."""
    back = tl.sqrt(back_sq)
    key_gram = tl.abs(tl.dot(k, tl.trans(k), input_precision=DOT))
    kernel = tl.abs(gram) + key_gram * (back[:, None] * back[None, :])
    root = tl.sqrt(tl.maximum(eta, 0.0))
    matrix = root[:, None] * kernel * root[None, :]
    x = tl.where(live, 1.0, 0.0).to(matrix.dtype)
    for _ in tl.static_range(4):
        x = tl.sum(matrix * x[None, :], 1)
        x = x / tl.maximum(tl.max(x, 0), 1e-30) + 1e-12
    ratio = tl.where(live, tl.sum(matrix * x[None, :], 1) / x, 0.0)
    return 2.0 * tl.max(ratio, 0)


@triton.jit
def write_member_fwd(w1_ptr, w2_ptr, w1_out, w2_out, inc1_out, inc2_out, read_ptr,
                     k, v, q, eta_in, alpha, skip, t, i, o, live, CQ, I, O, M,
                     HAS_Q: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_INC: tl.constexpr,
                     DOT_LOSS: tl.constexpr, CP: tl.constexpr, OP: tl.constexpr,
                     BLOCK_M: tl.constexpr, SQUARINGS: tl.constexpr,
                     DOT: tl.constexpr):  # fmt: skip
    """One member's chunk write from its state at w1_ptr, w2_ptr (the pointers of this
    member's head): W1', W2' (and the increments when HAS_INC) stored, and its reads
    M(q) when HAS_Q. k, v, q [CP, IP], eta_in, alpha [CP] in registers; ``skip`` the
    residual coefficient when HAS_SKIP."""
    pred, v_hat, read, back_sq, gram = _pass_forward(w1_ptr, w2_ptr, k, v, q, t, i, o, I, O,
                                                     M, HAS_Q, CP, OP, BLOCK_M, DOT)  # fmt: skip
    if HAS_SKIP:  # O == I
        pred += skip * k
        v_hat += skip * v
        read += skip * q
    if HAS_Q:
        store_tile(read_ptr, read, t, o, CQ, O, O)
    err = -v_hat if DOT_LOSS else 2.0 * (pred - v_hat)
    gain = 1.0 / (1.0 + _bound(k, gram, back_sq, eta_in, live, DOT))
    terms = chunk_terms_of(k, eta_in * gain, alpha, t, i, live, CP, SQUARINGS, DOT)
    eta, keys = terms[3], terms[11]
    gamma_prev, end_over_s, gamma_end = terms[12], terms[13], terms[14]
    scaled_e = (-eta * end_over_s)[:, None] * err  # c1 ⊙ E
    hom_coef = -eta * gamma_prev
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        w2 = load_tile(w2_ptr, m, i, M, I, I)
        w1 = load_tile(w1_ptr, o, m, O, M, M)
        pre = tl.dot(k, tl.trans(w2), input_precision=DOT)  # W2 k
        d = tl.dot(err, w1, input_precision=DOT) * slope_of(pre)
        u = -eta[:, None] * d
        rhs = u + hom_coef[:, None] * pre
        change2 = tl.dot(tl.trans(rhs), keys, input_precision=DOT)
        store_tile(w2_out, change2 + gamma_end * w2, m, i, M, I, I)
        inc1 = tl.dot(tl.trans(scaled_e), gelu(pre), input_precision=DOT)
        store_tile(w1_out, inc1 + gamma_end * w1, o, m, O, M, M)
        if HAS_INC:
            store_tile(inc2_out, tl.dot(tl.trans(u), keys, input_precision=DOT), m, i, M, I, I)
            store_tile(inc1_out, inc1, o, m, O, M, M)


@triton.jit
def _smt_write_fwd(w1_ptr, w2_ptr, k_ptr, v_ptr, q_ptr, eta_ptr, alpha_ptr, scale_ptr,
                   w1_out, w2_out, inc1_out, inc2_out, read_ptr,
                   H, GH, C, CQ, I, O, M,
                   HAS_Q: tl.constexpr, HAS_SCALE: tl.constexpr, RESIDUAL: tl.constexpr,
                   DOT_LOSS: tl.constexpr, CP: tl.constexpr, IP: tl.constexpr,
                   OP: tl.constexpr, BLOCK_M: tl.constexpr, SQUARINGS: tl.constexpr,
                   DOT: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    gh = bh % GH
    head = bh // GH * H + gh % H  # the shared inputs' head
    t, i, o = tl.arange(0, CP), tl.arange(0, IP), tl.arange(0, OP)
    live = t < C
    k = load_tile(k_ptr + head * C * I, t, i, C, I, I)
    v = load_tile(v_ptr + head * C * I, t, i, C, I, I)
    q = load_tile(q_ptr + head * CQ * I, t, i, CQ if HAS_Q else 0, I, I)
    eta_in = tl.load(eta_ptr + head * C + t, mask=live, other=0.0)
    alpha = tl.load(alpha_ptr + head * C + t, mask=live, other=1.0)
    skip = 1.0
    if HAS_SCALE:
        skip = tl.load(scale_ptr + gh)
    a, b = bh * O * M, bh * M * I
    write_member_fwd(w1_ptr + a, w2_ptr + b, w1_out + a, w2_out + b, inc1_out + a, inc2_out + b,
                     read_ptr + bh * CQ * O, k, v, q, eta_in, alpha, skip, t, i, o, live, CQ,
                     I, O, M, HAS_Q, HAS_SCALE or RESIDUAL, True, DOT_LOSS, CP, OP, BLOCK_M,
                     SQUARINGS, DOT)  # fmt: skip


@triton.jit
def _write_grads_of(w1_ptr, w2_ptr, gw1_ptr, gw2_ptr, gi1_ptr, gi2_ptr, m, i, o, I, O, M,
                    HAS_GW1: tl.constexpr, HAS_GW2: tl.constexpr, HAS_GI1: tl.constexpr,
                    HAS_GI2: tl.constexpr):  # fmt: skip
    """A block of the weights and of the gradients reaching W1', W2', inc1, inc2."""
    w2 = load_tile(w2_ptr, m, i, M, I, I)
    w1 = load_tile(w1_ptr, o, m, O, M, M)
    gw1 = load_tile(gw1_ptr, o, m, O if HAS_GW1 else 0, M, M)
    gw2 = load_tile(gw2_ptr, m, i, M if HAS_GW2 else 0, I, I)
    g1 = gw1 + load_tile(gi1_ptr, o, m, O if HAS_GI1 else 0, M, M)  # inc1's path
    gi2 = load_tile(gi2_ptr, m, i, M if HAS_GI2 else 0, I, I)
    return w1, w2, gw1, gw2, g1, gi2


@triton.jit
def write_member_bwd(w1_g, w2_g, gw1_g, gw2_g, gi1_g, gi2_g, gread_g, GREAD_SR, GREAD_SC,
                     dw1_g, dw2_g,
                     k, v, q, eta_in, alpha, skip, t, i, o, live, CQ, I, O, M,
                     HAS_Q: tl.constexpr, HAS_SKIP: tl.constexpr, DOT_LOSS: tl.constexpr,
                     HAS_GW1: tl.constexpr, HAS_GW2: tl.constexpr, HAS_GI1: tl.constexpr,
                     HAS_GI2: tl.constexpr, HAS_GREAD: tl.constexpr, CP: tl.constexpr,
                     IP: tl.constexpr, OP: tl.constexpr, BLOCK_M: tl.constexpr,
                     SQUARINGS: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """One member's share of the write's backward (pointers at this member's head):
    dW1, dW2 stored at dw1_g, dw2_g; returns its shares of d(k, v, q, eta, alpha). The read's
    gradient at gread_g has strides GREAD_SR (tokens) and GREAD_SC (features)."""
    # The forward again: E, the bound, the write's C x C terms.
    pred, v_hat, _, back_sq, gram = _pass_forward(w1_g, w2_g, k, v, q, t, i, o, I, O, M,
                                                  False, CP, OP, BLOCK_M, DOT)  # fmt: skip
    if HAS_SKIP:  # O == I
        pred += skip * k
        v_hat += skip * v
    err = -v_hat if DOT_LOSS else 2.0 * (pred - v_hat)
    gain = 1.0 / (1.0 + _bound(k, gram, back_sq, eta_in, live, DOT))
    terms = chunk_terms_of(k, eta_in * gain, alpha, t, i, live, CP, SQUARINGS, DOT)
    eta, keys, gamma_prev = terms[3], terms[11], terms[12]
    end_over_s, gamma_end = terms[13], terms[14]
    c1 = -eta * end_over_s
    hom_coef = -eta * gamma_prev
    # The write's backward (``triton_kernels._dgd_chunk_bwd`` with A, D, W2 k recomputed).
    a_g = tl.zeros([CP, OP], dtype=k.dtype)
    d_keys = tl.zeros([CP, IP], dtype=k.dtype)
    d_hom = tl.zeros([CP], dtype=k.dtype)
    d_eta = tl.zeros([CP], dtype=k.dtype)
    d_gain = tl.zeros([BLOCK_M], dtype=k.dtype)
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        w1, w2, gw1, gw2, g1, gi2 = _write_grads_of(w1_g, w2_g, gw1_g, gw2_g, gi1_g, gi2_g,
                                                    m, i, o, I, O, M, HAS_GW1, HAS_GW2,
                                                    HAS_GI1, HAS_GI2)  # fmt: skip
        pre = tl.dot(k, tl.trans(w2), input_precision=DOT)
        d = tl.dot(err, w1, input_precision=DOT) * slope_of(pre)
        u = -eta[:, None] * d
        rhs = u + hom_coef[:, None] * pre
        d_gain += tl.sum(gw1 * w1, 0) + tl.sum(gw2 * w2, 1)
        a_g += tl.dot(gelu(pre), tl.trans(g1), input_precision=DOT)
        d_rhs = tl.dot(keys, tl.trans(gw2), input_precision=DOT)
        d_u = d_rhs + tl.dot(keys, tl.trans(gi2), input_precision=DOT)
        d_keys += tl.dot(rhs, gw2, input_precision=DOT) + tl.dot(u, gi2, input_precision=DOT)
        d_hom += tl.sum(pre * d_rhs, 1)
        d_eta -= tl.sum(d * d_u, 1)
    d_k, d_eta_cc, d_alpha = dgd_cc_backward(err, a_g, d_keys, d_hom, d_gain, terms, DOT)
    d_eta_in = (d_eta + d_eta_cc) * gain  # the bound rho is not differentiated
    # The pass's backward: dL/dE from inc1 and from D = (E W1) ⊙ gelu'(W2 k).
    g_err = c1[:, None] * a_g
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        w1, w2, gw1, gw2, g1, gi2 = _write_grads_of(w1_g, w2_g, gw1_g, gw2_g, gi1_g, gi2_g,
                                                    m, i, o, I, O, M, HAS_GW1, HAS_GW2,
                                                    HAS_GI1, HAS_GI2)  # fmt: skip
        slope = slope_of(tl.dot(k, tl.trans(w2), input_precision=DOT))
        d_u = tl.dot(keys, tl.trans(gw2 + gi2), input_precision=DOT)
        g_err += tl.dot(-eta[:, None] * d_u * slope, tl.trans(w1), input_precision=DOT)
    g_pred = tl.zeros([CP, OP], dtype=k.dtype) if DOT_LOSS else 2.0 * g_err
    g_vhat = -g_err if DOT_LOSS else -2.0 * g_err
    g_read = load_strided(gread_g, t, o, CQ if HAS_GREAD else 0, O, GREAD_SR, GREAD_SC)
    d_v = tl.zeros([CP, IP], dtype=k.dtype)
    d_q = tl.zeros([CP, IP], dtype=k.dtype)
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        w1, w2, gw1, gw2, g1, gi2 = _write_grads_of(w1_g, w2_g, gw1_g, gw2_g, gi1_g, gi2_g,
                                                    m, i, o, I, O, M, HAS_GW1, HAS_GW2,
                                                    HAS_GI1, HAS_GI2)  # fmt: skip
        pre = tl.dot(k, tl.trans(w2), input_precision=DOT)
        act, slope = gelu(pre), slope_of(pre)
        d_rhs = tl.dot(keys, tl.trans(gw2), input_precision=DOT)
        g_hid = -eta[:, None] * (d_rhs + tl.dot(keys, tl.trans(gi2), input_precision=DOT))
        g_act = tl.dot(g_pred, w1, input_precision=DOT)
        g_act += c1[:, None] * tl.dot(err, g1, input_precision=DOT)
        g_slope = g_hid * tl.dot(err, w1, input_precision=DOT)
        g_pre = g_slope * curve_of(pre) + g_act * slope + hom_coef[:, None] * d_rhs
        d_w1 = gamma_end * gw1 + tl.dot(tl.trans(g_pred), act, input_precision=DOT)
        d_w1 += tl.dot(tl.trans(err), g_hid * slope, input_precision=DOT)
        d_w2 = gamma_end * gw2 + tl.dot(tl.trans(g_pre), k, input_precision=DOT)
        d_k += tl.dot(g_pre, w2, input_precision=DOT)
        r_w1, r_w2, r_z = rows_backward(v, g_vhat, w1, w2, DOT)
        d_w1, d_w2, d_v = d_w1 + r_w1, d_w2 + r_w2, d_v + r_z
        if HAS_Q and HAS_GREAD:
            r_w1, r_w2, r_z = rows_backward(q, g_read, w1, w2, DOT)
            d_w1, d_w2, d_q = d_w1 + r_w1, d_w2 + r_w2, d_q + r_z
        store_tile(dw1_g, d_w1, o, m, O, M, M)
        store_tile(dw2_g, d_w2, m, i, M, I, I)
    if HAS_SKIP:  # O == I
        d_k += skip * g_pred
        d_v += skip * g_vhat
        d_q += skip * g_read
    return d_k, d_v, d_q, d_eta_in, d_alpha


@triton.jit
def _smt_write_bwd(w1_ptr, w2_ptr, k_ptr, v_ptr, q_ptr, eta_ptr, alpha_ptr, scale_ptr,
                   gw1_ptr, gw2_ptr, gi1_ptr, gi2_ptr, gread_ptr,
                   dw1_ptr, dw2_ptr, dk_ptr, dv_ptr, dq_ptr, deta_ptr, dalpha_ptr,
                   H, GH, C, CQ, I, O, M,
                   HAS_Q: tl.constexpr, HAS_SCALE: tl.constexpr, RESIDUAL: tl.constexpr,
                   DOT_LOSS: tl.constexpr, HAS_GW1: tl.constexpr, HAS_GW2: tl.constexpr,
                   HAS_GI1: tl.constexpr, HAS_GI2: tl.constexpr, HAS_GREAD: tl.constexpr,
                   CP: tl.constexpr, IP: tl.constexpr, OP: tl.constexpr,
                   BLOCK_M: tl.constexpr, SQUARINGS: tl.constexpr,
                   DOT: tl.constexpr):  # fmt: skip
    head = tl.program_id(0).to(tl.int64)  # b * H + h; every stacked member of it
    t, i, o = tl.arange(0, CP), tl.arange(0, IP), tl.arange(0, OP)
    live = t < C
    k = load_tile(k_ptr + head * C * I, t, i, C, I, I)
    v = load_tile(v_ptr + head * C * I, t, i, C, I, I)
    q = load_tile(q_ptr + head * CQ * I, t, i, CQ if HAS_Q else 0, I, I)
    eta_in = tl.load(eta_ptr + head * C + t, mask=live, other=0.0)
    alpha = tl.load(alpha_ptr + head * C + t, mask=live, other=1.0)
    d_k = tl.zeros([CP, IP], dtype=k.dtype)
    d_v = tl.zeros([CP, IP], dtype=k.dtype)
    d_q = tl.zeros([CP, IP], dtype=k.dtype)
    d_eta_in = tl.zeros([CP], dtype=k.dtype)
    d_alpha = tl.zeros([CP], dtype=k.dtype)
    for g in range(0, GH // H):
        gh = g * H + head % H
        bh = head // H * GH + gh
        skip = 1.0
        if HAS_SCALE:
            skip = tl.load(scale_ptr + gh)
        a, b = bh * O * M, bh * M * I
        share = write_member_bwd(w1_ptr + a, w2_ptr + b, gw1_ptr + a, gw2_ptr + b, gi1_ptr + a,
                                 gi2_ptr + b, gread_ptr + bh * CQ * O, O, 1, dw1_ptr + a,
                                 dw2_ptr + b,
                                 k, v, q, eta_in, alpha, skip, t, i, o, live, CQ, I, O, M,
                                 HAS_Q, HAS_SCALE or RESIDUAL, DOT_LOSS, HAS_GW1, HAS_GW2,
                                 HAS_GI1, HAS_GI2, HAS_GREAD, CP, IP, OP, BLOCK_M, SQUARINGS,
                                 DOT)  # fmt: skip
        d_k += share[0]
        d_v += share[1]
        d_q += share[2]
        d_eta_in += share[3]
        d_alpha += share[4]
    store_tile(dk_ptr + head * C * I, d_k, t, i, C, I, I)
    store_tile(dv_ptr + head * C * I, d_v, t, i, C, I, I)
    if HAS_Q:
        store_tile(dq_ptr + head * CQ * I, d_q, t, i, CQ, I, I)
    tl.store(deta_ptr + head * C + t, d_eta_in, mask=live)
    tl.store(dalpha_ptr + head * C + t, d_alpha, mask=live)


def _sizes(inputs: tuple[Tensor | None, ...], residual: bool) -> dict[str, Any]:
    w1, _, k, _, q, _, _, scale = inputs
    assert w1 is not None and k is not None
    sizes = pass_sizes(w1, k, q, scale is not None or residual)
    return sizes | {"SQUARINGS": sizes["CP"].bit_length() - 2}


def _flat(inputs: tuple[Tensor | None, ...]) -> list[Tensor]:
    """The kernels' inputs (w1, w2, k, v, q, eta, alpha, scale) contiguous, absent ones
    replaced by k (never read)."""
    w1, w2, k, v, q, eta, alpha, scale = inputs
    assert w1 is not None and w2 is not None and k is not None
    kf = flat_heads(k)
    rest = [None if t is None else t.contiguous() for t in (eta, alpha)]
    scale_f = kf if scale is None else scale.to(w1.dtype).contiguous()
    rows = [kf if t is None else flat_heads(t) for t in (v, q)]
    return [flat_heads(w1), flat_heads(w2), kf, *rows, *(kf if t is None else t for t in rest),
            scale_f]  # fmt: skip


def smt_write_triton(
    inputs: tuple[Tensor | None, ...], residual: bool, dot: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``hope::smt_write`` in one kernel launch."""
    w1, w2, _, _, q, _, _, scale = inputs
    assert w1 is not None and w2 is not None
    sizes = _sizes(inputs, residual)
    b, gh, o, _ = w1.shape
    outs = (w1.new_empty(w1.shape), w1.new_empty(w2.shape), w1.new_empty(w1.shape),
            w1.new_empty(w2.shape), w1.new_empty(b, gh, sizes["CQ"], o))  # fmt: skip
    _smt_write_fwd[(b * gh,)](
        *_flat(inputs), *outs, HAS_Q=q is not None, HAS_SCALE=scale is not None,
        RESIDUAL=residual, DOT_LOSS=dot, **sizes,
    )  # fmt: skip
    return outs


def smt_write_backward_triton(
    inputs: tuple[Tensor | None, ...], residual: bool, dot: bool, grads: tuple[Tensor | None, ...]
) -> tuple[Tensor | None, ...]:
    """``hope::smt_write_backward`` in one kernel launch."""
    w1, w2, k, v, q, eta, alpha, scale = inputs
    assert w1 is not None and w2 is not None and k is not None and v is not None
    assert eta is not None and alpha is not None
    flat = _flat(inputs)
    g_flat = [flat[2] if g is None else flat_heads(g) for g in grads]
    outs = (w1.new_empty(w1.shape), w1.new_empty(w2.shape), w1.new_empty(k.shape),
            w1.new_empty(v.shape), None if q is None else w1.new_empty(q.shape),
            w1.new_empty(eta.shape), w1.new_empty(alpha.shape))  # fmt: skip
    flags = ("HAS_GW1", "HAS_GW2", "HAS_GI1", "HAS_GI2", "HAS_GREAD")
    _smt_write_bwd[(k.shape[0] * k.shape[1],)](
        *flat, *g_flat, *(flat[2] if t is None else t for t in outs),
        HAS_Q=q is not None, HAS_SCALE=scale is not None, RESIDUAL=residual, DOT_LOSS=dot,
        **{f: g is not None for f, g in zip(flags, grads, strict=True)}, **_sizes(inputs, residual),
    )  # fmt: skip
    return outs
