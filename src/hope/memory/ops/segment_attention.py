"""Softmax attention over [P || context] (``masked_attention``, the sliding-window and
MAC attentions' core) and ``hope::segment_attention``, MAC's segment attention
Attn([P || h || S]) (Ti eq. 22) as one operator each way (backend ``fused``; one
Triton kernel each way on CUDA, ``triton_segment_attention.py``, plus a sum of P's
values' per-sample gradients backward).

Query i of a segment sees P, h_j and x_j for j <= i (``segment_visibility``). The
operator takes the memory tokens' keys and values as their projection h W_kv
[B, S, 2d] and rotates the keys itself, so that projection's gradient comes back as
one tensor. As PyTorch ops a segment's attention launches the keys' rotation, their
and the values' head layouts and concatenations, the scores, the mask, P's scores'
concatenation, the softmax, the weighted values and their token-major copy forward,
and about as many backward, once per segment.

Backward, with probs = softmax(scores) and y = probs V: dprobs = dy V^T,
dscores = probs (dprobs - <dy, y>), dq = dscores K, dK = dscores^T q, dV = probs^T dy,
dL/dp_scores = dscores over P's columns; the memory keys' gradient is rotated back
(the rotation by the opposite angles).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hope.layers import apply_rotary


def segment_visibility(length: int, device: torch.device) -> Tensor:
    """MAC's visibility [S, 2S] over [h || x]: query i sees h_j and x_j for j <= i.

    A deviation (docs/FAITHFULNESS.md): Ti eq. 22 attends to all of h; h_j reads the
    memory at token j's query, so a query before j seeing it would see the future."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return torch.cat((causal, causal), dim=1)


def masked_attention(
    q: Tensor, k: Tensor, values: Tensor, hidden: Tensor, p_scores: Tensor | None
) -> Tensor:
    """Softmax over [P || context]: q [B, H, T, D] scaled by 1/sqrt(D), k [B, H, K, D],
    values [B, H, N_p+K, D] (P's first when ``p_scores`` [B, H, T, N_p] is given),
    hidden [T, K] or [B, 1, T, K] (True: not visible) -> y [B, T, H, D]."""
    scores = torch.einsum("bhtd,bhkd->bhtk", q, k)
    scores = scores.masked_fill(hidden, float("-inf"))
    if p_scores is not None:
        scores = torch.cat((p_scores, scores), dim=-1)
    # Softmax in at least fp32 (bf16 autocast), in fp64 for fp64 checks.
    work = torch.float32 if scores.dtype in (torch.float16, torch.bfloat16) else scores.dtype
    probs = torch.softmax(scores, dim=-1, dtype=work).to(values.dtype)
    return torch.einsum("bhtk,bhkd->bthd", probs, values)


def segment_keys(
    k_mem: Tensor, v_mem: Tensor, k_seg: Tensor, v_seg: Tensor, p_values: Tensor | None
) -> tuple[Tensor, Tensor]:
    """A segment's keys [h || x] and values [P || h || x] along the tokens."""
    keys = torch.cat((k_mem, k_seg), dim=2)
    parts = [v_mem, v_seg]
    if p_values is not None:
        parts.insert(0, p_values.expand(v_mem.shape[0], -1, -1, -1))
    return keys, torch.cat(parts, dim=2)


