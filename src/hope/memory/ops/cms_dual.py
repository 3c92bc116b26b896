"""Dual (block-causal linear-attention) form of a CMS level's pass B (MECHANISMS §8.3b).

For an inner rule that is linear in (Δ, m, G) with scalar coefficients (plain GD with
retention, momentum; NL eq. 31), the delta in force during chunk n is

    Δ_n = c_n⁰ Δ_0 + c_n¹ m_0 + Σ_{i<n} c_n^(i) G_i,     G_i = Σ_{t∈i} u_t a_tᵀ,

with scalar coefficients c that depend only on the rule and the surprise gates. A read
through Δ_n never needs Δ_n itself:

    a_s Δ_nᵀ = c_n⁰ a_s Δ_0ᵀ + c_n¹ a_s m_0ᵀ + Σ_{t in chunks < n} c_n^(i(t)) (a_s·a_t) u_t,

i.e. block-causal linear attention over the earlier chunks (queries a_s, keys a_t,
values u_t). For W_in the values are u_t = (W_outᵀ-side back-signal) and for W_out
they are δ_t with keys the hidden activations. This replaces the per-chunk weight
stacks [B, n, h, d] of the materialised twin (``CMSLevel.chunk_deltas``) by [B, T, T]
score matrices and a short scan of small matmuls (one ``baddbmm`` per factor per
chunk), with exactly the same values and gradients (tests, float64).

The chunk-start factors (NL eq. 31) are still sequential over chunks: chunk j's hidden
layer and back-signal use Δ_j, which needs the factors of chunks < j.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from hope.memory.cms_state import ChunkLayout, LevelState
from hope.memory.ops.cms_factor_scan import cms_factor_scan, cms_factor_scan_reference
from hope.memory.ops.dispatch import resolve_backend
from hope.optim.inner import InnerRule

# Sources of Δ_n: 0 = carried Δ_0, 1 = carried momentum m_0, 2 + i = chunk i's G_i.
_CARRIED = 2


Matrix = tuple[tuple[float, ...], ...]


def _powers(
    step: Matrix, drive: tuple[float, ...], count: int, like: Tensor
) -> tuple[Tensor, Tensor]:
    """A^k [count + 1, P, P] and A^k b [count + 1, P] for k = 0..count, (A, b) the rule's
    open-gate step (``rule.linear_step``), on ``like``'s device and dtype: two launches
    (clones of a cached device copy, so never a host read a CUDA graph cannot capture),
    whatever ``count``."""
    matrices, vectors = _device_powers(step, drive, count, like.device, like.dtype)
    return matrices.clone(), vectors.clone()


@functools.lru_cache(maxsize=64)
def _device_powers(
    step: Matrix, drive: tuple[float, ...], count: int, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``_powers`` computed on the host in double precision and copied to ``device``
    once; hidden from dispatch modes (a one-time cost: counts do not depend on it)."""
    size = len(drive)
    power = [[float(i == j) for j in range(size)] for i in range(size)]
    matrices, vectors = [], []
    for _ in range(count + 1):
        matrices.append(power)
        vectors.append([sum(power[i][j] * drive[j] for j in range(size)) for i in range(size)])
        power = [
            [sum(step[i][m] * power[m][j] for m in range(size)) for j in range(size)]
            for i in range(size)
        ]
    with _disable_current_modes():
        host = (
            torch.tensor(matrices, dtype=torch.float64),
            torch.tensor(vectors, dtype=torch.float64),
        )
        m, v = (t.to(device, dtype, copy=True) for t in host)
    return m, v


def _step_of(rule: InnerRule) -> tuple[Matrix, tuple[float, ...]]:
    step, drive = rule.linear_step()
    return tuple(tuple(row) for row in step), tuple(drive)


