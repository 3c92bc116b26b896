"""RMSNorm as a single operator each way (backend ``fused``): on CUDA one Triton kernel
forward and two launches backward (``triton_norm.py``: the rows' gradients with each
block's share of the weight's, then that share summed), elsewhere the same closed form
in PyTorch ops. Eager RMSNorm launches six kernels forward and about ten backward, and
MAC runs two norms in every segment (``model/titans.py``): about a quarter of a fused
``titans_mac`` step's launches at the pilot chunking.

    r = 1 / sqrt(mean(x²) + eps),  x̂ = x r,  y = x̂ ⊙ w
    dx = r (u − x̂ mean(u ⊙ x̂)),  u = g ⊙ w;   dw = Σ_rows g ⊙ x̂

computed in fp32 for half-precision inputs (bf16 autocast must not lose the scale),
in the input's dtype otherwise; y and dx in the input's dtype, dw in the weight's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _work(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """y = x / rms(x) ⊙ w over the last axis, in PyTorch ops (autograd's reference)."""
    work = _work(x)
    normed = work * torch.rsqrt(work.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.to(normed.dtype)).to(x.dtype)


def rms_norm_backward_reference(
    x: Tensor, weight: Tensor, grad: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """(dL/dx, dL/dw) of ``rms_norm_reference`` given dL/dy, in closed form."""
    work = _work(x)
    g = grad.to(work.dtype)
    rstd = torch.rsqrt(work.pow(2).mean(dim=-1, keepdim=True) + eps)
    normed = work * rstd
    u = g * weight.to(work.dtype)
    dx = rstd * (u - normed * (u * normed).mean(dim=-1, keepdim=True))
    dw = (g * normed).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@torch.library.custom_op("hope::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rms_norm_reference`` in one launch."""
    if x.device.type == "cuda":
        from hope.memory.ops.triton_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps).contiguous()  # dense, as the kernel's


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("hope::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    x: Tensor, weight: Tensor, grad: Tensor, eps: float, weight_grad: bool = True
) -> tuple[Tensor, Tensor]:
    """The gradients of ``rms_norm`` (``rms_norm_backward_reference``); without
    ``weight_grad`` the weight's is an empty tensor (a caller that takes it later, for
    several calls at once: ``loop_shared``), and the kernel's blocks are not summed."""
    if x.device.type == "cuda":
        from hope.memory.ops.triton_norm import rms_norm_backward_triton

        return rms_norm_backward_triton(x, weight, grad, eps, weight_grad)
    dx, dw = rms_norm_backward_reference(x, weight, grad, eps)
    return dx.contiguous(), dw if weight_grad else weight.new_empty(0)


@rms_norm_backward.register_fake
def _(
    x: Tensor, weight: Tensor, grad: Tensor, eps: float, weight_grad: bool = True
) -> tuple[Tensor, Tensor]:
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return dx, torch.empty_like(weight) if weight_grad else weight.new_empty(0)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
    x, weight = ctx.saved_tensors
    dx, dw = rms_norm_backward(x, weight, grad, ctx.eps)
    return dx, dw, None


rms_norm.register_autograd(_backward, setup_context=_setup)