def memory_heads(kv_mem: Tensor, cos: Tensor, sin: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """The memory tokens' keys (rotated by cos, sin [S, D/2]) and values [B, H, S, D]
    of their projection kv_mem [B, S, 2d] (the k rows' output, then the v rows')."""
    batch, length, width = kv_mem.shape
    k, v = kv_mem.view(batch, length, 2, heads, width // (2 * heads)).permute(2, 0, 3, 1, 4)
    return apply_rotary(k, cos, sin), v


def segment_attention_reference(
    q: Tensor,
    kv_mem: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_seg: Tensor,
    v_seg: Tensor,
    p_scores: Tensor | None,
    p_values: Tensor | None,
) -> Tensor:
    """y [B, S, H, D] of one segment: q [B, H, S, D] (rotated, scaled), the memory
    tokens' projection kv_mem [B, S, 2d] and their angles cos, sin [S, D/2]
    (``memory_heads``), the segment's keys and values [B, H, S, D], P's scores with the
    queries [B, H, S, N_p] and P's values [1 or B, H, N_p, D] (both or neither; per
    sample, e.g. expanded, their gradient is per sample too)."""
    k_mem, v_mem = memory_heads(kv_mem, cos, sin, q.shape[1])
    keys, values = segment_keys(k_mem, v_mem, k_seg, v_seg, p_values)
    hidden = ~segment_visibility(q.shape[2], q.device)
    return masked_attention(q, keys, values, hidden, p_scores).contiguous()


def segment_attention_backward_reference(
    inputs: tuple[Tensor | None, ...], grad: Tensor
) -> tuple[Tensor | None, ...]:
    """(dq, dkv_mem, dk_seg, dv_seg, dp_scores, dp_values) of
    ``segment_attention_reference`` at ``inputs`` given dL/dy [B, S, H, D], in PyTorch
    ops (the module docstring's closed form)."""
    q, kv_mem, cos, sin, k_seg, v_seg, p_scores, p_values = inputs
    assert q is not None and kv_mem is not None and cos is not None and sin is not None
    assert k_seg is not None and v_seg is not None
    k_mem, v_mem = memory_heads(kv_mem, cos, sin, q.shape[1])
    keys, values = segment_keys(k_mem, v_mem, k_seg, v_seg, p_values)
    length, n_p = q.shape[2], 0 if p_scores is None else p_scores.shape[-1]
    scores = torch.einsum("bhtd,bhkd->bhtk", q, keys)
    scores = scores.masked_fill(~segment_visibility(length, q.device), float("-inf"))
    if p_scores is not None:
        scores = torch.cat((p_scores, scores), dim=-1)
    probs = torch.softmax(scores, dim=-1)
    dy = grad.transpose(1, 2)  # [B, H, S, D]
    y = probs @ values
    d_scores = probs * (dy @ values.transpose(-1, -2) - (dy * y).sum(-1, keepdim=True))
    d_context = d_scores[..., n_p:]
    d_keys = d_context.transpose(-1, -2) @ q
    d_values = probs.transpose(-1, -2) @ dy
    d_pv = None if p_values is None else d_values[:, :, :n_p].clone()
    if p_values is not None and p_values.shape[0] != q.shape[0]:  # shared: summed here
        d_pv = d_values[:, :, :n_p].sum(0, keepdim=True)
    d_ps = None if p_scores is None else d_scores[..., :n_p].clone()
    v_part = d_values[:, :, n_p:]
    d_k_mem = apply_rotary(d_keys[:, :, :length], cos, -sin)  # the rotation's transpose
    d_kv = torch.stack((d_k_mem, v_part[:, :, :length]), dim=2)  # [B, H, 2, S, D]
    d_kv = d_kv.permute(0, 3, 2, 1, 4).reshape(kv_mem.shape)
    # fresh tensors: an operator's outputs may not alias one another
    parts = (d_keys[:, :, length:], v_part[:, :, length:])
    return (d_context @ keys, d_kv, *(t.clone() for t in parts), d_ps, d_pv)


@torch.library.custom_op("hope::segment_attention", mutates_args=())
def segment_attention(
    q: Tensor,
    kv_mem: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_seg: Tensor,
    v_seg: Tensor,
    p_scores: Tensor | None,
    p_values: Tensor | None,
) -> Tensor:
    """``segment_attention_reference`` in one launch, with the visibility (a deviation,
    docs/FAITHFULNESS.md) of ``segment_visibility``."""
    args = (q, kv_mem, cos, sin, k_seg, v_seg, p_scores, p_values)
    if q.device.type == "cuda":
        from hope.memory.ops.triton_segment_attention import segment_attention_triton

        return segment_attention_triton(*args)
    return segment_attention_reference(*args)


@segment_attention.register_fake
def _(
    q: Tensor,
    kv_mem: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_seg: Tensor,
    v_seg: Tensor,
    p_scores: Tensor | None,
    p_values: Tensor | None,
) -> Tensor:
    batch, heads, length, dim = q.shape
    return q.new_empty(batch, length, heads, dim)


# the inputs with a gradient: all but the angles (slots 2 and 3)
_DIFFERENTIABLE = (0, 1, 4, 5, 6, 7)


@torch.library.custom_op("hope::segment_attention_backward", mutates_args=())
def segment_attention_backward(inputs: list[Tensor | None], grad: Tensor) -> list[Tensor]:
    """The gradients of ``segment_attention`` (``segment_attention_backward_reference``):
    those of q, kv_mem, k_seg, v_seg, then of p_scores and p_values when given."""
    if grad.device.type == "cuda":
        from hope.memory.ops.triton_segment_attention import segment_attention_backward_triton

        found = segment_attention_backward_triton(tuple(inputs), grad)
    else:
        found = segment_attention_backward_reference(tuple(inputs), grad)
    return [t for t in found if t is not None]


@segment_attention_backward.register_fake
def _(inputs: list[Tensor | None], grad: Tensor) -> list[Tensor]:
    return [
        torch.empty_like(t) for i, t in enumerate(inputs) if i in _DIFFERENTIABLE and t is not None
    ]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*(t for t in inputs if t is not None))
    ctx.given = [t is not None for t in inputs]


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    saved = iter(ctx.saved_tensors)
    inputs = [next(saved) if given else None for given in ctx.given]
    found = iter(segment_attention_backward(inputs, grad))
    return tuple(
        next(found) if given and slot in _DIFFERENTIABLE else None
        for slot, given in enumerate(ctx.given)
    )


segment_attention.register_autograd(_backward, setup_context=_setup)