def linear_coefficients(
    rule: InnerRule,
    gates: Tensor | None,
    n_fire: int,
    n_rows: int,
    batch: int,
    like: Tensor,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Coefficients of Δ_n over the sources, in closed form.

    Returns rows [B, n_rows, S] (Δ_n for n < n_rows), and the final Δ and momentum
    coefficients [B, S] after the n_fire updates (momentum None for a rule without it).
    A gated update is the rule's affine step (A, b) where the gate is open and the
    identity where it is closed, so with c_n = the open gates among updates 1..n, the
    state after n updates is A^(c_n) on the carried (Δ_0, m_0) plus, for every open
    update i <= n, A^(c_n - c_i) b times G_i: a gather from the powers of A, no device
    work per update (its twin, the rule stepped update by update on one-hot gradients, is
    tests/test_cms_dual.py::_stepped_coefficients).
    """
    return _closed_form(*_step_of(rule), gates, n_fire, n_rows, batch, like)


def _closed_form(
    step: Matrix,
    drive: tuple[float, ...],
    gates: Tensor | None,
    n_fire: int,
    n_rows: int,
    batch: int,
    like: Tensor,
) -> tuple[Tensor, Tensor, Tensor | None]:
    powers, driven_by = _powers(step, drive, n_fire, like)  # A^k [n_fire + 1, P, P], A^k b [.., P]
    size = powers.shape[-1]
    open_ = (
        like.new_ones(batch, n_fire)
        if gates is None
        else gates.to(like.dtype).expand(batch, n_fire)
    )
    zero = like.new_zeros(batch, 1)
    counts = torch.cat((zero, open_.cumsum(-1)), dim=-1).long()  # [B, n_fire + 1]: c_n
    carried = powers[counts]  # [B, n + 1, P, P]: A^(c_n)
    since = (counts[:, :, None] - counts[:, None, 1:]).clamp_min(0)  # c_n - c_i [B, n+1, F]
    driven = driven_by[since]  # [B, n + 1, F, P]: A^(c_n - c_i) b
    updates = torch.arange(1, n_fire + 1, device=like.device)
    after = torch.arange(n_fire + 1, device=like.device)[:, None] >= updates[None, :]  # n >= i
    driven = driven * (after[None, :, :, None] * open_[:, None, :, None])

    # state component k (0 = Δ, 1 = m) over the sources [Δ_0, m_0, G_1..G_F]
    def component(k: int) -> Tensor:
        carry = carried[..., k, :]  # [B, n + 1, P]
        if size == 1:
            carry = torch.cat((carry, torch.zeros_like(carry)), dim=-1)
        return torch.cat((carry, driven[..., k]), dim=-1)  # [B, n + 1, S]

    delta = component(0)
    momentum = component(1)[:, -1] if size == 2 else None
    return delta[:, :n_rows], delta[:, -1], momentum


def level_coefficients(
    rule: InnerRule,
    gates: Tensor | None,
    n_fire: int,
    n_rows: int,
    batch: int,
    like: Tensor,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``linear_coefficients`` on ``like``'s device and dtype. Without surprise gates the
    coefficients are the same for every sample and depend only on the rule and the
    counts: they are computed on the host for one sample (float64) and reach the device
    in one copy, expanded over the batch, instead of ~20 small launches per level per
    call. Same values: the gather and the 0/1 masks are exact.

    The device copy is cached too (``_device_table``): after a first call for a shape,
    a call copies nothing from the host, so a CUDA graph can capture it (a pageable
    host-to-device copy cannot be captured; ``hope.train.graphed``)."""
    if gates is not None:
        return linear_coefficients(rule, gates, n_fire, n_rows, batch, like)
    table, shapes = _device_table(*_step_of(rule), n_fire, n_rows, like.device, like.dtype)
    packed = table.clone()  # the cached table is never handed out, so never written
    sizes = [math.prod(shape) for shape in shapes]
    views = [
        flat.view(1, *shape).expand(batch, *shape)
        for flat, shape in zip(packed.split(sizes), shapes, strict=True)
    ]
    return views[0], views[1], views[2] if len(views) == 3 else None


@functools.lru_cache(maxsize=8)  # a few levels x (train, eval) lengths
def _ungated_table(
    step: Matrix, drive: tuple[float, ...], n_fire: int, n_rows: int
) -> tuple[Tensor, tuple[tuple[int, ...], ...]]:
    """One sample's ungated coefficients, flattened into one float64 host tensor, and
    the shapes (without the batch) of rows, final Δ and final momentum."""
    # Host constants, not device work: no dispatch mode active at the first call (the
    # bench's launch counter, a tracer) sees them, so a count does not depend on
    # whether the cache was warm.
    with _disable_current_modes():
        host = torch.empty(0, dtype=torch.float64)
        parts = [
            p for p in _closed_form(step, drive, None, n_fire, n_rows, 1, host) if p is not None
        ]
        packed = torch.cat([p.flatten() for p in parts])
    return packed, tuple(tuple(p.shape[1:]) for p in parts)


@functools.lru_cache(maxsize=64)  # levels x (train, eval) lengths x devices x dtypes
def _device_table(
    step: Matrix,
    drive: tuple[float, ...],
    n_fire: int,
    n_rows: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[Tensor, tuple[tuple[int, ...], ...]]:
    """``_ungated_table`` on ``device`` in ``dtype``, copied there once. The upload is a
    one-time cost like the host computation, hidden from dispatch modes alike."""
    packed, shapes = _ungated_table(step, drive, n_fire, n_rows)
    with _disable_current_modes():
        return packed.to(device, dtype, copy=True), shapes


def _carried(
    z: Tensor, delta0: Tensor, mom0: Tensor | None, c_delta: Tensor, c_mom: Tensor
) -> Tensor:
    """Σ over carried sources of c(token) · z Wᵀ; z [B, L, I], W [B, O, I] -> [B, L, O]."""
    out = c_delta[..., None] * (z @ delta0.detach().transpose(-1, -2).to(z.dtype))
    if mom0 is not None:
        out = out + c_mom[..., None] * (z @ mom0.detach().transpose(-1, -2).to(z.dtype))
    return out


def _widened(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in the wider of its dtype and ``dtype`` (a no-op outside autocast)."""
    return x.to(torch.promote_types(x.dtype, dtype))


def _scan_factors(
    w_in: Tensor,
    w_out: Tensor,
    layout: ChunkLayout,
    state: LevelState,
    token_coef: Tensor,
    carried: tuple[Tensor, Tensor],
    carries: bool,
) -> tuple[Tensor, Tensor]:
    """Hidden activations h_t and back-signals u_t = (δ_t W_out') ⊙ gelu'(z_t) of the
    fired chunks [B, F, h], at each chunk's start weights."""
    batch, _, chunk, dim = layout.inputs.shape
    fired = layout.n_fire * chunk
    inputs = layout.inputs.reshape(batch, -1, dim)
    teach = layout.teach.reshape(batch, -1, dim)
    c_delta, c_mom = carried
    # The dtype the carried terms' sum has (under autocast a bf16 matmul plus fp32
    # terms is fp32), also when a fresh state's zero terms are left out.
    wide = torch.promote_types(c_delta.dtype, inputs.dtype)
    pre_0 = _widened(inputs @ w_in.t(), wide)
    back_0 = _widened(teach @ w_out, wide)
    if carries:
        pre_0 = pre_0 + _carried(inputs, state.delta_in, state.mom_in, c_delta, c_mom)
        # δ_t W_out' = δ_t (W_out + Δ_out): the transpose side of the same carried terms.
        out_t0 = state.delta_out.transpose(-1, -2)
        mom_t0 = None if state.mom_out is None else state.mom_out.transpose(-1, -2)
        back_0 = back_0 + _carried(teach, out_t0, mom_t0, c_delta, c_mom)
    key_scores = (inputs @ inputs[:, :fired].transpose(1, 2)) * token_coef
    teach_scores = (teach @ teach[:, :fired].transpose(1, 2)) * token_coef
    scan = (pre_0, back_0, key_scores, teach_scores, chunk)
    if resolve_backend(None) == "fused":  # one operator instead of ~6 launches per chunk
        return cms_factor_scan(*scan)
    return cms_factor_scan_reference(*scan)


def dual_teach_read(
    w_in: Tensor,
    w_out: Tensor,
    rule: InnerRule,
    x_norm: Tensor,
    layout: ChunkLayout,
    state: LevelState,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor | None, Tensor | None]]:
    """Pass-B read y [B, T, d] of the call tokens through θ0 + sg(Δ_n), and the written
    (Δ_in, Δ_out, m_in, m_out) after the call. Same values as the materialised twin."""
    batch, n_rows, chunk, dim = layout.inputs.shape
    fired = layout.n_fire * chunk
    work = layout.inputs.dtype  # the scan's dtype: fp32, fp64 for an fp64 model
    # A fresh state's carried Δ_0, m_0 are zeros: their terms are left out (same values).
    carries = not state.carries_nothing()
    with torch.no_grad():
        rows, final_d, final_m = level_coefficients(
            rule, layout.gates, layout.n_fire, n_rows, batch, layout.inputs
        )
        per_token = rows.repeat_interleave(chunk, dim=1)  # [B, L, S]
        token_coef = per_token[..., _CARRIED:].repeat_interleave(chunk, dim=2)  # [B, L, F]
        carried = (per_token[..., 0], per_token[..., 1])
        w_in0, w_out0 = w_in.detach().to(work), w_out.detach().to(work)
        hidden, back = _scan_factors(w_in0, w_out0, layout, state, token_coef, carried, carries)
        inputs = layout.inputs.reshape(batch, -1, dim)[:, :fired]
        teach = layout.teach.reshape(batch, -1, dim)[:, :fired]
        new_state = _final_state(
            state, final_d, final_m, inputs, teach, hidden, back, chunk, carries
        )

    queries = slice(layout.offset, layout.offset + x_norm.shape[1])
    dtype = x_norm.dtype
    q_coef = token_coef[:, queries].to(dtype)
    q_delta, q_mom = (c[:, queries].to(dtype) for c in carried)
    wide = torch.promote_types(q_delta.dtype, dtype)  # the carried sum's dtype (see above)
    pre = _widened(x_norm @ w_in.t().to(dtype), wide)
    if carries:
        pre = pre + _carried(x_norm, state.delta_in, state.mom_in, q_delta, q_mom)
    pre = pre + ((x_norm @ inputs.transpose(1, 2).to(dtype)) * q_coef) @ back.to(dtype)
    act = F.gelu(pre)
    out = _widened(act @ w_out.t().to(dtype), torch.promote_types(q_delta.dtype, act.dtype))
    if carries:
        out = out + _carried(act, state.delta_out, state.mom_out, q_delta, q_mom)
    out = out + ((act @ hidden.transpose(1, 2).to(dtype)) * q_coef) @ teach.to(dtype)
    return out, new_state


def _final_state(
    state: LevelState,
    final_d: Tensor,
    final_m: Tensor | None,
    inputs: Tensor,
    teach: Tensor,
    hidden: Tensor,
    back: Tensor,
    chunk: int,
    carries: bool,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Δ and m after the call from their source coefficients: carried terms plus
    Σ_t c_(i(t)) u_t a_tᵀ (W_in) and Σ_t c_(i(t)) δ_t h_tᵀ (W_out)."""

    def combine(coef: Tensor, delta0: Tensor, mom0: Tensor | None, g: Tensor) -> Tensor:
        if not carries:  # c·0 terms; the dtype the sum would have had
            return _widened(g, torch.promote_types(coef.dtype, delta0.dtype))
        out = coef[:, 0, None, None] * delta0 + g
        return out if mom0 is None else out + coef[:, 1, None, None] * mom0

    def written(coef: Tensor) -> tuple[Tensor, Tensor]:
        per_token = coef[:, _CARRIED:].repeat_interleave(chunk, dim=1)[..., None]  # [B, F, 1]
        g_in = back.transpose(1, 2) @ (per_token * inputs)  # [B, h, d]
        g_out = (per_token * teach).transpose(1, 2) @ hidden  # [B, d, h]
        return g_in, g_out

    g_in, g_out = written(final_d)
    delta_in = combine(final_d, state.delta_in, state.mom_in, g_in)
    delta_out = combine(final_d, state.delta_out, state.mom_out, g_out)
    if final_m is None:
        return delta_in, delta_out, None, None
    m_in, m_out = written(final_m)
    assert state.mom_in is not None and state.mom_out is not None
    return (
        delta_in,
        delta_out,
        combine(final_m, state.delta_in, state.mom_in, m_in),
        combine(final_m, state.delta_out, state.mom_out, m_out),
    )
