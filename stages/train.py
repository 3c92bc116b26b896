"""python stages/train.py [--params params.yaml] [--set train.steps=50 ...]

Train the configured model on data/shards (checked against data/tokenizer/spm.model).
Checkpoints go to models/checkpoints/ (resumed when the config is unchanged);
reports/train.json and reports/train_log.tsv hold the metrics. With
train.nproc_per_node (or train.nnodes) > 1 the stage re-runs itself under torchrun
(data parallel, hope.train.distributed); under an existing torchrun it joins it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from hope.cli import run_stage
from hope.config import Config
from hope.errors import StageError

SHARD_DIR = Path("data/shards")
TOKENIZER_MODEL = Path("data/tokenizer/spm.model")
CKPT_DIR = Path("models/checkpoints")
REPORT_DIR = Path("reports")


def main(cfg: Config, args: argparse.Namespace) -> None:
    from hope.train.distributed import from_environment
    from hope.train.launch import relaunch_command
    from hope.train.loop import train

    command = relaunch_command(cfg, sys.argv)
    if command is not None:  # train.nproc_per_node/nnodes > 1: this stage under torchrun
        code = subprocess.run(command, check=False).returncode
        if code:
            raise StageError(f"torchrun exited with code {code}: {' '.join(command)}")
        return
    metrics = train(cfg, SHARD_DIR, TOKENIZER_MODEL, CKPT_DIR, REPORT_DIR)
    if not from_environment().is_main:
        return
    print(
        f"train: {metrics['steps']} steps, val_subset_loss {metrics['val_subset_loss']:.4f} "
        f"(ppl {metrics['val_subset_ppl']:.1f}, the first {metrics['val_subset_tokens']} "
        f"validation tokens), {metrics['tokens_per_s']:.0f} tokens/s"
    )


if __name__ == "__main__":
    raise SystemExit(run_stage(__doc__, main, outputs=(CKPT_DIR, REPORT_DIR)))
