"""MQAR (hope.eval.recall): the task generator, the query-only loss, the accuracy
metric on models whose answer is known, config refusal, and the sync-free loop."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hope.bench.measure import count_host_syncs
from hope.config import Config, RecallConfig
from hope.errors import ConfigError
from hope.eval.recall import (
    RecallBatch,
    check_recall_config,
    mqar_batch,
    query_loss,
    recall_accuracy,
    train_recall,
)

REPO = Path(__file__).resolve().parents[1]
B, T, N, V = 16, 64, 8, 128


def _batch(seed: int = 0) -> RecallBatch:
    return mqar_batch(B, T, N, V, torch.Generator().manual_seed(seed))


def test_every_query_asks_for_a_value_bound_earlier_in_the_context() -> None:
    batch = _batch()
    seq = torch.cat([batch.inputs, batch.targets[:, -1:]], dim=1)  # [B, T+1]
    assert batch.inputs.shape == batch.targets.shape == batch.query_mask.shape == (B, T)
    assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])  # next-token targets
    for row in range(B):
        keys, values = seq[row, 0 : 2 * N : 2], seq[row, 1 : 2 * N : 2]
        assert len(set(keys.tolist())) == len(set(values.tolist())) == N  # distinct
        assert bool(((keys >= 1) & (keys < V // 2)).all())
        assert bool(((values >= V // 2) & (values < V)).all())
        where = batch.query_mask[row].nonzero().flatten()
        assert len(where) == N and bool((where >= 2 * N).all())
        bound = dict(zip(keys.tolist(), values.tolist(), strict=True))
        asked = batch.inputs[row, where].tolist()
        assert sorted(asked) == sorted(bound)  # each key asked exactly once
        assert batch.targets[row, where].tolist() == [bound[k] for k in asked]
        # everything after the context that is not a query key or its value is 0
        rest = torch.ones(T + 1, dtype=torch.bool)
        rest[: 2 * N] = False
        rest[where] = rest[where + 1] = False
        assert bool((seq[row, rest] == 0).all())


def test_batches_are_a_pure_function_of_the_generator_seed() -> None:
    a, b, c = _batch(3), _batch(3), _batch(4)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.query_mask, b.query_mask)
    assert not torch.equal(a.inputs, c.inputs)


def test_query_loss_is_the_cross_entropy_at_the_query_positions_only() -> None:
    batch = _batch()
    logits = torch.randn(B, T, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected = F.cross_entropy(logits[batch.query_mask], batch.targets[batch.query_mask])
    torch.testing.assert_close(query_loss(logits, batch), expected)


class _LookupModel(nn.Module):
    """Answers every position with the value bound to the key of pair ``pair`` (or,
    with ``pair=None``, to the key actually read): a known accuracy."""

    def __init__(self, pair: int | None) -> None:
        super().__init__()
        self.pair = pair

    def forward_teach(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, None]:  # noqa: E501
        keys, values = inputs[:, 0 : 2 * N : 2], inputs[:, 1 : 2 * N : 2]
        if self.pair is None:
            match = inputs.unsqueeze(-1) == keys.unsqueeze(1)  # [B, T, N]
            answer = (match.long() * values.unsqueeze(1)).sum(-1)
        else:
            answer = values[:, self.pair].unsqueeze(1).expand_as(inputs)
        return F.one_hot(answer, V).float(), None


def test_accuracy_is_one_for_a_perfect_recaller_and_chance_for_a_fixed_guess() -> None:
    batch = _batch()
    assert float(recall_accuracy(_LookupModel(None), batch)) == 1.0  # type: ignore[arg-type]
    # One value per row: exactly one of the N queries of every row asks for it.
    guess = float(recall_accuracy(_LookupModel(0), batch))  # type: ignore[arg-type]
    assert guess == pytest.approx(1.0 / N)


@pytest.mark.parametrize(
    ("knobs", "named"),
    [
        ({"num_pairs": 0}, "recall.num_pairs"),
        ({"vocab_size": 16, "num_pairs": 8}, "recall.vocab_size"),
        ({"seq_len": 20, "num_pairs": 8}, "recall.seq_len"),
        ({"steps": 0}, "recall.steps"),
        ({"eval_every": 0}, "recall.eval_every"),
        ({"variants": ["hope", "hope"]}, "recall.variants"),
    ],
)
def test_impossible_settings_are_refused_naming_the_knob(knobs: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        check_recall_config(dataclasses.replace(RecallConfig(), **knobs))


def _tiny_recall(steps: int) -> Config:
    cfg = Config()
    cfg.model.vocab_size = V
    cfg.recall = dataclasses.replace(
        RecallConfig(), steps=steps, batch_size=4, seq_len=32, num_pairs=4, dim=16,
        n_layers=1, n_heads=2, eval_sequences=8, eval_every=1, num_threads=1,
    )  # fmt: skip
    return cfg


def test_the_training_loop_syncs_once_per_run_not_per_step() -> None:
    counts = []
    for steps in (2, 5):
        with count_host_syncs() as calls:
            row = train_recall(_tiny_recall(steps), "hope_attention")
        counts.append(len(calls))
        assert len(row["curve"]) == steps and 0.0 <= row["accuracy"] <= 1.0
    assert counts[0] == counts[1] <= 3


def test_the_stage_refuses_an_unknown_variant_before_training(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "stages" / "recall.py"),
         "--params", str(REPO / "params.yaml"), "--set", "recall.variants=[hope,hopf]"],
        capture_output=True, text=True, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "recall.variants" in proc.stderr and "'hopf'" in proc.stderr
    assert not (tmp_path / "reports" / "recall.json").exists()
