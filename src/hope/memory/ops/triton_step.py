"""Triton kernels of ``hope::smt_step`` and its backward (``smt_step.py``): one program
per (sample, head) running the chunk step of every stacked member of that head.

Forward: the generating members on x~ (hidden-block walks, ``_apply``), the eq. 83
epilogue in registers, then each member's write (``triton_write.write_member_fwd``,
the read of M_mem riding on its write when it is the stack's last member), else
M_mem's read apart. Backward: the generation again, each member's write backward
(``write_member_bwd``, dW1 and dW2 stored), M_mem's read backward, the epilogue's
backward, and the generation's backward added to the stored dW1, dW2 (after a
barrier: other threads of the program stored them). Padding and precision as in
``triton_pass.py``; tested on a CPU with ``TRITON_INTERPRET=1`` against
``smt_step_reference`` and its backward.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl
from torch import Tensor

from hope.memory.ops.layouts import dense_below
from hope.memory.ops.pointwise import EPS
from hope.memory.ops.smt_step import _mem_gets_grad
from hope.memory.ops.triton_generation import (
    _unit_backward,
    apply_rows,
    head_generation,
    skip_of,
)
from hope.memory.ops.triton_kernels import (
    dot_precision,
    flat_heads,
    load_strided,
    load_tile,
    store_tile,
)
from hope.memory.ops.triton_pass import pad_size, rows_backward
from hope.memory.ops.triton_write import write_member_bwd, write_member_fwd


@triton.jit
def _rows_of(rows_ptr, t, i, n, I):
    """k, v, q [T, IP] of n tokens stored as rows [n, 3, I] (zero past n)."""
    k = load_tile(rows_ptr, t, i, n, I, 3 * I)
    v = load_tile(rows_ptr + I, t, i, n, I, 3 * I)
    return k, v, load_tile(rows_ptr + 2 * I, t, i, n, I, 3 * I)


@triton.jit
def _gates_of(gates_ptr, t, n, alpha_past):
    """eta, alpha [T] of n tokens stored as gates [n, 2]; past n: 0 and ``alpha_past``."""
    eta = tl.load(gates_ptr + t * 2, mask=t < n, other=0.0)
    return eta, tl.load(gates_ptr + t * 2 + 1, mask=t < n, other=alpha_past)


@triton.jit
def _store_rows(rows_ptr, gates_ptr, k, v, q, eta, alpha, t, i, n, I):
    store_tile(rows_ptr, k, t, i, n, I, 3 * I)
    store_tile(rows_ptr + I, v, t, i, n, I, 3 * I)
    store_tile(rows_ptr + 2 * I, q, t, i, n, I, 3 * I)
    tl.store(gates_ptr + t * 2, eta, mask=t < n)
    tl.store(gates_ptr + t * 2 + 1, alpha, mask=t < n)


@triton.jit
def _smt_step_fwd(w1_ptr, w2_ptr, x_ptr, query_ptr, r1_ptr, r2_ptr, bias_ptr, scale_ptr,
                  prows_ptr, pgates_ptr, w1_out, w2_out, inc1_out, inc2_out, rows_out,
                  gates_out, read_out, m1_out, m2_out, mi1_out, mi2_out, bias_out,
                  H, GH, C, P, I, O, M, BIAS_STRIDE, X_SB, X_SH, X_SC, X_SD,
                  Q_SB, Q_SH, Q_SC, Q_SD, eta_scale, READ_SH,
                  HAS_PEND, FLUSH, HAS_QUERY: tl.constexpr, OWN_READ: tl.constexpr,
                  HAS_SCALE: tl.constexpr, RESIDUAL: tl.constexpr,
                  DOT_LOSS: tl.constexpr, CP: tl.constexpr, CMP: tl.constexpr,
                  IP: tl.constexpr, OP: tl.constexpr, BLOCK_M: tl.constexpr,
                  SQUARINGS: tl.constexpr, MSQUARINGS: tl.constexpr, EPS: tl.constexpr,
                  DOT: tl.constexpr):  # fmt: skip
    head = tl.program_id(0).to(tl.int64)  # b * H + h
    b, h = head // H, head % H
    t, i, o = tl.arange(0, CP), tl.arange(0, IP), tl.arange(0, OP)
    live = t < C
    x = load_strided(x_ptr + b * X_SB + h * X_SH, t, i, C, I, X_SC, X_SD)
    gen = head_generation(w1_ptr, w2_ptr, x, query_ptr + b * Q_SB + h * Q_SH, bias_ptr,
                      scale_ptr, b, h, head, t, i, o, live, H, GH, C, I, O, M, BIAS_STRIDE,
                      Q_SC, Q_SD, eta_scale, HAS_QUERY, HAS_SCALE,
                      RESIDUAL, CP, OP, BLOCK_M, EPS, DOT)  # fmt: skip
    k, v, q, eta, alpha = gen[4], gen[5], gen[6], gen[7], gen[8]
    tl.store(bias_out + head, tl.load(bias_ptr + b * BIAS_STRIDE + h))  # carried
    # The pending tokens, then this chunk's: rows [P + C, 3, I], gates [P + C, 2].
    ext_rows, ext_gates = rows_out + head * (P + C) * 3 * I, gates_out + head * (P + C) * 2
    tm = tl.arange(0, CMP)
    if HAS_PEND:
        held = _rows_of(prows_ptr + head * P * 3 * I, tm, i, P, I)
        held_gates = _gates_of(pgates_ptr + head * P * 2, tm, P, 1.0)
        _store_rows(ext_rows, ext_gates, held[0], held[1], held[2], held_gates[0], held_gates[1],
                    tm, i, P, I)  # fmt: skip
    _store_rows(ext_rows + P * 3 * I, ext_gates + P * 2, k, v, q, eta, alpha, t, i, C, I)
    for g in range(0, GH // H - OWN_READ):
        sh = b * GH + g * H + h
        a, c = sh * O * M, sh * M * I
        write_member_fwd(w1_ptr + a, w2_ptr + c, w1_out + a, w2_out + c, inc1_out + a,
                         inc2_out + c, read_out, k, v, q, eta, alpha,
                         skip_of(scale_ptr, g * H + h, HAS_SCALE, RESIDUAL), t, i, o, live, C, I,
                         O, M, False, HAS_SCALE or RESIDUAL, True, DOT_LOSS, CP, OP, BLOCK_M,
                         SQUARINGS, DOT)  # fmt: skip
    if OWN_READ:  # M_mem, the last member: read before write, in its write
        g = GH // H - 1
        sh = b * GH + g * H + h
        a, c = sh * O * M, sh * M * I
        write_member_fwd(w1_ptr + a, w2_ptr + c, w1_out + a, w2_out + c, inc1_out + a,
                         inc2_out + c, read_out + head * READ_SH, k, v, q, eta, alpha,
                         skip_of(scale_ptr, g * H + h, HAS_SCALE, RESIDUAL), t, i, o, live, C, I,
                         O, M, True, HAS_SCALE or RESIDUAL, True, DOT_LOSS, CP, OP, BLOCK_M,
                         SQUARINGS, DOT)  # fmt: skip
    else:  # M_mem apart (residual): read at its chunk-start state
        read = apply_rows(r1_ptr + head * O * M, r2_ptr + head * M * I, q, i, o, I, O, M, CP, OP,
                      BLOCK_M, DOT) + q  # fmt: skip
        store_tile(read_out + head * READ_SH, read, t, o, C, O, O)
        if FLUSH == 0:  # M_mem carried unchanged
            for m0 in range(0, M, BLOCK_M):
                m = m0 + tl.arange(0, BLOCK_M)
                a, c = head * O * M, head * M * I
                store_tile(m1_out + a, load_tile(r1_ptr + a, o, m, O, M, M), o, m, O, M, M)
                store_tile(m2_out + c, load_tile(r2_ptr + c, m, i, M, I, I), m, i, M, I, I)
    if FLUSH:  # M_mem's write from its C_m = P + C tokens, read back from the stores above
        tl.debug_barrier()
        mem = _rows_of(ext_rows, tm, i, P + C, I)
        mem_gates = _gates_of(ext_gates, tm, P + C, 1.0)
        a, c = head * O * M, head * M * I
        write_member_fwd(r1_ptr + a, r2_ptr + c, m1_out + a, m2_out + c, mi1_out + a,
                         mi2_out + c, read_out, mem[0], mem[1], mem[0], mem_gates[0],
                         mem_gates[1], 1.0, tm,
                         i, o, tm < P + C, 0, I, O, M, False, True, True, DOT_LOSS, CMP, OP,
                         BLOCK_M, MSQUARINGS, DOT)  # fmt: skip


@triton.jit
def _raw_backward(w1_ptr, w2_ptr, scale_ptr, dw1_ptr, dw2_ptr, x, g_raw, b, g, h, H, GH, i, o,
                  I, O, M, HAS_SCALE: tl.constexpr, RESIDUAL: tl.constexpr,
                  BLOCK_M: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    """Generating member g's share of the generation's backward: added to the stored
    dW1, dW2; returns its share of dL/dx~."""
    sh = b * GH + g * H + h
    w1_ptr += sh * O * M
    w2_ptr += sh * M * I
    dw1_ptr += sh * O * M
    dw2_ptr += sh * M * I
    d_x = skip_of(scale_ptr, g * H + h, HAS_SCALE, RESIDUAL) * g_raw
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        w2 = load_tile(w2_ptr, m, i, M, I, I)
        w1 = load_tile(w1_ptr, o, m, O, M, M)
        d_w1, d_w2, share = rows_backward(x, g_raw, w1, w2, DOT)
        d_x += share
        store_tile(dw1_ptr, load_tile(dw1_ptr, o, m, O, M, M) + d_w1, o, m, O, M, M)
        store_tile(dw2_ptr, load_tile(dw2_ptr, m, i, M, I, I) + d_w2, m, i, M, I, I)
    return d_x


@triton.jit
def _smt_step_bwd(w1_ptr, w2_ptr, x_ptr, query_ptr, r1_ptr, r2_ptr, bias_ptr, scale_ptr,
                  rows_ptr, gates_ptr, gw1_ptr, gw2_ptr, gi1_ptr, gi2_ptr, grows_ptr, ggates_ptr,
                  gread_ptr, gm1_ptr, gm2_ptr, gmi1_ptr, gmi2_ptr, gbias_ptr, dw1_ptr, dw2_ptr,
                  dx_ptr,
                  dquery_ptr, dr1_ptr, dr2_ptr, dbias_ptr, drows_ptr, dgates_ptr,
                  H, GH, C, P, I, O, M, BIAS_STRIDE, X_SB, X_SH, X_SC, X_SD,
                  Q_SB, Q_SH, Q_SC, Q_SD, G_SB, G_SH, G_SC, G_SD, GR_SB, GR_SH, GG_SB, GG_SH,
                  eta_scale, DX_SH,
                  FLUSH, HAS_GROWS, HAS_GGATES, HAS_QUERY: tl.constexpr, OWN_READ: tl.constexpr,
                  HAS_SCALE: tl.constexpr, RESIDUAL: tl.constexpr, DOT_LOSS: tl.constexpr,
                  HAS_GW1: tl.constexpr, HAS_GW2: tl.constexpr, HAS_GI1: tl.constexpr,
                  HAS_GI2: tl.constexpr,
                  HAS_GREAD: tl.constexpr, HAS_GM1: tl.constexpr, HAS_GM2: tl.constexpr,
                  HAS_GMI1: tl.constexpr, HAS_GMI2: tl.constexpr, HAS_GBIAS: tl.constexpr,
                  CP: tl.constexpr,
                  CMP: tl.constexpr, IP: tl.constexpr, OP: tl.constexpr, BLOCK_M: tl.constexpr,
                  SQUARINGS: tl.constexpr, MSQUARINGS: tl.constexpr, EPS: tl.constexpr,
                  DOT: tl.constexpr):  # fmt: skip
    head = tl.program_id(0).to(tl.int64)  # b * H + h
    b, h = head // H, head % H
    t, i, o = tl.arange(0, CP), tl.arange(0, IP), tl.arange(0, OP)
    live = t < C
    rows = head * DX_SH  # dx, dquery: [C, I] per head, heads DX_SH apart
    x = load_strided(x_ptr + b * X_SB + h * X_SH, t, i, C, I, X_SC, X_SD)
    gen = head_generation(w1_ptr, w2_ptr, x, query_ptr + b * Q_SB + h * Q_SH, bias_ptr,
                      scale_ptr, b, h, head, t, i, o, live, H, GH, C, I, O, M, BIAS_STRIDE,
                      Q_SC, Q_SD, eta_scale, HAS_QUERY, HAS_SCALE,
                      RESIDUAL, CP, OP, BLOCK_M, EPS, DOT)  # fmt: skip
    raw_k, raw_v, raw_q, raw_eta = gen[0], gen[1], gen[2], gen[3]
    k, v, q, eta, alpha = gen[4], gen[5], gen[6], gen[7], gen[8]
    # dL/d(the pending and this chunk's tokens): given, plus M_mem's write's backward.
    n = P + C
    tm = tl.arange(0, CMP)
    # The rows' and gates' gradients: dense per head, batch and head strides read (a
    # slice of the next step's pending gradients needs no copy).
    grows_head, ggates_head = grows_ptr + b * GR_SB + h * GR_SH, ggates_ptr + b * GG_SB + h * GG_SH
    d_km, d_vm, d_qm = _rows_of(grows_head, tm, i, tl.where(HAS_GROWS, n, 0), I)
    d_etam, d_alpham = _gates_of(ggates_head, tm, tl.where(HAS_GGATES, n, 0), 0.0)
    if FLUSH:
        mem = _rows_of(rows_ptr + head * n * 3 * I, tm, i, n, I)
        mem_gates = _gates_of(gates_ptr + head * n * 2, tm, n, 1.0)
        a, c = head * O * M, head * M * I
        share = write_member_bwd(r1_ptr + a, r2_ptr + c, gm1_ptr + a, gm2_ptr + c, gmi1_ptr + a,
                                 gmi2_ptr + c, gread_ptr, O, 1, dr1_ptr + a, dr2_ptr + c, mem[0],
                                 mem[1], mem[0], mem_gates[0], mem_gates[1], 1.0, tm, i, o,
                                 tm < n, 0, I, O, M, False, True, DOT_LOSS, HAS_GM1, HAS_GM2,
                                 HAS_GMI1, HAS_GMI2, False, CMP, IP, OP, BLOCK_M, MSQUARINGS,
                                 DOT)  # fmt: skip
        d_km, d_vm = d_km + share[0], d_vm + share[1]
        d_etam, d_alpham = d_etam + share[3], d_alpham + share[4]
    ext_rows, ext_gates = drows_ptr + head * n * 3 * I, dgates_ptr + head * n * 2
    _store_rows(ext_rows, ext_gates, d_km, d_vm, d_qm, d_etam, d_alpham, tm, i, n, I)
    tl.debug_barrier()  # this chunk's rows are read back at offset P
    d_k, d_v, d_q = _rows_of(ext_rows + P * 3 * I, t, i, C, I)
    d_eta, d_alpha = _gates_of(ext_gates + P * 2, t, C, 0.0)
    for g in range(0, GH // H - OWN_READ):
        sh = b * GH + g * H + h
        a, c = sh * O * M, sh * M * I
        share = write_member_bwd(w1_ptr + a, w2_ptr + c, gw1_ptr + a, gw2_ptr + c, gi1_ptr + a,
                                 gi2_ptr + c, gread_ptr, O, 1, dw1_ptr + a, dw2_ptr + c, k, v, q,
                                 eta, alpha, skip_of(scale_ptr, g * H + h, HAS_SCALE, RESIDUAL),
                                 t, i, o, live, C, I, O, M, False, HAS_SCALE or RESIDUAL, DOT_LOSS,
                                 HAS_GW1, HAS_GW2, HAS_GI1, HAS_GI2, False, CP, IP, OP,
                                 BLOCK_M, SQUARINGS, DOT)  # fmt: skip
        d_k, d_v = d_k + share[0], d_v + share[1]
        d_eta, d_alpha = d_eta + share[3], d_alpha + share[4]
    if OWN_READ:
        g = GH // H - 1
        sh = b * GH + g * H + h
        a, c = sh * O * M, sh * M * I
        share = write_member_bwd(w1_ptr + a, w2_ptr + c, gw1_ptr + a, gw2_ptr + c, gi1_ptr + a,
                                 gi2_ptr + c, gread_ptr + b * G_SB + h * G_SH, G_SC, G_SD,
                                 dw1_ptr + a,
                                 dw2_ptr + c, k, v, q, eta, alpha,
                                 skip_of(scale_ptr, g * H + h, HAS_SCALE, RESIDUAL), t, i, o, live,
                                 C, I, O, M, True, HAS_SCALE or RESIDUAL, DOT_LOSS, HAS_GW1,
                                 HAS_GW2, HAS_GI1, HAS_GI2, HAS_GREAD, CP, IP, OP, BLOCK_M,
                                 SQUARINGS, DOT)  # fmt: skip
        d_k, d_v, d_q = d_k + share[0], d_v + share[1], d_q + share[2]
        d_eta, d_alpha = d_eta + share[3], d_alpha + share[4]
    else:  # M_mem apart (residual): the read's backward, plus its write's or its copy's
        g_read = load_strided(
            gread_ptr + b * G_SB + h * G_SH, t, o, C if HAS_GREAD else 0, O, G_SC, G_SD
        )
        d_q += g_read
        a, c = head * O * M, head * M * I
        for m0 in range(0, M, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            w2 = load_tile(r2_ptr + c, m, i, M, I, I)
            w1 = load_tile(r1_ptr + a, o, m, O, M, M)
            d_w1, d_w2, share_q = rows_backward(q, g_read, w1, w2, DOT)
            d_q += share_q
            if FLUSH:  # stored by the write's backward above, before the barrier
                d_w1 += load_tile(dr1_ptr + a, o, m, O, M, M)
                d_w2 += load_tile(dr2_ptr + c, m, i, M, I, I)
            else:
                d_w1 += load_tile(gm1_ptr + a, o, m, O if HAS_GM1 else 0, M, M)
                d_w2 += load_tile(gm2_ptr + c, m, i, M if HAS_GM2 else 0, I, I)
            store_tile(dr1_ptr + a, d_w1, o, m, O, M, M)
            store_tile(dr2_ptr + c, d_w2, m, i, M, I, I)
    # The epilogue's backward (``triton_generation._generation_bwd``).
    g_k, g_v = _unit_backward(raw_k, d_k, EPS), _unit_backward(raw_v, d_v, EPS)
    g_q = _unit_backward(raw_q, d_q, EPS)
    column = o[None, :] == 0
    g_eta = tl.where(column, (d_eta * eta_scale / (1.0 + tl.exp(-raw_eta)))[:, None], 0.0)
    g_pre = tl.where(live, d_alpha * alpha * (1.0 - alpha), 0.0)
    g_alpha = tl.where(column, g_pre[:, None], 0.0)
    d_bias = tl.sum(g_pre, 0)
    if HAS_GBIAS:  # the carried copy's
        d_bias += tl.load(gbias_ptr + head)
    tl.store(dbias_ptr + head, d_bias)
    tl.debug_barrier()  # the writes' dW1, dW2 are read back below
    d_x = _raw_backward(w1_ptr, w2_ptr, scale_ptr, dw1_ptr, dw2_ptr, x, g_k, b, 0, h, H, GH, i, o,
                        I, O, M, HAS_SCALE, RESIDUAL, BLOCK_M, DOT)  # fmt: skip
    d_x += _raw_backward(w1_ptr, w2_ptr, scale_ptr, dw1_ptr, dw2_ptr, x, g_v, b, 1, h, H, GH, i,
                         o, I, O, M, HAS_SCALE, RESIDUAL, BLOCK_M, DOT)  # fmt: skip
    if HAS_QUERY:
        store_tile(dquery_ptr + rows, g_q, t, i, C, I, I)
        first = 2
    else:
        d_x += _raw_backward(w1_ptr, w2_ptr, scale_ptr, dw1_ptr, dw2_ptr, x, g_q, b, 2, h, H, GH,
                             i, o, I, O, M, HAS_SCALE, RESIDUAL, BLOCK_M, DOT)  # fmt: skip
        first = 3
    d_x += _raw_backward(w1_ptr, w2_ptr, scale_ptr, dw1_ptr, dw2_ptr, x, g_eta, b, first, h, H,
                         GH, i, o, I, O, M, HAS_SCALE, RESIDUAL, BLOCK_M, DOT)  # fmt: skip
    d_x += _raw_backward(w1_ptr, w2_ptr, scale_ptr, dw1_ptr, dw2_ptr, x, g_alpha, b, first + 1, h,
                         H, GH, i, o, I, O, M, HAS_SCALE, RESIDUAL, BLOCK_M, DOT)  # fmt: skip
    store_tile(dx_ptr + rows, d_x, t, i, C, I, I)


def _strides(name: str, t: Tensor) -> dict[str, int]:
    """A [B, H, C, D] tensor's strides as the kernels' ``{name}_SB``, ``_SH``, ``_SC``,
    ``_SD`` (read in place: chunk slices and transposed layouts need no copy)."""
    return dict(zip((f"{name}_SB", f"{name}_SH", f"{name}_SC", f"{name}_SD"), t.stride(),
                    strict=True))  # fmt: skip


def _sizes(inputs: tuple[Tensor | None, ...], options: tuple[Any, ...]) -> dict[str, Any]:
    w1, _, x, query, r1, _, bias, scale, pend_rows = inputs[:9]
    assert w1 is not None and x is not None and bias is not None
    residual, dot, eta_scale, _, flush = options
    heads, c, i = x.shape[1:]
    gh, o, m = w1.shape[1:]
    if o != i:
        raise ValueError(f"smt_step: the stacked memories need d_out = d_in, got {o} != {i}")
    held = 0 if pend_rows is None else pend_rows.shape[2]
    cp, cmp = pad_size(c), pad_size(held + c)
    return {
        "H": heads, "GH": gh, "C": c, "P": held, "I": i, "O": o, "M": m,
        "BIAS_STRIDE": bias.stride(0), **_strides("X", x),
        **_strides("Q", x if query is None else query),
        "eta_scale": eta_scale, "HAS_QUERY": query is not None,
        "OWN_READ": r1 is None, "FLUSH": flush, "HAS_SCALE": scale is not None,
        "RESIDUAL": residual, "DOT_LOSS": dot, "CP": cp, "CMP": cmp, "IP": pad_size(i),
        "OP": pad_size(o), "BLOCK_M": min(64, pad_size(m)), "SQUARINGS": cp.bit_length() - 2,
        "MSQUARINGS": cmp.bit_length() - 2, "EPS": EPS, "DOT": dot_precision(w1),
    }  # fmt: skip


def _flat(inputs: tuple[Tensor | None, ...]) -> list[Tensor]:
    """The kernels' inputs contiguous (x, the query and alpha_bias as given: their strides
    are read; ``layouts.STRIDED_READS``), absent ones replaced by x (never read)."""
    w1, w2, x, query, r1, r2, bias, scale, *pending = inputs
    assert w1 is not None and w2 is not None and x is not None and bias is not None
    rest = [x if query is None else query, *(x if t is None else flat_heads(t) for t in (r1, r2))]
    scale_f = x if scale is None else scale.to(w1.dtype).contiguous()
    held = [x if t is None else t.contiguous() for t in pending]
    return [flat_heads(w1), flat_heads(w2), x, *rest, bias, scale_f, *held]


def smt_step_triton(
    inputs: tuple[Tensor | None, ...], options: tuple[Any, ...]
) -> tuple[Tensor, ...]:
    """``hope::smt_step`` in one kernel launch."""
    w1, w2, x, _, r1, r2, _, _, pend_rows, _ = inputs
    assert w1 is not None and w2 is not None and x is not None
    b, heads, c, i = x.shape
    sizes = _sizes(inputs, options)
    n = sizes["P"] + c
    weights = [w1.new_empty(t.shape) for t in (w1, w2, w1, w2)]
    ext = [x.new_empty(b, heads, n, 3, i), x.new_empty(b, heads, n, 2)]
    read = x.new_empty(b, heads, c, w1.shape[-2])
    mem = [x.new_empty(0) for _ in range(4)]  # four tensors: outputs may not alias
    if r1 is not None and r2 is not None:  # written (flush) or carried
        mem[:2] = [r1.new_empty(r1.shape), r2.new_empty(r2.shape)]
    if options[4] and r1 is not None and r2 is not None:
        mem[2:] = [r1.new_empty(r1.shape), r2.new_empty(r2.shape)]
    bias = x.new_empty(b, heads)
    flat = _flat(inputs)
    _smt_step_fwd[(b * heads,)](
        *flat, *weights, *ext, read, *(flat[2] if not t.numel() else t for t in mem), bias,
        HAS_PEND=pend_rows is not None, READ_SH=c * w1.shape[-2], **sizes,
    )  # fmt: skip
    return (*weights, *ext, read, *mem, bias)


def smt_step_backward_triton(
    saved: tuple[Tensor | None, ...], options: tuple[Any, ...], grads: tuple[Tensor | None, ...]
) -> tuple[Tensor | None, ...]:
    """``hope::smt_step_backward`` in one kernel launch; ``saved``: the inputs, then the
    forward's rows and gates."""
    w1, w2, x, query, r1, r2, _, _, pend_rows, _, rows, gates = saved
    assert w1 is not None and w2 is not None and x is not None
    assert rows is not None and gates is not None
    sizes = _sizes(saved[:10], options)
    flat = _flat(saved[:10])
    # The read's gradient (index 6) is read through its strides, the rows' and gates'
    # (4, 5) through their batch and head strides; the others dense.
    g_flat = [
        flat[2] if g is None or not g.numel() else g if j in (4, 5, 6) else g.contiguous()
        for j, g in enumerate(grads)
    ]
    for j in (4, 5):
        if g_flat[j] is not flat[2] and not dense_below(g_flat[j], 2):
            g_flat[j] = g_flat[j].contiguous()
    g_read = grads[6] if grads[6] is not None and grads[6].numel() else x
    held_strides = {"GR_SB": g_flat[4].stride(0), "GR_SH": g_flat[4].stride(1),
                    "GG_SB": g_flat[5].stride(0), "GG_SH": g_flat[5].stride(1)}  # fmt: skip
    mem = (
        [None, None]
        if r1 is None or r2 is None
        else [r1.new_empty(r1.shape), r2.new_empty(r2.shape)]
    )
    outs = [w1.new_empty(w1.shape), w1.new_empty(w2.shape), x.new_empty(x.shape),
            None if query is None else x.new_empty(x.shape), *mem, x.new_empty(x.shape[:2]),
            rows.new_empty(rows.shape), gates.new_empty(gates.shape)]  # fmt: skip
    flags = ("HAS_GW1", "HAS_GW2", "HAS_GI1", "HAS_GI2", "HAS_GROWS", "HAS_GGATES", "HAS_GREAD",
             "HAS_GM1", "HAS_GM2", "HAS_GMI1", "HAS_GMI2", "HAS_GBIAS")  # fmt: skip
    _smt_step_bwd[(x.shape[0] * x.shape[1],)](
        *flat[:8], rows.contiguous(), gates.contiguous(), *g_flat,
        *(flat[2] if t is None else t for t in outs),
        **{f: g is not None and g.numel() > 0 for f, g in zip(flags, grads, strict=True)},
        **sizes, **_strides("G", g_read), **held_strides, DX_SH=x.shape[2] * x.shape[3],
    )  # fmt: skip
    if not _mem_gets_grad(r1, options[4], list(grads)):
        outs[4] = outs[5] = None
    held = sizes["P"]
    pending = [None, None] if pend_rows is None else [t[:, :, :held] for t in outs[7:]]
    return (*outs[:7], *pending)
