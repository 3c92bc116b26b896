"""End to end: `dvc repro` on the tiny preset, re-run, experiments, metrics diff, Snakemake."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import yaml

from conftest import copy_repo, run

pytestmark = pytest.mark.slow


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_dvc_repro_builds_every_artifact(dvc_repo: Path) -> None:
    train = _json(dvc_repo / "reports/train.json")
    evaluation = _json(dvc_repo / "reports/eval.json")
    rows = (dvc_repo / "reports/train_log.tsv").read_text().splitlines()
    header = rows[0].split("\t")
    losses = [float(r.split("\t")[header.index("train_loss")]) for r in rows[1:]]
    assert losses[-1] < losses[0] - 1.0, "training loss must go down"
    assert math.isfinite(evaluation["val"]["loss"])
    assert evaluation["val"]["loss"] < evaluation["val"]["unigram_entropy"] - 0.5
    assert (
        train["steps"]
        == yaml.safe_load((dvc_repo / "models/checkpoints/config.yaml").read_text())["train"][
            "steps"
        ]
    )
    for name in ("loss.png", "passkey.png", "lr.png"):
        assert (dvc_repo / "reports/plots" / name).stat().st_size > 1000
    for stage_config in ("data/raw", "data/tokenizer", "data/shards"):
        assert (dvc_repo / stage_config / "config.yaml").exists()
    bench = _json(dvc_repo / "reports/bench.json")
    for variant in ("transformer", "hope"):
        row = bench["tiny"][variant]
        assert row["tokens_per_s"] > 0 and row["host_syncs_per_step"] == 0
    assert bench["tiny"]["transformer"]["relative_to_transformer"] == 1.0
    verify = run([sys.executable, "stages/release.py", "--verify", "release"], dvc_repo)
    assert "ok" in verify.stdout


def test_second_repro_does_nothing(dvc_repo: Path) -> None:
    status = run(["dvc", "status"], dvc_repo)
    assert "up to date" in status.stdout
    again = run(["dvc", "repro"], dvc_repo)
    assert "Running stage" not in again.stdout
    for stage in ("train", "bench"):
        one_stage = run(["dvc", "repro", stage], dvc_repo)
        assert "Running stage" not in one_stage.stdout


def test_plots_render_as_json(dvc_repo: Path) -> None:
    shown = run(["dvc", "plots", "show", "--json"], dvc_repo)
    assert "reports/train_log.tsv" in shown.stdout
    assert "reports/plots/loss.png" in shown.stdout


def test_experiment_changes_metric_and_diff_shows_it(dvc_repo: Path) -> None:
    run(["git", "add", "-A"], dvc_repo)
    run(["git", "commit", "-qm", "baseline run"], dvc_repo)
    before = _json(dvc_repo / "reports/train.json")
    run(["dvc", "exp", "run", "-S", "train.steps=60"], dvc_repo)
    after = _json(dvc_repo / "reports/train.json")
    assert after["steps"] == 60 and before["steps"] != 60
    assert after["val_loss"] != before["val_loss"]
    diff = run(["dvc", "metrics", "diff", "--md"], dvc_repo)
    assert "reports/train.json" in diff.stdout and "val_loss" in diff.stdout
    table = run(["dvc", "exp", "show", "--md"], dvc_repo)
    assert "train.steps" in table.stdout and "60" in table.stdout
    run(["git", "checkout", "--", "."], dvc_repo)
    run(["dvc", "checkout"], dvc_repo)


def test_snakemake_mirror_produces_same_artifacts(
    dvc_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    repo = copy_repo(tmp_path_factory.mktemp("smk") / "repo")
    run(["snakemake", "--cores", "2"], repo)
    for rel in ("data/raw/manifest.json", "data/tokenizer/spm.model", "data/shards/manifest.json"):
        assert (repo / rel).read_bytes() == (dvc_repo / rel).read_bytes(), rel
    ours, theirs = _json(repo / "reports/eval.json"), _json(dvc_repo / "reports/eval.json")
    assert ours["val"]["loss"] == pytest.approx(theirs["val"]["loss"], rel=1e-4)
    run([sys.executable, "stages/release.py", "--verify", "release"], repo)
