"""Triton kernels of ``hope::segment_attention`` and its backward
(``segment_attention.py``): one program per (sample, head), the whole segment in
registers (S and D padded to powers of two >= 16, ``tl.dot``'s smallest tile). The
scores with the memory tokens h and with the segment's tokens x are two S x S tiles
under the same causal mask (query i sees j <= i), P's scores a third tile; one
softmax over the three. Every argument is read through its strides (q, k and v are
slices of the call's projections, h's keys and values columns of their projection
h W_kv [B, S, 2d]), and y is written token-major [B, S, H, D], so the output projection
needs no copy. h's keys are rotated on load: the tile at the columns d and at their
partners d +- D/2 (the rotary pairs), cos and sin per token.

The backward recomputes the probabilities and y, then dscores = probs (dy V^T -
<dy, y>); h's keys' gradient dscores^T q is rotated back with a second product
dscores^T q' (q's partner columns), and h's keys' and values' gradients are written
into one [B, S, 2d] gradient of their projection. P's values' gradient is written per
sample, and summed by the wrapper (one more launch) when P's values came as [1, ...]
rather than per sample (expanded over the batch: the caller sums them). fp32 products
use IEEE precision (no TF32); float64 runs in float64.

Tested on a CPU with ``TRITON_INTERPRET=1`` (tests/test_fused_ops.py).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from hope.memory.ops.triton_kernels import compute_dtype, dot_precision


@triton.jit
def _tile(ptr, s_b, s_h, s_r, s_c, b, h, rows, cols, n_rows, n_cols, ACC: tl.constexpr):
    """The [R, C] tile (rows, cols) of a [B, H, n_rows, n_cols] tensor (zeros outside)."""
    at = ptr + b * s_b + h * s_h + rows[:, None] * s_r + cols[None, :] * s_c
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return tl.load(at, mask=mask, other=0.0).to(ACC)


@triton.jit
def _partners(d, D):
    """The rotary partner column of each head column d (d + D/2 in the first half,
    d - D/2 in the second; D, outside, for the padding) and the sign of its sine term."""
    half = D // 2
    first = d < half
    partner = tl.where(d < D, tl.where(first, d + half, d - half), D)
    return partner, tl.where(first, -1.0, 1.0), tl.where(first, d, d - half)


@triton.jit
def _angle(ptr, s_s, s_c, s, d, S, D, ACC: tl.constexpr):
    """cos or sin [SP, DP] (of a [S, D/2] table) at each (token, head column): its pair's."""
    _, _, j = _partners(d, D)
    mask = (s < S)[:, None] & (d < D)[None, :]
    return tl.load(ptr + s[:, None] * s_s + j[None, :] * s_c, mask=mask, other=0.0).to(ACC)


@triton.jit
def _probabilities(q, k_mem, k_seg, p_scores, s, S, n_p, pc, HAS_P: tl.constexpr,
                   DOT: tl.constexpr):  # fmt: skip
    """The softmax over [P || h || x] as three tiles (P's, h's, x's) [SP, *]."""
    seen = (s[None, :] <= s[:, None]) & (s[None, :] < S)
    scores_m = tl.where(seen, tl.dot(q, tl.trans(k_mem), input_precision=DOT), float("-inf"))
    scores_s = tl.where(seen, tl.dot(q, tl.trans(k_seg), input_precision=DOT), float("-inf"))
    top = tl.maximum(tl.max(scores_m, 1), tl.max(scores_s, 1))
    if HAS_P:
        scores_p = tl.where((pc < n_p)[None, :], p_scores, float("-inf"))
        top = tl.maximum(top, tl.max(scores_p, 1))
    e_m = tl.exp(scores_m - top[:, None])
    e_s = tl.exp(scores_s - top[:, None])
    total = tl.sum(e_m, 1) + tl.sum(e_s, 1)
    e_p = tl.zeros_like(p_scores)
    if HAS_P:
        e_p = tl.exp(scores_p - top[:, None])
        total += tl.sum(e_p, 1)
    return e_p / total[:, None], e_m / total[:, None], e_s / total[:, None]


