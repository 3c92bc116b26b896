"""Triton kernels of the ``fused`` backend's operators (``memory/ops/fused.py``): one
program per (sample, stacked head), the whole chunk in it.

``hope::dgd_chunk`` and its backward:

Per program: the decays γ, the C x C preconditioner L = I + η ⊙ (P ∘ K K^T) and its
inverse, the keys Z = L^-T (γ_C/γ_s ⊙ K) (C x I, kept in registers), then the h_m
rows of W1 and W2 in blocks of ``BLOCK_M``. L is unit lower triangular with
N = L - I nilpotent, so L^-1 = (I - N)(I + N^2)(I + N^4)···(I + N^(CP/2)): log2(CP) - 1
squarings and products of C x C tiles, no triangular solve. Every dimension is padded
to a power of two >= 16 (``tl.dot``'s smallest tile); padded tokens have η = 0, α = 1
and zero keys and factors, so they write and receive nothing. fp32 products follow the
run's policy for fp32 matmuls (``dot_precision``), as the closed form they replace does.

The backward recomputes the C x C terms and Z from the inputs (the operator saves
nothing else), accumulates dZ, dE and the decay sums over the h_m blocks, then
takes the C x C part (``dgd_chunk_backward_reference`` written per program).

``hope::l2_normalize`` and its backward (``pointwise.py``): blocks of rows.

``hope::bounded_step``: the C x C matrix diag(sqrt(s)) K diag(sqrt(s)) in registers,
the Collatz-Wielandt bound rho after four power iterations (``residual_mlp.perron_bound``;
``overshoot_of``, shared with ``triton_chunk_rates.py``), then s / (1 + rho).

Tested on a CPU with ``TRITON_INTERPRET=1`` against the PyTorch forms
(tests/test_fused_ops.py); scripts/gpu_check.sh runs the same parity on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor


def compute_dtype(t: Tensor) -> tl.dtype:
    """float32 (bf16 and fp16 inputs under autocast too: ``tl.log`` and ``tl.exp`` take
    fp32/fp64 only), float64 for float64 inputs."""
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def dot_precision(t: Tensor) -> str:
    """``tl.dot``'s input precision for products in ``t``'s compute dtype: the run's own
    policy for fp32 matmuls (``hope.train.device.configure_numerics``), so a fused kernel
    multiplies as the PyTorch forms it replaces do. "tf32" (tensor cores) where TF32 is
    allowed (``train.precision`` bf16 or auto on CUDA), "ieee" otherwise (fp32 strict, and
    always for fp64). An "ieee" fp32 product runs on the CUDA cores' FMA units: 67 TFLOP/s
    on an H100/H200 against 494 for TF32 tensor cores (``hope.bench.projection``)."""
    if compute_dtype(t) == tl.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


# A [rows, cols] tile of a row-major matrix with n_rows x n_cols live entries (zeros
# outside), and its masked store; shared by every kernel of the fused backend.
@triton.jit
def load_tile(ptr, rows, cols, n_rows, n_cols, stride):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def load_strided(ptr, rows, cols, n_rows, n_cols, row_stride, col_stride):
    """``load_tile`` of a matrix with any strides (a view read in place)."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offsets = rows[:, None] * row_stride + cols[None, :] * col_stride
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def store_tile(ptr, value, rows, cols, n_rows, n_cols, stride):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(ptr + rows[:, None] * stride + cols[None, :], value, mask=mask)


