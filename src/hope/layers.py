"""Building blocks shared by the memories and every variant: rotary embedding, MLPs, GELU's
derivative (RMSNorm, which has a fused form, is ``hope.memory.norm``).

Imports only torch, so `hope.memory` and `hope.model` can both use it."""

from __future__ import annotations

import math
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


class _GeluPrime(torch.autograd.Function):
    """gelu′(z) = Φ(z) + z φ(z) of the exact (erf) GELU, with the closed-form
    gelu″(z) = φ(z)(2 − z²) as its backward: it saves only z (already kept by the GELU
    itself) and runs one backward node instead of autograd's five."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, z: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(z)
        # gelu′(z) is GELU's backward of a unit signal: PyTorch's fused kernel on a
        # broadcast scalar one, two launches instead of the closed form's ten (9x
        # faster on a 2-core CPU at the tiny shape's [8, 20, 16, 64]).
        return gelu_backward(z.new_ones(()).expand_as(z), z)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (z,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad * torch.exp(-0.5 * z * z) * _INV_SQRT_2PI * (2.0 - z * z)


def gelu_prime(z: torch.Tensor) -> torch.Tensor:
    """d/dz GELU(z) for the exact GELU; differentiable (closed-form second derivative).
    The one gelu′ of the package: every rank-1 gradient factor of an MLP memory uses it."""
    return cast(torch.Tensor, _GeluPrime.apply(z))


def gelu_backward(signal: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """signal ⊙ gelu′(z) (the back-signal through a GELU at pre-activation z) in
    PyTorch's own fused GELU-backward kernel: one launch instead of gelu_prime's few;
    differentiable in both arguments. Equal to ``signal * gelu_prime(z)`` (tests)."""
    return torch.ops.aten.gelu_backward(signal, z)


def rotary_tables(
    head_dim: int, start: int, length: int, base: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [length, head_dim/2] for absolute positions start..start+length-1.

    Positions are absolute so a streamed call at offset ``start`` rotates exactly as
    the same tokens inside one long call (the streaming invariant).
    """
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=work) / head_dim)
    positions = torch.arange(start, start + length, device=device, dtype=work)
    angles = torch.outer(positions, inv_freq)  # [T, D/2]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :D/2], x[..., D/2:]) of x [B, H, T, D] by the position angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def swiglu_hidden(dim: int, mlp_ratio: float, multiple_of: int = 8) -> int:
    """Hidden width of a SwiGLU MLP with the parameter count of a GELU MLP of ratio mlp_ratio.

    SwiGLU has three matrices instead of two, so 2/3 of the GELU width keeps the size.
    """
    hidden = int(round(2.0 * mlp_ratio * dim / 3.0))
    return max(multiple_of, (hidden + multiple_of - 1) // multiple_of * multiple_of)


class MLP(nn.Module):
    """Position-wise MLP d -> hidden -> d; ``down`` is a residual projection (scaled init)."""

    def __init__(
        self, dim: int, hidden: int, activation: Literal["swiglu", "gelu"] = "swiglu"
    ) -> None:
        super().__init__()
        self.activation = activation
        width = 2 * hidden if activation == "swiglu" else hidden
        self.up = nn.Linear(dim, width, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.down.residual_projection = True  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.activation == "swiglu":
            gate, value = h.chunk(2, dim=-1)
            h = F.silu(gate) * value
        else:
            h = F.gelu(h)
        return self.down(h)
