"""Batches for training and evaluation, cut from a split's token stream.

``random_batch`` is a pure function of ``(seed, step)``: a resumed run draws the
very batches an uninterrupted one would, with no sampler state to checkpoint.
``eval_batches`` walks the split from its start in non-overlapping windows, so
every evaluation of every model sees the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from hope.data.shards import ShardedTokens
from hope.errors import StageError


def _check_length(tokens: ShardedTokens, seq_len: int) -> None:
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if tokens.num_tokens < seq_len + 1:
        raise StageError(
            f"the split has {tokens.num_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "use more data or a smaller data.seq_len"
        )


def _pair(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T+1] windows -> inputs x and next-token targets y, both int64 [B, T]."""
    tensor = torch.from_numpy(windows)
    return tensor[:, :-1].contiguous(), tensor[:, 1:].contiguous()


def random_batch(
    tokens: ShardedTokens, batch_size: int, seq_len: int, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` windows at uniform random offsets drawn from ``(seed, step)`` alone."""
    _check_length(tokens, seq_len)
    rng = np.random.default_rng([seed, step])
    # The last valid start leaves room for T inputs plus one more target.
    starts = rng.integers(0, tokens.num_tokens - seq_len, size=batch_size)
    windows = np.stack([tokens.window(int(s), seq_len + 1) for s in starts])  # [B, T+1]
    return _pair(windows)


def num_eval_windows(tokens: ShardedTokens, seq_len: int) -> int:
    """Windows of T inputs at stride T; each needs one token past its end as a target."""
    return (tokens.num_tokens - 1) // seq_len


def eval_batches(
    tokens: ShardedTokens, batch_size: int, seq_len: int, max_batches: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Windows at offsets 0, T, 2T, ... (each token is a target once), ``batch_size`` at a time.

    ``max_batches <= 0`` means all of them; the last batch may be smaller.
    """
    _check_length(tokens, seq_len)
    total = num_eval_windows(tokens, seq_len)
    if max_batches > 0:
        total = min(total, max_batches * batch_size)
    for first in range(0, total, batch_size):
        count = min(batch_size, total - first)
        windows = np.stack(
            [tokens.window((first + i) * seq_len, seq_len + 1) for i in range(count)]
        )  # [b, T+1]
        yield _pair(windows)
