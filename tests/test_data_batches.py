"""Training and evaluation batches: determinism per (seed, step), shifts, windows, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hope.data.batches import eval_batches, num_eval_windows, random_batch
from hope.data.shards import ShardedTokens
from hope.errors import StageError


def counting_tokens(sizes: list[int]) -> ShardedTokens:
    """Token i has value i (mod 2**16), cut into shards of the given sizes."""
    values = np.arange(sum(sizes)) % 2**16
    edges = np.cumsum(sizes)[:-1]
    return ShardedTokens([a.astype(np.uint16) for a in np.split(values, edges)])


def test_random_batch_is_a_pure_function_of_seed_and_step() -> None:
    tokens = counting_tokens([700, 13, 1000])
    later = random_batch(tokens, 8, 33, seed=3, step=5)
    random_batch(tokens, 8, 33, seed=3, step=4)  # call history must not matter
    again = random_batch(tokens, 8, 33, seed=3, step=5)
    assert all(torch.equal(a, b) for a, b in zip(later, again, strict=True))
    other_step = random_batch(tokens, 8, 33, seed=3, step=6)[0]
    other_seed = random_batch(tokens, 8, 33, seed=4, step=5)[0]
    assert not torch.equal(later[0], other_step) and not torch.equal(later[0], other_seed)


def test_random_batch_targets_are_inputs_shifted() -> None:
    tokens = counting_tokens([50, 50, 900])  # windows often cross the shard edges
    x, y = random_batch(tokens, 16, 31, seed=0, step=0)
    assert x.shape == y.shape == (16, 31) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Consecutive stream positions: each row counts up by one, targets one ahead.
    assert torch.equal(y, x + 1)
    assert torch.equal(x - x[:, :1], torch.arange(31).expand(16, 31))


def test_random_batch_reaches_the_last_window_and_no_further() -> None:
    tokens = counting_tokens([20, 22])  # 42 tokens, T = 40: starts 0 and 1 only
    starts = {
        int(random_batch(tokens, 4, 40, seed=0, step=s)[0][i, 0])
        for s in range(20)
        for i in range(4)
    }
    assert starts == {0, 1}


def test_eval_batches_walk_the_split_in_order() -> None:
    tokens = counting_tokens([100, 5, 60])  # 165 tokens
    T = 16
    assert num_eval_windows(tokens, T) == (165 - 1) // 16 == 10
    batches = list(eval_batches(tokens, batch_size=4, seq_len=T, max_batches=0))
    assert [b[0].shape[0] for b in batches] == [4, 4, 2]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert torch.equal(x.flatten(), torch.arange(160))  # non-overlapping, from the start
    assert torch.equal(y, x + 1)
    capped = list(eval_batches(tokens, batch_size=4, seq_len=T, max_batches=2))
    assert len(capped) == 2 and torch.equal(capped[1][0], batches[1][0])


def test_too_short_split_is_a_clear_error() -> None:
    tokens = counting_tokens([10])
    with pytest.raises(StageError, match="10 tokens, fewer than seq_len \\+ 1 = 11"):
        random_batch(tokens, 2, 10, seed=0, step=0)
    with pytest.raises(StageError, match="data.seq_len"):
        next(eval_batches(tokens, 2, 10, max_batches=1))
    with pytest.raises(StageError, match="0 tokens"):
        random_batch(ShardedTokens([]), 1, 4, seed=0, step=0)
