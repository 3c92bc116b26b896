"""Triton kernels of ``hope::titans_heads`` and its backward (``titans_heads.py``): one
program per (sample, part-head), part = q, k or v, looping over blocks of tokens.

Forward: the W taps of the causal depthwise conv read SiLU(pre) (or the carried tail,
before the call's first token) at W shifted token blocks; q and k rows are
L2-normalised; the gate of the same (part, head) goes through its sigmoid; the
last program block writes the new tail.

Backward: per token block, the conv output's gradient dy (through the normalisation
for q and k) goes to a scratch buffer [B, T, 3d] and into the conv weight's per-sample
gradient; after a barrier, the same block of conv inputs (padded positions, tail
first) gathers w_j dy_{i-j} over the W taps, plus the new tail's gradient, and goes to
the tail's or (through SiLU') the pre-activations' gradient, the gates' beside it in
the projection's gradient [B, T, 3d + 3H]. The wrapper sums the
weight's per-sample gradients: one more launch, unless the weight came per sample
([B, 3d, W], e.g. expanded: the caller sums them). Compute in float32 (float64 for
float64 inputs).

Tested on a CPU with ``TRITON_INTERPRET=1`` (tests/test_fused_ops.py).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from hope.memory.ops.triton_kernels import compute_dtype

_EPS = tl.constexpr(1e-12)  # F.normalize's


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _conv_input(pre_b, tail_b, u, ch, live, d_live, PW, CW, W: tl.constexpr,
                ACC: tl.constexpr):  # fmt: skip
    """The conv's inputs [BT, DP] at tokens u (< 0: the tail's row W-1+u): SiLU(pre);
    pre's rows are PW apart (the projection's qkv columns), the tail's CW."""
    inside = (u >= 0)[:, None]
    mask = live[:, None] & d_live[None, :]
    x = tl.load(pre_b + u[:, None] * PW + ch[None, :], mask=mask & inside, other=0.0).to(ACC)
    past = tl.load(tail_b + (u + W - 1)[:, None] * CW + ch[None, :], mask=mask & ~inside,
                   other=0.0).to(ACC)  # fmt: skip
    return tl.where(inside, x * _sigmoid(x), past)


