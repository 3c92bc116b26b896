"""Micro-batching (train.micro_batch_size): gradient accumulation over row slices gives
the whole batch's step, with no host syncs, for every kind of fast state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hope
from conftest import tiny_lm
from hope.bench.measure import count_host_syncs
from hope.optim.outer import build_optimizer
from hope.train.step import evaluate_loss, micro_slices, train_step


def tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_micro_slices_cover_the_rows_in_order() -> None:
    assert micro_slices(5, None) == [slice(0, 5)]
    assert micro_slices(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert micro_slices(4, 4) == [slice(0, 4)]


@pytest.mark.parametrize("variant", ["hope", "hope_attention", "titans_mac", "transformer"])
def test_accumulated_step_equals_the_whole_batch_step(variant: str) -> None:
    """float64: loss, every gradient and the parameters after one AdamW step are the
    whole batch's for micro-batches of 2 (and a ragged 3 + 2) out of 5 rows."""
    x, y = tokens(5, 12, 1), tokens(5, 12, 2)
    results = {}
    for micro in (None, 2, 3):
        model = tiny_lm(variant)
        cfg = hope.load_config(None, ["optim.lr=0.01"])
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        loss = train_step(model, optimizer, scheduler, x, y, grad_clip=0.0, micro_batch=micro)
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        params = [p.detach().clone() for p in model.parameters()]
        results[micro] = (loss, grads, params)
    whole = results[None]
    assert len(whole[1]) == len(list(tiny_lm(variant).parameters()))
    for micro in (2, 3):
        loss, grads, params = results[micro]
        torch.testing.assert_close(loss, whole[0], rtol=0, atol=1e-12)
        for got, want in zip(grads, whole[1], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        for got, want in zip(params, whole[2], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_micro_batched_step_and_eval_make_no_host_syncs() -> None:
    model = tiny_lm("hope")
    optimizer = build_optimizer(model, hope.load_config(None, ["optim.lr=0.01"]).optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    x, y = tokens(4, 8, 1), tokens(4, 8, 2)
    train_step(model, optimizer, scheduler, x, y, 1.0, micro_batch=1)  # optimizer state
    with count_host_syncs() as calls:
        train_step(model, optimizer, scheduler, x, y, 1.0, micro_batch=1)
        value = evaluate_loss(model, [(x, y)], torch.device("cpu"), None, micro_batch=3)
        assert calls == []
    whole = evaluate_loss(model, [(x, y)], torch.device("cpu"), None)
    torch.testing.assert_close(value, whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize("value", [0, 9])
def test_micro_batch_size_outside_the_batch_is_refused(value: int) -> None:
    with pytest.raises(hope.ConfigError, match=rf"train.micro_batch_size={value}"):
        hope.load_config(None, ["train.batch_size=8", f"train.micro_batch_size={value}"])


def test_training_run_with_micro_batches_matches_the_whole_batch_run(tmp_path: Path) -> None:
    """The same run (fp32) with micro-batches of 1 row: equal metrics within fp32
    summation-order noise."""
    from test_train_loop import run

    whole = run(tmp_path / "whole")
    micro = run(tmp_path / "micro", "train.micro_batch_size=1")
    assert micro["val_subset_loss"] == pytest.approx(whole["val_subset_loss"], rel=1e-4)
    assert micro["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-4)
