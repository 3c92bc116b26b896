"""Triton kernels of ``hope::memory_pass`` and its backward (``memory_pass.py``).

Forward: one program per (sample, stacked head); the chunk's keys, values and
queries (C <= CP rows each) stay in registers while the hidden layer is walked in
blocks of ``BLOCK_M`` units: per block the pre-activations, A and the prediction's,
v_hat's and the read's partial products, the squared norms and the Gram matrix of
A; then E, and a second walk for D = (E W1) ⊙ gelu'(W2 k).

Backward: one program per (sample, head) looping over the G stacked members, so
the gradients of the shared k, v, q are summed in registers. Per member a first
walk over the hidden blocks completes dL/dE (D's share) and back_sq; a second
recomputes the activations and writes dW1, dW2 block by block.

Padding as in ``triton_kernels.py``; fp32 products in IEEE precision. Tested on a CPU
with ``TRITON_INTERPRET=1`` against the reference forms (tests/test_fused_ops.py).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl
from torch import Tensor

from hope.memory.ops.triton_kernels import (
    dot_precision,
    flat_heads,
    load_strided,
    load_tile,
    store_tile,
)


@triton.jit
def gelu(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def slope_of(x):  # gelu'(x) = Φ(x) + x φ(x)
    return (
        0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
    )


@triton.jit
def curve_of(x):  # gelu''(x) = φ(x) (2 - x^2)
    return tl.exp(-0.5 * x * x) * 0.3989422804014327 * (2.0 - x * x)


@triton.jit
def _memory_pass_fwd(w1_ptr, w2_ptr, k_ptr, v_ptr, q_ptr, tgt_ptr, scale_ptr,
                     vhat_ptr, read_ptr, err_ptr, act_ptr, hid_ptr, pre_ptr, curv_ptr,
                     bsq_ptr, coup_ptr, H, GH, C, CQ, I, O, M,
                     HAS_V: tl.constexpr, HAS_Q: tl.constexpr, HAS_SCALE: tl.constexpr,
                     RESIDUAL: tl.constexpr, DOT_LOSS: tl.constexpr, CP: tl.constexpr,
                     IP: tl.constexpr, OP: tl.constexpr, BLOCK_M: tl.constexpr,
                     DOT: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    gh = bh % GH
    rows = (bh // GH * H + gh % H) * C * I  # the shared inputs' head
    w1_ptr += bh * O * M
    w2_ptr += bh * M * I
    cm, co = bh * C * M, bh * C * O
    t, i, o = tl.arange(0, CP), tl.arange(0, IP), tl.arange(0, OP)
    k = load_tile(k_ptr + rows, t, i, C, I, I)
    v = load_tile(v_ptr + rows, t, i, C if HAS_V else 0, I, I)
    q = load_tile(q_ptr + (bh // GH * H + gh % H) * CQ * I, t, i, CQ if HAS_Q else 0, I, I)
    pred = tl.zeros([CP, OP], dtype=k.dtype)
    v_hat = tl.zeros([CP, OP], dtype=k.dtype)
    read = tl.zeros([CP, OP], dtype=k.dtype)
    act_sq = tl.zeros([CP], dtype=k.dtype)
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
        store_tile(pre_ptr + cm, pre, t, m, C, M, M)
        store_tile(act_ptr + cm, act, t, m, C, M, M)
        back_sq += tl.sum(slope * slope * tl.sum(w1 * w1, 0)[None, :], 1)
        act_sq += tl.sum(act * act, 1)
        gram += tl.dot(act, tl.trans(act), input_precision=DOT)
        if HAS_V:
            v_act = gelu(tl.dot(v, tl.trans(w2), input_precision=DOT))
            v_hat += tl.dot(v_act, tl.trans(w1), input_precision=DOT)
        if HAS_Q:
            q_act = gelu(tl.dot(q, tl.trans(w2), input_precision=DOT))
            read += tl.dot(q_act, tl.trans(w1), input_precision=DOT)
    if HAS_SCALE or RESIDUAL:  # O == I (checked by the launcher)
        skip = 1.0
        if HAS_SCALE:
            skip = tl.load(scale_ptr + gh)
        pred += skip * k
        v_hat += skip * v
        read += skip * q
    if HAS_V:
        store_tile(vhat_ptr + co, v_hat, t, o, C, O, O)
        target = v_hat
    else:
        target = load_tile(tgt_ptr + co, t, o, C, O, O)
    if HAS_Q:
        store_tile(read_ptr + bh * CQ * O, read, t, o, CQ, O, O)
    err = -target if DOT_LOSS else 2.0 * (pred - target)
    store_tile(err_ptr + co, err, t, o, C, O, O)
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        pre = tl.dot(k, tl.trans(load_tile(w2_ptr, m, i, M, I, I)), input_precision=DOT)
        w1 = load_tile(w1_ptr, o, m, O, M, M)
        hid = tl.dot(err, w1, input_precision=DOT) * slope_of(pre)
        store_tile(hid_ptr + cm, hid, t, m, C, M, M)
    live = t < C
    tl.store(curv_ptr + bh * C + t, act_sq + tl.sum(k * k, 1) * back_sq, mask=live)
    tl.store(bsq_ptr + bh * C + t, back_sq, mask=live)
    back = tl.sqrt(back_sq)
    key_gram = tl.abs(tl.dot(k, tl.trans(k), input_precision=DOT))
    coupling = tl.abs(gram) + key_gram * (back[:, None] * back[None, :])
    store_tile(coup_ptr + bh * C * C, coupling, t, t, C, C, C)


@triton.jit
def rows_backward(z, g_out, w1, w2, DOT: tl.constexpr):
    """A block's share of (dW1, dW2, dz) from rows z whose outputs M(z) get g_out."""
    pre = tl.dot(z, tl.trans(w2), input_precision=DOT)
    g_pre = tl.dot(g_out, w1, input_precision=DOT) * slope_of(pre)
    g_w1 = tl.dot(tl.trans(g_out), gelu(pre), input_precision=DOT)
    g_w2 = tl.dot(tl.trans(g_pre), z, input_precision=DOT)
    return g_w1, g_w2, tl.dot(g_pre, w2, input_precision=DOT)


