"""python stages/tokenizer.py [--params params.yaml] [--set tokenizer.vocab_size=4096 ...]

Train the sentencepiece tokenizer on data/raw/train.jsonl and measure it on
data/raw/val.jsonl: data/tokenizer/{spm.model,spm.vocab,coverage.json,config.yaml}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hope.cli import run_stage
from hope.config import Config, save_config
from hope.data.tokenizer import train_tokenizer

RAW_DIR = Path("data/raw")
TOKENIZER_DIR = Path("data/tokenizer")


def body(cfg: Config, args: argparse.Namespace) -> None:
    train_tokenizer(
        cfg.tokenizer, RAW_DIR / "train.jsonl", TOKENIZER_DIR, val_jsonl=RAW_DIR / "val.jsonl"
    )
    save_config(cfg, TOKENIZER_DIR / "config.yaml")


def main() -> int:
    return run_stage(__doc__, body, outputs=(TOKENIZER_DIR,))


if __name__ == "__main__":
    raise SystemExit(main())
