"""python stages/shard.py [--params params.yaml]

Tokenize data/raw/{train,val}.jsonl with data/tokenizer/spm.model into flat
token files: data/shards/{train_00000.bin,...,val_00000.bin,manifest.json,config.yaml}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hope.cli import run_stage
from hope.config import Config, save_config
from hope.data.shards import write_shards

RAW_DIR = Path("data/raw")
TOKENIZER_MODEL = Path("data/tokenizer/spm.model")
SHARD_DIR = Path("data/shards")


def body(cfg: Config, args: argparse.Namespace) -> None:
    # Threads only speed up encoding; the shards are identical for any count.
    write_shards(TOKENIZER_MODEL, RAW_DIR, SHARD_DIR, num_threads=cfg.tokenizer.num_threads)
    save_config(cfg, SHARD_DIR / "config.yaml")


def main() -> int:
    return run_stage(__doc__, body, outputs=(SHARD_DIR,))


if __name__ == "__main__":
    raise SystemExit(main())
