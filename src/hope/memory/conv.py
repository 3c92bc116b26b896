"""Causal depthwise 1-D convolution with a carried tail (MECHANISMS §1, §3, §5).

y_t = sum_j w[:, j] * x_{t-(W-1)+j}: each channel mixes only its own past
W-1 values and the current one. The last W-1 inputs are returned as the
``tail`` so chained calls equal one call on the concatenated sequence.

With a ``PieceGrid`` (teach pass A, MECHANISMS §8.3b) the values are unchanged but a
tap whose source token lies in another piece reads it detached, so no gradient
crosses a piece boundary through the conv.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from hope.memory.pieces import PieceGrid


def causal_depthwise(x: Tensor, tail: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """y_t = sum_j weight[:, j] x_{t-(W-1)+j} of x [B, T, C] after the history tail
    [B, W-1, C], weight [C, W] (or per sample [B, C, W]) -> (y [B, T, C], the new tail
    [B, W-1, C]: the last W-1 inputs, a view)."""
    window = weight.shape[-1]
    padded = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, W-1+T, C]
    new_tail = padded[:, padded.shape[1] - (window - 1) :]
    if weight.dim() == 3:  # per sample: each sample's taps
        return torch.einsum("btcw,bcw->btc", padded.unfold(1, window, 1), weight), new_tail
    y = F.conv1d(padded.transpose(1, 2), weight.unsqueeze(1), groups=weight.shape[0])
    return y.transpose(1, 2), new_tail


class CausalDepthwiseConv(nn.Module):
    # Per-channel kernels [d, w], not a map between features: AdamW, not Muon/M3.
    vector_params = ("weight",)

    def __init__(self, channels: int, window: int, init_std: float = 0.02):
        super().__init__()
        if window < 1:
            raise ValueError(f"conv window must be >= 1, got {window}")
        self.channels, self.window = channels, window
        # Start near the identity (current tap = 1) so the conv does not scramble
        # inputs at init; small noise on the past taps gives them gradient.
        weight = torch.randn(channels, window) * init_std
        weight[:, -1] += 1.0
        self.weight = nn.Parameter(weight)

    def init_tail(self, batch_size: int) -> Tensor:
        """Zero history [B, W-1, C] (a fresh context has no past tokens)."""
        return torch.zeros(
            batch_size,
            self.window - 1,
            self.channels,
            dtype=self.weight.dtype,
            device=self.weight.device,
        )

    def forward(
        self, x: Tensor, tail: Tensor, pieces: PieceGrid | None = None
    ) -> tuple[Tensor, Tensor]:
        """x [B, T, C], tail [B, W-1, C] -> (y [B, T, C], new tail [B, W-1, C])."""
        if pieces is None:
            return causal_depthwise(x, tail, self.weight)
        padded = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, W-1+T, C]
        new_tail = padded[:, padded.shape[1] - (self.window - 1) :]
        return self._cut_at_pieces(padded, pieces), new_tail

    def _cut_at_pieces(self, padded: Tensor, pieces: PieceGrid) -> Tensor:
        """The same y, with taps from other pieces (and from the tail) detached."""
        length = padded.shape[1] - (self.window - 1)
        windows = padded.unfold(1, self.window, 1)  # [B, T, C, W], tap j reads t-(W-1)+j
        same = pieces.same_piece(length, self.window, padded.device)  # [T, W]
        windows = torch.where(same[None, :, None, :], windows, windows.detach())
        # A broadcast product and a sum over the W taps, not an einsum: its backward
        # would form the weight's gradient as C batched [B*T, 1] x [1, W] products
        # (2.4x the time of the whole call on a 2-core CPU at the smoke shape).
        return (windows * self.weight.to(padded.dtype)).sum(-1)
