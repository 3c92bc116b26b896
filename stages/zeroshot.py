"""python stages/zeroshot.py [--params params.yaml] [--set zeroshot.tasks=[hope_cloze] ...]

Zero-shot evaluation of the latest checkpoint in models/checkpoints through the
lm-evaluation-harness (hope.eval.harness; tasks from zeroshot.tasks). The offline
default tasks read items this stage writes to data/zeroshot/ from data/raw/val.jsonl
(task YAMLs: configs/lm_eval/): reports/zeroshot.json (numbers: per task, each metric
with its stderr and the document count), reports/zeroshot_meta.json (lm-eval and task
versions, checkpoint, variant).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hope.cli import run_stage
from hope.config import Config
from hope.io import write_metrics
from hope.report import headline

CKPT_DIR = Path("models/checkpoints")
TOKENIZER_MODEL = Path("data/tokenizer/spm.model")
RAW_VAL = Path("data/raw/val.jsonl")
ITEMS_DIR = Path("data/zeroshot")
TASK_DIR = Path("configs/lm_eval")
REPORT = Path("reports/zeroshot.json")


def body(cfg: Config, args: argparse.Namespace) -> None:
    from hope.eval.zeroshot import run_zeroshot

    metrics, records = run_zeroshot(cfg, CKPT_DIR, TOKENIZER_MODEL, RAW_VAL, ITEMS_DIR, TASK_DIR)
    write_metrics(REPORT, metrics, records, headline.zeroshot(metrics))
    for task in cfg.zeroshot.tasks:
        row = metrics.get(task, {})
        shown = ", ".join(f"{k} {v:.4g}" for k, v in row.items() if not k.endswith("_stderr"))
        print(f"zeroshot {task}: {shown}")


def main() -> int:
    return run_stage(__doc__, body, outputs=(REPORT.parent, ITEMS_DIR))


if __name__ == "__main__":
    raise SystemExit(main())
