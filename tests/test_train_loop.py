"""Training loop: schedule, sync-free steps, SIGKILL + resume == uninterrupted, config changes."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hope
from conftest import CLASSIC_SHELL
from hope.bench.measure import count_host_syncs
from hope.config import TrainConfig
from hope.data.shards import ShardedTokens
from hope.errors import StageError
from hope.io import non_numbers
from hope.memory.ops.dispatch import resolve_backend, set_default_backend
from hope.optim.outer import build_optimizer
from hope.train import checkpoint as ckpt
from hope.train import loop as loop_module
from hope.train.device import autocast_dtype, resolve_device, setup_runtime
from hope.train.guard import RunLock
from hope.train.loop import run_training, train_step
from hope.train.schedule import build_scheduler, lr_factor

VOCAB = 64
OVERRIDES = [
    "model.dim=32",
    "model.n_layers=2",
    "model.n_heads=4",
    f"tokenizer.vocab_size={VOCAB}",
    "data.seq_len=16",
    "train.batch_size=4",
    "train.steps=12",
    "train.log_every=4",
    "train.val_every=6",
    "train.checkpoint_every=3",
    "train.val_batches=2",
    "train.device=cpu",
    "train.num_threads=1",
    "train.wandb_mode=disabled",
    "optim.warmup_steps=3",
    "optim.lr=0.01",
]


def tiny_cfg(*extra: str) -> hope.Config:
    return hope.load_config(None, [*OVERRIDES, *extra])


def token_streams() -> tuple[ShardedTokens, ShardedTokens]:
    """A learnable stream: a fixed permutation repeated, so token t determines token t+1."""
    order = np.random.default_rng(0).permutation(VOCAB).astype(np.uint16)
    stream = np.tile(order, 40)
    # Two train shards, to exercise windows that cross a shard boundary.
    return ShardedTokens([stream[:1000], stream[1000:]]), ShardedTokens([stream[:300]])


def run(tmp: Path, *extra: str) -> dict[str, Any]:
    train_tokens, val_tokens = token_streams()
    return run_training(tiny_cfg(*extra), train_tokens, val_tokens, tmp / "ckpt", tmp / "reports")


def latest(ckpt_dir: Path) -> Path:
    path = ckpt.latest_checkpoint(ckpt_dir)
    assert path is not None, f"no checkpoint in {ckpt_dir}"
    return path


def read_tsv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle, delimiter="\t"))


def test_schedule_warms_up_linearly_then_decays_to_min_ratio() -> None:
    assert lr_factor(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_factor(4, 10, 100, 0.1) == pytest.approx(0.5)
    assert lr_factor(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(10, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(55, 10, 100, 0.1) == pytest.approx(0.55)  # cosine midpoint
    assert lr_factor(100, 10, 100, 0.1) == pytest.approx(0.1)
    cfg = tiny_cfg()
    model = hope.build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    seen = []
    for _ in range(cfg.train.steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen[:3] == pytest.approx([0.01 / 3, 0.02 / 3, 0.01])
    assert seen[-1] > 0.001 and optimizer.param_groups[0]["lr"] == pytest.approx(0.001)


# HOPE's frozen-base reads (memory/smt_frozen.py): its masks are built without a sync
FROZEN_READS = ("model.smt_chunk=8", "model.smt_mem_chunk=8", "model.smt_read_chunk=2")


@pytest.mark.parametrize("extra", [(), FROZEN_READS], ids=["default", "frozen_reads"])
def test_training_step_makes_no_host_syncs(extra: tuple[str, ...]) -> None:
    cfg = tiny_cfg(*extra)
    model = hope.build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    x, y = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    train_step(model, optimizer, scheduler, x, y, grad_clip=1.0)  # creates optimizer state
    before = [p.detach().clone() for p in model.parameters()]
    with count_host_syncs() as calls:
        loss = train_step(model, optimizer, scheduler, x, y, grad_clip=1.0)
        # The counter does see a sync when one happens.
        loss.item()
        assert calls == ["item"]
    # The step did real work.
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# train.json's figures two runs of the same work must agree on
RUN_FIGURES = ("train_loss", "val_subset_loss", "val_subset_ppl", "steps", "tokens_seen", "params")


def _assert_same_run(whole: dict[str, Any], resumed: dict[str, Any], tmp_path: Path) -> None:
    for key in RUN_FIGURES:
        assert resumed[key] == pytest.approx(whole[key], rel=1e-6, abs=1e-6), key
    a = ckpt.load_checkpoint(latest(tmp_path / "whole" / "ckpt"))
    b = ckpt.load_checkpoint(latest(tmp_path / "resumed" / "ckpt"))
    for name, value in a["model"].items():
        torch.testing.assert_close(b["model"][name], value, rtol=0, atol=1e-7)
    rows_a = read_tsv(tmp_path / "whole" / "reports" / "train_log.tsv")
    rows_b = read_tsv(tmp_path / "resumed" / "reports" / "train_log.tsv")
    drop_speed = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows_a]
    assert [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows_b] == drop_speed
    numbers = {k: v for k, v in resumed.items() if k != "runtime"}
    assert json.loads((tmp_path / "resumed" / "reports" / "train.json").read_text()) == numbers


KILL_RUN = ("train.steps=48",)


def test_sigkill_at_random_moments_then_rerun_gives_the_uninterrupted_result(
    tmp_path: Path,
) -> None:
    """A real SIGKILL from outside, at random moments after a checkpoint appears (mid
    step, mid log interval, mid checkpoint write): nothing gets cleaned up, and the
    same command run again ends with the metrics and weights of an uninterrupted run."""
    whole = run(tmp_path / "whole", *KILL_RUN)
    ckpt_dir = tmp_path / "resumed" / "ckpt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    rng, kills = random.Random(0), 0
    for _ in range(3):
        seen = len(ckpt.list_checkpoints(ckpt_dir))
        newest = ckpt.latest_checkpoint(ckpt_dir)
        proc = subprocess.Popen(
            [sys.executable, __file__, str(tmp_path / "resumed"), *KILL_RUN], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        while proc.poll() is None and ckpt.latest_checkpoint(ckpt_dir) in (None, newest):
            time.sleep(0.002)  # until this run writes its first checkpoint
        time.sleep(rng.uniform(0.0, 0.15))
        proc.kill()
        _, stderr = proc.communicate()
        if proc.returncode == 0:
            break
        assert proc.returncode == -9, stderr.decode()[-2000:]
        kills += 1
        assert len(ckpt.list_checkpoints(ckpt_dir)) >= min(seen, 1)
    assert kills >= 1  # the test did kill a run
    resumed = run(tmp_path / "resumed", *KILL_RUN)
    _assert_same_run(whole, resumed, tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "flip_a_byte"])
def test_a_corrupt_latest_checkpoint_falls_back_to_the_newest_intact_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    whole = run(tmp_path / "whole")
    run(tmp_path / "resumed")  # keeps step 9 and step 12 (the final one)
    final = latest(tmp_path / "resumed" / "ckpt")
    assert final.name == "step_0000012.pt"
    blob = final.read_bytes()
    if damage == "truncate":
        final.write_bytes(blob[: len(blob) // 2])
    else:
        final.write_bytes(blob[:100] + bytes([blob[100] ^ 1]) + blob[101:])
    caplog.set_level(logging.INFO, logger="hope.train")
    resumed = run(tmp_path / "resumed")
    assert "step_0000012.pt: its bytes do not match the sha256" in caplog.text
    assert (
        "falling back to step_0000009.pt" in caplog.text and "resuming from step 9" in caplog.text
    )
    _assert_same_run(whole, resumed, tmp_path)


def test_no_intact_checkpoint_is_an_error_naming_each(tmp_path: Path) -> None:
    run(tmp_path)
    for path in ckpt.list_checkpoints(tmp_path / "ckpt"):
        path.write_bytes(path.read_bytes()[:64])
    with pytest.raises(StageError, match="no intact checkpoint.*step_0000012.*step_0000009"):
        run(tmp_path)


def test_keep_checkpoints_keeps_that_many_with_their_digests(tmp_path: Path) -> None:
    run(tmp_path, "train.keep_checkpoints=3")
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))
    assert names == [f"step_{s:07d}.pt{x}" for s in (6, 9, 12) for x in ("", ".sha256")]


def _tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested checkpoint tree, by its path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if not isinstance(tree, (dict, list, tuple)):
        return {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(_tensors(value, f"{prefix}/{key}"))
    return out


def test_same_params_give_identical_metrics_and_checkpoints(tmp_path: Path) -> None:
    """Two runs of the train stage with the same params, one in another process whose
    environment asks for one thread (as Snakemake exports for a 1-thread job): the
    params' thread count wins, and metrics and checkpoints agree bit for bit."""
    here = run(tmp_path / "here", "train.num_threads=2")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    subprocess.run(
        [sys.executable, __file__, str(tmp_path / "there"), "train.num_threads=2"],
        env=env, check=True, capture_output=True,
    )  # fmt: skip
    reports = tmp_path / "there" / "reports"
    metrics = json.loads((reports / "train.json").read_text())
    assert non_numbers(metrics) == []  # a DVC metrics file: the runtime record is beside it
    there = {**metrics, **json.loads((reports / "train_meta.json").read_text())}
    assert here["runtime"]["num_threads"] == there["runtime"]["num_threads"] == 2
    for key in (*RUN_FIGURES, "runtime"):
        assert here[key] == there[key], key
    a = ckpt.load_checkpoint(latest(tmp_path / "here" / "ckpt"))
    b = ckpt.load_checkpoint(latest(tmp_path / "there" / "ckpt"))
    for part in ("model", "optimizer", "rng"):
        ta, tb = _tensors(a[part]), _tensors(b[part])
        assert ta.keys() == tb.keys() and ta, part
        for name, value in ta.items():
            assert torch.equal(value, tb[name]), f"{part}{name}"


