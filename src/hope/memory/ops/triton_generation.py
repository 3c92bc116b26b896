"""Triton kernels of ``hope::smt_generation`` and its backward (``generation.py``): one
program per (sample, head) holding the chunk's T rows of every member; and the whole
generation of one head from the stacked memories (``head_generation``: their outputs on
x~ by hidden-block walks, then this epilogue in registers) for ``triton_step.py``.

Tested on a CPU with ``TRITON_INTERPRET=1`` against the PyTorch forms
(tests/test_fused_ops.py); scripts/gpu_check.sh runs the same parity on CUDA.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl
from torch import Tensor

from hope.memory.ops.pointwise import EPS
from hope.memory.ops.triton_kernels import load_strided, load_tile, store_tile
from hope.memory.ops.triton_pass import gelu


@triton.jit
def _unit(x, EPS: tl.constexpr):
    """Rows of x over their norms clamped at EPS (``F.normalize``), and the norms."""
    norm = tl.sqrt(tl.sum(x * x, 1))
    scale = tl.maximum(norm, EPS)
    return x / scale[:, None], norm, scale


@triton.jit
def _unit_backward(x, g, EPS: tl.constexpr):
    y, norm, scale = _unit(x, EPS)
    along = tl.where(norm >= EPS, tl.sum(y * g, 1), 0.0)
    return (g - y * along[:, None]) / scale[:, None]


@triton.jit
def _member(raw_ptr, b, j, h, H, G, T, O):
    return raw_ptr + ((b * G + j) * H + h) * T * O


@triton.jit
def _generation_fwd(raw_ptr, query_ptr, bias_ptr, k_ptr, v_ptr, q_ptr, eta_ptr, alpha_ptr,
                    H, G, T, O, eta_scale, HAS_QUERY: tl.constexpr, TP: tl.constexpr,
                    OP: tl.constexpr, EPS: tl.constexpr):  # fmt: skip
    head = tl.program_id(0).to(tl.int64)  # b * H + h
    b, h = head // H, head % H
    r, o = tl.arange(0, TP), tl.arange(0, OP)
    rows = head * T * O
    x = load_tile(_member(raw_ptr, b, 0, h, H, G, T, O), r, o, T, O, O)
    store_tile(k_ptr + rows, _unit(x, EPS)[0], r, o, T, O, O)
    x = load_tile(_member(raw_ptr, b, 1, h, H, G, T, O), r, o, T, O, O)
    store_tile(v_ptr + rows, _unit(x, EPS)[0], r, o, T, O, O)
    if HAS_QUERY:
        x = load_tile(query_ptr + rows, r, o, T, O, O)
    else:
        x = load_tile(_member(raw_ptr, b, 2, h, H, G, T, O), r, o, T, O, O)
    store_tile(q_ptr + rows, _unit(x, EPS)[0], r, o, T, O, O)
    live = r < T
    z = tl.load(_member(raw_ptr, b, G - 2, h, H, G, T, O) + r * O, mask=live, other=0.0)
    softplus = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
    tl.store(eta_ptr + head * T + r, eta_scale * softplus, mask=live)
    z = tl.load(_member(raw_ptr, b, G - 1, h, H, G, T, O) + r * O, mask=live, other=0.0)
    z += tl.load(bias_ptr + h)
    tl.store(alpha_ptr + head * T + r, 1.0 / (1.0 + tl.exp(-z)), mask=live)


@triton.jit
def _generation_bwd(raw_ptr, query_ptr, alpha_ptr, gk_ptr, gv_ptr, gq_ptr, geta_ptr, galpha_ptr,
                    draw_ptr, dquery_ptr, dbias_ptr, H, G, T, O, eta_scale,
                    HAS_QUERY: tl.constexpr, HAS_GK: tl.constexpr, HAS_GV: tl.constexpr,
                    HAS_GQ: tl.constexpr, HAS_GETA: tl.constexpr, HAS_GALPHA: tl.constexpr,
                    TP: tl.constexpr, OP: tl.constexpr, EPS: tl.constexpr):  # fmt: skip
    head = tl.program_id(0).to(tl.int64)
    b, h = head // H, head % H
    r, o = tl.arange(0, TP), tl.arange(0, OP)
    rows = head * T * O
    live = r < T
    zero = tl.zeros([TP, OP], dtype=draw_ptr.dtype.element_ty)
    d = zero
    if HAS_GK:
        x = load_tile(_member(raw_ptr, b, 0, h, H, G, T, O), r, o, T, O, O)
        d = _unit_backward(x, load_tile(gk_ptr + rows, r, o, T, O, O), EPS)
    store_tile(_member(draw_ptr, b, 0, h, H, G, T, O), d, r, o, T, O, O)
    d = zero
    if HAS_GV:
        x = load_tile(_member(raw_ptr, b, 1, h, H, G, T, O), r, o, T, O, O)
        d = _unit_backward(x, load_tile(gv_ptr + rows, r, o, T, O, O), EPS)
    store_tile(_member(draw_ptr, b, 1, h, H, G, T, O), d, r, o, T, O, O)
    d = zero
    if HAS_QUERY:
        if HAS_GQ:
            x = load_tile(query_ptr + rows, r, o, T, O, O)
            d = _unit_backward(x, load_tile(gq_ptr + rows, r, o, T, O, O), EPS)
        store_tile(dquery_ptr + rows, d, r, o, T, O, O)
    else:
        if HAS_GQ:
            x = load_tile(_member(raw_ptr, b, 2, h, H, G, T, O), r, o, T, O, O)
            d = _unit_backward(x, load_tile(gq_ptr + rows, r, o, T, O, O), EPS)
        store_tile(_member(draw_ptr, b, 2, h, H, G, T, O), d, r, o, T, O, O)
    first = o[None, :] == 0  # the scalar memories' output column
    d_eta = tl.zeros([TP], dtype=zero.dtype)
    if HAS_GETA:
        z = tl.load(_member(raw_ptr, b, G - 2, h, H, G, T, O) + r * O, mask=live, other=0.0)
        g = tl.load(geta_ptr + head * T + r, mask=live, other=0.0)
        d_eta = g * eta_scale / (1.0 + tl.exp(-z))
    store_tile(_member(draw_ptr, b, G - 2, h, H, G, T, O), tl.where(first, d_eta[:, None], 0.0),
               r, o, T, O, O)  # fmt: skip
    d_alpha = tl.zeros([TP], dtype=zero.dtype)
    if HAS_GALPHA:
        alpha = tl.load(alpha_ptr + head * T + r, mask=live, other=0.0)
        d_alpha = tl.load(galpha_ptr + head * T + r, mask=live, other=0.0) * alpha * (1.0 - alpha)
    store_tile(_member(draw_ptr, b, G - 1, h, H, G, T, O), tl.where(first, d_alpha[:, None], 0.0),
               r, o, T, O, O)  # fmt: skip
    tl.store(dbias_ptr + head, tl.sum(d_alpha, 0))


@triton.jit
def apply_rows(w1_ptr, w2_ptr, z, i, o, I, O, M, CP: tl.constexpr, OP: tl.constexpr,
           BLOCK_M: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """W1 gelu(W2 z) for rows z [CP, IP] (the skip is the caller's)."""
    out = tl.zeros([CP, OP], dtype=z.dtype)
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        pre = tl.dot(z, tl.trans(load_tile(w2_ptr, m, i, M, I, I)), input_precision=DOT)
        out += tl.dot(gelu(pre), tl.trans(load_tile(w1_ptr, o, m, O, M, M)), input_precision=DOT)
    return out


@triton.jit
def skip_of(scale_ptr, gh, HAS_SCALE: tl.constexpr, RESIDUAL: tl.constexpr):
    skip = 1.0 if RESIDUAL else 0.0
    if HAS_SCALE:
        skip = tl.load(scale_ptr + gh)
    return skip


@triton.jit
def raw_member(w1_ptr, w2_ptr, scale_ptr, x, b, g, h, H, GH, i, o, I, O, M, HAS_SCALE: tl.constexpr,
         RESIDUAL: tl.constexpr, CP: tl.constexpr, OP: tl.constexpr, BLOCK_M: tl.constexpr,
         DOT: tl.constexpr):  # fmt: skip
    """Generating member g's output M_g(x~) with its skip."""
    sh = b * GH + g * H + h
    out = apply_rows(
        w1_ptr + sh * O * M, w2_ptr + sh * M * I, x, i, o, I, O, M, CP, OP, BLOCK_M, DOT
    )
    return out + skip_of(scale_ptr, g * H + h, HAS_SCALE, RESIDUAL) * x


@triton.jit
def head_generation(w1_ptr, w2_ptr, x, query_ptr, bias_ptr, scale_ptr, b, h, head, t, i, o, live,
                H, GH, C, I, O, M, BIAS_STRIDE, Q_SC, Q_SD, eta_scale, HAS_QUERY: tl.constexpr,
                HAS_SCALE: tl.constexpr, RESIDUAL: tl.constexpr, CP: tl.constexpr,
                OP: tl.constexpr, BLOCK_M: tl.constexpr, EPS: tl.constexpr,
                DOT: tl.constexpr):  # fmt: skip
    """Eq. 83 for one head: the members' raw outputs (k, v, q or x W_q, eta's first
    column) and k, v, q, eta, alpha (padded tokens: eta 0, alpha 1). ``query_ptr``: this
    head's query rows x W_q, read through their strides Q_SC (tokens), Q_SD (features)."""
    raw_k = raw_member(w1_ptr, w2_ptr, scale_ptr, x, b, 0, h, H, GH, i, o, I, O, M, HAS_SCALE,
                 RESIDUAL, CP, OP, BLOCK_M, DOT)  # fmt: skip
    raw_v = raw_member(w1_ptr, w2_ptr, scale_ptr, x, b, 1, h, H, GH, i, o, I, O, M, HAS_SCALE,
                 RESIDUAL, CP, OP, BLOCK_M, DOT)  # fmt: skip
    if HAS_QUERY:
        raw_q = load_strided(query_ptr, t, i, C, I, Q_SC, Q_SD)
        first = 2
    else:
        raw_q = raw_member(w1_ptr, w2_ptr, scale_ptr, x, b, 2, h, H, GH, i, o, I, O, M, HAS_SCALE,
                     RESIDUAL, CP, OP, BLOCK_M, DOT)  # fmt: skip
        first = 3
    column = o[None, :] == 0  # the scalar memories' output
    out = raw_member(w1_ptr, w2_ptr, scale_ptr, x, b, first, h, H, GH, i, o, I, O, M, HAS_SCALE,
               RESIDUAL, CP, OP, BLOCK_M, DOT)  # fmt: skip
    raw_eta = tl.sum(tl.where(column, out, 0.0), 1)
    out = raw_member(w1_ptr, w2_ptr, scale_ptr, x, b, first + 1, h, H, GH, i, o, I, O, M, HAS_SCALE,
               RESIDUAL, CP, OP, BLOCK_M, DOT)  # fmt: skip
    raw_alpha = tl.sum(tl.where(column, out, 0.0), 1)
    softplus = tl.where(raw_eta > 20.0, raw_eta, tl.log(1.0 + tl.exp(tl.minimum(raw_eta, 20.0))))
    eta = tl.where(live, eta_scale * softplus, 0.0)
    alpha = 1.0 / (1.0 + tl.exp(-(raw_alpha + tl.load(bias_ptr + b * BIAS_STRIDE + h))))
    alpha = tl.where(live, alpha, 1.0)
    k, v, q = _unit(raw_k, EPS)[0], _unit(raw_v, EPS)[0], _unit(raw_q, EPS)[0]
    return raw_k, raw_v, raw_q, raw_eta, k, v, q, eta, alpha


def _sizes(raw: Tensor, heads: int) -> dict[str, Any]:
    _, gh, t, o = raw.shape
    pad = [max(16, triton.next_power_of_2(n)) for n in (t, o)]
    return {"H": heads, "G": gh // heads, "T": t, "O": o, "TP": pad[0], "OP": pad[1], "EPS": EPS}


def smt_generation_triton(
    raw: Tensor, query: Tensor | None, alpha_bias: Tensor, eta_scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``hope::smt_generation`` in one kernel launch."""
    heads = alpha_bias.shape[0]
    b, _, t, o = raw.shape
    raw = raw.contiguous()
    query_in = raw if query is None else query.contiguous()
    rows = [raw.new_empty(b, heads, t, o) for _ in range(3)]
    gates = [raw.new_empty(b, heads, t) for _ in range(2)]
    _generation_fwd[(b * heads,)](
        raw, query_in, alpha_bias.to(raw.dtype).contiguous(), *rows, *gates,
        eta_scale=eta_scale, HAS_QUERY=query is not None, **_sizes(raw, heads),
    )  # fmt: skip
    return rows[0], rows[1], rows[2], gates[0], gates[1]


def smt_generation_backward_triton(
    raw: Tensor, query: Tensor | None, alpha: Tensor, eta_scale: float, grads: list[Tensor | None]
) -> tuple[Tensor, Tensor | None, Tensor]:
    """``hope::smt_generation_backward`` in one kernel launch."""
    heads = alpha.shape[1]
    raw = raw.contiguous()
    query_in = raw if query is None else query.contiguous()
    flat = [raw if g is None else g.contiguous() for g in grads]
    d_raw = raw.new_empty(raw.shape)
    d_query = None if query is None else query.new_empty(query.shape)
    d_bias = raw.new_empty(alpha.shape[:2])
    flags = ("HAS_GK", "HAS_GV", "HAS_GQ", "HAS_GETA", "HAS_GALPHA")
    _generation_bwd[(alpha.shape[0] * heads,)](
        raw, query_in, alpha.contiguous(), *flat, d_raw,
        raw if d_query is None else d_query, d_bias, eta_scale=eta_scale,
        HAS_QUERY=query is not None, **_sizes(raw, heads),
        **{f: g is not None for f, g in zip(flags, grads, strict=True)},
    )  # fmt: skip
    return d_raw, d_query, d_bias
