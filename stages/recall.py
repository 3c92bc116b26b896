"""python stages/recall.py [--params params.yaml] [--set recall.steps=100 ...]

Multi-query associative recall (MQAR): train a small fresh model of every
``recall.variants`` entry on synthetic key-value sequences and score its in-context
recall on held-out ones (hope.eval.recall): reports/recall.json (numbers),
reports/recall_meta.json (accuracy curves, config).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hope.cli import run_stage
from hope.config import Config
from hope.io import write_metrics
from hope.report import headline

REPORT = Path("reports/recall.json")


def body(cfg: Config, args: argparse.Namespace) -> None:
    from hope.eval.recall import run_recall, split_recall_report

    report = run_recall(cfg)
    numbers, records = split_recall_report(report)
    write_metrics(REPORT, numbers, records, headline.recall(numbers))
    chance = 1.0 / cfg.recall.num_pairs
    scores = ", ".join(f"{v} {row['accuracy']:.3f}" for v, row in report["variants"].items())
    print(f"recall (MQAR, chance {chance:.3f}): {scores}")


def main() -> int:
    return run_stage(__doc__, body, outputs=(REPORT.parent,))


if __name__ == "__main__":
    raise SystemExit(main())
