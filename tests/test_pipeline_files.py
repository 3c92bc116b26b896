"""The DVC pipeline, the Snakemake mirror and the SLURM profile agree with each other."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from hope.config import all_keys

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _dvc_stages() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def _snakemake_commands(tmp_path: Path) -> dict[str, str]:
    """Rule name -> shell command, from a forced dry run of the real Snakefile."""
    for rel in ("Snakefile", "params.yaml", "configs", "src", "stages"):
        src = ROOT / rel
        if src.is_dir():
            shutil.copytree(src, tmp_path / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, tmp_path / rel)
    proc = subprocess.run(
        [str(BIN / "snakemake"), "-n", "-p", "--forceall", "--cores", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.findall(r"rule (\w+):\n(?:[^\n]*\n)*?Shell command: ([^\n]+)", proc.stdout)
    return {name: cmd.strip() for name, cmd in found if name != "all"}


def test_snakefile_mirrors_dvc_stages(tmp_path: Path) -> None:
    stages = _dvc_stages()
    commands = _snakemake_commands(tmp_path)
    assert set(commands) == set(stages)
    for name, stage in stages.items():
        assert commands[name] == stage["cmd"], name


def test_dvc_params_are_real_knobs() -> None:
    keys = set(all_keys())
    sections = {k.split(".")[0] for k in keys}
    for name, stage in _dvc_stages().items():
        for param in stage.get("params", []):
            assert param == "preset" or param in keys or param in sections, (name, param)


def test_training_knobs_do_not_rerun_data_stages() -> None:
    stages = _dvc_stages()
    for name in ("download", "tokenizer", "shard"):
        params = stages[name].get("params", [])
        assert not any(p.startswith(("train", "model", "optim", "eval")) for p in params), name
    assert "data.seq_len" not in stages["download"]["params"]


def test_checkpoints_persist_between_runs() -> None:
    outs = _dvc_stages()["train"]["outs"]
    assert {"models/checkpoints": {"persist": True}} in outs


def test_slurm_profile_leaves_gpus_to_params() -> None:
    """GPUs come from params in the Snakefile (hope.train.launch): the train rule's
    (slurm_resources) and the evaluation rules' (eval_resources: one unless
    train.device is cpu). A profile entry would override them, so it sets none."""
    profile = yaml.safe_load((ROOT / "configs/slurm/config.yaml").read_text())
    assert profile["executor"] == "slurm"
    for rule, resources in profile["set-resources"].items():
        assert not {"gpu", "gpus", "gres", "nodes", "tasks"} & set(resources), rule
    assert set(profile["set-resources"]) <= set(_dvc_stages())
    snakefile = (ROOT / "Snakefile").read_text()
    for rule in ("eval", "zeroshot", "niah", "longctx", "continual", "recall"):
        body = snakefile.split(f"\nrule {rule}:\n")[1].split("\nrule ")[0]
        assert "**eval_resources(CFG)" in body, rule
    assert "**slurm_resources(CFG)" in snakefile.split("\nrule train:\n")[1].split("\nrule ")[0]


def test_dvc_yaml_is_valid_for_dvc(tmp_path: Path) -> None:
    """`dvc dag` parses and validates dvc.yaml (templating, plots, outs) without running."""
    proc = subprocess.run(
        [str(BIN / "dvc"), "dag", "--md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DVC_NO_ANALYTICS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    for stage in _dvc_stages():
        assert stage in proc.stdout
