"""Triton kernels of ``hope::smt_walk`` and its backward (``smt_walk.py``): one program
per (sample, head) walking every chunk of the run through ``hope::smt_step``'s kernel
bodies (``triton_step.py``), one launch each way.

States between chunks live in slot buffers [S, ...] with the stack's and M_mem's
flat layouts: chunk c reads slot c mod S (the walk's inputs for c = 0) and writes
slot c + 1 mod S (the walk's outputs for the last chunk), a barrier between chunks
(each thread of the program stored part of what the next chunk reads). The forward
keeps two slots, or every chunk's input state and rows (S = N) when asked to keep
them for backward; the backward walks forward again keeping them unless they were
kept, then walks back through the chunk step's backward body, whose output gradients
of chunk c are the input gradients chunk c + 1 stored: two slots again, the last
chunk's filled first with the walk's output gradients (zeros where none), zeroed
again after each piece cut. Tested on a CPU with ``TRITON_INTERPRET=1`` against
``smt_walk_reference`` and its backward.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl
from torch import Tensor

from hope.memory.ops.triton_pass import pad_size
from hope.memory.ops.triton_step import _flat, _sizes, _smt_step_bwd, _smt_step_fwd, _strides


@triton.jit
def _walk(w1_ptr, w2_ptr, x_ptr, query_ptr, r1_ptr, r2_ptr, bias_ptr, scale_ptr,
          w1_out, w2_out, inc1_out, inc2_out, read_out, m1_out, m2_out, mi1_out, mi2_out,
          bias_out, s_w1, s_w2, s_r1, s_r2, s_rows, s_gates, N, SLOTS,
          W1_N, W2_N, R1_N, R2_N, ROWS_N, GATES_N,
          H, GH, C, I, O, M, BIAS_STRIDE, X_SB, X_SH, X_SC, X_SD, Q_SB, Q_SH, Q_SC, Q_SD,
          eta_scale, PERIOD, FLUSH_AT, HAS_QUERY: tl.constexpr,
          OWN_READ: tl.constexpr, HAS_SCALE: tl.constexpr, RESIDUAL: tl.constexpr,
          DOT_LOSS: tl.constexpr, CP: tl.constexpr, CMP: tl.constexpr, IP: tl.constexpr,
          OP: tl.constexpr, BLOCK_M: tl.constexpr, SQUARINGS: tl.constexpr,
          MSQUARINGS: tl.constexpr, EPS: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """The N chunk steps, chunk c's input state in slot c mod SLOTS (module docstring);
    chunk j of each period holds j C pending tokens and flushes them at FLUSH_AT."""
    wide = tl.program_id(0).to(tl.int64) * 0  # slot offsets in int64: N slots pass 2^31
    for step in range(0, N):
        c = step + wide
        j = c % PERIOD
        here, after, before = c % SLOTS, (c + 1) % SLOTS, (c + SLOTS - 1) % SLOTS
        first, last = c == 0, c == N - 1
        _smt_step_fwd(
            tl.where(first, w1_ptr, s_w1 + here * W1_N),
            tl.where(first, w2_ptr, s_w2 + here * W2_N),
            x_ptr + c * C * X_SC, query_ptr + c * C * Q_SC,
            tl.where(first, r1_ptr, s_r1 + here * R1_N),
            tl.where(first, r2_ptr, s_r2 + here * R2_N),
            bias_ptr, scale_ptr, s_rows + before * ROWS_N, s_gates + before * GATES_N,
            tl.where(last, w1_out, s_w1 + after * W1_N),
            tl.where(last, w2_out, s_w2 + after * W2_N), inc1_out, inc2_out,
            s_rows + here * ROWS_N, s_gates + here * GATES_N, read_out + c * C * O,
            tl.where(last, m1_out, s_r1 + after * R1_N),
            tl.where(last, m2_out, s_r2 + after * R2_N), mi1_out, mi2_out, bias_out,
            H, GH, C, j * C, I, O, M, BIAS_STRIDE, X_SB, X_SH, X_SC, X_SD,
            Q_SB, Q_SH, Q_SC, Q_SD, eta_scale, N * C * O, j > 0, j == FLUSH_AT,
            HAS_QUERY, OWN_READ, HAS_SCALE, RESIDUAL, DOT_LOSS, CP, CMP, IP, OP, BLOCK_M,
            SQUARINGS, MSQUARINGS, EPS, DOT,
        )  # fmt: skip
        tl.debug_barrier()


@triton.jit
def _smt_walk_fwd(w1_ptr, w2_ptr, x_ptr, query_ptr, r1_ptr, r2_ptr, bias_ptr, scale_ptr,
                  w1_out, w2_out, inc1_out, inc2_out, read_out, m1_out, m2_out, mi1_out,
                  mi2_out, bias_out, s_w1, s_w2, s_r1, s_r2, s_rows, s_gates, N, SLOTS,
                  W1_N, W2_N, R1_N, R2_N, ROWS_N, GATES_N,
                  H, GH, C, I, O, M, BIAS_STRIDE, X_SB, X_SH, X_SC, X_SD,
                  Q_SB, Q_SH, Q_SC, Q_SD, eta_scale, PERIOD,
                  FLUSH_AT, HAS_QUERY: tl.constexpr, OWN_READ: tl.constexpr,
                  HAS_SCALE: tl.constexpr, RESIDUAL: tl.constexpr, DOT_LOSS: tl.constexpr,
                  CP: tl.constexpr, CMP: tl.constexpr, IP: tl.constexpr, OP: tl.constexpr,
                  BLOCK_M: tl.constexpr, SQUARINGS: tl.constexpr, MSQUARINGS: tl.constexpr,
                  EPS: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    _walk(w1_ptr, w2_ptr, x_ptr, query_ptr, r1_ptr, r2_ptr, bias_ptr, scale_ptr, w1_out, w2_out,
          inc1_out, inc2_out, read_out, m1_out, m2_out, mi1_out, mi2_out, bias_out, s_w1, s_w2,
          s_r1, s_r2, s_rows, s_gates, N, SLOTS, W1_N, W2_N, R1_N, R2_N, ROWS_N, GATES_N,
          H, GH, C, I, O, M, BIAS_STRIDE, X_SB, X_SH, X_SC, X_SD, Q_SB, Q_SH, Q_SC, Q_SD,
          eta_scale, PERIOD, FLUSH_AT, HAS_QUERY, OWN_READ, HAS_SCALE, RESIDUAL, DOT_LOSS,
          CP, CMP, IP, OP, BLOCK_M, SQUARINGS, MSQUARINGS, EPS, DOT)  # fmt: skip


@triton.jit
def _fill(dst, src, n, HAS_SRC: tl.constexpr, BLOCK: tl.constexpr):
    """dst[:n] = src[:n], or zeros."""
    for start in range(0, n, BLOCK):
        at = start + tl.arange(0, BLOCK)
        if HAS_SRC:
            tl.store(dst + at, tl.load(src + at, mask=at < n, other=0.0), mask=at < n)
        else:
            tl.store(dst + at, tl.zeros([BLOCK], tl.float32).to(dst.dtype.element_ty), mask=at < n)


@triton.jit
def _fill_head(dst, src, head, b, h, H, GH, SIZE, HAS_SRC: tl.constexpr, BLOCK: tl.constexpr):
    """This program's blocks of a flat [B*GH, SIZE] state: member g of head h at row
    b GH + g H + h."""
    for g in range(0, GH // H):
        at = (b * GH + g * H + h) * SIZE
        _fill(dst + at, src + at, SIZE, HAS_SRC, BLOCK)


@triton.jit
def _smt_walk_bwd(w1_ptr, w2_ptr, x_ptr, query_ptr, r1_ptr, r2_ptr, bias_ptr, scale_ptr,
                  f_w1, f_w2, f_inc1, f_inc2, f_read, f_m1, f_m2, f_mi1, f_mi2, f_bias,
                  s_w1, s_w2, s_r1, s_r2, s_rows, s_gates,
                  gw1_ptr, gw2_ptr, gi1_ptr, gi2_ptr, gread_ptr, gm1_ptr, gm2_ptr, gmi1_ptr,
                  gmi2_ptr, gbias_ptr, zi1_ptr, zi2_ptr, zmi1_ptr, zmi2_ptr,
                  c_w1, c_w2, c_r1, c_r2, c_rows, c_gates, c_bias,
                  dw1_ptr, dw2_ptr, dx_ptr, dquery_ptr, dr1_ptr, dr2_ptr, dbias_ptr, N, CUT,
                  W1_N, W2_N, R1_N, R2_N, ROWS_N, GATES_N,
                  H, GH, C, I, O, M, BIAS_STRIDE, X_SB, X_SH, X_SC, X_SD,
                  Q_SB, Q_SH, Q_SC, Q_SD, G_SB, G_SH, G_SC, G_SD, eta_scale,
                  PERIOD, FLUSH_AT, HAS_QUERY: tl.constexpr,
                  OWN_READ: tl.constexpr, HAS_SCALE: tl.constexpr, RESIDUAL: tl.constexpr,
                  DOT_LOSS: tl.constexpr, HAS_GW1: tl.constexpr, HAS_GW2: tl.constexpr,
                  HAS_GI1: tl.constexpr, HAS_GI2: tl.constexpr, HAS_GREAD: tl.constexpr,
                  HAS_GM1: tl.constexpr, HAS_GM2: tl.constexpr, HAS_GMI1: tl.constexpr,
                  HAS_GMI2: tl.constexpr, HAS_GBIAS: tl.constexpr, CP: tl.constexpr,
                  CMP: tl.constexpr, IP: tl.constexpr, OP: tl.constexpr, BLOCK_M: tl.constexpr,
                  SQUARINGS: tl.constexpr, MSQUARINGS: tl.constexpr, EPS: tl.constexpr,
                  DOT: tl.constexpr, BLOCK: tl.constexpr,
                  RECOMPUTE: tl.constexpr):  # fmt: skip
    if RECOMPUTE:  # the forward again, every chunk's input state and rows kept (slot c)
        _walk(w1_ptr, w2_ptr, x_ptr, query_ptr, r1_ptr, r2_ptr, bias_ptr, scale_ptr, f_w1, f_w2,
              f_inc1, f_inc2, f_read, f_m1, f_m2, f_mi1, f_mi2, f_bias, s_w1, s_w2, s_r1,
              s_r2, s_rows, s_gates, N, N, W1_N, W2_N, R1_N, R2_N, ROWS_N, GATES_N,
              H, GH, C, I, O, M, BIAS_STRIDE, X_SB, X_SH, X_SC, X_SD, Q_SB, Q_SH, Q_SC, Q_SD,
              eta_scale, PERIOD, FLUSH_AT, HAS_QUERY, OWN_READ, HAS_SCALE, RESIDUAL,
              DOT_LOSS, CP, CMP, IP, OP, BLOCK_M, SQUARINGS, MSQUARINGS, EPS, DOT)  # fmt: skip
    head = tl.program_id(0).to(tl.int64)  # b * H + h
    b, h = head // H, head % H
    B = tl.num_programs(0) // H
    # The last chunk's output gradients: the walk's (zeros where it has none).
    top = N % 2
    _fill_head(c_w1 + top * W1_N, gw1_ptr, head, b, h, H, GH, O * M, HAS_GW1, BLOCK)
    _fill_head(c_w2 + top * W2_N, gw2_ptr, head, b, h, H, GH, M * I, HAS_GW2, BLOCK)
    if not OWN_READ:
        _fill(c_r1 + top * R1_N + head * O * M, gm1_ptr + head * O * M, O * M, HAS_GM1, BLOCK)
        _fill(c_r2 + top * R2_N + head * M * I, gm2_ptr + head * M * I, M * I, HAS_GM2, BLOCK)
    _fill(c_bias + top * B * H + head, gbias_ptr + head, 1, HAS_GBIAS, BLOCK)
    tl.debug_barrier()
    for back in range(0, N):
        c = N - 1 - back + head * 0  # int64, as the slot offsets need
        j = c % PERIOD
        here, after = c % 2, (c + 1) % 2
        first, last = c == 0, c == N - 1
        held = (j + 2) * C  # the next chunk's rows: this one's, pending there
        rows_given = j < PERIOD - 1  # else they were M_mem's, written in this chunk
        if ((c + 1) % CUT == 0) & (c < N - 1):  # a piece cut: the next chunk's state detached
            _fill_head(c_w1 + after * W1_N, c_w1, head, b, h, H, GH, O * M, False, BLOCK)
            _fill_head(c_w2 + after * W2_N, c_w2, head, b, h, H, GH, M * I, False, BLOCK)
            if not OWN_READ:
                _fill(c_r1 + after * R1_N + head * O * M, c_r1, O * M, False, BLOCK)
                _fill(c_r2 + after * R2_N + head * M * I, c_r2, M * I, False, BLOCK)
            tl.debug_barrier()
        _smt_step_bwd(
            tl.where(first, w1_ptr, s_w1 + c * W1_N),
            tl.where(first, w2_ptr, s_w2 + c * W2_N),
            x_ptr + c * C * X_SC, query_ptr + c * C * Q_SC,
            tl.where(first, r1_ptr, s_r1 + c * R1_N),
            tl.where(first, r2_ptr, s_r2 + c * R2_N),
            bias_ptr, scale_ptr, s_rows + c * ROWS_N, s_gates + c * GATES_N,
            c_w1 + after * W1_N, c_w2 + after * W2_N,
            tl.where(last, gi1_ptr, zi1_ptr), tl.where(last, gi2_ptr, zi2_ptr),
            c_rows + after * ROWS_N, c_gates + after * GATES_N, gread_ptr + c * C * G_SC,
            c_r1 + after * R1_N, c_r2 + after * R2_N,
            tl.where(last, gmi1_ptr, zmi1_ptr), tl.where(last, gmi2_ptr, zmi2_ptr),
            c_bias + after * B * H,
            tl.where(first, dw1_ptr, c_w1 + here * W1_N),
            tl.where(first, dw2_ptr, c_w2 + here * W2_N),
            dx_ptr + c * C * I, dquery_ptr + c * C * I,
            tl.where(first, dr1_ptr, c_r1 + here * R1_N),
            tl.where(first, dr2_ptr, c_r2 + here * R2_N),
            tl.where(first, dbias_ptr, c_bias + here * B * H),
            c_rows + here * ROWS_N, c_gates + here * GATES_N,
            H, GH, C, j * C, I, O, M, BIAS_STRIDE, X_SB, X_SH, X_SC, X_SD,
            Q_SB, Q_SH, Q_SC, Q_SD, G_SB, G_SH, G_SC, G_SD,
            H * held * 3 * I, held * 3 * I, H * held * 2, held * 2, eta_scale, N * C * I,
            j == FLUSH_AT, rows_given, rows_given, HAS_QUERY, OWN_READ, HAS_SCALE, RESIDUAL,
            DOT_LOSS, True, True, HAS_GI1, HAS_GI2, HAS_GREAD, not OWN_READ, not OWN_READ,
            HAS_GMI1, HAS_GMI2, True,
            CP, CMP, IP, OP, BLOCK_M, SQUARINGS, MSQUARINGS, EPS, DOT,
        )  # fmt: skip
        tl.debug_barrier()


def _walk_sizes(inputs: tuple[Tensor | None, ...], options: tuple[Any, ...]) -> dict[str, Any]:
    """The chunk step's sizes at the walk's chunk, the slot sizes and the period."""
    w1, w2, x, query, r1, r2, bias, scale = inputs
    assert w1 is not None and w2 is not None and x is not None
    residual, dot, eta_scale, generators, size, period = options
    step = (w1, w2, x[:, :, :size], None if query is None else query[:, :, :size], r1, r2,
            bias, scale, None, None)  # fmt: skip
    sizes = _sizes(step, (residual, dot, eta_scale, generators, False))
    del sizes["P"], sizes["FLUSH"]
    b, heads, _, i = x.shape
    cmp = pad_size(size * period)
    held = b * heads * size * period
    return {
        **sizes, "CMP": cmp, "MSQUARINGS": cmp.bit_length() - 2, "PERIOD": period,
        "FLUSH_AT": -1 if r1 is None else period - 1, "N": x.shape[2] // size,
        "W1_N": w1.numel(), "W2_N": w2.numel(), "R1_N": 0 if r1 is None else r1.numel(),
        "R2_N": 0 if r2 is None else r2.numel(), "ROWS_N": held * 3 * i, "GATES_N": held * 2,
    }  # fmt: skip


def _slots(inputs: tuple[Tensor | None, ...], sizes: dict[str, Any], count: int) -> list[Tensor]:
    """``count`` slots of the stack's, M_mem's (empty when it is in the stack), the rows'
    and the gates' states (``smt_walk.KEPT``)."""
    w1, w2, x, _, r1, r2 = inputs[:6]
    assert w1 is not None and w2 is not None and x is not None
    mem = [x.new_empty(0) if t is None else t.new_empty(count, *t.shape) for t in (r1, r2)]
    held = [x.new_empty(count, sizes[n]) for n in ("ROWS_N", "GATES_N")]
    return [w1.new_empty(count, *w1.shape), w2.new_empty(count, *w2.shape), *mem, *held]


