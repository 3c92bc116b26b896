"""python stages/train.py [--params params.yaml] [--set train.steps=50 ...]

Train the configured model on data/shards (checked against data/tokenizer/spm.model).
Checkpoints go to models/checkpoints/ (resumed when the config is unchanged);
reports/train.json and reports/train_log.tsv hold the metrics.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hope.cli import run_stage
from hope.config import Config

SHARD_DIR = Path("data/shards")
TOKENIZER_MODEL = Path("data/tokenizer/spm.model")
CKPT_DIR = Path("models/checkpoints")
REPORT_DIR = Path("reports")


def main(cfg: Config, args: argparse.Namespace) -> None:
    from hope.train.loop import train

    metrics = train(cfg, SHARD_DIR, TOKENIZER_MODEL, CKPT_DIR, REPORT_DIR)
    print(
        f"train: {metrics['steps']} steps, val_loss {metrics['val_loss']:.4f} "
        f"(ppl {metrics['val_ppl']:.1f}), {metrics['tokens_per_s']:.0f} tokens/s"
    )


if __name__ == "__main__":
    raise SystemExit(run_stage(__doc__, main))
