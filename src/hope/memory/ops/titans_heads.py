"""``hope::titans_heads``: the Titans memory's inputs from its projections, as one
operator each way (backend ``fused``; one Triton kernel forward and one backward plus
a sum of the conv weight's per-sample gradients on CUDA, ``triton_heads.py``).

From one matmul's output [B, T, 3d + 3H], the pre-activations of x W_qkv [B, T, 3d]
followed by those of the gates x W_g + b [B, T, 3H] (Ti §4.4; one map, so x's gradient
is one matmul, not two and an add): SiLU, the causal depthwise conv after the carried
tail, the heads
q, k, v [B, H, T, d_h] with q and k L2-normalised, and the gates theta, eta, alpha =
sigmoid(.) [B, H, T], all dense; plus the conv's new tail. As PyTorch ops these launch
8 kernels forward and about 9 backward per call (SiLU, the tail's concatenation, the
conv, the heads' and gates' layouts, two normalisations, the sigmoid, and their
backwards), once per segment in ``titans_mac``.

Its backward is written out (``titans_heads_backward_reference``; tests compare it with
autograd of ``titans_heads_reference``, the composition the plain path runs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from hope.memory.conv import causal_depthwise
from hope.memory.ops.pointwise import l2_normalize_backward_reference

HeadsOut = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]
HeadsGrads = tuple[Tensor, Tensor, Tensor]


def split_projected(projected: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """[B, T, 3d + 3H] -> the qkv pre-activations [B, T, 3d] and the gates' [B, T, 3H]
    (column views)."""
    width = projected.shape[-1] - 3 * heads
    if width <= 0 or width % (3 * heads):
        raise ValueError(f"titans_heads: {projected.shape[-1]} columns for {heads} heads")
    pre, gate_pre = projected.split([width, 3 * heads], dim=-1)
    return pre, gate_pre


def titans_heads_reference(projected: Tensor, tail: Tensor, weight: Tensor, heads: int) -> HeadsOut:
    """(q, k, v [B, H, T, d_h], theta, eta, alpha [B, H, T], new tail [B, W-1, 3d]) of
    ``projected`` [B, T, 3d + 3H] (``split_projected``), the conv's ``tail``
    [B, W-1, 3d] and ``weight`` [3d, W] (or per sample [B, 3d, W]: its gradient is then
    per sample too), in PyTorch ops, every output dense."""
    pre, gate_pre = split_projected(projected, heads)
    batch, length, width = pre.shape
    conv, new_tail = causal_depthwise(F.silu(pre), tail, weight.to(pre.dtype))
    parts = conv.reshape(batch, length, 3, heads, width // (3 * heads)).permute(2, 0, 3, 1, 4)
    q, k, v = (t.contiguous() for t in parts.unbind(0))
    gates = torch.sigmoid(gate_pre).view(batch, length, 3, heads).permute(2, 0, 3, 1)
    theta, eta, alpha = (t.contiguous() for t in gates.unbind(0))
    dense_tail = new_tail.clone(memory_format=torch.contiguous_format)
    return F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, theta, eta, alpha, dense_tail


def titans_heads_backward_reference(
    inputs: tuple[Tensor, Tensor, Tensor], heads: int, grads: tuple[Tensor | None, ...]
) -> HeadsGrads:
    """(dL/dprojected, dL/dtail, dL/dweight) of ``titans_heads_reference`` given its
    outputs' gradients (None: zero), in PyTorch ops: the normalisations' backward, the
    conv's (a transposed conv for its inputs, a sum over tokens for its weight), SiLU'
    and the sigmoid's."""
    projected, tail, weight = inputs
    pre, gate_pre = split_projected(projected, heads)
    batch, length, width = pre.shape
    window, d_head = weight.shape[-1], width // (3 * heads)
    x = F.silu(pre)
    padded = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, W-1+T, 3d]
    conv, _ = causal_depthwise(x, tail, weight.to(pre.dtype))
    y = conv.view(batch, length, 3, heads, d_head)

    def token_major(g: Tensor | None, like: Tensor) -> Tensor:  # [B, H, T, ...] -> [B, T, H, ...]
        return torch.zeros_like(like) if g is None else g.transpose(1, 2)

    d_y = torch.stack(
        [l2_normalize_backward_reference(y[:, :, 0], token_major(grads[0], y[:, :, 0])),
         l2_normalize_backward_reference(y[:, :, 1], token_major(grads[1], y[:, :, 1])),
         token_major(grads[2], y[:, :, 2])],
        dim=2,
    ).reshape(batch, length, width)  # fmt: skip
    # y_t = sum_j w_j padded_{t+j}: padded_{t+j} gets w_j dy_t (per sample or shared w)
    taps = weight.to(pre.dtype).expand(batch, width, window)
    d_padded = d_y.new_zeros(batch, window - 1 + length, width)
    for j in range(window):
        d_padded[:, j : j + length] += taps[:, None, :, j] * d_y
    if grads[6] is not None:  # the new tail: the last W-1 padded positions
        d_padded = d_padded + F.pad(grads[6], (0, 0, length, 0))
    s = torch.sigmoid(pre)
    d_pre = d_padded[:, window - 1 :] * s * (1.0 + pre * (1.0 - s))
    # The outputs' gradients may come in fp32 beside bf16 activations (CUDA autocast
    # runs the normalisations in fp32): the product takes the wider dtype.
    common = torch.promote_types(d_y.dtype, padded.dtype)
    d_weight = torch.einsum("btc,btcw->bcw", d_y.to(common), padded.unfold(1, window, 1).to(common))
    d_weight = (d_weight.sum(0) if weight.dim() == 2 else d_weight).to(weight.dtype)
    gate = torch.sigmoid(gate_pre).view(batch, length, 3, heads)
    d_gate = torch.stack([token_major(g, gate[:, :, 0]) for g in grads[3:6]], dim=2)
    d_gate_pre = (d_gate * gate * (1.0 - gate)).view_as(gate_pre)
    d_projected = torch.cat([d_pre, d_gate_pre], dim=-1)
    return d_projected, d_padded[:, : window - 1].contiguous(), d_weight


