"""Checkpoint files: weights_only round trip, RNG restore, pruning, load_model."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import hope
from hope.errors import StageError
from hope.io import atomic_write
from hope.optim.outer import build_optimizer
from hope.train import checkpoint as ckpt
from hope.train.schedule import build_scheduler


def tiny_cfg() -> hope.Config:
    return hope.load_config(
        None, ["model.dim=32", "model.n_heads=4", "tokenizer.vocab_size=64", "train.steps=10"]
    )


def test_round_trip_with_weights_only_restores_model_optimizer_and_rng(tmp_path: Path) -> None:
    cfg = tiny_cfg()
    torch.manual_seed(0)
    model = hope.build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    x = torch.randint(0, 64, (2, 8))
    model.training_loss(x, x).backward()
    optimizer.step()
    scheduler.step()
    random.seed(3)
    np.random.seed(4)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    payload = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": ckpt.capture_rng_state(),
        "step": 1,
        "config": cfg.to_dict(),
        "fingerprint": ckpt.config_fingerprint(cfg),
    }
    path = ckpt.save_checkpoint(tmp_path, 1, payload)
    assert path.name == "step_0000001.pt"
    expected = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])

    loaded = torch.load(path, weights_only=True)  # must not need unpickling of code
    ckpt.restore_rng_state(loaded["rng"])
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert [random.random() for _ in range(3)] == expected[2]

    model2 = hope.build_model(cfg.model)
    model2.load_state_dict(loaded["model"])
    optimizer2 = build_optimizer(model2, cfg.optim)
    optimizer2.load_state_dict(loaded["optimizer"])
    scheduler2 = build_scheduler(optimizer2, cfg.optim, cfg.train.steps)
    scheduler2.load_state_dict(loaded["scheduler"])
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    state, state2 = optimizer.state_dict()["state"], optimizer2.state_dict()["state"]
    for key in state:
        assert torch.equal(state[key]["exp_avg_sq"], state2[key]["exp_avg_sq"])
    assert loaded["fingerprint"] == ckpt.config_fingerprint(
        hope.config.config_from_dict(loaded["config"])
    )


def test_only_the_last_two_checkpoints_are_kept(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        ckpt.save_checkpoint(tmp_path, step, {"step": step})
    (tmp_path / ".step_0000020.pt.abc.tmp").write_bytes(b"partial")  # a killed writer's leftover
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step_0000010.pt",
        "step_0000015.pt",
    ]
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_0000015.pt"


def test_load_model_rebuilds_the_stored_model(tmp_path: Path) -> None:
    cfg = tiny_cfg()
    model = hope.build_model(cfg.model)
    payload = {"model": model.state_dict(), "config": cfg.to_dict(), "step": 7}
    ckpt.save_checkpoint(tmp_path, 7, payload)
    loaded, loaded_cfg, step = ckpt.load_model(tmp_path)
    assert step == 7 and loaded_cfg.model == cfg.model
    x = torch.randint(0, 64, (1, 6))
    torch.testing.assert_close(loaded(x)[0], model(x)[0], rtol=0, atol=0)


def test_missing_or_corrupt_checkpoints_raise_stage_errors(tmp_path: Path) -> None:
    with pytest.raises(StageError, match="no checkpoint"):
        ckpt.load_model(tmp_path)
    (tmp_path / "step_0000003.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(StageError, match="step_0000003.pt"):
        ckpt.load_model(tmp_path)


def test_disk_full_during_an_atomic_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.write_text("old")

    def fill(tmp: Path) -> None:
        tmp.write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(StageError, match="report.json: no space left on the device"):
        atomic_write(target, fill)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["report.json"]


def test_a_rewrite_removes_what_a_killed_write_of_that_file_left(tmp_path: Path) -> None:
    """A killed writer leaves its temp file (or a bundle's temp folder) beside the
    target; the next write of that target removes it, and nothing of other targets."""
    target = tmp_path / "a.json"
    (tmp_path / ".a.json.k3j9x_2q.tmp").write_text("partial")
    (tmp_path / ".a.json.old-123").mkdir()
    (tmp_path / ".b.json.k3j9x_2q.tmp").write_text("another target's")
    atomic_write(target, lambda tmp: tmp.write_text("new"))
    assert sorted(os.listdir(tmp_path)) == [".b.json.k3j9x_2q.tmp", "a.json"]
    assert target.read_text() == "new"
