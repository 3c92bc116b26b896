"""Report plots: written, non-empty, byte-stable, and clear errors for bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hope.errors import StageError
from hope.report.plots import make_plots, read_train_log

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_inputs(folder: Path) -> tuple[Path, Path]:
    log = folder / "train_log.tsv"
    rows = ["step\ttrain_loss\tval_subset_loss\tlr\ttokens\ttokens_per_s"]
    for step in range(0, 101, 10):
        val = f"{5.0 - step / 40:.3f}" if step % 50 == 0 else ""
        rows.append(
            f"{step}\t{6.0 - step / 30:.4f}\t{val}\t{min(step, 30) * 1e-4:.6g}\t{step * 2048}\t9000"
        )
    log.write_text("\n".join(rows) + "\n")
    evaluation = folder / "eval.json"
    passkey = {
        f"len_{n}": {"acc": acc, "chance": 0.25, "true_logprob": -8.0}
        for n, acc in ((128, 0.5), (64, 0.75), (1024, 0.0))
    }
    evaluation.write_text(json.dumps({"val": {"loss": 3.0}, "passkey": passkey, "variant": "hope"}))
    return log, evaluation


def test_plots_are_written_and_byte_stable(tmp_path: Path) -> None:
    log, evaluation = write_inputs(tmp_path)
    paths = make_plots(log, evaluation, tmp_path / "plots")
    assert [p.name for p in paths] == ["loss.png", "passkey.png", "lr.png"]
    first = [p.read_bytes() for p in paths]
    for blob in first:
        assert blob.startswith(PNG_MAGIC) and len(blob) > 5000
        assert b"Software" not in blob and b"matplotlib" not in blob
    make_plots(log, evaluation, tmp_path / "plots")
    assert [p.read_bytes() for p in paths] == first
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted(p.name for p in paths)


def test_changed_numbers_change_the_picture(tmp_path: Path) -> None:
    log, evaluation = write_inputs(tmp_path)
    make_plots(log, evaluation, tmp_path / "a")
    data = json.loads(evaluation.read_text())
    data["passkey"]["len_64"]["acc"] = 1.0
    evaluation.write_text(json.dumps(data))
    make_plots(log, evaluation, tmp_path / "b")
    assert (tmp_path / "a/passkey.png").read_bytes() != (tmp_path / "b/passkey.png").read_bytes()
    assert (tmp_path / "a/loss.png").read_bytes() == (tmp_path / "b/loss.png").read_bytes()


def test_train_log_parsing_keeps_empty_val_cells(tmp_path: Path) -> None:
    log, _ = write_inputs(tmp_path)
    columns = read_train_log(log)
    assert columns["step"][:3] == [0.0, 10.0, 20.0]
    assert columns["val_subset_loss"][:2] == [5.0, None]
    assert sum(v is not None for v in columns["val_subset_loss"]) == 3


@pytest.mark.parametrize("missing", ["train_log.tsv", "eval.json"])
def test_missing_input_names_the_file(tmp_path: Path, missing: str) -> None:
    log, evaluation = write_inputs(tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(StageError, match=missing):
        make_plots(log, evaluation, tmp_path / "plots")
    assert not (tmp_path / "plots").exists()  # nothing half-drawn


def test_bad_cells_and_columns_are_named(tmp_path: Path) -> None:
    log = tmp_path / "train_log.tsv"
    log.write_text("step\ttrain_loss\tval_subset_loss\tlr\n1\tnan-ish\t\t0.1\n")
    with pytest.raises(StageError, match="line 2: train_loss='nan-ish'"):
        read_train_log(log)
    log.write_text("step\ttrain_loss\n1\t2.0\n")
    with pytest.raises(StageError, match="missing column"):
        read_train_log(log)