@triton.jit
def _segment_attention(q_ptr, kv_ptr, cos_ptr, sin_ptr, ks_ptr, vs_ptr, ps_ptr, pv_ptr, g_ptr,
                       y_ptr, dq_ptr, dkv_ptr, dks_ptr, dvs_ptr, dps_ptr, dpv_ptr,
                       S, D, n_p, H,
                       q_b, q_h, q_s, q_d, kv_b, kv_s, kv_c, c_s, c_c, c2_s, c2_c,
                       ks_b, ks_h, ks_s, ks_d, vs_b, vs_h, vs_s, vs_d, ps_b, ps_h, ps_s, ps_p,
                       pv_b, pv_h, pv_p, pv_d, g_b, g_s, g_h, g_d,
                       SP: tl.constexpr, DP: tl.constexpr, PP: tl.constexpr,
                       HAS_P: tl.constexpr, BACKWARD: tl.constexpr, DOT: tl.constexpr,
                       ACC: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    s, d, pc = tl.arange(0, SP), tl.arange(0, DP), tl.arange(0, PP)
    q = _tile(q_ptr, q_b, q_h, q_s, q_d, b, h, s, d, S, D, ACC)
    # h's keys (columns h D + d of the projection) rotated, its values (H D + h D + d)
    partner, sign, _ = _partners(d, D)
    cos = _angle(cos_ptr, c_s, c_c, s, d, S, D, ACC)
    sin = _angle(sin_ptr, c2_s, c2_c, s, d, S, D, ACC)
    k_raw = _tile(kv_ptr, kv_b, D * kv_c, kv_s, kv_c, b, h, s, d, S, D, ACC)
    k_pair = _tile(kv_ptr, kv_b, D * kv_c, kv_s, kv_c, b, h, s, partner, S, D, ACC)
    k_mem = k_raw * cos + sign[None, :] * k_pair * sin
    v_mem = _tile(kv_ptr + H * D * kv_c, kv_b, D * kv_c, kv_s, kv_c, b, h, s, d, S, D, ACC)
    k_seg = _tile(ks_ptr, ks_b, ks_h, ks_s, ks_d, b, h, s, d, S, D, ACC)
    v_seg = _tile(vs_ptr, vs_b, vs_h, vs_s, vs_d, b, h, s, d, S, D, ACC)
    p_scores = tl.zeros([SP, PP], dtype=ACC)
    p_values = tl.zeros([PP, DP], dtype=ACC)
    if HAS_P:
        p_scores = _tile(ps_ptr, ps_b, ps_h, ps_s, ps_p, b, h, s, pc, S, n_p, ACC)
        p_values = _tile(pv_ptr, pv_b, pv_h, pv_p, pv_d, b, h, pc, d, n_p, D, ACC)
    probs_p, probs_m, probs_s = _probabilities(q, k_mem, k_seg, p_scores, s, S, n_p, pc,
                                               HAS_P, DOT)  # fmt: skip
    y = tl.dot(probs_m, v_mem, input_precision=DOT) + tl.dot(probs_s, v_seg, input_precision=DOT)
    if HAS_P:
        y += tl.dot(probs_p, p_values, input_precision=DOT)
    live = (s < S)[:, None] & (d < D)[None, :]
    dense = ((b * S + s[:, None]) * H + h) * D + d[None, :]  # [B, S, H, D]
    if not BACKWARD:
        tl.store(y_ptr + dense, y, mask=live)
    else:
        dy = tl.load(g_ptr + b * g_b + s[:, None] * g_s + h * g_h + d[None, :] * g_d,
                     mask=live, other=0.0).to(ACC)  # fmt: skip
        along = tl.sum(dy * y, 1)[:, None]
        ds_m = probs_m * (tl.dot(dy, tl.trans(v_mem), input_precision=DOT) - along)
        ds_s = probs_s * (tl.dot(dy, tl.trans(v_seg), input_precision=DOT) - along)
        d_q = tl.dot(ds_m, k_mem, input_precision=DOT) + tl.dot(ds_s, k_seg, input_precision=DOT)
        heads = (bh * S + s[:, None]) * D + d[None, :]  # [B, H, S, D]
        tl.store(dq_ptr + heads, d_q, mask=live)
        # the rotated keys' gradient g at d and (from q's partner columns) at partner(d):
        # the keys' is g cos - sign g' sin, the rotation by the opposite angles
        q_pair = _tile(q_ptr, q_b, q_h, q_s, q_d, b, h, s, partner, S, D, ACC)
        g_rot = tl.dot(tl.trans(ds_m), q, input_precision=DOT)
        g_pair = tl.dot(tl.trans(ds_m), q_pair, input_precision=DOT)
        d_k_mem = g_rot * cos - sign[None, :] * g_pair * sin
        row = (b * S + s[:, None]) * (2 * H * D) + h * D + d[None, :]  # [B, S, 2d]
        tl.store(dkv_ptr + row, d_k_mem, mask=live)
        tl.store(dkv_ptr + H * D + row, tl.dot(tl.trans(probs_m), dy, input_precision=DOT),
                 mask=live)  # fmt: skip
        tl.store(dks_ptr + heads, tl.dot(tl.trans(ds_s), q, input_precision=DOT), mask=live)
        tl.store(dvs_ptr + heads, tl.dot(tl.trans(probs_s), dy, input_precision=DOT), mask=live)
        if HAS_P:
            ds_p = probs_p * (tl.dot(dy, tl.trans(p_values), input_precision=DOT) - along)
            at = (bh * S + s[:, None]) * n_p + pc[None, :]
            tl.store(dps_ptr + at, ds_p, mask=(s < S)[:, None] & (pc < n_p)[None, :])
            d_pv = tl.dot(tl.trans(probs_p), dy, input_precision=DOT)
            at = (bh * n_p + pc[:, None]) * D + d[None, :]
            tl.store(dpv_ptr + at, d_pv, mask=(pc < n_p)[:, None] & (d < D)[None, :])


def _launch(inputs: tuple[Tensor | None, ...], grad: Tensor | None) -> tuple[Tensor | None, ...]:
    q, kv_mem, cos, sin, k_seg, v_seg, p_scores, p_values = inputs
    assert q is not None and kv_mem is not None and cos is not None and sin is not None
    assert k_seg is not None and v_seg is not None
    batch, heads, length, dim = q.shape
    if dim % 2 or kv_mem.shape[-1] != 2 * heads * dim:
        raise ValueError(f"segment_attention: kv_mem {tuple(kv_mem.shape)} for {heads} x {dim}")
    n_p = 0 if p_scores is None else p_scores.shape[-1]
    y = q.new_empty(batch, length, heads, dim) if grad is None else q
    outs: list[Tensor] = [y]
    if grad is not None:
        outs = [q.new_empty(q.shape), kv_mem.new_empty(kv_mem.shape),
                k_seg.new_empty(q.shape), v_seg.new_empty(q.shape)]  # fmt: skip
        if p_scores is not None and p_values is not None:
            outs += [p_scores.new_empty(batch, heads, length, n_p),
                     p_values.new_empty(batch, heads, n_p, dim)]  # fmt: skip
    slots = outs + [q] * (6 - len(outs))
    ps = q if p_scores is None else p_scores
    pv = q[:1] if p_values is None else p_values
    g = q.transpose(1, 2) if grad is None else grad
    strides = list(q.stride()) + list(kv_mem.stride()) + list(cos.stride()) + list(sin.stride())
    strides += [s for t in (k_seg, v_seg, ps) for s in t.stride()]
    pv_batch = 0 if pv.shape[0] == 1 else pv.stride(0)  # P's values, shared or per sample
    strides += [pv_batch, *pv.stride()[1:], *g.stride()]
    _segment_attention[(batch * heads,)](
        q, kv_mem, cos, sin, k_seg, v_seg, ps, pv, g, y, *slots, length, dim, n_p, heads,
        *strides,
        SP=max(16, triton.next_power_of_2(length)), DP=max(16, triton.next_power_of_2(dim)),
        PP=max(16, triton.next_power_of_2(max(n_p, 1))), HAS_P=n_p > 0,
        BACKWARD=grad is not None, DOT=dot_precision(q),
        ACC=compute_dtype(q),
    )  # fmt: skip
    if grad is None:
        return (y,)
    if len(outs) == 4:
        return (*outs, None, None)
    assert p_values is not None
    # per sample when P's values came per sample (expanded: the caller sums them)
    d_pv = outs[5] if p_values.shape[0] == batch else outs[5].sum(0, keepdim=True)
    return (*outs[:4], outs[4], d_pv)


def segment_attention_triton(
    q: Tensor,
    kv_mem: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_seg: Tensor,
    v_seg: Tensor,
    p_scores: Tensor | None,
    p_values: Tensor | None,
) -> Tensor:
    """``hope::segment_attention`` in one kernel launch."""
    (y,) = _launch((q, kv_mem, cos, sin, k_seg, v_seg, p_scores, p_values), None)
    assert y is not None
    return y


def segment_attention_backward_triton(
    inputs: tuple[Tensor | None, ...], grad: Tensor
) -> tuple[Tensor | None, ...]:
    """``hope::segment_attention_backward`` in one kernel launch, and the sum of P's
    values' per-sample gradients when P is given."""
    return _launch(inputs, grad)