def test_reports_have_the_logged_rows_and_training_learns(tmp_path: Path) -> None:
    metrics = run(tmp_path)
    rows = read_tsv(tmp_path / "reports" / "train_log.tsv")
    assert [r["step"] for r in rows] == ["4", "6", "8", "12"]  # log every 4, val every 6, end
    assert [r["val_subset_loss"] != "" for r in rows] == [False, True, False, True]
    assert [r["train_loss"] != "" for r in rows] == [True, False, True, True]
    assert float(rows[-1]["val_subset_loss"]) == pytest.approx(metrics["val_subset_loss"], rel=1e-5)
    assert metrics["val_subset_ppl"] == pytest.approx(math.exp(metrics["val_subset_loss"]))
    # The permutation stream is learnable: well below the uniform log(64) = 4.16.
    assert metrics["val_subset_loss"] < 3.0 and metrics["train_loss"] < 4.0
    assert metrics["params"] == sum(
        p.numel() for p in hope.build_model(tiny_cfg().model).parameters()
    )
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "ckpt")] == [
        "step_0000009.pt",
        "step_0000012.pt",
    ]
    assert hope.config.load_config(tmp_path / "ckpt" / "config.yaml").model.dim == 32


def test_finished_run_only_rewrites_reports(tmp_path: Path) -> None:
    first = run(tmp_path)
    (tmp_path / "reports" / "train.json").unlink()
    (tmp_path / "reports" / "train_log.tsv").unlink()
    again = run(tmp_path)
    assert again == first  # same wall time too: nothing was retrained
    assert len(read_tsv(tmp_path / "reports" / "train_log.tsv")) == 4


