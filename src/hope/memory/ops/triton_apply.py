"""Triton kernels of ``hope::memory_apply`` and its backward (``memory_apply.py``): one
program per applied member forward; backward one per (sample, head) looping over every
stacked member, so z's gradient is summed in registers and the members not applied
get zero gradients. z and the output's gradient are read through their strides (a
chunk of a call's queries, a token-major output's gradient), and the output is written
with the strides of the layout asked for. Padding and precision as in
``triton_pass.py``; tested on a CPU with ``TRITON_INTERPRET=1`` against the reference
forms (tests/test_fused_ops.py).
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
from hope.memory.ops.triton_pass import gelu, pad_size, rows_backward


@triton.jit
def _memory_apply_fwd(w1_ptr, w2_ptr, z_ptr, scale_ptr, out_ptr, H, GH, FIRST, COUNT, T, I, O, M,
                      sz_b, sz_h, sz_t, sz_i, so_b, so_h, so_t,
                      HAS_SCALE: tl.constexpr, RESIDUAL: tl.constexpr, TP: tl.constexpr,
                      IP: tl.constexpr, OP: tl.constexpr, BLOCK_M: tl.constexpr,
                      DOT: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # b * COUNT * H + j
    b, j = pid // (COUNT * H), pid % (COUNT * H)
    gh = FIRST * H + j
    sh = b * GH + gh
    r, i, o = tl.arange(0, TP), tl.arange(0, IP), tl.arange(0, OP)
    z = load_strided(z_ptr + b * sz_b + (j % H) * sz_h, r, i, T, I, sz_t, sz_i)
    out = tl.zeros([TP, OP], dtype=z.dtype)
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        pre = tl.dot(
            z, tl.trans(load_tile(w2_ptr + sh * M * I, m, i, M, I, I)), input_precision=DOT
        )
        w1 = load_tile(w1_ptr + sh * O * M, o, m, O, M, M)
        out += tl.dot(gelu(pre), tl.trans(w1), input_precision=DOT)
    if HAS_SCALE or RESIDUAL:  # O == I
        skip = 1.0
        if HAS_SCALE:
            skip = tl.load(scale_ptr + gh)
        out += skip * z
    store_tile(out_ptr + b * so_b + j * so_h, out, r, o, T, O, so_t)


@triton.jit
def _memory_apply_bwd(w1_ptr, w2_ptr, z_ptr, scale_ptr, g_ptr, dw1_ptr, dw2_ptr, dz_ptr,
                      H, GH, FIRST, COUNT, T, I, O, M, sz_b, sz_h, sz_t, sz_i,
                      sg_b, sg_h, sg_t, sg_o,
                      HAS_SCALE: tl.constexpr, RESIDUAL: tl.constexpr, TP: tl.constexpr,
                      IP: tl.constexpr, OP: tl.constexpr, BLOCK_M: tl.constexpr,
                      DOT: tl.constexpr):  # fmt: skip
    head = tl.program_id(0).to(tl.int64)  # b * H + h; every stacked member of it
    b, h = head // H, head % H
    r, i, o = tl.arange(0, TP), tl.arange(0, IP), tl.arange(0, OP)
    z = load_strided(z_ptr + b * sz_b + h * sz_h, r, i, T, I, sz_t, sz_i)
    d_z = tl.zeros([TP, IP], dtype=z.dtype)
    for g in range(0, GH // H):
        sh = b * GH + g * H + h
        chosen = (g >= FIRST) & (g < FIRST + COUNT)
        rows = tl.where(chosen, T, 0)  # a member not applied gets zero gradients
        member = b * sg_b + ((g - FIRST) * H + h) * sg_h
        grad = load_strided(g_ptr + member, r, o, rows, O, sg_t, sg_o)
        for m0 in range(0, M, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            w2 = load_tile(w2_ptr + sh * M * I, m, i, M, I, I)
            w1 = load_tile(w1_ptr + sh * O * M, o, m, O, M, M)
            d_w1, d_w2, share = rows_backward(z, grad, w1, w2, DOT)
            d_z += share
            store_tile(dw1_ptr + sh * O * M, d_w1, o, m, O, M, M)
            store_tile(dw2_ptr + sh * M * I, d_w2, m, i, M, I, I)
        if HAS_SCALE or RESIDUAL:  # O == I
            skip = 1.0
            if HAS_SCALE:
                skip = tl.load(scale_ptr + g * H + h)
            d_z += skip * grad
    store_tile(dz_ptr + head * T * I, d_z, r, i, T, I, I)


def _apply_sizes(w1: Tensor, z: Tensor, skip: bool, first: int, count: int) -> dict[str, Any]:
    heads, t, i = z.shape[1:]
    gh, o, m = w1.shape[1:]
    if skip and o != i:
        raise ValueError(f"memory_apply: a residual memory needs d_out = d_in, got {o} != {i}")
    if gh % heads or not 0 <= first < first + count <= gh // heads:
        raise ValueError(f"memory_apply: members {first}..{first + count} of {gh // heads}")
    return {
        "H": heads, "GH": gh, "FIRST": first, "COUNT": count, "T": t, "I": i, "O": o, "M": m,
        "TP": pad_size(t), "IP": pad_size(i), "OP": pad_size(o),
        "BLOCK_M": min(64, pad_size(m)), "DOT": dot_precision(w1),
    }  # fmt: skip


def _strides(prefix: str, axes: str, t: Tensor) -> dict[str, int]:
    """The kernel's stride arguments ``{prefix}_{axis}`` of t's leading len(axes) axes."""
    return {f"{prefix}_{axis}": t.stride(n) for n, axis in enumerate(axes)}


def memory_apply_triton(
    w1: Tensor, w2: Tensor, z: Tensor, scale: Tensor | None, residual: bool, first: int,
    count: int, token_major: bool = False,
) -> Tensor:  # fmt: skip
    """``hope::memory_apply`` in one kernel launch."""
    sizes = _apply_sizes(w1, z, scale is not None or residual, first, count)
    b, heads, t, _ = z.shape
    out = w1.new_empty(b, count * heads, t, w1.shape[-2])
    if token_major:  # [B, count*H, T, O] over a [B, T, count*H, O] buffer
        out = w1.new_empty(b, t, count * heads, w1.shape[-2]).transpose(1, 2)
    _memory_apply_fwd[(b * count * heads,)](
        flat_heads(w1), flat_heads(w2), z, z if scale is None else scale.to(w1.dtype), out,
        **_strides("sz", "bhti", z), **_strides("so", "bht", out), HAS_SCALE=scale is not None,
        RESIDUAL=residual, **sizes,
    )  # fmt: skip
    return out


def memory_apply_backward_triton(
    w1: Tensor, w2: Tensor, z: Tensor, scale: Tensor | None, residual: bool, first: int,
    count: int, grad: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``hope::memory_apply_backward`` in one kernel launch."""
    sizes = _apply_sizes(w1, z, scale is not None or residual, first, count)
    outs = (w1.new_empty(w1.shape), w1.new_empty(w2.shape), z.new_empty(z.shape))
    _memory_apply_bwd[(z.shape[0] * z.shape[1],)](
        flat_heads(w1), flat_heads(w2), z, z if scale is None else scale.to(w1.dtype),
        grad, *outs, **_strides("sz", "bhti", z), **_strides("sg", "bhto", grad),
        HAS_SCALE=scale is not None, RESIDUAL=residual, **sizes,
    )  # fmt: skip
    return outs
