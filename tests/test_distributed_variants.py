"""Data parallelism is exact for every variant: two gloo ranks (DDP, and FSDP2; with
checkpointed blocks too) train what one process trains on
the whole batch, float64, 3 steps — fast state is per sample, so each rank's rows give
exactly their share of the gradient."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hope.model.zoo import VARIANTS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_variant_trains_the_same_on_two_ranks_ddp_and_fsdp(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests")}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "tests/dist_variants_worker.py"), str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    expected = {f"{v}/{p}" for v in VARIANTS for p in ("ddp", "fsdp")}
    assert set(report) == expected | {"hope/fsdp+ckpt", "titans_mac/fsdp+ckpt"}
    for run, diff in report.items():
        # float64: only the order of the two halves' gradient sums differs.
        assert diff["loss"] <= 1e-10 and diff["params"] <= 1e-10, (run, diff)
