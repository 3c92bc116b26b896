"""The SMT's generation epilogue as one operator (backend ``fused``):
``hope::smt_generation`` and its backward.

Per chunk the generating memories' outputs (``hope::memory_apply``, stacked
member-major: M_k, M_v, [M_q,] M_eta, M_alpha) become (NL-arXiv eq. 83)

  k = norm(M_k(x)),  v = norm(M_v(x)),  q = norm(M_q(x) or x W_q),
  eta = s_eta softplus(M_eta(x)),  alpha = sigmoid(M_alpha(x) + b_alpha)

(v normalised like k: see ``SelfModifyingTitans._generate``). As PyTorch ops that is
about eight kernels forward and fifteen backward per chunk; here one each way, plus
the sum of b_alpha's per-sample gradient over the batch. On CUDA each direction is
one Triton kernel (``triton_generation.py``); elsewhere the same closed forms in
PyTorch ops. The scalar memories' outputs are their first column (their W1 rows are
padded with zeros to the stack's width).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from hope.memory.ops.pointwise import EPS, l2_normalize_backward_reference

Generation = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]  # k, v, q, eta, alpha


def _members(raw: Tensor, query: Tensor | None, heads: int) -> list[Tensor]:
    """raw [B, G*H, T, O] split into its members [B, H, T, O] (k, v, [q,] eta, alpha)."""
    parts = list(raw.split(heads, dim=1))
    want = 4 if query is not None else 5
    if len(parts) != want:
        raise ValueError(f"smt_generation: {len(parts)} stacked members, expected {want}")
    return parts


def smt_generation_reference(
    raw: Tensor, query: Tensor | None, alpha_bias: Tensor, eta_scale: float
) -> Generation:
    """The forward in PyTorch ops (module docstring). query [B, H, T, O] is x W_q, or
    None when M_q is the third member of ``raw``; alpha_bias [H] or per sample [B, H]."""
    parts = _members(raw, query, alpha_bias.shape[-1])
    k, v = F.normalize(parts[0], dim=-1, eps=EPS), F.normalize(parts[1], dim=-1, eps=EPS)
    q = F.normalize(parts[2] if query is None else query, dim=-1, eps=EPS)
    eta = eta_scale * F.softplus(parts[-2][..., 0])
    alpha = torch.sigmoid(parts[-1][..., 0] + alpha_bias[..., None])
    return k, v, q, eta, alpha


def smt_generation_backward_reference(
    raw: Tensor, query: Tensor | None, alpha: Tensor, eta_scale: float, grads: list[Tensor | None]
) -> tuple[Tensor, Tensor | None, Tensor]:
    """d(raw, query, b_alpha per sample [B, H]) given d(k, v, q, eta, alpha) (None where
    zero) and the forward's alpha."""
    heads = alpha.shape[1]
    parts = _members(raw, query, heads)
    g_k, g_v, g_q, g_eta, g_alpha = grads
    g_parts = [torch.zeros_like(p) for p in parts]
    for j, g in ((0, g_k), (1, g_v)):
        if g is not None:
            g_parts[j] = l2_normalize_backward_reference(parts[j], g)
    g_query = None
    if g_q is not None:
        if query is None:
            g_parts[2] = l2_normalize_backward_reference(parts[2], g_q)
        else:
            g_query = l2_normalize_backward_reference(query, g_q)
    if g_eta is not None:
        g_parts[-2][..., 0] = g_eta * eta_scale * torch.sigmoid(parts[-2][..., 0])
    g_bias = alpha.new_zeros(alpha.shape[:2])
    if g_alpha is not None:
        g_pre = g_alpha * alpha * (1.0 - alpha)
        g_parts[-1][..., 0] = g_pre
        g_bias = g_pre.sum(-1)
    if query is not None and g_query is None:
        g_query = torch.zeros_like(query)
    return torch.cat(g_parts, dim=1), g_query, g_bias


@torch.library.custom_op("hope::smt_generation", mutates_args=())
def smt_generation(
    raw: Tensor, query: Tensor | None, alpha_bias: Tensor, eta_scale: float
) -> Generation:
    """k, v, q [B, H, T, O], eta, alpha [B, H, T] from the generating members' outputs
    raw [B, G*H, T, O] (module docstring); alpha_bias [H]."""
    if raw.device.type == "cuda":
        from hope.memory.ops.triton_generation import smt_generation_triton

        return smt_generation_triton(raw, query, alpha_bias, eta_scale)
    return smt_generation_reference(raw, query, alpha_bias, eta_scale)


@smt_generation.register_fake
def _(raw: Tensor, query: Tensor | None, alpha_bias: Tensor, eta_scale: float) -> Generation:
    b, _, t, o = raw.shape
    h = alpha_bias.shape[0]
    rows = raw.new_empty(b, h, t, o)
    return (rows, torch.empty_like(rows), torch.empty_like(rows), raw.new_empty(b, h, t),
            raw.new_empty(b, h, t))  # fmt: skip


@torch.library.custom_op("hope::smt_generation_backward", mutates_args=())
def smt_generation_backward(
    raw: Tensor, query: Tensor | None, alpha: Tensor, eta_scale: float, grads: list[Tensor | None]
) -> tuple[Tensor, Tensor, Tensor]:
    """``smt_generation_backward_reference``; the gradient of an absent query is empty."""
    if raw.device.type == "cuda":
        from hope.memory.ops.triton_generation import smt_generation_backward_triton

        out = smt_generation_backward_triton(raw, query, alpha, eta_scale, grads)
    else:
        out = smt_generation_backward_reference(raw, query, alpha, eta_scale, grads)
    g_raw, g_query, g_bias = out
    return g_raw, raw.new_empty(0) if g_query is None else g_query, g_bias


@smt_generation_backward.register_fake
def _(
    raw: Tensor, query: Tensor | None, alpha: Tensor, eta_scale: float, grads: list[Tensor | None]
) -> tuple[Tensor, Tensor, Tensor]:
    g_query = raw.new_empty(0) if query is None else torch.empty_like(query)
    return torch.empty_like(raw), g_query, alpha.new_empty(alpha.shape[:2])


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Generation) -> None:
    raw, query, _, eta_scale = inputs
    ctx.save_for_backward(raw, query, output[4])
    ctx.eta_scale = eta_scale
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    raw, query, alpha = ctx.saved_tensors
    g_raw, g_query, g_bias = smt_generation_backward(raw, query, alpha, ctx.eta_scale, list(grads))
    return g_raw, None if query is None else g_query, g_bias.sum(0), None


smt_generation.register_autograd(_backward, setup_context=_setup)
