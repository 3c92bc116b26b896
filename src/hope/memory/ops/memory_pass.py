"""A memory's whole chunk-start pass as one operator (backend ``fused``):
``hope::memory_pass`` and its backward ``hope::memory_pass_backward``.

Before each chunk write, an MLP memory M(z) = [s z +] W1 gelu(W2 z) (NL-arXiv eqs.
89/91, Ti eq. 12) is evaluated at its chunk-start weights on the chunk's values v
(the SMT's self-generated targets v_hat = M(v), NL-arXiv eq. 84), keys k and queries
q (the reads, eq. 94), and at the keys it yields the rank-1 factors of the inner
gradient (MECHANISMS §3 step 6), the curvature bound and the chunk's kernel bound
(``residual_mlp.chunk_pass``, which is the reference). As PyTorch ops that pass is
~45 kernels forward and ~60 backward per memory group and chunk, plus a copy of
v, k, q per stacked member; here it is one launch each way.

With ``members`` = G memories stacked along the head axis (w1 [B, G*H, O, M],
w2 [B, G*H, M, I]) the inputs v, k, q [B, H, ·, I] are shared by every member
(stacked head g*H + h reads head h), so they are never repeated, and their
gradients are summed over the members inside the backward.

Forward, per stacked head, with a = gelu(W2 k), g' = gelu'(W2 k):
  out = M(z) for z in v, q (v_hat, read) and pred = M(k);
  target = v_hat, or the given one (Titans); E = 2 (pred - target) (l2) or -target;
  D = (E W1) ⊙ g';  curvature = ||a||^2 + ||k||^2 back_sq, back_sq = sum_m g'_m^2 ||W1_:m||^2;
  coupling = |a a^T| + |k k^T| ⊙ sqrt(back_sq) sqrt(back_sq)^T  (no gradient).
Backward (``memory_pass_backward_reference``): the chain rule through those lines,
target a constant of E's inner loss but in the outer graph (eq. 84).

On CUDA each direction is one Triton kernel (``triton_pass.py``); on other devices
the same closed forms in PyTorch ops, so a CPU counts the launches a GPU pays.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import Tensor
from torch.nn import functional as F

from hope.layers import gelu_prime
from hope.memory.ops.stacking import repeat_heads, sum_members

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# (v_hat, read, E, A, D, pre, curvature, back_sq, coupling)
PassOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
# d(w1, w2, k, v, q, target)
PassGrads = tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]


def _members(w1: Tensor, k: Tensor) -> int:
    return w1.shape[1] // k.shape[1]


def _stacked(t: Tensor | None, members: int) -> Tensor | None:
    return None if t is None else repeat_heads(t, members)


def _skip(scale: Tensor | None, residual: bool, like: Tensor) -> Tensor | float:
    """The residual coefficient s per stacked head ([1, G*H, 1, 1]) or for all."""
    if scale is not None:
        return scale.to(like.dtype).view(1, -1, 1, 1)
    return 1.0 if residual else 0.0


def _apply(w1: Tensor, w2: Tensor, z: Tensor, skip: Tensor | float) -> Tensor:
    return F.gelu(z @ w2.mT) @ w1.mT + skip * z


def memory_pass_reference(
    w1: Tensor,
    w2: Tensor,
    k: Tensor,
    v: Tensor | None,
    q: Tensor | None,
    target: Tensor | None,
    scale: Tensor | None,
    residual: bool,
    dot: bool,
) -> PassOutputs:
    """The forward in PyTorch ops (module docstring); shapes as ``memory_pass``."""
    g = _members(w1, k)
    keys, values, queries = _stacked(k, g), _stacked(v, g), _stacked(q, g)
    assert keys is not None
    skip = _skip(scale, residual, w1)
    pre = keys @ w2.mT
    act = F.gelu(pre)
    slope = gelu_prime(pre)
    pred = act @ w1.mT + skip * keys
    none = w1.shape[:2] + (0, w1.shape[-2])
    v_hat = w1.new_zeros(none) if values is None else _apply(w1, w2, values, skip)
    read = w1.new_zeros(none) if queries is None else _apply(w1, w2, queries, skip)
    tgt = v_hat if target is None else target
    err = -tgt if dot else 2.0 * (pred - tgt)
    hidden_err = (err @ w1) * slope
    back_sq = (slope * slope) @ (w1 * w1).sum(-2).unsqueeze(-1)
    back_sq = back_sq.squeeze(-1)
    curvature = (act * act).sum(-1) + (keys * keys).sum(-1) * back_sq
    back = back_sq.sqrt()
    outer = back[..., :, None] * back[..., None, :]
    coupling = (act @ act.mT).abs() + (keys @ keys.mT).abs() * outer
    return v_hat, read, err, act, hidden_err, pre, curvature, back_sq, coupling


def _sum_members(t: Tensor | None, heads: int) -> Tensor | None:
    return None if t is None else sum_members(t, heads)


def memory_pass_backward_reference(
    saved: tuple[Tensor | None, ...],
    residual: bool,
    dot: bool,
    grads: tuple[Tensor | None, ...],
) -> PassGrads:
    """d(w1, w2, k, v, q, target) of ``memory_pass`` in PyTorch ops. ``saved``: its
    inputs (w1, w2, k, v, q, target, scale) and its output E; ``grads``: the gradients
    of (v_hat, read, E, A, D, pre, curvature), None where zero."""
    w1, w2, k, v, q, target, scale, err = saved
    assert w1 is not None and w2 is not None and k is not None and err is not None
    g_vhat, g_read, g_err, g_act, g_hid, g_pre, g_curv = grads
    heads, g = k.shape[1], _members(w1, k)
    keys = _stacked(k, g)
    assert keys is not None
    skip = _skip(scale, residual, w1)
    pre = keys @ w2.mT
    act, slope = F.gelu(pre), gelu_prime(pre)
    zero = torch.zeros_like(pre)
    g_w1 = torch.zeros_like(w1)
    g_err = torch.zeros_like(err) if g_err is None else g_err.clone()
    g_slope, g_keys = zero.clone(), torch.zeros_like(keys)
    g_act_k = zero.clone() if g_act is None else g_act.clone()
    if g_hid is not None:  # D = (E W1) ⊙ g'
        g_errw1 = g_hid * slope
        g_slope += g_hid * (err @ w1)
        g_err += g_errw1 @ w1.mT
        g_w1 += err.mT @ g_errw1
    if g_curv is not None:  # curvature = ||a||^2 + ||k||^2 sum_m g'_m^2 ||W1_:m||^2
        col_sq = (w1 * w1).sum(-2)
        k_sq = (keys * keys).sum(-1)
        back_sq = ((slope * slope) @ col_sq.unsqueeze(-1)).squeeze(-1)
        g_act_k += 2.0 * act * g_curv.unsqueeze(-1)
        g_slope += 2.0 * slope * (g_curv * k_sq).unsqueeze(-1) * col_sq.unsqueeze(-2)
        g_w1 += 2.0 * w1 * ((g_curv * k_sq).unsqueeze(-2) @ (slope * slope))
        g_keys += 2.0 * keys * (g_curv * back_sq).unsqueeze(-1)
    g_pred = torch.zeros_like(err) if dot else 2.0 * g_err
    g_tgt = -g_err if dot else -2.0 * g_err
    if target is None:  # the target is v_hat = M(v): its gradient joins v_hat's
        g_vhat = g_tgt if g_vhat is None else g_vhat + g_tgt
    g_pre_k = g_slope * torch.exp(-0.5 * pre * pre) * _INV_SQRT_2PI * (2.0 - pre * pre)
    g_pre_k = g_pre_k + (g_act_k + g_pred @ w1) * slope
    if g_pre is not None:
        g_pre_k = g_pre_k + g_pre
    g_w1 += g_pred.mT @ act
    g_w2 = g_pre_k.mT @ keys
    g_keys += g_pre_k @ w2 + skip * g_pred
    g_rows: list[Tensor | None] = []
    for rows, g_out in ((v, g_vhat), (q, g_read)):
        z = _stacked(rows, g)
        if z is None:
            g_rows.append(None)
            continue
        g_out = z.new_zeros(*z.shape[:-1], w1.shape[-2]) if g_out is None else g_out
        pre_z = z @ w2.mT
        g_pre_z = (g_out @ w1) * gelu_prime(pre_z)
        g_w1 += g_out.mT @ F.gelu(pre_z)
        g_w2 += g_pre_z.mT @ z
        g_rows.append(g_pre_z @ w2 + skip * g_out)
    g_target = None if target is None else g_tgt
    g_k, g_v, g_q = (_sum_members(t, heads) for t in (g_keys, *g_rows))
    assert g_k is not None
    return g_w1, g_w2, g_k, g_v, g_q, g_target


@torch.library.custom_op("hope::memory_pass", mutates_args=())
def memory_pass(
    w1: Tensor,
    w2: Tensor,
    k: Tensor,
    v: Tensor | None,
    q: Tensor | None,
    target: Tensor | None,
    scale: Tensor | None,
    residual: bool,
    dot: bool,
) -> PassOutputs:
    """One memory pass (module docstring). w1 [B, G*H, O, M], w2 [B, G*H, M, I];
    k [B, H, C, I], v [B, H, C, I] or None (then ``target`` [B, G*H, C, O] is given),
    q [B, H, C_q, I] or None; ``scale`` [G*H] the 0/1 residual coefficient per stacked
    head, or None for ``residual`` on all; ``dot``: the dot-product inner loss, else l2.
    Returns v_hat [B, G*H, C or 0, O], read [B, G*H, C_q or 0, O], E [.., C, O],
    A, D, pre [.., C, M], curvature, back_sq [.., C], coupling [.., C, C]."""
    if w1.device.type == "cuda":
        from hope.memory.ops.triton_pass import memory_pass_triton

        return cast(PassOutputs, memory_pass_triton(w1, w2, k, v, q, target, scale, residual, dot))
    return memory_pass_reference(w1, w2, k, v, q, target, scale, residual, dot)


@memory_pass.register_fake
def _(
    w1: Tensor,
    w2: Tensor,
    k: Tensor,
    v: Tensor | None,
    q: Tensor | None,
    target: Tensor | None,
    scale: Tensor | None,
    residual: bool,
    dot: bool,
) -> PassOutputs:
    b, gh, o, m = w1.shape
    c = k.shape[2]
    rows = w1.new_empty(b, gh, c, m)
    return (
        w1.new_empty(b, gh, 0 if v is None else c, o),
        w1.new_empty(b, gh, 0 if q is None else q.shape[2], o),
        w1.new_empty(b, gh, c, o), rows, torch.empty_like(rows), torch.empty_like(rows),
        w1.new_empty(b, gh, c), w1.new_empty(b, gh, c), w1.new_empty(b, gh, c, c),
    )  # fmt: skip


@torch.library.custom_op("hope::memory_pass_backward", mutates_args=())
def memory_pass_backward(
    saved: list[Tensor | None],
    residual: bool,
    dot: bool,
    grads: list[Tensor | None],
) -> list[Tensor]:
    """d(w1, w2, k, v, q, target) of ``memory_pass`` (``memory_pass_backward_reference``);
    the gradient of an absent v, q or target is an empty tensor."""
    w1 = saved[0]
    assert w1 is not None
    out: tuple[Tensor | None, ...]
    if w1.device.type == "cuda":
        from hope.memory.ops.triton_pass import memory_pass_backward_triton

        out = memory_pass_backward_triton(tuple(saved), residual, dot, tuple(grads))
    else:
        out = memory_pass_backward_reference(tuple(saved), residual, dot, tuple(grads))
    return [w1.new_empty(0) if t is None else t for t in out]


@memory_pass_backward.register_fake
def _(
    saved: list[Tensor | None], residual: bool, dot: bool, grads: list[Tensor | None]
) -> list[Tensor]:
    like = saved[0]
    assert like is not None
    return [like.new_empty(0) if t is None else torch.empty_like(t) for t in saved[:6]]


def _pass_setup(ctx: Any, inputs: tuple[Any, ...], output: PassOutputs) -> None:
    w1, w2, k, v, q, target, scale, residual, dot = inputs
    ctx.has = (v is not None, q is not None, target is not None)
    ctx.options = (residual, dot)
    ctx.save_for_backward(w1, w2, k, v, q, target, scale, output[2])
    # Unused outputs (read in pass A, curvature in the SMT) get None, not zero tensors.
    ctx.set_materialize_grads(False)


def _pass_backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    has_v, has_q, has_target = ctx.has
    out = memory_pass_backward(list(ctx.saved_tensors), *ctx.options, list(grads[:7]))
    g_w1, g_w2, g_k, g_v, g_q, g_target = out
    return (
        g_w1, g_w2, g_k, g_v if has_v else None, g_q if has_q else None,
        g_target if has_target else None, None, None, None,
    )  # fmt: skip


memory_pass.register_autograd(_pass_backward, setup_context=_pass_setup)