@torch.library.custom_op("hope::titans_heads", mutates_args=())
def titans_heads(projected: Tensor, tail: Tensor, weight: Tensor, heads: int) -> HeadsOut:
    """``titans_heads_reference`` in one launch."""
    if projected.device.type == "cuda":
        from hope.memory.ops.triton_heads import titans_heads_triton

        return titans_heads_triton(projected, tail, weight, heads)
    return titans_heads_reference(projected, tail, weight, heads)


@titans_heads.register_fake
def _(projected: Tensor, tail: Tensor, weight: Tensor, heads: int) -> HeadsOut:
    batch, length, columns = projected.shape
    head = projected.new_empty(batch, heads, length, (columns - 3 * heads) // (3 * heads))
    gate = projected.new_empty(batch, heads, length)
    return (head, head.clone(), head.clone(), gate, gate.clone(), gate.clone(),
            projected.new_empty(tail.shape))  # fmt: skip


@torch.library.custom_op("hope::titans_heads_backward", mutates_args=())
def titans_heads_backward(
    projected: Tensor, tail: Tensor, weight: Tensor, heads: int, grads: list[Tensor | None]
) -> HeadsGrads:
    """The gradients of ``titans_heads`` (``titans_heads_backward_reference``); ``grads``
    those of its seven outputs, None where absent."""
    inputs = (projected, tail, weight)
    if projected.device.type == "cuda":
        from hope.memory.ops.triton_heads import titans_heads_backward_triton

        return titans_heads_backward_triton(inputs, heads, grads)
    return titans_heads_backward_reference(inputs, heads, tuple(grads))


@titans_heads_backward.register_fake
def _(
    projected: Tensor, tail: Tensor, weight: Tensor, heads: int, grads: list[Tensor | None]
) -> HeadsGrads:
    return tuple(torch.empty_like(t) for t in (projected, tail, weight))  # type: ignore[return-value]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs[:3])
    ctx.heads = inputs[3]
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    if all(g is None for g in grads):
        return (None,) * 4
    found = titans_heads_backward(*ctx.saved_tensors, ctx.heads, list(grads))
    return (*found, None)


titans_heads.register_autograd(_backward, setup_context=_setup)
