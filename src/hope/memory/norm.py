"""RMSNorm, the norm of every variant's shell and of the CMS chain."""

from __future__ import annotations

import torch
from torch import nn

from hope.memory.ops.dispatch import rms_normalized


class RMSNorm(nn.Module):
    """y = x / rms(x) * g, computed in fp32 so bf16 autocast does not lose the scale;
    one operator each way under the ``fused`` backend (``memory/ops/rms_norm.py``)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_normalized(x, self.weight, self.eps)
