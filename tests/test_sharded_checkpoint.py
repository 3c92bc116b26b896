"""Sharded checkpoints (train.checkpoint_format=sharded, hope.train.sharded): every rank
writes its own shards through torch.distributed.checkpoint; a resume on any world size
(and in the other format) ends where the uninterrupted run ends; a crash mid-save or a
corrupted shard falls back to the newest intact checkpoint; eval and release read the
weights on one process."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from hope.errors import ConfigError
from hope.train import checkpoint as ckpt
from test_distributed import _run_worker
from test_train_loop import run, tiny_cfg

SHARDED = ("train.checkpoint_format=sharded", "train.keep_checkpoints=20")


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """12 steps on one process, a sharded checkpoint every 3."""
    out = tmp_path_factory.mktemp("sharded")
    return out, run(out, *SHARDED)


def _resume_from(src: Path, dest: Path, last_step: int) -> Path:
    """A copy of ``src``'s checkpoints up to ``last_step`` (as if killed after it)."""
    (dest / "ckpt").mkdir(parents=True)
    for path in ckpt.list_checkpoints(src / "ckpt"):
        if ckpt.step_of(path) <= last_step:
            copy = shutil.copytree if path.is_dir() else shutil.copy2
            copy(path, dest / "ckpt" / path.name)
    return dest


def test_a_sharded_checkpoint_is_a_directory_of_verified_shards(sharded_run) -> None:
    out, _ = sharded_run
    paths = ckpt.list_checkpoints(out / "ckpt")
    assert [p.name for p in paths] == [f"step_{s:07d}" for s in (3, 6, 9, 12)]
    files = sorted(p.name for p in paths[-1].iterdir())
    assert files == [".metadata", "SHA256SUMS", "__0_0.distcp", "train_state.pt"]
    listed = [line.split("  ")[1] for line in (paths[-1] / "SHA256SUMS").read_text().splitlines()]
    assert sorted(listed) == [".metadata", "__0_0.distcp", "train_state.pt"]
    assert not list((out / "ckpt").glob(".step_*"))  # no staging left behind
    payload = ckpt.load_checkpoint(paths[-1])
    assert payload["step"] == 12 and payload["sharded"] == str(paths[-1])
    assert "model" not in payload  # the weights stay in the shards


@pytest.mark.parametrize("resume_format", ["sharded", "full"])
def test_a_resume_from_a_sharded_checkpoint_ends_as_the_uninterrupted_run(
    sharded_run, tmp_path: Path, resume_format: str
) -> None:
    """Killed after step 6: the resume (in either format: the format is not part of
    what is trained) ends with exactly the uninterrupted run's metrics."""
    out, reference = sharded_run
    resumed = _resume_from(out, tmp_path, 6)
    metrics = run(resumed, "train.keep_checkpoints=20", f"train.checkpoint_format={resume_format}")
    for key in ("train_loss", "val_subset_loss", "tokens_seen", "steps"):
        assert metrics[key] == reference[key], key
    newest = ckpt.latest_checkpoint(resumed / "ckpt")
    assert newest is not None and newest.is_dir() == (resume_format == "sharded")


def test_a_crash_mid_save_and_a_corrupt_shard_fall_back_to_an_intact_checkpoint(
    sharded_run, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out, _ = sharded_run
    copy = _resume_from(out, tmp_path, 12) / "ckpt"
    # A crash mid-save of step 15: its staging directory holds a partial shard.
    staging = copy / ".step_0000015.staging"
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"partial")
    path, payload = ckpt.latest_intact(copy) or (None, None)
    assert path is not None and path.name == "step_0000012" and payload["step"] == 12
    # One flipped byte in step 12's shard: refused, naming the file; step 9 is used.
    shard = copy / "step_0000012/__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    problem = ckpt.checkpoint_problem(copy / "step_0000012")
    assert problem is not None and "__0_0.distcp does not match the sha256" in problem
    with caplog.at_level(logging.WARNING, logger="hope.train"):
        path, payload = ckpt.latest_intact(copy) or (None, None)
    assert path is not None and path.name == "step_0000009" and payload["step"] == 9
    assert "step_0000012" in caplog.text
    # The next save clears what the crash left.
    ckpt.prune(copy, keep=20)
    assert not staging.exists() and (copy / "step_0000009").is_dir()


def test_eval_and_release_read_the_same_weights_from_either_format(
    sharded_run, tmp_path: Path
) -> None:
    out, _ = sharded_run
    run(tmp_path, "train.keep_checkpoints=20")  # the same run, full checkpoints
    from_shards, cfg_a, step_a = ckpt.load_model(out / "ckpt", step=9)
    from_file, cfg_b, step_b = ckpt.load_model(tmp_path / "ckpt", step=9)
    assert (step_a, step_b) == (9, 9) and cfg_a.model == cfg_b.model
    ours, theirs = from_shards.state_dict(), from_file.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_sharded_checkpoints_are_refused_for_the_orthogonalising_optimizers() -> None:
    with pytest.raises(ConfigError, match="train.checkpoint_format=sharded is built for"):
        tiny_cfg("train.checkpoint_format=sharded", "optim.name=muon")


def _metrics(out: Path) -> dict:
    return json.loads((out / "reports/train.json").read_text())


@pytest.mark.slow
def test_fsdp_shards_resume_on_one_process_and_back(tmp_path: Path) -> None:
    """Two FSDP2 ranks write two shards per checkpoint; killed after step 6 (its later
    checkpoints removed), one process resumes from them; and one process's checkpoint
    resumes on two FSDP2 ranks. Both end with the uninterrupted run's metrics (fp32
    summation order differs between world sizes: rel 1e-5)."""
    fsdp = (*SHARDED, "train.parallel=fsdp")
    two = _run_worker(tmp_path / "two", 2, *fsdp)
    assert two.returncode == 0, two.stderr[-3000:]
    reference = _metrics(tmp_path / "two")
    assert len(list((tmp_path / "two/ckpt/step_0000006").glob("*.distcp"))) == 2

    one = _resume_from(tmp_path / "two", tmp_path / "one", 6)
    resumed = _run_worker(one, 1, *SHARDED)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert len(list((one / "ckpt/step_0000012").glob("*.distcp"))) == 1

    back = _resume_from(one, tmp_path / "back", 9)  # step 9: written by the one process
    again = _run_worker(back, 2, *fsdp)
    assert again.returncode == 0, again.stderr[-3000:]
    for out in (one, back):
        for key in ("train_loss", "val_subset_loss"):
            assert _metrics(out)[key] == pytest.approx(reference[key], rel=1e-5), (out, key)
        assert _metrics(out)["tokens_seen"] == reference["tokens_seen"]
