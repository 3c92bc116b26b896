"""Faults as a user meets them, each injected for real: a file-size limit the kernel
enforces (a disk that fills), a real overflow to NaN, bytes that are not UTF-8, a
folder even root cannot write, a missing tokenizer, a truncated safetensors file.
Each ends in one line naming the file, key or value and what to do, exit code 2, and
nothing written before it lost (docs/RELIABILITY.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import ROOT, make_bundle, make_pipeline_layout, pipeline_env
from hope.errors import StageError
from hope.train import checkpoint as ckpt
from test_train_loop import run, tiny_cfg

TESTS = Path(__file__).parent


def _digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _finite(path: Path) -> bool:
    model = ckpt.load_checkpoint(path)["model"]
    return all(torch.isfinite(t).all() for t in model.values() if t.is_floating_point())


# --------------------------------------------------------------- D1: a full disk

# In a child process: the disk "fills up" when step 9's checkpoint is written, as a
# file-size limit the kernel enforces (RLIMIT_FSIZE; with SIGXFSZ ignored a write past
# it fails with EFBIG, as one on a full disk fails with ENOSPC).
FULL_DISK_AT_STEP_9 = """
import resource, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from hope.errors import StageError
from hope.train import checkpoint as ckpt
from test_train_loop import run

real = ckpt.save_checkpoint

def save_on_a_filling_disk(ckpt_dir, step, payload, keep=2):
    if step == 9:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    return real(ckpt_dir, step, payload, keep)

ckpt.save_checkpoint = save_on_a_filling_disk
try:
    run(Path(sys.argv[1]))
