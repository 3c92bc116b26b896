"""A pointwise step of the memories as a single operator (backend ``fused``), each with
its gradient written out; on CUDA one Triton kernel each way (``triton_kernels.py``),
elsewhere the same closed form in PyTorch ops.

- ``hope::l2_normalize``: the SMT normalises its generated keys, values and queries in
  every chunk (NL-arXiv eq. 83; v as k, ``SelfModifyingTitans._generate``):
  ``F.normalize`` launches three kernels forward and fourteen in backward (18% of
  a fused ``hope`` step's launches at the pilot chunking).
      y = x / max(||x||, eps),   dx = (g - y <y, g>) / ||x||   (g / eps where ||x|| < eps).
  Its PyTorch form with the same backward (``unit_rows_torch``) is the other
  backends' normalisation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

EPS = 1e-12  # F.normalize's


def _unit_rows_forward(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(y, ||x||, max(||x||, eps)) of y = x / max(||x||, eps) over the last axis."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    scale = norm.clamp_min(EPS)
    return x / scale, norm, scale


def _unit_rows_backward(y: Tensor, norm: Tensor, scale: Tensor, grad: Tensor) -> Tensor:
    """dL/dx = (g - y <y, g>) / ||x|| (g / eps where ||x|| < eps), from the forward's
    tensors: six launches."""
    along = (y * grad).sum(-1, keepdim=True).masked_fill_(norm < EPS, 0.0)
    return torch.addcmul(grad, y, along, value=-1.0).div_(scale)


def l2_normalize_backward_reference(x: Tensor, grad: Tensor) -> Tensor:
    """dL/dx of y = ``F.normalize(x, dim=-1)`` given dL/dy, in PyTorch ops."""
    return _unit_rows_backward(*_unit_rows_forward(x), grad)


class _UnitRows(torch.autograd.Function):
    """``F.normalize(x, dim=-1)`` with its gradient written out (the ``torch`` backend's
    form): the forward's three launches, and six backward instead of autograd's 14
    through the norm, the clamp and the division; forward and backward 20-25% faster
    on a 2-core CPU at the SMT's chunk shapes. For a 1-wide row the gradient is exactly
    0 (autograd's is rounding error over ||x||)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        y, norm, scale = _unit_rows_forward(x)
        ctx.save_for_backward(y, norm, scale)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        y, norm, scale = ctx.saved_tensors
        return _unit_rows_backward(y, norm, scale, grad)


def unit_rows_torch(x: Tensor) -> Tensor:
    """x / max(||x||, eps) over the last axis in PyTorch ops (``_UnitRows``)."""
    return _UnitRows.apply(x)  # type: ignore[no-any-return]


@torch.library.custom_op("hope::l2_normalize", mutates_args=())
def l2_normalize(x: Tensor) -> Tensor:
    """``F.normalize(x, dim=-1)`` in one launch."""
    if x.device.type == "cuda":
        from hope.memory.ops.triton_kernels import l2_normalize_triton

        return l2_normalize_triton(x)
    return F.normalize(x, dim=-1, eps=EPS)


@l2_normalize.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("hope::l2_normalize_backward", mutates_args=())
def l2_normalize_backward(x: Tensor, grad: Tensor) -> Tensor:
    """The gradient of ``l2_normalize`` (``l2_normalize_backward_reference``)."""
    if x.device.type == "cuda":
        from hope.memory.ops.triton_kernels import l2_normalize_backward_triton

        return l2_normalize_backward_triton(x, grad)
    return l2_normalize_backward_reference(x, grad)


@l2_normalize_backward.register_fake
def _(x: Tensor, grad: Tensor) -> Tensor:
    return torch.empty_like(x)


def _setup(ctx: Any, inputs: tuple[Tensor, ...], output: Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx: Any, grad: Tensor) -> Tensor:
    (x,) = ctx.saved_tensors
    return l2_normalize_backward(x, grad)  # type: ignore[no-any-return]


l2_normalize.register_autograd(_backward, setup_context=_setup)
