"""Triton kernel of ``hope::rms_norm`` and its backward (``rms_norm.py``): one program
per block of rows, a whole row in it. The backward writes each block's share of the
weight's gradient, summed by one more launch (deterministic: no atomics)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from hope.memory.ops.triton_kernels import load_tile, store_tile

ROWS = 16


@triton.jit
def _rms_norm(x_ptr, w_ptr, g_ptr, out_ptr, dw_ptr, R, D, eps, DP: tl.constexpr,
              ROWS: tl.constexpr, UPCAST: tl.constexpr, BACKWARD: tl.constexpr):  # fmt: skip
    block = tl.program_id(0)
    r = block * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, DP)
    x = load_tile(x_ptr, r, c, R, D, D)
    if UPCAST:  # half precision in, fp32 arithmetic (as the PyTorch form)
        x = x.to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(x.dtype)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    normed = x * rstd[:, None]
    if BACKWARD:  # dx = r (u - x̂ mean(u x̂)), u = g w; this block's rows of dw = Σ g x̂
        g = load_tile(g_ptr, r, c, R, D, D).to(x.dtype)
        u = g * w[None, :]
        along = tl.sum(u * normed, 1) / D
        store_tile(out_ptr, rstd[:, None] * (u - normed * along[:, None]), r, c, R, D, D)
        tl.store(dw_ptr + block * D + c, tl.sum(g * normed, 0), mask=c < D)
    else:
        store_tile(out_ptr, normed * w[None, :], r, c, R, D, D)


def _launch(x: Tensor, weight: Tensor, grad: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    d = x.shape[-1]
    rows = x.reshape(-1, d).contiguous()
    g = rows if grad is None else grad.reshape(-1, d).contiguous()
    out = torch.empty_like(rows)
    upcast = x.dtype in (torch.float16, torch.bfloat16)
    blocks = triton.cdiv(rows.shape[0], ROWS)
    work = torch.float32 if upcast else x.dtype
    partial = torch.empty(blocks if grad is not None else 0, d, device=x.device, dtype=work)
    _rms_norm[(blocks,)](
        rows, weight.contiguous(), g, out, partial, rows.shape[0], d, eps,
        DP=triton.next_power_of_2(d), ROWS=ROWS, UPCAST=upcast, BACKWARD=grad is not None,
    )  # fmt: skip
    return out.view_as(x), partial


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``hope::rms_norm`` in one kernel launch."""
    return _launch(x, weight, None, eps)[0]


def rms_norm_backward_triton(
    x: Tensor, weight: Tensor, grad: Tensor, eps: float, weight_grad: bool = True
) -> tuple[Tensor, Tensor]:
    """``hope::rms_norm_backward``: the kernel, then its blocks' weight gradients summed
    (skipped without ``weight_grad``)."""
    dx, partial = _launch(x, weight, grad, eps)
    if not weight_grad:
        return dx, weight.new_empty(0)
    return dx, partial.sum(0).to(weight.dtype)
