"""Surprise gate per sample and per chunk (MECHANISMS §4 "Ours", §7.6)."""

from __future__ import annotations

import pytest
import torch

from conftest import F64
from hope.memory.cms import CMSLevel
from hope.memory.ops.cms_online import naive_online_level
from hope.memory.surprise import chunk_gate, token_mask, token_scores
from hope.optim.inner import GDRule

DIM = 4


def make_level(threshold: float | None, metric: str = "l2", period: int = 2) -> CMSLevel:
    torch.manual_seed(0)
    level = CMSLevel(
        DIM,
        6,
        period,
        GDRule(0.3),
        surprise_threshold=threshold,
        surprise_metric=metric,
        init_std=0.4,
    )
    return level.to(F64)


def scaled_teach(norms: list[list[float]]) -> torch.Tensor:
    """δ [B, T, d] with prescribed per-token norms."""
    direction = torch.randn(
        len(norms), len(norms[0]), DIM, dtype=F64, generator=torch.Generator().manual_seed(3)
    )
    direction = direction / direction.norm(dim=-1, keepdim=True)
    return direction * torch.tensor(norms, dtype=F64)[..., None]


def test_chunk_gate_compares_each_chunk_mean_with_the_threshold() -> None:
    scores = torch.tensor([[[1.0, 3.0], [0.5, 1.0]], [[0.2, 0.2], [4.0, 0.0]]])
    gate = chunk_gate(scores, threshold=1.0)  # means 2.0, 0.75 / 0.2, 2.0
    assert gate is not None and gate.tolist() == [[True, False], [False, True]]
    assert chunk_gate(scores, None) is None


def test_token_mask_keeps_the_tokens_at_or_above_the_threshold() -> None:
    scores = torch.tensor([[0.5, 1.0, 3.0]], dtype=torch.float64)
    masked = token_mask(scores, 1.0)
    assert masked is not None and masked.dtype == torch.float64
    assert masked.tolist() == [[0.0, 1.0, 1.0]]
    assert token_mask(scores, None) is None


@pytest.mark.parametrize("metric", ["loss", "entropy"])
def test_loss_and_entropy_metrics_require_the_value(metric: str) -> None:
    teach = torch.ones(1, 3, DIM)
    with pytest.raises(ValueError, match=metric):
        token_scores(metric, teach)
    value = torch.tensor([[1.0, 2.0, 3.0]])
    kw = {"token_loss": value} if metric == "loss" else {"token_entropy": value}
    torch.testing.assert_close(token_scores(metric, teach, **kw), value)
    with pytest.raises(ValueError, match="shape"):
        token_scores(metric, teach, **{k: v[:, :2] for k, v in kw.items()})
    level = make_level(1.0, metric)
    with pytest.raises(ValueError, match=metric):
        level.write(torch.ones(1, 3, DIM, dtype=F64), teach.to(F64), level.init_state(1, dtype=F64))


def test_l2_gate_blocks_and_permits_exactly_per_sample_and_chunk() -> None:
    # period 2, 6 tokens → chunks 0..2; chunk means (τ = 1):
    # sample 0: 2, 0.3, 2; sample 1: 0.3, 2, 0.3
    norms = [[2.0, 2.0, 0.3, 0.3, 2.0, 2.0], [0.3, 0.3, 2.0, 2.0, 0.3, 0.3]]
    teach = scaled_teach(norms)
    x = torch.randn(2, 6, DIM, dtype=F64, generator=torch.Generator().manual_seed(1))
    gated, open_ = make_level(1.0), make_level(None)
    _, gated_state = gated.teach_forward(x, teach, gated.init_state(2, dtype=F64))
    assert gated_state.updates.tolist() == [2.0, 1.0]
    # Reference: the ungated level fed only the chunks that pass, chunk by chunk.
    for b, passing in ((0, [0, 2]), (1, [1])):
        state = open_.init_state(1, dtype=F64)
        for n in range(3):
            chunk = slice(2 * n, 2 * n + 2)
            keep = 1.0 if n in passing else 0.0
            state = open_.write(x[b : b + 1, chunk], keep * teach[b : b + 1, chunk], state)
        torch.testing.assert_close(gated_state.delta_in[b], state.delta_in[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(gated_state.delta_out[b], state.delta_out[0], rtol=0, atol=1e-12)


def test_gate_with_loss_metric_and_token_mask() -> None:
    level = make_level(1.0, "loss", period=3)
    x = torch.randn(1, 6, DIM, dtype=F64, generator=torch.Generator().manual_seed(2))
    teach = scaled_teach([[1.0] * 6])
    loss = torch.tensor([[0.1, 0.2, 0.3, 2.0, 0.5, 1.5]], dtype=F64)  # chunk means 0.2, 1.33
    _, state = level.teach_forward(x, teach, level.init_state(1, dtype=F64), token_loss=loss)
    assert state.updates.tolist() == [1.0]
    # Only chunk 1 writes, and only its tokens with loss ≥ τ (token mask: positions 3 and 5).
    ref = make_level(None, period=3)
    mask = torch.tensor([0, 0, 0, 1, 0, 1], dtype=F64)[None, :, None]
    _, ref_state = ref.teach_forward(x, teach * mask, ref.init_state(1, dtype=F64))
    torch.testing.assert_close(state.delta_in, ref_state.delta_in, rtol=0, atol=1e-12)


def test_gated_teach_pass_equals_gated_online_with_pending() -> None:
    level = make_level(0.9, period=3)
    norms = [[0.2, 1.5, 2.0, 0.1, 0.3, 0.2, 1.0, 1.2, 0.9, 3.0, 0.1], [1.0] * 11]
    teach = scaled_teach(norms)
    x = torch.randn(2, 11, DIM, dtype=F64, generator=torch.Generator().manual_seed(4))
    state = level.write(x[:, :2], teach[:, :2], level.init_state(2, dtype=F64))
    y1, s1 = level.teach_forward(x[:, 2:], teach[:, 2:], state)
    y2, s2 = naive_online_level(level, x[:, 2:], teach[:, 2:], state)
    torch.testing.assert_close(y1, y2, rtol=0, atol=1e-12)
    torch.testing.assert_close(s1.delta_in, s2.delta_in, rtol=0, atol=1e-12)
    torch.testing.assert_close(s1.updates, s2.updates, rtol=0, atol=0)
    # sample 0 chunk means 1.23, 0.2, 1.03: two open; the last 2 tokens stay pending
    assert s1.updates.tolist() == [2.0, 3.0] and s1.pending == 2
