"""The teach grid of pass A (MECHANISMS §8.3b): which piece each token of a call is in.

Pass A cuts every gradient path between pieces, so δ of piece m depends only on the
targets of piece m. Pieces are C1 tokens long (the finest CMS period) and the first
one completes the ``offset`` tokens a CMS level already buffered in earlier calls.
All values are static Python ints (no device syncs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PieceGrid:
    size: int  # C1
    offset: int = 0  # pending tokens before the call's first token, in [0, size)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.offset < self.size:
            raise ValueError(
                f"piece grid: size must be >= 1 and offset in [0, size); "
                f"got size={self.size}, offset={self.offset}"
            )

    def piece_of(self, t: int) -> int:
        """Piece index of call token t (t may be negative: tokens of earlier calls)."""
        return (t + self.offset) // self.size

    def bounds(self, length: int) -> list[tuple[int, int]]:
        """[start, stop) of the pieces covering a call of ``length`` tokens."""
        bounds, start = [], 0
        while start < length:
            stop = min(length, (self.piece_of(start) + 1) * self.size - self.offset)
            bounds.append((start, stop))
            start = stop
        return bounds

    def piece_ids(self, index: Tensor) -> Tensor:
        """Piece of each call token index (tensor form of ``piece_of``)."""
        return torch.div(index + self.offset, self.size, rounding_mode="floor")

    def same_piece(self, length: int, lags: int, device: torch.device) -> Tensor:
        """[length, lags] bool: token t and token t - (lags-1) + j share a piece.

        Tokens before the call (negative index) never share a piece with the call's
        tokens in pass A: the state carried into a call is detached.
        """
        t = torch.arange(length, device=device)[:, None]
        source = t - (lags - 1) + torch.arange(lags, device=device)[None, :]
        return (source >= 0) & (self.piece_ids(source) == self.piece_ids(t))