def test_changed_config_starts_fresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run(tmp_path, "train.steps=6")
    caplog.set_level(logging.INFO, logger="hope.train")
    changed = run(tmp_path, "train.steps=6", "optim.lr=0.005")
    assert "config (checkpoint" in caplog.text and "changed since" in caplog.text
    assert "resuming" not in caplog.text
    fresh = run(tmp_path / "fresh", "train.steps=6", "optim.lr=0.005")
    assert changed["val_subset_loss"] == pytest.approx(fresh["val_subset_loss"], abs=1e-6)
    new_fp = ckpt.config_fingerprint(tiny_cfg("train.steps=6", "optim.lr=0.005"))
    for path in ckpt.list_checkpoints(tmp_path / "ckpt"):
        assert ckpt.load_checkpoint(path)["fingerprint"] == new_fp


def test_changed_training_data_starts_fresh_instead_of_mixing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = tiny_cfg("train.steps=6")
    train_tokens, val_tokens = token_streams()
    run_training(cfg, train_tokens, val_tokens, tmp_path / "ckpt", tmp_path / "reports")
    shifted = ShardedTokens([(a + 1) % VOCAB for a in train_tokens.arrays])  # new shards
    caplog.set_level(logging.INFO, logger="hope.train")
    changed = run_training(cfg, shifted, val_tokens, tmp_path / "ckpt", tmp_path / "reports")
    assert "training data: shards or tokenizer (checkpoint" in caplog.text
    assert "resuming" not in caplog.text
    fresh = run_training(cfg, shifted, val_tokens, tmp_path / "f" / "ckpt", tmp_path / "f" / "r")
    assert changed["val_subset_loss"] == pytest.approx(fresh["val_subset_loss"], abs=1e-6)