@triton.jit
def _memory_pass_bwd(w1_ptr, w2_ptr, k_ptr, v_ptr, q_ptr, scale_ptr, err_ptr,
                     gvhat_ptr, gread_ptr, gerr_ptr, gact_ptr, ghid_ptr, gpre_ptr, gcurv_ptr,
                     dw1_ptr, dw2_ptr, dk_ptr, dv_ptr, dq_ptr, dtgt_ptr,
                     H, GH, C, CQ, I, O, M, sr_b, sr_h, sr_t, sr_o,
                     HAS_V: tl.constexpr, HAS_Q: tl.constexpr, HAS_SCALE: tl.constexpr,
                     RESIDUAL: tl.constexpr, DOT_LOSS: tl.constexpr,
                     HAS_GVHAT: tl.constexpr, HAS_GREAD: tl.constexpr, HAS_GERR: tl.constexpr,
                     HAS_GACT: tl.constexpr, HAS_GHID: tl.constexpr, HAS_GPRE: tl.constexpr,
                     HAS_GCURV: tl.constexpr, CP: tl.constexpr, IP: tl.constexpr,
                     OP: tl.constexpr, BLOCK_M: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    head = tl.program_id(0).to(tl.int64)  # b * H + h
    t, i, o = tl.arange(0, CP), tl.arange(0, IP), tl.arange(0, OP)
    k = load_tile(k_ptr + head * C * I, t, i, C, I, I)
    v = load_tile(v_ptr + head * C * I, t, i, C if HAS_V else 0, I, I)
    q = load_tile(q_ptr + head * CQ * I, t, i, CQ if HAS_Q else 0, I, I)
    k_sq = tl.sum(k * k, 1)
    d_k = tl.zeros([CP, IP], dtype=k.dtype)
    d_v = tl.zeros([CP, IP], dtype=k.dtype)
    d_q = tl.zeros([CP, IP], dtype=k.dtype)
    for g in range(0, GH // H):
        gh = g * H + head % H
        sh = head // H * GH + gh  # the stacked head
        w1_ptr_g, w2_ptr_g = w1_ptr + sh * O * M, w2_ptr + sh * M * I
        cm, co = sh * C * M, sh * C * O
        err = load_tile(err_ptr + co, t, o, C, O, O)
        g_err = load_tile(gerr_ptr + co, t, o, C if HAS_GERR else 0, O, O)
        g_curv = tl.zeros([CP], dtype=k.dtype)
        if HAS_GCURV:
            g_curv = tl.load(gcurv_ptr + sh * C + t, mask=t < C, other=0.0)
        back_sq = tl.zeros([CP], dtype=k.dtype)
        for m0 in range(0, M, BLOCK_M):  # dL/dE from D, and back_sq
            m = m0 + tl.arange(0, BLOCK_M)
            w1 = load_tile(w1_ptr_g, o, m, O, M, M)
            slope = slope_of(tl.dot(k, tl.trans(load_tile(w2_ptr_g, m, i, M, I, I)),
                                  input_precision=DOT))  # fmt: skip
            if HAS_GHID:
                g_hid = load_tile(ghid_ptr + cm, t, m, C, M, M)
                g_err += tl.dot(g_hid * slope, tl.trans(w1), input_precision=DOT)
            back_sq += tl.sum(slope * slope * tl.sum(w1 * w1, 0)[None, :], 1)
        g_pred = tl.zeros([CP, OP], dtype=k.dtype) if DOT_LOSS else 2.0 * g_err
        g_tgt = -g_err if DOT_LOSS else -2.0 * g_err
        g_vhat = load_tile(gvhat_ptr + co, t, o, C if HAS_GVHAT else 0, O, O)
        if HAS_V:
            g_vhat += g_tgt
        else:
            store_tile(dtgt_ptr + co, g_tgt, t, o, C, O, O)
        # the reads' gradient through its strides (a slice of the caller's joined reads')
        g_read = load_strided(gread_ptr + head // H * sr_b + gh * sr_h, t, o,
                              CQ if HAS_GREAD else 0, O, sr_t, sr_o)  # fmt: skip
        for m0 in range(0, M, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            w2 = load_tile(w2_ptr_g, m, i, M, I, I)
            w1 = load_tile(w1_ptr_g, o, m, O, M, M)
            col_sq = tl.sum(w1 * w1, 0)
            pre = tl.dot(k, tl.trans(w2), input_precision=DOT)
            act, slope = gelu(pre), slope_of(pre)
            g_act = tl.dot(g_pred, w1, input_precision=DOT)
            g_act += load_tile(gact_ptr + cm, t, m, C if HAS_GACT else 0, M, M)
            g_slope = tl.zeros([CP, BLOCK_M], dtype=k.dtype)
            d_w1 = tl.dot(tl.trans(g_pred), act, input_precision=DOT)
            if HAS_GHID:
                g_hid = load_tile(ghid_ptr + cm, t, m, C, M, M)
                g_slope += g_hid * tl.dot(err, w1, input_precision=DOT)
                d_w1 += tl.dot(tl.trans(err), g_hid * slope, input_precision=DOT)
            if HAS_GCURV:
                g_act += 2.0 * act * g_curv[:, None]
                weight = (g_curv * k_sq)[:, None]
                g_slope += 2.0 * slope * weight * col_sq[None, :]
                d_w1 += 2.0 * w1 * tl.sum(weight * slope * slope, 0)[None, :]
            g_pre = g_slope * curve_of(pre) + g_act * slope
            g_pre += load_tile(gpre_ptr + cm, t, m, C if HAS_GPRE else 0, M, M)
            d_w2 = tl.dot(tl.trans(g_pre), k, input_precision=DOT)
            d_k += tl.dot(g_pre, w2, input_precision=DOT)
            if HAS_V:
                r_w1, r_w2, r_z = rows_backward(v, g_vhat, w1, w2, DOT)
                d_w1, d_w2, d_v = d_w1 + r_w1, d_w2 + r_w2, d_v + r_z
            if HAS_Q:
                r_w1, r_w2, r_z = rows_backward(q, g_read, w1, w2, DOT)
                d_w1, d_w2, d_q = d_w1 + r_w1, d_w2 + r_w2, d_q + r_z
            store_tile(dw1_ptr + sh * O * M, d_w1, o, m, O, M, M)
            store_tile(dw2_ptr + sh * M * I, d_w2, m, i, M, I, I)
        if HAS_SCALE or RESIDUAL:  # O == I
            skip = 1.0
            if HAS_SCALE:
                skip = tl.load(scale_ptr + gh)
            d_k += skip * g_pred
            d_v += skip * g_vhat
            d_q += skip * g_read
        d_k += 2.0 * k * (g_curv * back_sq)[:, None]
    store_tile(dk_ptr + head * C * I, d_k, t, i, C, I, I)
    if HAS_V:
        store_tile(dv_ptr + head * C * I, d_v, t, i, C, I, I)
    if HAS_Q:
        store_tile(dq_ptr + head * CQ * I, d_q, t, i, CQ, I, I)


def pad_size(n: int) -> int:  # tl.dot's smallest tile is 16
    return max(16, triton.next_power_of_2(n))


_READ_STRIDES = ("sr_b", "sr_h", "sr_t", "sr_o")  # the reads' gradient's, in the backward


def pass_sizes(w1: Tensor, k: Tensor, q: Tensor | None, skip: bool) -> dict[str, Any]:
    """Runtime and padded sizes; the residual needs d_out = d_in, the reads <= C rows."""
    heads, c, i = k.shape[1:]
    gh, o, m = w1.shape[1:]
    cq = 0 if q is None else q.shape[2]
    if skip and o != i:
        raise ValueError(f"memory_pass: a residual memory needs d_out = d_in, got {o} != {i}")
    if cq > c or gh % heads:
        raise ValueError(f"memory_pass: {cq} queries for {c} keys, {gh} stacked of {heads} heads")
    return {
        "H": heads, "GH": gh, "C": c, "CQ": cq, "I": i, "O": o, "M": m, "CP": pad_size(c),
        "IP": pad_size(i), "OP": pad_size(o), "BLOCK_M": min(64, pad_size(m)),
        "DOT": dot_precision(w1),
    }  # fmt: skip


def memory_pass_triton(
    w1: Tensor, w2: Tensor, k: Tensor, v: Tensor | None, q: Tensor | None,
    target: Tensor | None, scale: Tensor | None, residual: bool, dot: bool,
) -> tuple[Tensor, ...]:  # fmt: skip
    """``hope::memory_pass`` in one kernel launch."""
    sizes = pass_sizes(w1, k, q, scale is not None or residual)
    b, gh, o, m = w1.shape
    c = k.shape[2]
    kf = flat_heads(k)
    vf, qf = (kf if t is None else flat_heads(t) for t in (v, q))
    tgt = kf if target is None else flat_heads(target)
    sf = kf if scale is None else scale.to(w1.dtype).contiguous()
    outs = (
        w1.new_empty(b, gh, 0 if v is None else c, o), w1.new_empty(b, gh, sizes["CQ"], o),
        w1.new_empty(b, gh, c, o), w1.new_empty(b, gh, c, m), w1.new_empty(b, gh, c, m),
        w1.new_empty(b, gh, c, m), w1.new_empty(b, gh, c), w1.new_empty(b, gh, c),
        w1.new_empty(b, gh, c, c),
    )  # fmt: skip
    _memory_pass_fwd[(b * gh,)](
        flat_heads(w1), flat_heads(w2), kf, vf, qf, tgt, sf, *outs,
        HAS_V=v is not None, HAS_Q=q is not None, HAS_SCALE=scale is not None,
        RESIDUAL=residual, DOT_LOSS=dot, **sizes,
    )  # fmt: skip
    return outs


def memory_pass_backward_triton(
    saved: tuple[Tensor | None, ...],
    residual: bool,
    dot: bool,
    grads: tuple[Tensor | None, ...],
) -> tuple[Tensor | None, ...]:
    """``hope::memory_pass_backward`` in one kernel launch."""
    w1, w2, k, v, q, target, scale, err = saved
    assert w1 is not None and w2 is not None and k is not None and err is not None
    sizes = pass_sizes(w1, k, q, scale is not None or residual)
    kf = flat_heads(k)
    vf, qf = (kf if t is None else flat_heads(t) for t in (v, q))
    sf = kf if scale is None else scale.to(w1.dtype).contiguous()
    # every gradient dense per (sample, head) but the reads', read through its strides
    g_flat = [kf if g is None else g if j == 1 else flat_heads(g) for j, g in enumerate(grads)]
    read_strides = [0] * 4 if grads[1] is None else list(grads[1].stride())
    strided = dict(zip(_READ_STRIDES, read_strides, strict=True))
    outs = (
        w1.new_empty(w1.shape),
        w1.new_empty(w2.shape),
        w1.new_empty(k.shape),
        *(None if t is None else w1.new_empty(t.shape) for t in (v, q, target)),
    )
    flags = ("HAS_GVHAT", "HAS_GREAD", "HAS_GERR", "HAS_GACT", "HAS_GHID", "HAS_GPRE", "HAS_GCURV")
    _memory_pass_bwd[(k.shape[0] * k.shape[1],)](
        flat_heads(w1), flat_heads(w2), kf, vf, qf, sf, flat_heads(err), *g_flat,
        *(kf if t is None else t for t in outs), **strided,
        HAS_V=v is not None, HAS_Q=q is not None, HAS_SCALE=scale is not None,
        RESIDUAL=residual, DOT_LOSS=dot,
        **{f: g is not None for f, g in zip(flags, grads, strict=True)}, **sizes,
    )  # fmt: skip
    return outs