def _pointers(tensors: list[Tensor], x: Tensor) -> list[Tensor]:
    """Empty tensors replaced by x (a pointer the kernel never reads)."""
    return [x if not t.numel() else t for t in tensors]


def _outputs(inputs: tuple[Tensor | None, ...]) -> list[Tensor]:
    """Fresh tensors for ``WalkResult``."""
    w1, w2, x, _, r1, r2, bias = inputs[:7]
    assert w1 is not None and w2 is not None and x is not None and bias is not None
    b, heads, t, _ = x.shape
    mem = [x.new_empty(0) for _ in range(4)]  # four tensors: outputs may not alias
    if r1 is not None and r2 is not None:
        mem = [r.new_empty(r.shape) for r in (r1, r2, r1, r2)]
    return [w1.new_empty(w1.shape), w2.new_empty(w2.shape), w1.new_empty(w1.shape),
            w2.new_empty(w2.shape), x.new_empty(b, heads, t, w1.shape[-2]), *mem,
            x.new_empty(b, heads)]  # fmt: skip


def _flat_inputs(inputs: tuple[Tensor | None, ...]) -> list[Tensor]:
    return _flat((*inputs, None, None))[:8]


def smt_walk_triton(
    inputs: tuple[Tensor | None, ...], options: tuple[Any, ...], keep: bool = False
) -> tuple[Tensor, ...]:
    """``hope::smt_walk`` in one kernel launch; ``keep``: every chunk's input state in
    the slots returned (``smt_walk.KEPT``), else two slots, not returned."""
    x = inputs[2]
    assert x is not None
    sizes = _walk_sizes(inputs, options)
    out = _outputs(inputs)
    flat = _flat_inputs(inputs)
    slots = _slots(inputs, sizes, sizes["N"] if keep else 2)
    _smt_walk_fwd[(x.shape[0] * x.shape[1],)](
        *flat, *_pointers(out, x), *_pointers(slots, x), SLOTS=slots[0].shape[0], **sizes
    )  # fmt: skip
    return (*out, *(slots if keep else [x.new_empty(0) for _ in slots]))


