"""A pointwise step of the memories as a single operator (backend ``fused``), each with
its gradient written out; on CUDA one Triton kernel each way (``triton_kernels.py``),
elsewhere the same closed form in PyTorch ops.

- ``hope::l2_normalize``: the SMT normalises its generated keys, values and queries in
  every chunk (NL-arXiv eq. 83; v as k, ``SelfModifyingTitans._generate``):
  ``F.normalize`` launches three kernels forward and about fifteen in backward (18% of
  a fused ``hope`` step's launches at the pilot chunking).
      y = x / max(||x||, eps),   dx = (g - y <y, g>) / ||x||   (g / eps where ||x|| < eps).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

EPS = 1e-12  # F.normalize's


def l2_normalize_backward_reference(x: Tensor, grad: Tensor) -> Tensor:
    """dL/dx of y = ``F.normalize(x, dim=-1)`` given dL/dy, in PyTorch ops."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    scale = norm.clamp_min(EPS)
    y = x / scale
    along = torch.where(norm >= EPS, (y * grad).sum(-1, keepdim=True), 0.0)
    return (grad - y * along) / scale


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
