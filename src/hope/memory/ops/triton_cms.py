"""Triton kernel of ``hope::cms_factor_scan`` (``cms_factor_scan.py``): one program per
(sample, block of BLOCK_H hidden units) walks the fired chunks in order; per chunk,
blocks of BLOCK_R of its rows take the earlier chunks' factors in blocks of BLOCK_S
source tokens. A program rereads the factors it stored for earlier chunks, so a
barrier closes each chunk. fp32 products in IEEE precision; tested on a CPU with
``TRITON_INTERPRET=1`` against the reference (tests/test_fused_ops.py).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from hope.memory.ops.triton_kernels import compute_dtype, dot_precision, load_tile, store_tile
from hope.memory.ops.triton_pass import gelu, pad_size, slope_of


@triton.jit
def _scores_times(scores_ptr, rows, factor_ptr, hb, before, F, HID, BLOCK_R: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, DOT: tl.constexpr,
                  ACC: tl.constexpr):  # fmt: skip
    """Σ_{s < before} scores[rows, s] factor[s, hb] -> [BLOCK_R, BLOCK_H]."""
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=ACC)
    for s0 in range(0, before, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        mask = (rows[:, None] >= 0) & (s[None, :] < before)
        scores = tl.load(scores_ptr + rows[:, None] * F + s[None, :], mask=mask, other=0.0)
        scores = scores.to(ACC)
        factor = load_tile(factor_ptr, s, hb, before, HID, HID).to(ACC)
        acc += tl.dot(scores, factor, input_precision=DOT)
    return acc


@triton.jit
def _cms_scan(pre0_ptr, back0_ptr, ks_ptr, ts_ptr, hidden_ptr, back_ptr, ROWS, F, HID, CHUNK,
              BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
              DOT: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pre0_ptr += b * ROWS * HID
    back0_ptr += b * ROWS * HID
    ks_ptr += b * ROWS * F
    ts_ptr += b * ROWS * F
    hidden_ptr += b * F * HID
    back_ptr += b * F * HID
    for start in range(0, F, CHUNK):
        for r0 in range(0, CHUNK, BLOCK_R):
            rows = start + r0 + tl.arange(0, BLOCK_R)
            end = tl.minimum(start + CHUNK, F)
            pre = load_tile(pre0_ptr, rows, hb, end, HID, HID).to(ACC)
            pre += _scores_times(ks_ptr, tl.where(rows < end, rows, 0), back_ptr, hb, start, F,
                                 HID, BLOCK_R, BLOCK_H, BLOCK_S, DOT, ACC)  # fmt: skip
            store_tile(hidden_ptr, gelu(pre), rows, hb, end, HID, HID)
            signal = load_tile(back0_ptr, rows, hb, end, HID, HID).to(ACC)
            signal += _scores_times(ts_ptr, tl.where(rows < end, rows, 0), hidden_ptr, hb, start,
                                    F, HID, BLOCK_R, BLOCK_H, BLOCK_S, DOT, ACC)  # fmt: skip
            store_tile(back_ptr, signal * slope_of(pre), rows, hb, end, HID, HID)
        tl.debug_barrier()  # the next chunk reads these rows' factors


def cms_factor_scan_triton(
    pre_0: Tensor, back_0: Tensor, key_scores: Tensor, teach_scores: Tensor, chunk: int
) -> tuple[Tensor, Tensor]:
    """``hope::cms_factor_scan`` in one kernel launch."""
    batch, rows, hid = pre_0.shape
    fired = key_scores.shape[-1]
    hidden = pre_0.new_empty(batch, fired, hid)
    back = pre_0.new_empty(batch, fired, hid)
    block_h = min(64, pad_size(hid))
    grid = (batch, triton.cdiv(hid, block_h))
    _cms_scan[grid](
        pre_0.contiguous(), back_0.contiguous(), key_scores.contiguous(),
        teach_scores.contiguous(), hidden, back, rows, fired, hid, chunk,
        BLOCK_R=min(32, pad_size(chunk)), BLOCK_H=block_h, BLOCK_S=32, DOT=dot_precision(pre_0),
        ACC=compute_dtype(pre_0),  # bf16 activations under autocast: erf/exp take fp32
    )  # fmt: skip
    return hidden, back
