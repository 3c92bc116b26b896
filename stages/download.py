"""python stages/download.py [--params params.yaml] [--set data.source=local ...]

Collect documents from ``data.source`` (builtin | hf | local), filter, dedup and
split them into data/raw/{train.jsonl,val.jsonl,manifest.json,config.yaml}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hope.cli import run_stage
from hope.config import Config
from hope.data.download import run_download

RAW_DIR = Path("data/raw")


def body(cfg: Config, args: argparse.Namespace) -> None:
    run_download(cfg, RAW_DIR)


def main() -> int:
    return run_stage(__doc__, body, outputs=(RAW_DIR,))


if __name__ == "__main__":
    raise SystemExit(main())