def _inject_nan(monkeypatch: pytest.MonkeyPatch, at_calls: set[int]) -> None:
    """Make train_step diverge on the given calls (1-based): NaN weights and loss."""
    real, calls = loop_module.train_step, [0]

    def diverging(model, *args, **kwargs):  # type: ignore[no-untyped-def]
        loss = real(model, *args, **kwargs)
        calls[0] += 1
        if calls[0] not in at_calls:
            return loss
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float("nan"))
        return loss * float("nan")

    monkeypatch.setattr(loop_module, "train_step", diverging)


def test_nan_stop_keeps_the_last_good_checkpoint(tmp_path: Path, monkeypatch) -> None:
    _inject_nan(monkeypatch, {7})
    with pytest.raises(StageError, match=r"non-finite loss in steps 7\.\.8 .*step_0000006\.pt"):
        run(tmp_path)
    assert latest(tmp_path / "ckpt").name == "step_0000006.pt"  # nothing saved after
    payload = ckpt.load_checkpoint(latest(tmp_path / "ckpt"))
    assert all(torch.isfinite(t).all() for t in payload["model"].values())


def test_nan_rewind_resumes_from_the_last_good_checkpoint_with_a_lower_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _inject_nan(monkeypatch, {7})
    caplog.set_level(logging.INFO, logger="hope.train")
    metrics = run(tmp_path, "train.nan_policy=rewind")
    assert "non-finite loss in steps 7..8: rewinding to step_0000006.pt" in caplog.text
    assert metrics["steps"] == 12 and math.isfinite(metrics["val_subset_loss"])
    steps = [int(r["step"]) for r in read_tsv(tmp_path / "reports" / "train_log.tsv")]
    assert steps == sorted(set(steps))  # the rewound interval's rows are not duplicated
    final = ckpt.load_checkpoint(latest(tmp_path / "ckpt"))
    assert final["nan_rewinds"] == 1
    assert final["scheduler"]["base_lrs"] == [pytest.approx(0.005)] * len(
        final["scheduler"]["base_lrs"]
    )  # optim.lr 0.01 x nan_lr_factor 0.5


def test_nan_rewind_gives_up_after_the_maximum(tmp_path: Path, monkeypatch) -> None:
    _inject_nan(monkeypatch, set(range(7, 100)))
    with pytest.raises(StageError, match="after 2 rewinds.*step_0000006.pt"):
        run(tmp_path, "train.nan_policy=rewind", "train.nan_max_rewinds=2")


def test_a_second_run_on_the_same_folder_is_refused_naming_the_holder(tmp_path: Path) -> None:
    holder = rf"in use by another training run \(pid {os.getpid()}"
    with RunLock(tmp_path / "ckpt"), pytest.raises(StageError, match=holder):
        run(tmp_path)
    run(tmp_path, "train.steps=3")  # released: the folder trains again