def smt_walk_backward_triton(
    saved: tuple[Tensor | None, ...],
    options: tuple[Any, ...],
    grads: tuple[Tensor | None, ...],
    cut: int = 0,
) -> tuple[Tensor | None, ...]:
    """``hope::smt_walk_backward`` in one kernel launch; ``saved``: the inputs, then the
    kept forward (``smt_walk.KEPT``; empty: the kernel reruns it)."""
    w1, w2, x, query, r1, r2 = saved[:6]
    assert w1 is not None and w2 is not None and x is not None
    sizes = _walk_sizes(saved[:8], options)
    flat = _flat_inputs(saved[:8])
    given = [g is not None and g.numel() > 0 for g in grads]
    # The read's gradient is read through its strides, the others dense.
    g_flat = [x if g is None or not g.numel() else g if j == 4 else g.contiguous()
              for j, g in enumerate(grads)]  # fmt: skip
    g_read = g_flat[4]
    # The increments' gradients reach the last chunk only: the others read zeros.
    zeros = [g.new_zeros(g.shape) if here else x for g, here
             in zip(g_flat[2:4] + g_flat[7:9], [given[2], given[3], given[7], given[8]],
                    strict=True)]  # fmt: skip
    mem = (
        [None, None]
        if r1 is None or r2 is None
        else [r1.new_empty(r1.shape), r2.new_empty(r2.shape)]
    )
    d_query = None if query is None else x.new_empty(x.shape)
    outs = [w1.new_empty(w1.shape), w2.new_empty(w2.shape), x.new_empty(x.shape), d_query, *mem,
            x.new_empty(x.shape[:2])]  # fmt: skip
    chain = _pointers(_slots(saved, sizes, 2), x)
    chain.append(x.new_empty(2 * x.shape[0] * x.shape[1]))
    kept = [t for t in saved[8:] if t is not None]
    recompute = not kept or not kept[0].numel()
    if recompute:
        kept = _slots(saved, sizes, sizes["N"])
    flags = ("HAS_GW1", "HAS_GW2", "HAS_GI1", "HAS_GI2", "HAS_GREAD", "HAS_GM1", "HAS_GM2",
             "HAS_GMI1", "HAS_GMI2", "HAS_GBIAS")  # fmt: skip
    _smt_walk_bwd[(x.shape[0] * x.shape[1],)](
        *flat, *_pointers(_outputs(saved), x), *_pointers(kept, x), *g_flat, *zeros, *chain,
        *(x if t is None else t for t in outs), CUT=cut or sizes["N"],
        **{f: here for f, here in zip(flags, given, strict=True)}, **sizes,
        **_strides("G", g_read), BLOCK=256, RECOMPUTE=recompute,
    )  # fmt: skip
    return tuple(outs)
