"""The rotary position embedding as a single operator (backend ``fused``): on CUDA one
Triton kernel each way (``triton_rotary.py``, reading x through its strides: q and k
are views of the fused qkv projection), elsewhere ``hope.layers.apply_rotary``. Eager
rotary launches seven kernels forward and about eight backward, and MAC rotates its
memory tokens' keys in every segment (``model/sliding_attention.py``).

    y = (x1 cos − x2 sin, x2 cos + x1 sin),   x = (x1, x2) halves of the head dim

The backward is the rotation by the opposite angles (sin → −sin), the same kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hope.layers import apply_rotary


def rotary_reference(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    """x [B, H, T, D] rotated by the angles of cos, sin [T, D/2] (by their negatives when
    ``inverse``), in PyTorch ops."""
    return apply_rotary(x, cos, -sin if inverse else sin)


@torch.library.custom_op("hope::rotary", mutates_args=())
def rotary(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    """``rotary_reference`` in one launch; the result is dense."""
    if x.device.type == "cuda":
        from hope.memory.ops.triton_rotary import rotary_triton

        return rotary_triton(x, cos, sin, inverse)
    return rotary_reference(x, cos, sin, inverse).contiguous()


@rotary.register_fake
def _(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    _, cos, sin, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.inverse = inverse


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
    cos, sin = ctx.saved_tensors
    return rotary(grad, cos, sin, not ctx.inverse), None, None, None


rotary.register_autograd(_backward, setup_context=_setup)