def test_shard_digest_follows_the_manifest_not_the_path(tmp_path: Path) -> None:
    a, b = ShardedTokens([np.arange(10, dtype=np.uint16)]), ShardedTokens([np.arange(10)])
    assert a.digest != b.digest  # dtype is part of the content
    assert a.digest == ShardedTokens([np.arange(10, dtype=np.uint16)]).digest
    assert ShardedTokens([np.arange(3)], digest="from-manifest").digest == "from-manifest"


def test_bf16_autocast_step_stays_close_to_fp32() -> None:
    cfg = tiny_cfg()
    gen = torch.Generator().manual_seed(0)  # fixed data: not whatever ran before
    x, y = (
        torch.randint(0, VOCAB, (2, 16), generator=gen),
        torch.randint(0, VOCAB, (2, 16), generator=gen),
    )
    losses = {}
    for dtype in (None, torch.bfloat16):
        torch.manual_seed(0)
        model = hope.build_model(cfg.model)
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
        losses[dtype] = train_step(model, optimizer, scheduler, x, y, 1.0, dtype)
        assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights fp32
    assert losses[None].dtype == losses[torch.bfloat16].dtype == torch.float32
    # Autocast really ran (results differ) yet stays close to fp32.
    assert losses[None] != losses[torch.bfloat16]
    # bf16 rounds at 2^-8 relative; the untrained default shell's loss is ~9 nats
    assert abs(losses[None] - losses[torch.bfloat16]) < 1e-3 * losses[None]


def test_device_and_precision_resolution() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(hope.ConfigError, match="train.device"):
        resolve_device("tpu")
    assert autocast_dtype(torch.device("cpu"), "auto") is None
    assert autocast_dtype(torch.device("cpu"), "bf16") == torch.bfloat16
    assert autocast_dtype(torch.device("cpu"), "fp32") is None


def test_setup_runtime_sets_the_memory_backend() -> None:
    try:
        setup_runtime(TrainConfig(memory_backend="compile"), torch.device("cpu"))
        assert resolve_backend(None) == "compile"
        setup_runtime(TrainConfig(), torch.device("cpu"))
        assert resolve_backend(None) == "torch"
    finally:
        set_default_backend("torch")


def test_zero_steps_reports_the_initial_model(tmp_path: Path) -> None:
    metrics = run(tmp_path, "train.steps=0", *CLASSIC_SHELL)
    assert metrics["steps"] == 0 and metrics["train_loss"] is None
    assert abs(metrics["val_subset_loss"] - math.log(VOCAB)) < 0.1  # untrained: near uniform
    assert latest(tmp_path / "ckpt").name == "step_0000000.pt"


if __name__ == "__main__":  # the subprocess of the SIGKILL and repeatability tests
    run(Path(sys.argv[1]), *sys.argv[2:])


def test_train_scores_a_named_subset_of_the_split_as_eval_scores_its_windows(
    tmp_path: Path,
) -> None:
    """train.json's ``val_subset_loss`` is the first ``train.val_batches`` windows of the
    validation split, scored as the eval stage scores (``evaluate_perplexity``, one
    fresh context per window): on the same windows the two give one number, so the
    eval stage's ``val.loss`` (the whole split) differs from it only by the tokens."""
    from hope.data.batches import eval_batches
    from hope.eval.perplexity import evaluate_perplexity

    metrics = run(tmp_path)
    cfg = tiny_cfg()
    _, val_tokens = token_streams()
    model, _, step = ckpt.load_model(tmp_path / "ckpt")
    assert step == metrics["steps"] == cfg.train.steps  # the last validation's weights
    windows = eval_batches(
        val_tokens, cfg.train.batch_size, cfg.data.seq_len, cfg.train.val_batches
    )
    scored = evaluate_perplexity(model, windows, torch.device("cpu"))
    assert metrics["val_subset_tokens"] == scored.tokens == 2 * 4 * 16
    assert metrics["val_subset_loss"] == pytest.approx(scored.loss, rel=1e-6)
    whole = evaluate_perplexity(model, eval_batches(val_tokens, 4, 16, 100), torch.device("cpu"))
    assert whole.tokens > scored.tokens
