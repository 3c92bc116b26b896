"""Stacked memories applied to one shared input as one operator (backend ``fused``):
``hope::memory_apply`` and its backward ``hope::memory_apply_backward``.

The SMT reads its memories outside their writes: every chunk the generating memories
M_k, M_v, (M_q,) M_eta, M_alpha map the chunk's tokens to k, v, q, eta, alpha
(NL-arXiv eq. 83), and M_mem reads its queries whenever it is not written in the same
step (eq. 94). Stacked along the head axis (w1 [B, G*H, O, M], w2 [B, G*H, M, I]),
members ``first`` ... ``first + count - 1`` each compute M(z) = [s z +] W1 gelu(W2 z)
on the same z [B, H, T, I]. As PyTorch ops that is a copy of z per member, a slice of
the stacked state (bmm copies it), two products, the GELU and the skip: ~6 kernels
forward and ~10 backward. Here it is one launch each way; the backward sums z's
gradient over the members and gives zero gradients to the members not applied.

On CUDA each direction is one Triton kernel (``triton_apply.py``); elsewhere the same
closed forms in PyTorch ops. The kernels read z and the output's gradient through their
strides (``layouts.STRIDED_READS``); ``token_major`` lays the output out as
[B, T, count*H, O] (its [B, count*H, T, O] view is returned), so a caller that merges
the heads per token (MAC's retrieval before W_o) needs no copy either way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from hope.layers import gelu_prime
from hope.memory.ops.stacking import repeat_heads, sum_members


def _chosen(w1: Tensor, heads: int, first: int, count: int) -> slice:
    return slice(first * heads, (first + count) * heads)


def _skip(scale: Tensor | None, residual: bool, like: Tensor, part: slice) -> Tensor | float:
    if scale is not None:
        return scale[part].to(like.dtype).view(1, -1, 1, 1)
    return 1.0 if residual else 0.0


def memory_apply_reference(
    w1: Tensor, w2: Tensor, z: Tensor, scale: Tensor | None, residual: bool, first: int,
    count: int,
) -> Tensor:  # fmt: skip
    """The forward in PyTorch ops; -> [B, count*H, T, O]."""
    part = _chosen(w1, z.shape[1], first, count)
    zz = repeat_heads(z, count)
    out = F.gelu(zz @ w2[:, part].mT) @ w1[:, part].mT
    return out + _skip(scale, residual, w1, part) * zz


def memory_apply_backward_reference(
    w1: Tensor, w2: Tensor, z: Tensor, scale: Tensor | None, residual: bool, first: int,
    count: int, grad: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """d(w1, w2, z) of ``memory_apply`` given d(out) ``grad``, in PyTorch ops."""
    heads = z.shape[1]
    part = _chosen(w1, heads, first, count)
    zz = repeat_heads(z, count)
    pre = zz @ w2[:, part].mT
    g_pre = (grad @ w1[:, part]) * gelu_prime(pre)
    g_w1, g_w2 = torch.zeros_like(w1), torch.zeros_like(w2)
    g_w1[:, part] = grad.mT @ F.gelu(pre)
    g_w2[:, part] = g_pre.mT @ zz
    g_zz = g_pre @ w2[:, part] + _skip(scale, residual, w1, part) * grad
    return g_w1, g_w2, sum_members(g_zz, z.shape[1])


@torch.library.custom_op("hope::memory_apply", mutates_args=())
def memory_apply(
    w1: Tensor, w2: Tensor, z: Tensor, scale: Tensor | None, residual: bool, first: int,
    count: int, token_major: bool = False,
) -> Tensor:  # fmt: skip
    """Members ``first`` ... ``first + count - 1`` of a stack applied to z [B, H, T, I]
    (module docstring); ``scale`` [G*H] the 0/1 residual coefficient per stacked head,
    or None for ``residual`` on all. -> [B, count*H, T, O], member-major; with
    ``token_major`` a view of a dense [B, T, count*H, O]."""
    if w1.device.type == "cuda":
        from hope.memory.ops.triton_apply import memory_apply_triton

        return memory_apply_triton(w1, w2, z, scale, residual, first, count, token_major)
    out = memory_apply_reference(w1, w2, z, scale, residual, first, count)
    return _laid_out(out, token_major)


def _laid_out(out: Tensor, token_major: bool) -> Tensor:
    return out.transpose(1, 2).contiguous().transpose(1, 2) if token_major else out


@memory_apply.register_fake
def _(
    w1: Tensor, w2: Tensor, z: Tensor, scale: Tensor | None, residual: bool, first: int,
    count: int, token_major: bool = False,
) -> Tensor:  # fmt: skip
    out = w1.new_empty(z.shape[0], count * z.shape[1], z.shape[2], w1.shape[-2])
    return _laid_out(out, token_major)


@torch.library.custom_op("hope::memory_apply_backward", mutates_args=())
def memory_apply_backward(
    w1: Tensor, w2: Tensor, z: Tensor, scale: Tensor | None, residual: bool, first: int,
    count: int, grad: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """d(w1, w2, z) of ``memory_apply`` (``memory_apply_backward_reference``)."""
    args = (w1, w2, z, scale, residual, first, count, grad)
    if w1.device.type == "cuda":
        from hope.memory.ops.triton_apply import memory_apply_backward_triton

        return memory_apply_backward_triton(*args)
    return memory_apply_backward_reference(*args)


@memory_apply_backward.register_fake
def _(
    w1: Tensor, w2: Tensor, z: Tensor, scale: Tensor | None, residual: bool, first: int,
    count: int, grad: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return torch.empty_like(w1), torch.empty_like(w2), torch.empty_like(z)


def _apply_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    w1, w2, z, scale, residual, first, count, _ = inputs
    ctx.save_for_backward(w1, w2, z, scale)
    ctx.options = (residual, first, count)


def _apply_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    w1, w2, z, scale = ctx.saved_tensors
    g_w1, g_w2, g_z = memory_apply_backward(w1, w2, z, scale, *ctx.options, grad)
    return g_w1, g_w2, g_z, None, None, None, None, None


memory_apply.register_autograd(_apply_backward, setup_context=_apply_setup)