@triton.jit
def _chunk_terms(k_ptr, eta_ptr, alpha_ptr, C, I, CP: tl.constexpr, IP: tl.constexpr,
                 SQUARINGS: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    t = tl.arange(0, CP)
    i = tl.arange(0, IP)
    live = t < C
    eta = tl.load(eta_ptr + t, mask=live, other=0.0)
    alpha = tl.load(alpha_ptr + t, mask=live, other=1.0)
    k = load_tile(k_ptr, t, i, C, I, I)
    return chunk_terms_of(k, eta, alpha, t, i, live, CP, SQUARINGS, DOT)


@triton.jit
def chunk_terms_of(k, eta, alpha, t, i, live, CP: tl.constexpr, SQUARINGS: tl.constexpr,
                   DOT: tl.constexpr):  # fmt: skip
    """The C x C terms of a DGD chunk write from its keys k [CP, IP], steps eta and
    retentions alpha [CP] (padded tokens: eta 0, alpha 1)."""
    log_keep = tl.log(alpha)
    cum = tl.cumsum(log_keep, 0)  # log γ_t
    prev = cum - log_keep  # log γ_{t-1}
    end = tl.sum(log_keep, 0)  # log γ_C (padded tokens add 0)
    strict = t[:, None] > t[None, :]
    ratio = tl.where(strict, tl.exp(tl.where(strict, prev[:, None] - cum[None, :], 0.0)), 0.0)
    gram = tl.dot(k, tl.trans(k), input_precision=DOT)
    coupling = ratio * gram
    nil = eta[:, None] * coupling
    eye = (t[:, None] == t[None, :]).to(k.dtype)
    inverse = eye - nil
    power = nil
    for _ in tl.static_range(SQUARINGS):
        power = tl.dot(power, power, input_precision=DOT)
        inverse = tl.dot(inverse, eye + power, input_precision=DOT)
    end_over_s = tl.exp(end - cum)
    keys = tl.dot(tl.trans(inverse), end_over_s[:, None] * k, input_precision=DOT)
    return (t, i, live, eta, alpha, strict, ratio, gram, coupling, inverse, k, keys,
            tl.exp(prev), end_over_s, tl.exp(end))  # fmt: skip


@triton.jit
def dgd_cc_backward(e, a_g, d_keys, d_hom, d_gain, terms, DOT: tl.constexpr):
    """The C x C part of the DGD write's backward (``dgd_chunk_backward_reference``) from
    the sums its hidden-block walk gathers (a_g = A G1^T, dL/dZ, the homogeneous and
    gain terms) and the chunk's ``chunk_terms_of``: dL/dk through L and the Gram
    matrix, this part's dL/deta, and dL/dalpha through the decays."""
    eta, alpha, strict, ratio, gram = terms[3], terms[4], terms[5], terms[6], terms[7]
    coupling, inverse, k, keys = terms[8], terms[9], terms[10], terms[11]
    gamma_prev, end_over_s, gamma_end = terms[12], terms[13], terms[14]
    d_c1 = tl.sum(e * a_g, 1)
    y = tl.dot(inverse, d_keys, input_precision=DOT)
    d_lower = tl.where(strict, -tl.dot(keys, tl.trans(y), input_precision=DOT), 0.0)
    d_end_over_s = tl.sum(k * y, 1) - eta * d_c1
    d_eta = tl.sum(d_lower * coupling, 1) - gamma_prev * d_hom - end_over_s * d_c1
    d_coupling = eta[:, None] * d_lower
    d_gram = d_coupling * ratio
    d_k = end_over_s[:, None] * y + tl.dot(d_gram + tl.trans(d_gram), k, input_precision=DOT)
    decay = d_coupling * gram * ratio
    d_prev = tl.sum(decay, 1) - eta * d_hom * gamma_prev
    scaled_end = d_end_over_s * end_over_s
    total = d_prev - tl.sum(decay, 0) - scaled_end
    d_end = tl.sum(scaled_end, 0) + tl.sum(d_gain, 0) * gamma_end
    suffix = total - tl.cumsum(total, 0) + tl.sum(total, 0)
    return d_k, d_eta, (suffix - d_prev + d_end) / alpha


@triton.jit
def _dgd_chunk_fwd(w1_ptr, w2_ptr, k_ptr, e_ptr, a_ptr, d_ptr, eta_ptr, alpha_ptr, w2k_ptr,
                   w1_out, w2_out, inc1_out, inc2_out, C, I, O, M, GH, HK,
                   CP: tl.constexpr, IP: tl.constexpr, OP: tl.constexpr, BLOCK_M: tl.constexpr,
                   SQUARINGS: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    kh = bh // GH * HK + bh % GH % HK  # k and alpha: per member, or shared (HK = H)
    k_ptr += kh * C * I
    e_ptr += bh * C * O
    a_ptr += bh * C * M
    d_ptr += bh * C * M
    w2k_ptr += bh * C * M
    w1_off = bh * O * M
    w2_off = bh * M * I
    terms = _chunk_terms(k_ptr, eta_ptr + bh * C, alpha_ptr + kh * C, C, I, CP, IP, SQUARINGS, DOT)
    t, i, eta, keys = terms[0], terms[1], terms[3], terms[11]
    gamma_prev, end_over_s, gamma_end = terms[12], terms[13], terms[14]
    o = tl.arange(0, OP)
    scaled_e = (-eta * end_over_s)[:, None] * load_tile(e_ptr, t, o, C, O, O)  # c1 ⊙ E
    hom_coef = -eta * gamma_prev
    for m0 in range(0, M, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        u = -eta[:, None] * load_tile(d_ptr, t, m, C, M, M)
        rhs = u + hom_coef[:, None] * load_tile(w2k_ptr, t, m, C, M, M)
        inc2 = tl.dot(tl.trans(u), keys, input_precision=DOT)
        change2 = tl.dot(tl.trans(rhs), keys, input_precision=DOT)
        w2 = load_tile(w2_ptr + w2_off, m, i, M, I, I)
        store_tile(w2_out + w2_off, change2 + gamma_end * w2, m, i, M, I, I)
        store_tile(inc2_out + w2_off, inc2, m, i, M, I, I)
        inc1 = tl.dot(tl.trans(scaled_e), load_tile(a_ptr, t, m, C, M, M), input_precision=DOT)
        w1 = load_tile(w1_ptr + w1_off, o, m, O, M, M)
        store_tile(w1_out + w1_off, inc1 + gamma_end * w1, o, m, O, M, M)
        store_tile(inc1_out + w1_off, inc1, o, m, O, M, M)


@triton.jit
def _dgd_chunk_bwd(w1_ptr, w2_ptr, k_ptr, e_ptr, a_ptr, d_ptr, eta_ptr, alpha_ptr, w2k_ptr,
                   gw1_ptr, gw2_ptr, gi1_ptr, gi2_ptr,
                   dw1_ptr, dw2_ptr, dk_ptr, de_ptr, da_ptr, dd_ptr, deta_ptr, dalpha_ptr,
                   dw2k_ptr, C, I, O, M, GH, HK,
                   HAS_GI1: tl.constexpr, HAS_GI2: tl.constexpr,
                   CP: tl.constexpr, IP: tl.constexpr, OP: tl.constexpr, BLOCK_M: tl.constexpr,
                   SQUARINGS: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    # One program per k/alpha head (HK of them per sample); the G = GH / HK stacked
    # members sharing it run in turn and their k and alpha gradients are summed here.
    head = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, CP)
    d_k_sum = tl.zeros([CP, IP], dtype=k_ptr.dtype.element_ty)
    d_alpha_sum = tl.zeros([CP], dtype=k_ptr.dtype.element_ty)
    for g in range(0, GH // HK):
        bh = head // HK * GH + g * HK + head % HK
        cm_off = bh * C * M
        w1_off = bh * O * M
        w2_off = bh * M * I
        terms = _chunk_terms(k_ptr + head * C * I, eta_ptr + bh * C, alpha_ptr + head * C, C, I,
                             CP, IP, SQUARINGS, DOT)  # fmt: skip
        t, i, live, eta, k, keys = terms[0], terms[1], terms[2], terms[3], terms[10], terms[11]
        gamma_prev, end_over_s, gamma_end = terms[12], terms[13], terms[14]
        o = tl.arange(0, OP)
        e = load_tile(e_ptr + bh * C * O, t, o, C, O, O)
        c1 = -eta * end_over_s
        hom_coef = -eta * gamma_prev
        a_g = tl.zeros([CP, OP], dtype=k.dtype)
        d_keys = tl.zeros([CP, IP], dtype=k.dtype)
        d_hom = tl.zeros([CP], dtype=k.dtype)
        d_eta = tl.zeros([CP], dtype=k.dtype)
        d_gain = tl.zeros([BLOCK_M], dtype=k.dtype)
        for m0 in range(0, M, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            d = load_tile(d_ptr + cm_off, t, m, C, M, M)
            w2k = load_tile(w2k_ptr + cm_off, t, m, C, M, M)
            u = -eta[:, None] * d
            rhs = u + hom_coef[:, None] * w2k
            gw1 = load_tile(gw1_ptr + w1_off, o, m, O, M, M)
            gw2 = load_tile(gw2_ptr + w2_off, m, i, M, I, I)
            w1 = load_tile(w1_ptr + w1_off, o, m, O, M, M)
            w2 = load_tile(w2_ptr + w2_off, m, i, M, I, I)
            d_gain += tl.sum(gw1 * w1, 0) + tl.sum(gw2 * w2, 1)
            store_tile(dw1_ptr + w1_off, gamma_end * gw1, o, m, O, M, M)
            store_tile(dw2_ptr + w2_off, gamma_end * gw2, m, i, M, I, I)
            g1 = gw1
            if HAS_GI1:
                g1 += load_tile(gi1_ptr + w1_off, o, m, O, M, M)
            a_g += tl.dot(
                load_tile(a_ptr + cm_off, t, m, C, M, M), tl.trans(g1), input_precision=DOT
            )
            d_a = c1[:, None] * tl.dot(e, g1, input_precision=DOT)
            store_tile(da_ptr + cm_off, d_a, t, m, C, M, M)
            d_rhs = tl.dot(keys, tl.trans(gw2), input_precision=DOT)
            d_u = d_rhs
            d_keys += tl.dot(rhs, gw2, input_precision=DOT)
            if HAS_GI2:
                gi2 = load_tile(gi2_ptr + w2_off, m, i, M, I, I)
                d_u += tl.dot(keys, tl.trans(gi2), input_precision=DOT)
                d_keys += tl.dot(u, gi2, input_precision=DOT)
            store_tile(dd_ptr + cm_off, -eta[:, None] * d_u, t, m, C, M, M)
            store_tile(dw2k_ptr + cm_off, hom_coef[:, None] * d_rhs, t, m, C, M, M)
            d_hom += tl.sum(w2k * d_rhs, 1)
            d_eta -= tl.sum(d * d_u, 1)
        store_tile(de_ptr + bh * C * O, c1[:, None] * a_g, t, o, C, O, O)
        d_k, d_eta_cc, d_alpha = dgd_cc_backward(e, a_g, d_keys, d_hom, d_gain, terms, DOT)
        d_eta += d_eta_cc
        d_k_sum += d_k
        d_alpha_sum += d_alpha
        tl.store(deta_ptr + bh * C + t, d_eta, mask=live)
    store_tile(dk_ptr + head * C * I, d_k_sum, t, tl.arange(0, IP), C, I, I)
    tl.store(dalpha_ptr + head * C + t, d_alpha_sum, mask=t < C)


@triton.jit
def overshoot_of(step, kernel, live, ITERATIONS: tl.constexpr):
    """rho = 2 x the Collatz-Wielandt bound on ||diag(sqrt(s)) K diag(sqrt(s))||_2 after
    ``ITERATIONS`` power iterations (``residual_mlp.overshoot_ratio``) of one chunk's
    steps s [CP] and kernel bound K [CP, CP] (zero outside the ``live`` tokens)."""
    root = tl.sqrt(tl.maximum(step, 0.0))
    matrix = root[:, None] * kernel * root[None, :]
    x = tl.where(live, 1.0, 0.0).to(matrix.dtype)
    for _ in tl.static_range(ITERATIONS):
        x = tl.sum(matrix * x[None, :], 1)
        x = x / tl.maximum(tl.max(x, 0), 1e-30) + 1e-12
    ratio = tl.where(live, tl.sum(matrix * x[None, :], 1) / x, 0.0)
    return 2.0 * tl.max(ratio, 0)


@triton.jit
def _bounded_step(kernel_ptr, step_ptr, gain_ptr, bounded_ptr, C, GH, HS, CP: tl.constexpr,
                  ITERATIONS: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, CP)
    live = t < C
    step = tl.load(step_ptr + (bh // GH * HS + bh % GH % HS) * C + t, mask=live, other=0.0)
    kernel = load_tile(kernel_ptr + bh * C * C, t, t, C, C, C)
    rho = overshoot_of(step, kernel, live, ITERATIONS)
    # the step divided by 1 + rho, and the gain 1 / (1 + rho)
    tl.store(bounded_ptr + bh * C + t, step / (1.0 + rho), mask=live)
    tl.store(gain_ptr + bh, 1.0 / (1.0 + rho))


@triton.jit
def _normalize(x_ptr, g_ptr, out_ptr, R, D, DP: tl.constexpr, ROWS: tl.constexpr,
               EPS: tl.constexpr, UPCAST: tl.constexpr, BACKWARD: tl.constexpr):  # fmt: skip
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, DP)
    x = load_tile(x_ptr, r, c, R, D, D)
    if UPCAST:  # half precision in (autocast), fp32 arithmetic: tl.sqrt takes fp32/fp64
        x = x.to(tl.float32)
    norm = tl.sqrt(tl.sum(x * x, 1))
    scale = tl.maximum(norm, EPS)
    y = x / scale[:, None]
    if BACKWARD:  # dx = (g - y <y, g>) / scale, the projection only where not clamped
        g = load_tile(g_ptr, r, c, R, D, D).to(x.dtype)
        along = tl.where(norm >= EPS, tl.sum(y * g, 1), 0.0)
        y = (g - y * along[:, None]) / scale[:, None]
    store_tile(out_ptr, y, r, c, R, D, D)


def _normalize_launch(x: Tensor, grad: Tensor | None) -> Tensor:
    d = x.shape[-1]
    rows = x.reshape(-1, d).contiguous()
    g = rows if grad is None else grad.reshape(-1, d).contiguous()
    out = torch.empty_like(rows)
    block = 16
    _normalize[(triton.cdiv(rows.shape[0], block),)](
        rows, g, out, rows.shape[0], d, DP=triton.next_power_of_2(d), ROWS=block,
        EPS=1e-12, UPCAST=x.dtype in (torch.float16, torch.bfloat16), BACKWARD=grad is not None,
    )  # fmt: skip
    return out.view_as(x)


def l2_normalize_triton(x: Tensor) -> Tensor:
    """``hope::l2_normalize`` in one kernel launch."""
    return _normalize_launch(x, None)


def l2_normalize_backward_triton(x: Tensor, grad: Tensor) -> Tensor:
    """``hope::l2_normalize_backward`` in one kernel launch."""
    return _normalize_launch(x, grad)


def bounded_step_triton(kernel: Tensor, step: Tensor) -> tuple[Tensor, Tensor]:
    """``hope::bounded_step`` in one kernel launch: (step / (1 + rho), 1 / (1 + rho)).
    step [B, H_s, C] may be shared by the G = GH / H_s members of kernel [B, GH, C, C]."""
    c = kernel.shape[-1]
    flat_kernel = kernel.reshape(-1, c, c).contiguous()
    gain = kernel.new_empty(kernel.shape[:-2])
    bounded = kernel.new_empty(kernel.shape[:-1])
    _bounded_step[(flat_kernel.shape[0],)](
        flat_kernel, step.contiguous(), gain, bounded, c, kernel.shape[1], step.shape[1],
        CP=max(16, triton.next_power_of_2(c)), ITERATIONS=4,
    )  # fmt: skip
    return bounded, gain


def flat_heads(t: Tensor) -> Tensor:
    """[B, H, r, c] -> contiguous [B*H, r, c] (one program per leading index)."""
    return t.reshape(-1, *t.shape[-2:]).contiguous() if t.dim() > 2 else t.contiguous()


def launch_sizes(w1: Tensor, k: Tensor) -> dict[str, Any]:
    """Runtime sizes of a chunk write (k [.., C, I], w1 [.., O, M]) and the padded
    compile-time ones."""
    c, i = k.shape[-2:]
    o, m = w1.shape[-2:]

    def pad(n: int) -> int:
        return max(16, triton.next_power_of_2(n))

    cp = pad(c)
    return {
        "C": c, "I": i, "O": o, "M": m, "CP": cp, "IP": pad(i), "OP": pad(o),
        "BLOCK_M": min(64, pad(m)), "SQUARINGS": cp.bit_length() - 2,
        "DOT": dot_precision(w1),
    }  # fmt: skip


def dgd_chunk_triton(
    w1: Tensor, w2: Tensor, k: Tensor, e: Tensor, a: Tensor, d: Tensor,
    eta: Tensor, alpha: Tensor, w2k: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``hope::dgd_chunk`` in one kernel launch (shapes as ``chunk_dgd_update``)."""
    ins = [flat_heads(x) for x in (w1, w2, k, e, a, d, eta.reshape(-1, eta.shape[-1]),
                              alpha.reshape(-1, alpha.shape[-1]), w2k)]  # fmt: skip
    outs = [torch.empty_like(x) for x in (ins[0], ins[1], ins[0], ins[1])]
    heads = {"GH": w1.shape[1], "HK": k.shape[1]}
    _dgd_chunk_fwd[(ins[0].shape[0],)](*ins, *outs, **heads, **launch_sizes(w1, k))
    return outs[0].view_as(w1), outs[1].view_as(w2), outs[2].view_as(w1), outs[3].view_as(w2)


def dgd_chunk_backward_triton(
    inputs: tuple[Tensor, ...],
    g_w1: Tensor,
    g_w2: Tensor,
    g_inc1: Tensor | None,
    g_inc2: Tensor | None,
) -> tuple[Tensor, ...]:
    """``hope::dgd_chunk_backward`` in one kernel launch."""
    w1, w2, k, e, a, d, eta, alpha, w2k = inputs
    ins = [flat_heads(x) for x in (w1, w2, k, e, a, d, eta.reshape(-1, eta.shape[-1]),
                              alpha.reshape(-1, alpha.shape[-1]), w2k)]  # fmt: skip
    gw1, gw2 = flat_heads(g_w1), flat_heads(g_w2)
    gi1 = gw1 if g_inc1 is None else flat_heads(g_inc1)
    gi2 = gw2 if g_inc2 is None else flat_heads(g_inc2)
    outs = [torch.empty_like(x) for x in ins]
    _dgd_chunk_bwd[(ins[2].shape[0],)](
        *ins, gw1, gw2, gi1, gi2, *outs, GH=w1.shape[1], HK=k.shape[1],
        HAS_GI1=g_inc1 is not None, HAS_GI2=g_inc2 is not None, **launch_sizes(w1, k),
    )  # fmt: skip
    return tuple(out.view_as(x) for out, x in zip(outs, inputs, strict=True))
