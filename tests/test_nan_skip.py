"""``train.nan_policy=skip``: a step with non-finite gradients changes nothing, decided on
the device (no host read), for every outer optimizer; the run finishes and says so."""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import hope
from hope.bench.measure import count_host_syncs
from hope.errors import StageError
from hope.optim.outer import build_optimizer
from hope.train import checkpoint as ckpt
from hope.train import loop as loop_module
from hope.train.schedule import build_scheduler
from hope.train.step import step_where, train_step
from test_train_loop import VOCAB, latest, read_tsv, run, tiny_cfg


def _tensor_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for i, group in enumerate(optimizer.param_groups):
        for j, param in enumerate(group["params"]):
            out[f"{i}.{j}"] = param.detach().clone()
            for name, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"{i}.{j}.{name}"] = value.detach().clone()
    return out


def _set_grads(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=gen)


@pytest.mark.parametrize("optim", ["adamw", "muon", "m3"])
def test_step_where_false_changes_nothing_and_true_is_a_plain_step(optim: str) -> None:
    cfg = tiny_cfg(f"optim.name={optim}", "model.final_norm=true")
    torch.manual_seed(0)
    model = hope.build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    _set_grads(model, 1)
    optimizer.step()  # optimizer state exists from here on
    twin_model = copy.deepcopy(model)
    twin = build_optimizer(twin_model, cfg.optim)
    twin.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # no shared tensors

    _set_grads(model, 2)
    before = _tensor_state(optimizer)
    step_where(optimizer, torch.tensor(False))
    after = _tensor_state(optimizer)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key

    _set_grads(model, 3)
    _set_grads(twin_model, 3)
    step_where(optimizer, torch.tensor(True))
    twin.step()
    mine, theirs = _tensor_state(optimizer), _tensor_state(twin)
    changed = [k for k in mine if not torch.equal(mine[k], before[k])]
    assert changed, "the taken step must update something"
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=0, atol=0, msg=key)
    if optim == "m3":  # its host-side step counter counts the skipped step (documented)
        steps = [g["step"] for g in optimizer.parts["m3"].param_groups]
        assert steps == [g["step"] + 1 for g in twin.parts["m3"].param_groups]


def test_a_fresh_adamw_skipped_then_stepped_equals_one_plain_step() -> None:
    """State created by a skipped first step is the optimizer's initial state."""
    cfg = tiny_cfg()
    torch.manual_seed(0)
    model = hope.build_model(cfg.model)
    twin_model = copy.deepcopy(model)
    optimizer, twin = build_optimizer(model, cfg.optim), build_optimizer(twin_model, cfg.optim)
    _set_grads(model, 1)
    step_where(optimizer, torch.tensor(False))
    _set_grads(model, 2)
    _set_grads(twin_model, 2)
    step_where(optimizer, torch.tensor(True))
    twin.step()
    for a, b in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_skipping_train_step_reads_nothing_on_the_host() -> None:
    cfg = tiny_cfg()
    model = hope.build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    x, y = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    train_step(model, optimizer, scheduler, x, y, 1.0, skip_nonfinite=True)
    with count_host_syncs() as calls:
        loss = train_step(model, optimizer, scheduler, x, y, 0.0, skip_nonfinite=True)
    assert calls == [] and math.isfinite(loss.item())


def _inject_nan_grads(monkeypatch: pytest.MonkeyPatch, at_calls: set[int]) -> list[bool]:
    """Give train_step NaN gradients on the given calls (1-based); records, for each of
    them, whether the parameters came out of the step unchanged."""
    real, calls, unchanged = loop_module.train_step, [0], []

    def poisoned(model: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] not in at_calls:
            return real(model, *args, **kwargs)
        first = next(model.parameters())
        hook = first.register_hook(lambda grad: grad * float("nan"))
        before = [p.detach().clone() for p in model.parameters()]
        try:
            loss = real(model, *args, **kwargs)
        finally:
            hook.remove()
        unchanged.append(
            all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        )
        return loss

    monkeypatch.setattr(loop_module, "train_step", poisoned)
    return unchanged


def test_nan_skip_skips_the_bad_steps_and_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    unchanged = _inject_nan_grads(monkeypatch, {7, 8})
    caplog.set_level(logging.INFO, logger="hope.train")
    metrics = run(tmp_path, "train.nan_policy=skip")
    assert unchanged == [True, True]
    assert "skipped 2 step(s) in steps 7..8 without updating" in caplog.text
    assert metrics["steps"] == 12 and metrics["nan_skipped_steps"] == 2
    assert math.isfinite(metrics["val_subset_loss"]) and math.isfinite(metrics["train_loss"])
    rows = read_tsv(tmp_path / "reports" / "train_log.tsv")
    assert all(math.isfinite(float(r["train_loss"])) for r in rows if r["train_loss"])
    payload = ckpt.load_checkpoint(latest(tmp_path / "ckpt"))
    assert payload["nan_skipped"] == 2
    assert all(torch.isfinite(t).all() for t in payload["model"].values())


def test_nan_skip_gives_up_after_the_maximum(tmp_path: Path, monkeypatch) -> None:
    _inject_nan_grads(monkeypatch, set(range(4, 100)))
    with pytest.raises(StageError, match=r"skipped for non-finite gradients.*nan_max_skips=3"):
        run(tmp_path, "train.nan_policy=skip", "train.nan_max_skips=3")