@triton.jit
def _conv(pre_b, tail_b, w_ptr, t, ch, live, d_live, PW, CW, W: tl.constexpr,
          BT: tl.constexpr, DP: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """The conv's outputs [BT, DP] at tokens t."""
    y = tl.zeros([BT, DP], dtype=ACC)
    for j in tl.static_range(W):
        w_j = tl.load(w_ptr + ch * W + j, mask=d_live, other=0.0).to(ACC)
        y += w_j[None, :] * _conv_input(
            pre_b, tail_b, t + j - (W - 1), ch, live, d_live, PW, CW, W, ACC
        )
    return y


@triton.jit
def _heads_fwd(pre_ptr, tail_ptr, w_ptr, q_ptr, k_ptr, v_ptr, theta_ptr, eta_ptr,
               alpha_ptr, new_tail_ptr, T, H, CW, PW, W_SB, DH: tl.constexpr, DP: tl.constexpr,
               W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)  # part * H + head: the channels c * DH + d of x W_qkv
    part, head = c // H, c % H
    d = tl.arange(0, DP)
    d_live = d < DH
    ch = c * DH + d
    pre_b, tail_b = pre_ptr + b * T * PW, tail_ptr + b * (W - 1) * CW
    w_ptr += b * W_SB  # the conv weight: shared (W_SB = 0) or per sample
    rows = (b * H + head) * T
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        live = t < T
        y = _conv(pre_b, tail_b, w_ptr, t, ch, live, d_live, PW, CW, W, BT, DP, ACC)
        if part < 2:
            y = y / tl.maximum(tl.sqrt(tl.sum(y * y, 1)), _EPS)[:, None]
        at = (rows + t)[:, None] * DH + d[None, :]
        mask = live[:, None] & d_live[None, :]
        gate = _sigmoid(tl.load(pre_b + t * PW + CW + c, mask=live).to(ACC))
        if part == 0:
            tl.store(q_ptr + at, y, mask=mask)
            tl.store(theta_ptr + rows + t, gate, mask=live)
        elif part == 1:
            tl.store(k_ptr + at, y, mask=mask)
            tl.store(eta_ptr + rows + t, gate, mask=live)
        else:
            tl.store(v_ptr + at, y, mask=mask)
            tl.store(alpha_ptr + rows + t, gate, mask=live)
    r = tl.arange(0, WP)
    r_live = r < W - 1
    x = _conv_input(pre_b, tail_b, T + r - (W - 1), ch, r_live, d_live, PW, CW, W, ACC)
    tl.store(new_tail_ptr + b * (W - 1) * CW + r[:, None] * CW + ch[None, :], x,
             mask=r_live[:, None] & d_live[None, :])  # fmt: skip


@triton.jit
def _grad_rows(ptr, s_b, s_h, s_t, s_d, b, head, t, d, live, d_live, ACC: tl.constexpr):
    at = ptr + b * s_b + head * s_h + t[:, None] * s_t + d[None, :] * s_d
    return tl.load(at, mask=live[:, None] & d_live[None, :], other=0.0).to(ACC)


@triton.jit
def _heads_bwd(pre_ptr, tail_ptr, w_ptr, gq_ptr, gk_ptr, gv_ptr, gth_ptr, geta_ptr, gal_ptr,
               gtail_ptr, dy_ptr, d_pre_ptr, d_tail_ptr, d_w_ptr, T, H, CW, PW, W_SB,
               sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
               sth_b, sth_h, sth_t, seta_b, seta_h, seta_t, sal_b, sal_h, sal_t,
               stl_b, stl_r, stl_c, HAS_Q: tl.constexpr, HAS_K: tl.constexpr,
               HAS_V: tl.constexpr, HAS_TH: tl.constexpr, HAS_ETA: tl.constexpr,
               HAS_AL: tl.constexpr, HAS_TAIL: tl.constexpr, DH: tl.constexpr,
               DP: tl.constexpr, W: tl.constexpr, WP2: tl.constexpr, BT: tl.constexpr,
               ACC: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    part, head = c // H, c % H
    d = tl.arange(0, DP)
    d_live = d < DH
    ch = c * DH + d
    pre_b, tail_b = pre_ptr + b * T * PW, tail_ptr + b * (W - 1) * CW
    d_pre_b, dy_b = d_pre_ptr + b * T * PW, dy_ptr + b * T * CW
    w_ptr += b * W_SB
    taps = tl.arange(0, WP2)
    d_w = tl.zeros([DP, WP2], dtype=ACC)
    for t0 in range(0, T + W - 1, BT):  # blocks of tokens, then of padded positions
        t = t0 + tl.arange(0, BT)
        live = t < T
        # 1. dy at tokens t: the normalisation's backward (q, k) or the gradient (v)
        g = tl.zeros([BT, DP], dtype=ACC)
        g_gate = tl.zeros([BT], dtype=ACC)
        t_gate = b * sth_b + head * sth_h + t * sth_t
        if part == 0:
            if HAS_Q:
                g = _grad_rows(gq_ptr, sq_b, sq_h, sq_t, sq_d, b, head, t, d, live, d_live, ACC)
            if HAS_TH:
                g_gate = tl.load(gth_ptr + t_gate, mask=live, other=0.0).to(ACC)
        elif part == 1:
            if HAS_K:
                g = _grad_rows(gk_ptr, sk_b, sk_h, sk_t, sk_d, b, head, t, d, live, d_live, ACC)
            if HAS_ETA:
                at = b * seta_b + head * seta_h + t * seta_t
                g_gate = tl.load(geta_ptr + at, mask=live, other=0.0).to(ACC)
        else:
            if HAS_V:
                g = _grad_rows(gv_ptr, sv_b, sv_h, sv_t, sv_d, b, head, t, d, live, d_live, ACC)
            if HAS_AL:
                at = b * sal_b + head * sal_h + t * sal_t
                g_gate = tl.load(gal_ptr + at, mask=live, other=0.0).to(ACC)
        dy = g
        if part < 2:
            y = _conv(pre_b, tail_b, w_ptr, t, ch, live, d_live, PW, CW, W, BT, DP, ACC)
            norm = tl.sqrt(tl.sum(y * y, 1))
            scale = tl.maximum(norm, _EPS)
            unit = y / scale[:, None]
            along = tl.where(norm >= _EPS, tl.sum(unit * g, 1), 0.0)
            dy = (g - unit * along[:, None]) / scale[:, None]
        tl.store(dy_b + t[:, None] * CW + ch[None, :], dy, mask=live[:, None] & d_live[None, :])
        for j in tl.static_range(W):
            x_j = _conv_input(pre_b, tail_b, t + j - (W - 1), ch, live, d_live, PW, CW, W, ACC)
            d_w += tl.where(taps[None, :] == j, tl.sum(dy * x_j, 0)[:, None], 0.0)
        gate_at = t * PW + CW + c  # the gates' columns follow the qkv ones
        gate = _sigmoid(tl.load(pre_b + gate_at, mask=live, other=0.0).to(ACC))
        tl.store(d_pre_b + gate_at, g_gate * gate * (1.0 - gate), mask=live)
        tl.debug_barrier()  # this block's dy, read below at shifted tokens
        # 2. the conv inputs' gradient at padded positions i = t (tail rows first)
        inside = t < T + W - 1
        d_x = tl.zeros([BT, DP], dtype=ACC)
        for j in tl.static_range(W):
            w_j = tl.load(w_ptr + ch * W + j, mask=d_live, other=0.0).to(ACC)
            u = t - j
            ok = (inside & (u >= 0) & (u < T))[:, None] & d_live[None, :]
            d_x += w_j[None, :] * tl.load(dy_b + u[:, None] * CW + ch[None, :], mask=ok, other=0.0)
        if HAS_TAIL:  # the new tail is the last W-1 padded positions
            r = t - T
            ok = (inside & (r >= 0))[:, None] & d_live[None, :]
            at = gtail_ptr + b * stl_b + r[:, None] * stl_r + ch[None, :] * stl_c
            d_x += tl.load(at, mask=ok, other=0.0).to(ACC)
        is_tail = (t < W - 1)[:, None]
        mask = inside[:, None] & d_live[None, :]
        tl.store(d_tail_ptr + b * (W - 1) * CW + t[:, None] * CW + ch[None, :], d_x,
                 mask=mask & is_tail)  # fmt: skip
        u = t - (W - 1)
        at = u[:, None] * PW + ch[None, :]
        x = tl.load(pre_b + at, mask=mask & ~is_tail, other=0.0).to(ACC)
        s = _sigmoid(x)
        tl.store(d_pre_b + at, d_x * s * (1.0 + x * (1.0 - s)), mask=mask & ~is_tail)
    at = d_w_ptr + b * CW * W + ch[:, None] * W + taps[None, :]
    tl.store(at, d_w, mask=d_live[:, None] & (taps < W)[None, :])


_BLOCK_TOKENS = 16  # tokens per loop step of a program


def _scratch_dtype(pre: Tensor) -> torch.dtype:
    """The scratch dy's dtype: the kernels' compute dtype (``compute_dtype``)."""
    return torch.float64 if pre.dtype == torch.float64 else torch.float32


def _constants(d_head: int, window: int, pre: Tensor) -> dict[str, Any]:
    return {"DH": d_head, "DP": triton.next_power_of_2(d_head), "W": window,
            "BT": _BLOCK_TOKENS, "ACC": compute_dtype(pre)}  # fmt: skip


def titans_heads_triton(
    projected: Tensor, tail: Tensor, weight: Tensor, heads: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``hope::titans_heads`` in one kernel launch."""
    batch, length, columns = projected.shape
    width = columns - 3 * heads
    d_head, window = width // (3 * heads), weight.shape[-1]
    projected, tail = projected.contiguous(), tail.contiguous()
    q, k, v = (projected.new_empty(batch, heads, length, d_head) for _ in range(3))
    theta, eta, alpha = (projected.new_empty(batch, heads, length) for _ in range(3))
    new_tail = projected.new_empty(tail.shape)
    weight, sample_stride = _conv_weight(weight)
    _heads_fwd[(batch, 3 * heads)](
        projected, tail, weight, q, k, v, theta, eta, alpha, new_tail, length, heads, width,
        columns, sample_stride, WP=max(2, triton.next_power_of_2(max(window - 1, 1))),
        **_constants(d_head, window, projected),
    )  # fmt: skip
    return q, k, v, theta, eta, alpha, new_tail


def titans_heads_backward_triton(
    inputs: tuple[Tensor, Tensor, Tensor], heads: int, grads: list[Tensor | None]
) -> tuple[Tensor, Tensor, Tensor]:
    """``hope::titans_heads_backward`` in one kernel launch, and the sum of the conv
    weight's per-sample gradients when the weight is shared ([3d, W], not [B, 3d, W])."""
    projected, tail = (t.contiguous() for t in inputs[:2])
    shared = inputs[2].dim() == 2
    weight, sample_stride = _conv_weight(inputs[2])
    batch, length, columns = projected.shape
    width = columns - 3 * heads
    d_head, window = width // (3 * heads), weight.shape[-1]
    given = [projected if g is None else g for g in grads]
    dy = torch.empty(batch, length, width, dtype=_scratch_dtype(projected), device=tail.device)
    d_projected, d_tail = torch.empty_like(projected), torch.empty_like(tail)
    d_w = torch.empty(batch, width, window, dtype=weight.dtype, device=tail.device)
    strides = [s for g in given[:3] for s in _strides(g, 4)]
    strides += [s for g in given[3:] for s in _strides(g, 3)]
    flags = {f"HAS_{n}": g is not None for n, g in zip(_NAMES, grads, strict=True)}
    _heads_bwd[(batch, 3 * heads)](
        projected, tail, weight, *given, dy, d_projected, d_tail, d_w, length, heads,
        width, columns, sample_stride, *strides, WP2=triton.next_power_of_2(window), **flags,
        **_constants(d_head, window, projected),
    )  # fmt: skip
    return d_projected, d_tail, d_w.sum(0) if shared else d_w


def _conv_weight(weight: Tensor) -> tuple[Tensor, int]:
    """The conv weight as the kernels read it ([3d, W] or per sample [B, 3d, W], each
    sample's dense) and its stride between samples (0: shared, or expanded)."""
    if weight.dim() == 2:
        return weight.contiguous(), 0
    if not weight[0].is_contiguous():
        weight = weight.contiguous()
    return weight, weight.stride(0)


_NAMES = ("Q", "K", "V", "TH", "ETA", "AL", "TAIL")


def _strides(t: Tensor, rank: int) -> list[int]:
    """The strides of a gradient of rank ``rank`` (0s for the placeholder of an absent one)."""
    return list(t.stride()) if t.dim() == rank else [0] * rank
