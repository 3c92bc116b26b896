"""Triton kernel of ``hope::rotary`` (``rotary.py``): one program per block of rows
(b, h, t) of x [B, H, T, D], read through x's four strides, both halves of a row in it;
the angles' tables cos, sin [T, D/2] dense; the result dense."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

ROWS = 16


@triton.jit
def _rotary(x_ptr, cos_ptr, sin_ptr, out_ptr, R, H, T, HALF, SB, SH, ST, SD,
            HP: tl.constexpr, ROWS: tl.constexpr, INVERSE: tl.constexpr):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, HP)
    live = (r[:, None] < R) & (c[None, :] < HALF)
    t = r % T
    h = (r // T) % H
    b = r // (T * H)
    base = b * SB + h * SH + t * ST
    x1 = tl.load(x_ptr + base[:, None] + c[None, :] * SD, mask=live, other=0.0)
    x2 = tl.load(x_ptr + base[:, None] + (c[None, :] + HALF) * SD, mask=live, other=0.0)
    angle = t[:, None] * HALF + c[None, :]
    cos = tl.load(cos_ptr + angle, mask=live, other=0.0).to(x1.dtype)
    sin = tl.load(sin_ptr + angle, mask=live, other=0.0).to(x1.dtype)
    if INVERSE:
        sin = -sin
    out = r[:, None] * (2 * HALF) + c[None, :]
    tl.store(out_ptr + out, x1 * cos - x2 * sin, mask=live)
    tl.store(out_ptr + out + HALF, x2 * cos + x1 * sin, mask=live)


def rotary_triton(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    """``hope::rotary`` in one kernel launch."""
    batch, heads, length, dim = x.shape
    out = torch.empty((batch, heads, length, dim), dtype=x.dtype, device=x.device)
    rows = batch * heads * length
    _rotary[(triton.cdiv(rows, ROWS),)](
        x, cos.contiguous(), sin.contiguous(), out, rows, heads, length, dim // 2,
        *x.stride(), HP=triton.next_power_of_2(dim // 2), ROWS=ROWS, INVERSE=inverse,
    )  # fmt: skip
    return out