except StageError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
"""


def test_d1_disk_full_during_a_checkpoint_write_is_one_line_and_loses_nothing(
    tmp_path: Path,
) -> None:
    child = subprocess.run(
        [sys.executable, "-c", FULL_DISK_AT_STEP_9, str(tmp_path), str(TESTS)],
        capture_output=True, text=True, timeout=300, check=False, env=pipeline_env(tmp_path),
    )  # fmt: skip
    assert child.returncode == 2, child.stderr[-3000:]
    last = child.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "step_0000009.pt: no space left on the device" in last
    assert "File too large" in last and "Traceback" not in child.stderr
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == [".lock", "config.yaml", "step_0000003.pt", "step_0000003.pt.sha256",
                     "step_0000006.pt", "step_0000006.pt.sha256"]  # fmt: skip
    assert ckpt.checkpoint_problem(tmp_path / "ckpt/step_0000006.pt") is None
    resumed = run(tmp_path)  # the disk has room again: the run ends as an uninterrupted one
    whole = run(tmp_path / "whole")
    assert resumed["val_subset_loss"] == pytest.approx(whole["val_subset_loss"], abs=1e-6)


# --------------------------------------------------- D2, D9: real divergence
# A negative weight decay multiplies every weight by 1 + lr·|decay| per step: after a
# few steps the activations overflow float32 and the loss is NaN (no hook involved).
BLOW_UP = ("optim.weight_decay=-2000", "optim.warmup_steps=1", "optim.grad_clip=0")


def test_d2_skip_that_never_recovers_stops_without_saving_a_diverged_model(
    tmp_path: Path,
) -> None:
    with pytest.raises(StageError) as raised:
        run(tmp_path, *BLOW_UP, "train.nan_policy=skip")
    message = str(raised.value)
    assert "train.nan_policy=skip" in message and "skipping steps cannot undo it" in message
    assert "lower optim.lr" in message
    saved = ckpt.list_checkpoints(tmp_path / "ckpt")
    assert all(_finite(p) for p in saved), saved
    assert not (tmp_path / "reports/train.json").exists()  # no report of a NaN model


def test_d9_rewind_before_the_first_checkpoint_rewinds_to_the_initial_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hope.train")
    # The first checkpoint would come at step 12; the run diverges long before. The
    # rewound rate (x 1e-6) makes the decay harmless, so the run then finishes.
    metrics = run(tmp_path, *BLOW_UP, "train.nan_policy=rewind", "train.checkpoint_every=12",
                  "train.nan_lr_factor=1e-6")  # fmt: skip
    assert "rewinding to step_0000000.pt" in caplog.text
    assert metrics["nan_rewinds"] == 1 and metrics["steps"] == 12
    assert metrics["val_subset_loss"] == pytest.approx(metrics["val_subset_loss"])  # finite
    assert all(_finite(p) for p in ckpt.list_checkpoints(tmp_path / "ckpt"))


def test_d9_a_rewind_that_cannot_help_advises_what_is_left(tmp_path: Path) -> None:
    with pytest.raises(StageError) as raised:
        run(tmp_path, *BLOW_UP, "train.nan_policy=rewind", "train.nan_max_rewinds=1",
            "train.checkpoint_every=12")  # fmt: skip
    message = str(raised.value)
    assert "train.nan_policy=rewind, after 1 rewinds" in message
    assert "step_0000000.pt) is intact: lower optim.lr" in message
    assert "set train.nan_policy=rewind" not in message  # not the policy already set


# ------------------------------------ D3, D4: a changed config keeps the old run


def test_d3_following_the_nan_advice_keeps_every_earlier_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = run(tmp_path, "train.steps=6")
    before = _digests(tmp_path / "ckpt")
    reports = _digests(tmp_path / "reports")
    caplog.set_level(logging.INFO, logger="hope.train")
    run(tmp_path, "train.steps=6", "optim.lr=0.005")  # "lower optim.lr", as advised
    old_fingerprint = ckpt.config_fingerprint(tiny_cfg("train.steps=6"))
    aside = tmp_path / "ckpt/superseded" / f"{old_fingerprint}-step6"
    assert f"kept in {aside}" in caplog.text
    kept = _digests(aside)
    for name, digest in before.items():
        if name.startswith("step_"):
            assert kept[name] == digest, name  # moved, byte for byte
    # The earlier run's reports went with it: reports/ now holds only the new run's.
    assert {n: kept[n] for n in reports} == reports
    assert (
        json.loads((aside / "train.json").read_text())["val_subset_loss"]
        == first["val_subset_loss"]
    )
    # Copied back into a folder of its own, the earlier run resumes: nothing was lost.
    back = tmp_path / "back/ckpt"
    back.mkdir(parents=True)
    for path in aside.glob("step_*"):
        shutil.copy2(path, back / path.name)
    assert run(tmp_path / "back", "train.steps=6")["val_subset_loss"] == first["val_subset_loss"]


def test_d4_checks_that_fail_at_start_leave_the_old_run_as_it_was(tmp_path: Path) -> None:
    run(tmp_path, "train.steps=6")
    before = _digests(tmp_path)
    # A new config whose windows the data cannot fill: refused before anything moves.
    with pytest.raises(StageError, match=r"fewer than seq_len \+ 1 = 4097"):
        run(tmp_path, "train.steps=6", "data.seq_len=4096")
    assert _digests(tmp_path) == before


# ------------------------------------------------------ D5: text that is not UTF-8


def test_d5_local_text_that_is_not_utf8_is_named_before_anything_is_written(
    tmp_path: Path,
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a fine document " * 40, encoding="utf-8")
    (corpus / "b.txt").write_bytes(("caf\u00e9 " * 30).encode("latin-1"))  # real Latin-1
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "stages/download.py"), "--params", str(ROOT / "params.yaml"),
         "--set", "data.source=local", "--set", f"data.local_glob={corpus}/*.txt"],
        cwd=work, env=pipeline_env(work), capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        f"error: {corpus}/b.txt: not UTF-8 text (byte 3: invalid continuation byte); "
        "convert it (e.g. `iconv -f latin1 -t utf-8`) or leave it out of data.local_glob"
    )
    leftovers = [p for p in work.rglob("*") if p.is_file()]
    assert leftovers == [], leftovers  # no .partial file, no manifest


# ----------------------------------------------------- D6: a folder not writable


@contextlib.contextmanager
def _read_only(folder: Path) -> Iterator[None]:
    """``folder`` really not writable: mode 0555 for a user; for root, which ignores
    modes, the immutable attribute (chattr +i), which root's writes obey too."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("running as root on a file system without chattr +i: no folder is read-only")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_d6_reports_not_writable_is_refused_before_the_eval_runs(tmp_path: Path) -> None:
    layout = make_pipeline_layout(tmp_path / "layout")
    reports = layout / "reports"
    reports.mkdir()
    (reports / "eval.json").write_text('{"old": 1}\n')
    argv = [sys.executable, str(ROOT / "stages/eval.py"), "--params", str(ROOT / "params.yaml"),
            "--set", "tokenizer.vocab_size=512", "--set", "model.dim=16", "--set",
            "model.n_layers=1", "--set", "model.n_heads=2", "--set", "data.seq_len=32"]  # fmt: skip
    with _read_only(reports):
        proc = subprocess.run(argv, cwd=layout, env=pipeline_env(layout), capture_output=True,
                              text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {reports}: not writable (")
    assert "eval: step" not in proc.stdout  # refused before any scoring
    assert (reports / "eval.json").read_text() == '{"old": 1}\n'


# ------------------------------------------------------- D7: no tokenizer


def test_d7_a_missing_tokenizer_is_named_as_missing(tmp_path: Path) -> None:
    from hope.data.shards import load_split, write_shards

    made = tmp_path / "made"
    make_bundle(made)
    write_shards(made / "tok/spm.model", made / "raw", tmp_path / "shards")
    missing = tmp_path / "gone/spm.model"
    with pytest.raises(StageError) as raised:
        load_split(tmp_path / "shards", "train", missing)
    message = str(raised.value)
    assert message.startswith(f"tokenizer {missing} is missing") and "sha256" not in message
    assert "dvc repro tokenizer" in message


# --------------------------------------------------- D8: a corrupt state file


@pytest.mark.parametrize("damage", ["truncated", "not_safetensors", "foreign"])
def test_d8_a_corrupt_state_file_is_one_line_and_exit_2(tmp_path: Path, damage: str) -> None:
    from safetensors.torch import save_file

    bundle = make_bundle(tmp_path / "made")
    text = tmp_path / "doc.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 8)
    state = tmp_path / "state.safetensors"
    hope = [str(Path(sys.executable).parent / "hope")]
    env = pipeline_env(tmp_path)
    made = subprocess.run(
        [*hope, "memorize", "--model", str(bundle), "--text", str(text), "--save", str(state)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    if damage == "truncated":
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    elif damage == "not_safetensors":
        state.write_bytes(b"\x00" * 64)
    else:
        save_file({"w": torch.zeros(2)}, str(state))  # a safetensors file, not a state
    proc = subprocess.run(
        [*hope, "generate", "--model", str(bundle), "--prompt", "the", "--max-new-tokens", "2",
         "--state", str(state)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert f"state file {state}" in last
    expected = "holds no fast state" if damage == "foreign" else "not a readable safetensors file"
    assert expected in last
